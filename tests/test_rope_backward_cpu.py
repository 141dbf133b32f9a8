"""CPU tests of the RoPE (+ QK-norm) backward kernel (``coda_cute.kernels.elementwise.rope_backward``).

1. It builds for sm_90a on fake tensors with symbolic extents and strides (one binary for every
   B, S and stride; ``coda_cute.elementwise.RopeBackwardSpec``), both variants, with 16-byte
   global accesses only, the hardware sin / cos approximations and no register spills.
2. The closed form the kernel uses for a head's share of the statistic s, and the row split
   behind ``dw_partials``. (The op's math, ``coda_cute.reference.rope_backward_ref``, is held
   against autograd in ``test_backward_cpu.py``.)
"""

import functools
import re

import pytest
import torch

from coda_cute.elementwise import RopeBackwardSpec, compile_elementwise
from coda_cute.kernels.elementwise.rope_backward import (
    MIN_ROWS, NUM_SMS, SMEM_BUDGET, SMEM_PER_SM, RopeBackward, num_row_blocks, smem_budget,
)
from helpers import generator


def row_blocks(m, p):
    """The kernel's rows of CTA i < p: an even split, the first m % p CTAs one row more."""
    share, extra = divmod(m, p)
    starts = [i * share + min(i, extra) for i in range(p + 1)]
    return [(starts[i], starts[i + 1]) for i in range(p)]


def test_closed_form_of_a_heads_share_of_s():
    """The kernel adds qk_eps rs^3 sum(x gw) per head for sum(x dz): the same number (the
    literal sum cancels down to ~qk_eps and loses its digits in fp32)."""
    g = generator(3)
    x = torch.randn(64, 16, generator=g, dtype=torch.float64)
    gw = torch.randn(64, 16, generator=g, dtype=torch.float64)
    eps = 1e-6
    rs = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    xh = x * rs
    dz = rs * (gw - xh * (gw * xh).mean(-1, keepdim=True))
    closed = (eps * rs ** 3).squeeze(-1) * (x * gw).sum(-1)
    torch.testing.assert_close((x * dz).sum(-1), closed, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("m", [0, 1, 15, 16, 17, 1000, 16384, 16384 * 8 + 5])
def test_row_blocks_cover_every_row_once_in_equal_shares(m):
    p = num_row_blocks(m)
    assert p == min(-(-m // MIN_ROWS), NUM_SMS) and p <= NUM_SMS
    if m == 0:
        return
    blocks = row_blocks(m, p)
    assert blocks[0][0] == 0 and blocks[-1][1] == m
    assert all(a1 == b0 for (_, a1), (b0, _) in zip(blocks, blocks[1:]))
    sizes = {b - a for a, b in blocks}
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(qk_norm=False, head_dim=12, n_heads=4, n_kv_heads=2), "multiple of 8"),
    (dict(qk_norm=True, head_dim=24, n_heads=4, n_kv_heads=2), "D/8 must divide 32"),
    (dict(qk_norm=False, head_dim=64, n_heads=0, n_kv_heads=2), "at least one"),
])
def test_kernel_rejects_unsupported_shapes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RopeBackward(**kwargs)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("ctas_per_sm", [1, 2, 3])
@pytest.mark.parametrize("stage_rows", [1, 2])
def test_staged_shared_memory_fits_the_ctas_that_share_an_sm(head_dim, ctas_per_sm, stage_rows):
    """The stages are capped so that ``ctas_per_sm`` CTAs fit on one SM together (each also
    reserving 1 KB), and a stage holds ``stage_rows`` rows per thread."""
    assert smem_budget(1) == SMEM_BUDGET
    assert ctas_per_sm * (smem_budget(ctas_per_sm) + 1024) <= SMEM_PER_SM
    try:
        k = RopeBackward(True, head_dim, 32, 8, ctas_per_sm=ctas_per_sm, stage_rows=stage_rows)
    except ValueError as e:  # no stage count fits: refused, never launched over the budget
        assert "no launch" in str(e)
        return
    assert k.staged and k.rif == stage_rows and k.smem_bytes() <= smem_budget(ctas_per_sm)
    base = RopeBackward(True, head_dim, 32, 8, stage_rows=stage_rows, stages=2)  # the fewest stages
    per_stage = stage_rows * k.threads * k.vpt * 2 * 16  # d and z, 16 bytes each per vector
    assert k.smem_bytes() - base.smem_bytes() == (k.stages - 2) * per_stage
    if k.stages < RopeBackward.DEFAULTS[True]["stages"]:  # capped: one more stage would not fit
        assert k.smem_bytes() + per_stage > smem_budget(ctas_per_sm)
    assert k.step == k.sub_rows * stage_rows and k.chunk % k.step == 0


@pytest.mark.parametrize("qk_norm, tuning", [(True, dict(stage_rows=0)), (False, dict(stage_rows=2)),
                                              (True, dict(stages=0, stage_rows=2))])
def test_stage_rows_must_be_positive_and_only_for_staged_loads(qk_norm, tuning):
    """A tuning that would build the same kernel as another (stage_rows without stages) is refused,
    not compiled under a name of its own."""
    with pytest.raises(ValueError, match="stage_rows"):
        RopeBackward(qk_norm, 64, 32, 8, **tuning)


def test_unstaging_the_qk_norm_kernel_drops_its_default_stage_rows():
    """stages=0 alone on QK-norm (whose default stages its loads two rows at a time) builds the
    unstaged layout: rows in registers from vecs_in_flight, one row per step and thread, and the
    same kernel as asking for stage_rows=1 too (one tuning, one name)."""
    k = RopeBackward(True, 64, 32, 8, stages=0)
    assert RopeBackward.DEFAULTS[True]["stage_rows"] > 1
    assert not k.staged and k.tuning["stage_rows"] == 1
    assert k.rif == max(1, k.tuning["vecs_in_flight"] // k.vpt)
    assert k.tuning == RopeBackward(True, 64, 32, 8, stages=0, stage_rows=1).tuning


def test_every_tuning_of_the_gpu_tests_is_a_layout():
    """Each tuning the GPU tests launch (``test_rope_backward_gpu._sweep_tunings``: the benchmark's
    sweep and the fixed staged, unstaged and ragged cases) is a layout the kernel accepts, checked
    here on the CPU: a change of defaults that turns one into an error (stages=0 alone raised once
    the staged default took two rows per stage) fails in CI, not first on the GPU."""
    from test_rope_backward_gpu import _sweep_tunings

    for qk_norm, head_dim, tuning, (h, hkv) in _sweep_tunings():
        k = RopeBackward(qk_norm, head_dim, h, hkv, **dict(tuning))
        assert k.threads <= 1024 and k.chunk % k.step == 0, (qk_norm, head_dim, tuning)


# -- the kernel builds -----------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _build(qk_norm, head_dim, weight_dtype="float32"):
    """(PTX, ptxas statistics) of the kernel for 32 / 8 heads, sm_90a."""
    spec = RopeBackwardSpec(qk_norm, head_dim, 32, 8, weight_dtype=weight_dtype)
    kernel = compile_elementwise(spec, keep_artifacts=True)
    return kernel.ptx, kernel.stats


@pytest.mark.parametrize("qk_norm, head_dim, weight_dtype", [(False, 64, "float32"), (True, 128, "float32"),
                                                            (True, 64, "bfloat16")])
def test_kernel_builds_for_sm90a_with_16_byte_accesses_and_no_spills(qk_norm, head_dim, weight_dtype):
    ptx, stats = _build(qk_norm, head_dim, weight_dtype)
    assert ".target sm_90a" in ptx
    # global data moves 16 bytes at a time (loads into registers or cp.async into shared
    # memory); no 2-byte bf16 access but the QK-norm weights', read once per thread (8 per
    # vector slot) as they are, and their gradients, written by the last CTA (one store)
    loads16 = re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32|cp\.async\.cg\.shared\.global[^;]*, 16;", ptx)
    stores16 = re.findall(r"st\.global(?:\.\w+)*\.v4\.b32", ptx)
    assert len(loads16) >= 2 and len(stores16) >= 1, (loads16, stores16)
    stores2 = re.findall(r"st\.global(?:\.\w+)*\.(?:b16|u16|bf16)\b", ptx)
    assert len(stores2) == (1 if weight_dtype == "bfloat16" else 0), stores2
    loads2 = re.findall(r"ld\.global(?:\.\w+)*\.(?:b16|u16|bf16)\b", ptx)
    vpt = RopeBackward(qk_norm, head_dim, 32, 8).vpt
    assert len(loads2) == (8 * vpt if weight_dtype == "bfloat16" else 0), loads2
    # cos / sin computed in the kernel with the hardware approximations (no table in memory)
    assert "sin.approx.f32" in ptx and "cos.approx.f32" in ptx
    if qk_norm:  # the per-head sums: butterflies within a head's lanes, and its rsqrt; the CTAs
        # counted in at GPU scope (a release fence, one acq_rel atomic per CTA)
        assert "shfl.sync.bfly.b32" in ptx and "rsqrt.approx" in ptx
        assert ptx.count("fence.acq_rel.gpu") == 1 and len(re.findall(r"atom\.global\.acq_rel\.add", ptx)) == 1
        # the last CTA's sum over the CTAs' rows: 8 rows' loads at a time (then the remainder's)
        finish = ptx[ptx.index("atom.global.acq_rel.add"):]
        assert len(re.findall(r"ld\.global\.b32\b", finish)) >= 9, finish[:2000]
    assert stats.get("spill_stores", 0) == 0 and stats.get("spill_loads", 0) == 0, stats
    assert stats.get("registers", 0) > 0, stats


def test_bench_rope_backward_counts_the_kernels_bytes():
    """scripts/bench_rope_backward.py: the bytes it credits the kernel with are the tensors the
    kernel reads and writes (no more: its ratio to copy bandwidth must not flatter it; with
    QK-norm the pre-norm values replace qkv on the Q/K columns, they do not add to it), and it
    refuses to run without a GPU."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_rope_backward.py"
    spec = importlib.util.spec_from_file_location("bench_rope_backward", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    m, n = 16384, 6144
    # dq + dk + dv (m x n together), z, g: bf16; r, positions, zdz: 4 bytes a row
    assert mod.moved_bytes(m, n) == 2 * m * n * 3 + 12 * m
    if not torch.cuda.is_available():
        assert mod.main([]) == 2


def test_bench_sweep_tunings_build_without_spills():
    """Every tuning ``bench_rope_backward.py --sweep`` times builds for sm_90a without spills (a
    spilling variant would waste the GPU's time and say nothing about the defaults)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_rope_backward.py"
    spec = importlib.util.spec_from_file_location("bench_rope_backward", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for (qk_norm, head_dim), tunings in mod.SWEEP.items():
        for tuning in tunings:
            for wdt in ("float32", "bfloat16") if qk_norm else ("float32",):  # the weights as the op has them
                stats = compile_elementwise(RopeBackwardSpec(qk_norm, head_dim, 32, 8, tuning=tuning, weight_dtype=wdt),
                                            keep_artifacts=True).stats
                assert stats["spill_stores"] == 0 and stats["spill_loads"] == 0, (qk_norm, head_dim, tuning, wdt, stats)


@pytest.mark.parametrize("w_dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                      (torch.float32, torch.bfloat16)])
def test_op_body_hands_the_kernel_its_weights_and_returns_separate_gradients(monkeypatch, w_dtypes):
    """``coda.rope_backward``'s CUDA body around the kernel (run here on CPU tensors, the kernel
    stood in by the float64 reference): the QK-norm weights reach it contiguous in one dtype
    (bf16 or fp32 as given; fp32 when they differ), its gradients (in that dtype) come back in
    each weight's own dtype, and the two outputs share no memory (a custom op's outputs may not
    alias: its aliasing check would refuse them)."""
    from coda_cute import reference as R
    from coda_cute.ops import qkv as Q
    from coda_cute.ops.attention import qkv_heads

    b, s, h, hkv, hd = 2, 9, 4, 2, 64
    m, n = b * s, (h + 2 * hkv) * hd
    qkv = torch.randn(m, n).bfloat16()
    dq, dk, dv = qkv_heads(torch.randn(m, n).bfloat16(), b, h, hkv, hd)
    r, pos = torch.rand(m) + 0.5, torch.arange(s, dtype=torch.int32).repeat(b)
    inv_freq, pre = R.rope_inv_freq(hd, 10000.0), torch.randn(m, n).bfloat16()
    qn = (1 + 0.1 * torch.randn(hd)).to(w_dtypes[0])
    kn = (1 + 0.1 * torch.randn(hd)).to(w_dtypes[1])
    want = R.rope_backward_ref(*(t.double() for t in (dq, dk, dv)), qkv, r, pos, inv_freq, pre.double(), qn, kn, 1e-6)
    seen = {}

    def kernel(dq_, dk_, dv_, qkv_, r_, pos_, inv_, pre_, q_w, k_w, qk_eps, tuning=()):
        seen.update(q_w=q_w, k_w=k_w, eps=qk_eps)
        return want[0].bfloat16(), want[1].float(), (want[2].float().to(q_w.dtype), want[3].float().to(k_w.dtype))

    monkeypatch.setattr(Q, "rope_backward_kernel", kernel)
    g, zdz, dqn, dkn = Q.rope_backward.impls["cuda"](dq, dk, dv, qkv, r, pos, inv_freq, pre, qn, kn, 1e-6)
    one = w_dtypes[0] if w_dtypes[0] == w_dtypes[1] else torch.float32
    assert seen["q_w"].dtype == seen["k_w"].dtype == one and seen["eps"] == 1e-6
    assert seen["q_w"].is_contiguous() and seen["k_w"].is_contiguous()
    assert torch.equal(seen["q_w"], qn.to(one)) and torch.equal(seen["k_w"], kn.to(one))
    assert (dqn.dtype, dkn.dtype) == w_dtypes and dqn.shape == dkn.shape == (hd,)
    assert torch.equal(dqn, want[2].float().to(w_dtypes[0])) and torch.equal(dkn, want[3].float().to(w_dtypes[1]))
    assert dqn.untyped_storage().data_ptr() != dkn.untyped_storage().data_ptr()
