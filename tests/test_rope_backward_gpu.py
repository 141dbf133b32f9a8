"""GPU tests of the RoPE backward (``coda.rope_backward`` and its kernel), against float64.

The op on GQA heads with ragged rows in the attention core's gradient layouts, with and without
QK-norm (its weights in bf16, fp32 or one of each); every tuning ``scripts/bench_rope_backward.py
--sweep`` times, on three row shapes and memory orders; the QK-norm kernel's cross-CTA finish on
small grids and two streams; no rows. Outputs are allocated poisoned (``conftest``), so a row a
kernel leaves unwritten is NaN and fails its comparison.
"""

import pytest
import torch

from coda_cute import reference as R
from coda_cute.ops.attention import attention_backward, attention_forward, qkv_heads
from coda_block_helpers import rand
from helpers import rel_err

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
ROPE_THETA = 500000.0


def cuda(*shape, dtype=BF16, scale=1.0):
    return rand(*shape, dtype=dtype, scale=scale, device="cuda")


def _qk_share(zdz, qkv, dv, n_qk):
    """zdz less its V columns' share sum qkv dv: the Q/K heads' share, qk_eps rs^3 sum(x gw) each
    with QK-norm (about qk_eps / (8 sqrt(D)) of the V share per head on unit data: a test needs
    a large qk_eps to see it)."""
    return zdz.double().flatten() - (qkv[:, n_qk:].double() * R.heads_as_rows(dv.double())).sum(1)


@pytest.mark.parametrize("qk_norm, qk_eps, w_dtypes", [
    (False, 1e-6, None), (True, 1e-6, ("bfloat16", "bfloat16")), (True, 1e-2, ("bfloat16", "bfloat16")),
    (True, 1e-2, ("float32", "float32")), (True, 1e-6, ("float32", "bfloat16"))])
@pytest.mark.parametrize("hd", [64, 128])
def test_rope_backward_op(qk_norm, qk_eps, w_dtypes, hd):
    """GQA heads, ragged rows, the attention core's own gradient layouts; with QK-norm at a model's
    qk_eps and at one where the Q/K heads' share of zdz is 2 % of it (checked on its own), its
    weights in bf16, fp32 or one of each (their gradients in their dtypes)."""
    b, s, h, hkv = 3, 333, 8, 2
    m, n = b * s, (h + 2 * hkv) * hd
    qkv = cuda(m, n)
    q, k, v = qkv_heads(cuda(m, n), b, h, hkv, hd)
    do = cuda(b, h, s, hd)
    o, lse = attention_forward(q, k, v)
    dq, dk, dv = attention_backward(do, q, k, v, o, lse)
    r = torch.rand(m, device="cuda") + 0.5
    pos = torch.arange(s, device="cuda", dtype=torch.int32).repeat(b)
    inv_freq = R.rope_inv_freq(hd, ROPE_THETA, "cuda")
    pre = cuda(m, n) if qk_norm else None
    qn = (1 + cuda(hd, scale=0.1)).to(getattr(torch, w_dtypes[0])) if qk_norm else None
    kn = (1 + cuda(hd, scale=0.1)).to(getattr(torch, w_dtypes[1])) if qk_norm else None
    got = torch.ops.coda.rope_backward(dq, dk, dv, qkv, r, pos, inv_freq, pre, qn, kn, qk_eps)
    again = torch.ops.coda.rope_backward(dq, dk, dv, qkv, r, pos, inv_freq, pre, qn, kn, qk_eps)
    assert all(a.equal(b) for a, b in zip(got, again) if a is not None)  # deterministic
    want = R.rope_backward_ref(*(t.double() for t in (dq, dk, dv)), qkv, r, pos, inv_freq,
                               pre.double() if qk_norm else None, qn, kn, qk_eps)
    assert rel_err(got[0], want[0]) < 1e-2
    assert rel_err(got[1], want[1].float()) < 1e-4
    if qk_norm:
        assert (got[2].dtype, got[3].dtype) == (qn.dtype, kn.dtype)
        assert rel_err(got[2].float(), want[2].float()) < 1e-2 and rel_err(got[3].float(), want[3].float()) < 1e-2
        if qk_eps >= 1e-2:
            n_qk = (h + hkv) * hd
            assert rel_err(_qk_share(got[1], qkv, dv, n_qk), _qk_share(want[1], qkv, dv, n_qk)) < 1e-3


def _sweep_tunings():
    """(qk_norm, head_dim, tuning, heads) of every tuning ``scripts/bench_rope_backward.py --sweep``
    times (at its 32 / 8 heads), and fixed staged cases of their own (the sweep's list is edited
    for speed): two vectors per thread and stage_rows 2 (two rows side by side), and 8 / 2 heads
    with stage_rows 4 (four rows side by side, each thread skipping the other three's rows), and
    the unstaged QK-norm path (rows in registers, the head sums of dw in shared memory of their
    own) at both head dims, and 3 / 1 heads (a ragged row: 40 vectors on 64 threads, the slots
    past it clamped onto a V vector)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_rope_backward.py"
    spec = importlib.util.spec_from_file_location("bench_rope_backward", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    swept = [(qk, hd, t, (32, 8)) for (qk, hd), tunings in mod.SWEEP.items() for t in tunings]
    fixed = [(True, 64, (("min_vpt", 2), ("stage_rows", 2)), (32, 8)), (True, 64, (("stage_rows", 4),), (8, 2)),
             (True, 128, (("stage_rows", 2),), (8, 2)), (True, 64, (("stages", 0),), (8, 2)),
             (True, 128, (("stages", 0),), (8, 2)), (True, 64, (), (3, 1))]
    return swept + [c for c in fixed if c not in swept]


#: (batch, seq, the gradients' memory order): the attention core's (B, S, heads, D); contiguous
#: (B, heads, S, D); S outermost (S, B, heads, D), where a step from a batch's last row to the next
#: batch's first goes back in memory
ROPE_SHAPES = [(8, 4133, "bshd"), (700, 3, "bhsd"), (37, 57, "sbhd")]


def _gradients(b, s, heads, hd, order):
    """dq / dk / dv (B, heads, S, D) with the memory order ``order`` (letters outermost first)."""
    sizes = dict(b=b, h=heads, s=s, d=hd)
    t = cuda(*(sizes[c] for c in order))
    return t.permute(*(order.index(c) for c in "bhsd"))


@pytest.mark.parametrize("b, s, order", ROPE_SHAPES)
@pytest.mark.parametrize("qk_norm, hd, tuning, heads", _sweep_tunings())
def test_rope_backward_kernel_tunings(qk_norm, hd, tuning, heads, b, s, order):
    """Each tuning the sweep may pick as a default, on the kernel itself against float64: 8 x 4133
    rows in the attention core's gradient layout (250-251 rows per CTA: four chunks of 64, the last
    partial; 125-126 with two CTAs per SM), 700 x 3 rows (a stage's consecutive rows cross batches;
    contiguous gradients) and 37 x 57 with the sequence outermost in memory. qk_eps 1e-2, so that
    the Q/K heads' share of zdz (2 % of it) is checked on its own; the norm weights in fp32 on the
    contiguous layout, bf16 on the others."""
    from coda_cute.elementwise import rope_backward_kernel

    h, hkv = heads
    m, n = b * s, (h + 2 * hkv) * hd
    qkv = cuda(m, n)
    dq, dk, dv = (_gradients(b, s, n_h, hd, order) for n_h in (h, hkv, hkv))
    r = torch.rand(m, device="cuda") + 0.5
    pos = torch.randint(0, 4096, (m,), device="cuda", dtype=torch.int32)
    inv_freq = R.rope_inv_freq(hd, ROPE_THETA, "cuda")
    pre = cuda(m, n) if qk_norm else None
    qn = (1 + cuda(hd, scale=0.1)) if qk_norm else None
    kn = (1 + cuda(hd, scale=0.1)) if qk_norm else None
    if qk_norm and order == "bhsd":
        qn, kn = qn.float(), kn.float()
    g, zdz, dw = rope_backward_kernel(dq, dk, dv, qkv, r, pos, inv_freq, pre, qn, kn, 1e-2, tuning)
    want = R.rope_backward_ref(*(t.double() for t in (dq, dk, dv)), qkv, r, pos, inv_freq,
                               pre.double() if qk_norm else None, qn, kn, 1e-2)
    assert rel_err(g, want[0]) < 1e-2
    assert rel_err(zdz, want[1].float()) < 1e-4
    if qk_norm:  # the last CTA's sums, in the weights' dtype; the arrival counter back at 0
        assert [t.dtype for t in dw] == [qn.dtype, kn.dtype] and dw[0].shape == dw[1].shape == (hd,)
        assert rel_err(dw[0].float(), want[2].float()) < 1e-2 and rel_err(dw[1].float(), want[3].float()) < 1e-2
        from coda_cute.elementwise import _arrival_counter

        assert _arrival_counter(qkv.device).item() == 0
        n_qk = (h + hkv) * hd
        assert rel_err(_qk_share(zdz, qkv, dv, n_qk), _qk_share(want[1], qkv, dv, n_qk)) < 1e-3


@pytest.mark.parametrize("b, s", [(1, 1), (1, 16), (1, 17), (2, 20), (1, 1000)])
def test_rope_backward_qk_norm_grids(b, s):
    """The QK-norm kernel's last CTA adds every CTA's dw row: grids of 1, 1, 2, 3 and 63 CTAs
    (16 rows or more each), so fewer CTAs than the finish's thread groups, empty and uneven
    groups; four launches in a row on one stream and one on a second stream, each against
    float64 and its counter back at 0."""
    from coda_cute.elementwise import _arrival_counter, rope_backward_kernel
    h, hkv, hd = 32, 8, 64
    m, n = b * s, (h + 2 * hkv) * hd
    qkv, pre = cuda(m, n), cuda(m, n)
    dq, dk, dv = (_gradients(b, s, n_h, hd, "bshd") for n_h in (h, hkv, hkv))
    r = torch.rand(m, device="cuda") + 0.5
    pos = torch.randint(0, 4096, (m,), device="cuda", dtype=torch.int32)
    inv_freq = R.rope_inv_freq(hd, ROPE_THETA, "cuda")
    qn, kn = 1 + cuda(hd, scale=0.1), 1 + cuda(hd, scale=0.1)
    want = R.rope_backward_ref(*(t.double() for t in (dq, dk, dv)), qkv, r, pos, inv_freq, pre.double(), qn, kn, 1e-2)
    side = torch.cuda.Stream()
    runs = []
    for stream in [torch.cuda.current_stream()] * 4 + [side]:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            runs.append(rope_backward_kernel(dq, dk, dv, qkv, r, pos, inv_freq, pre, qn, kn, 1e-2)[2])
            assert _arrival_counter(qkv.device).item() == 0
    torch.cuda.synchronize()
    for dqn, dkn in runs:
        assert rel_err(dqn.float(), want[2].float()) < 1e-2 and rel_err(dkn.float(), want[3].float()) < 1e-2
        assert dqn.equal(runs[0][0]) and dkn.equal(runs[0][1])  # deterministic


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_backward_without_rows(qk_norm):
    """No tokens: nothing launched (a grid of no CTAs is no launch), empty g and zdz, and with
    QK-norm zero weight gradients."""
    hd, h, hkv = 64, 4, 2
    dq, dk, dv = cuda(2, h, 0, hd), cuda(2, hkv, 0, hd), cuda(2, hkv, 0, hd)
    n = (h + 2 * hkv) * hd
    inv_freq = R.rope_inv_freq(hd, ROPE_THETA, "cuda")
    extra = (cuda(0, n), 1 + cuda(hd, scale=0.1), 1 + cuda(hd, scale=0.1), 1e-6) if qk_norm else ()
    g, zdz, dqn, dkn = torch.ops.coda.rope_backward(dq, dk, dv, cuda(0, n), torch.rand(0, device="cuda"),
                                                    torch.zeros(0, dtype=torch.int32, device="cuda"), inv_freq, *extra)
    assert g.shape == (0, n) and zdz.shape == (0, 1)
    if qk_norm:
        assert dqn.shape == dkn.shape == (hd,) and not dqn.any() and not dkn.any()
