"""The in-place cross-entropy gradient kernel (``kernels/elementwise/ce_grad.py``) without a GPU.

* Its math, pinned down: a pure-torch fp32 reference of exactly what the kernel computes (the
  bf16 gradient and the per-chunk partials), checked against a plain float64 ``softmax - onehot``
  on ragged vocabularies, ignored rows and targets in the last (partial) chunk.
* One sm_90a compile on fake tensors with symbolic M, V and row stride, checked for what the
  kernel's speed rests on: 16-byte global loads and stores, ``ex2.approx``, no spills, no atomics.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from coda_cute.artifacts import disassemble, find_nvdisasm
from coda_cute.elementwise import CrossEntropyGradSpec, compile_elementwise
from coda_cute.kernels.elementwise import ce_grad
from helpers import generator


def ce_grad_reference(logits, lse, rstd, coef, targets, target_logit, chunk: int = ce_grad.CHUNK):
    """What the kernel computes, in fp32 on the CPU: ``(gradient in logits' dtype, partials (M, T)
    fp32)`` with ``l = float(logits)`` but ``target_logit`` at each row's target, ``p = exp(l - lse)``
    and, per row ``m`` and chunk ``j``,

        grad[m, v]     = rstd[m] * coef[m] * (p - [v == targets[m]])
        partials[m, j] = coef[m] * sum_{v in chunk j} (p - [v == targets[m]]) * l

    Ignored rows (``coef == 0``) are exact zeros whatever their ``lse`` and ``targets`` hold (the
    kernel takes ``p = 0`` there); ``targets`` are compared, never used as indices."""
    m, v = logits.shape
    onehot = (torch.arange(v)[None, :] == targets[:, None].long()).float()
    l = torch.where(onehot.bool(), target_logit[:, None], logits.float())
    t = -(-v // chunk)
    ignored = coef == 0
    p = torch.where(ignored[:, None], 0.0, torch.exp(l - lse[:, None]))
    d = p - onehot
    grad = ((rstd * coef)[:, None] * d).to(logits.dtype)
    per_chunk = F.pad(d * l, (0, t * chunk - v)).view(m, t, chunk).sum(-1)
    return grad, coef[:, None] * per_chunk


def _problem(m: int, v: int, seed: int, chunk: int):
    """Random fp32 logits stored in bf16 with their fp32 lse, ~1/4 of the rows ignored (target -100,
    coef 0, lse NaN), row 0's target the last column and row 1's the first column of the last
    chunk; each row's target logit in fp32 (the logits GEMM's gather, before the rounding)."""
    g = generator(seed)
    exact = 3 * torch.randn(m, v, generator=g)
    logits = exact.to(torch.bfloat16)
    lse = torch.logsumexp(exact, dim=1)
    rstd = 0.5 + torch.rand(m, generator=g)
    coef = 0.1 + torch.rand(m, generator=g)
    targets = torch.randint(0, v, (m,), generator=g, dtype=torch.int32)
    ignored = torch.rand(m, generator=g) < 0.25
    ignored[:2] = False
    ignored[2] = True
    targets[ignored], coef[ignored], lse[ignored] = -100, 0.0, float("nan")
    targets[0] = v - 1
    targets[1] = (-(-v // chunk) - 1) * chunk
    target_logit = torch.where(ignored, 0.0, exact[torch.arange(m), targets.clamp(0, v - 1).long()])
    return logits, lse, rstd, coef, targets, target_logit, ignored


@pytest.mark.parametrize("m, v, chunk", [
    (6, 1000, 256),  # T = 4, last chunk 232 columns, V a multiple of 8
    (5, 33, 8),  # T = 5, last chunk one column, V % 8 == 1
    (4, 32003, ce_grad.CHUNK),  # the kernel's own chunk: T = 8, V % 8 == 3
    (3, 7, ce_grad.CHUNK),  # less than one vector
])
def test_reference_is_softmax_minus_onehot_in_float64(m, v, chunk):
    logits, lse, rstd, coef, targets, target_logit, ignored = _problem(m, v, seed=m * 1000 + v, chunk=chunk)
    grad, partials = ce_grad_reference(logits, lse, rstd, coef, targets, target_logit, chunk)
    t = -(-v // chunk)
    assert partials.shape == (m, t) and partials.dtype == torch.float32
    if chunk == ce_grad.CHUNK:
        assert ce_grad.num_chunks(v) == t

    # float64, straight from the definition: dlogit = coef * (softmax - onehot) on kept rows, the
    # logits as stored but the target's as gathered in fp32, the lse of the fp32 logits
    keep = ~ignored
    onehot = torch.zeros(m, v, dtype=torch.float64)
    onehot[keep] = F.one_hot(targets[keep].long(), v).double()
    l64 = torch.where(onehot.bool(), target_logit.double()[:, None], logits.double())
    softmax = torch.exp(l64 - lse.double()[:, None])
    dlogit = torch.where(keep[:, None], coef.double()[:, None] * (softmax - onehot), 0.0)
    torch.testing.assert_close(grad.double(), rstd.double()[:, None] * dlogit, rtol=2 ** -8, atol=1e-6)

    # partials: the per-chunk terms of s = sum_v dlogit * logit, as the spec writes them
    for j in range(t):
        cols = slice(j * chunk, min((j + 1) * chunk, v))
        in_chunk = keep & (targets >= cols.start) & (targets < cols.stop)
        l_target = torch.where(in_chunk, l64[torch.arange(m), targets.clamp(0, v - 1).long()], 0.0)
        spec = coef.double() * ((softmax[:, cols] * l64[:, cols]).sum(1) - l_target)
        spec = torch.where(keep, spec, 0.0)
        torch.testing.assert_close(partials[:, j].double(), spec, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(partials.double().sum(1), (dlogit * l64).sum(1), rtol=1e-5, atol=1e-5)

    # ignored rows: exact zeros although their lse is NaN and their target out of range
    assert (grad[ignored] == 0).all() and (partials[ignored] == 0).all()
    # the targets in the last chunk (row 0: the last column, row 1: the chunk's first column)
    assert grad[0, v - 1] < 0 and grad[1, (t - 1) * chunk] < 0


def test_num_chunks():
    c = ce_grad.CHUNK
    assert [ce_grad.num_chunks(v) for v in (1, c - 1, c, c + 1, 128256)] == [1, 1, 1, 2, -(-128256 // c)]
    assert ce_grad.num_chunks(128256) == 32  # Llama-3's vocabulary with CHUNK = 4096


def test_only_bf16_is_supported():
    import cutlass

    with pytest.raises(NotImplementedError):
        ce_grad.CrossEntropyGrad(cutlass.Float16)


# -- one sm_90a compile on fake tensors -------------------------------------------------------------


@pytest.fixture(scope="module")
def built():
    """(PTX, cubin, ptxas statistics) of the kernel for sm_90a, compiled as the package compiles
    it (``coda_cute.elementwise.CrossEntropyGradSpec``: symbolic extents, M shared by every
    argument so TVM-FFI checks they agree, a 16-byte-aligned base and row stride for the logits)."""
    kernel = compile_elementwise(CrossEntropyGradSpec(), keep_artifacts=True)
    return kernel.ptx, kernel.cubin, kernel.stats


# 16 bytes per access, as the DSL spells it (ld.global.v4.b32) or as other spellings would
_LD128 = re.compile(r"\bld\.global(?:\.[\w:]+)*?\.(?:v4\.[bfu]32|v8\.b16|b128)\s")
_ST128 = re.compile(r"\bst\.global(?:\.[\w:]+)*?\.(?:v4\.[bfu]32|v8\.b16|b128)\s")


def test_kernel_compiles_for_sm90a_with_16_byte_accesses_and_fast_exp(built):
    ptx, _, _ = built
    assert ".target sm_90a" in ptx
    # every 16-byte vector of a thread's band, in the interior and the guarded path
    assert len(_LD128.findall(ptx)) >= ce_grad.ROWS * ce_grad.VPT
    assert len(_ST128.findall(ptx)) >= ce_grad.ROWS * ce_grad.VPT
    assert "ex2.approx" in ptx
    # the row sum: butterfly shuffles and one CTA barrier; no atomics (deterministic partials)
    assert "shfl.sync.bfly" in ptx and "bar.sync" in ptx
    assert not re.search(r"\b(atom|red)\.", ptx)


def test_kernel_has_no_spills(built):
    _, _, stats = built
    assert "registers" in stats, "ptxas reported no statistics"
    assert stats.get("spill_stores", 0) == 0 and stats.get("spill_loads", 0) == 0, stats
    # the measured configuration runs at 48 registers (10 CTAs of 128 threads per SM); past 64
    # the occupancy that keeps enough loads in flight halves
    assert stats["registers"] <= 64, stats


def test_sass_moves_16_bytes_per_access(built):
    _, cubin, _ = built
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    ops = [line.split()[1] if not line.split()[1].startswith("@") else line.split()[2]
           for line in disassemble(cubin).splitlines() if " LDG." in line or " STG." in line]
    wide = [op for op in ops if op.endswith(".128")]
    assert sum(op.startswith("LDG") for op in wide) >= ce_grad.ROWS * ce_grad.VPT, ops
    assert sum(op.startswith("STG") for op in wide) >= ce_grad.ROWS * ce_grad.VPT, ops
    # the rest: 32-bit row scalars and partials, 16-bit elements of a ragged row end
    assert all(op.endswith((".128", ".E", ".U16")) for op in ops), ops


# -- the LSE of the logits GEMM's per-tile partials (kernels/elementwise/lse_combine.py) ----------
def test_lse_combine_builds_spill_free_with_a_fixed_order_warp_reduction():
    from coda_cute.elementwise import LseCombineSpec

    k = compile_elementwise(LseCombineSpec(), keep_artifacts=True)
    assert ".target sm_90a" in k.ptx
    assert k.stats.get("spill_stores", 0) == 0 and k.stats.get("spill_loads", 0) == 0, k.stats
    # max, then sum: two butterflies of five steps each; no atomics; the result stored once per row
    assert k.ptx.count("shfl.sync.bfly") == 10
    assert not re.search(r"\b(atom|red)\.", k.ptx)
    assert k.ptx.count("st.global") == 1
