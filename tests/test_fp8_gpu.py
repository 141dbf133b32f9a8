"""GPU tests of the FP8 quantize kernels (``coda_cute.elementwise_fp8.quantize_rows``, 1 x 128,
``quantize_weight``, the fold + 128 x 128, ``quantize_dual``, 1 x 128 of x and of x^T, and
``quantize_rowwise``, the row-wise recipe's whole rows and columns, with ``abs_max``, its amaxes,
its gradients' rows with their fold factors and the folded columns, and ``transpose_fp8``)
against the oracle
``coda_cute.reference.quantize_blocks_ref``: bit for bit (values and scales), ragged shapes (a
partial last block), values over many binades, zero blocks, inf and NaN blocks, an M-major scales
buffer, every output written (values and scales NaN-poisoned first: an unwritten one stays NaN
where the reference's is not), blocks of denormals (the floor scale); fp32 and power-of-two
scales."""

import pytest
import torch

from coda_cute import reference as R
from coda_cute.elementwise_fp8 import quantize_rows

pytestmark = pytest.mark.gpu


def _input(m, k, dtype):
    x = torch.randn(m, k, device="cuda") * torch.exp2(torch.randint(-10, 8, (m, k), device="cuda").float())
    return x.to(dtype)


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32-scales", "pow2-scales"])
@pytest.mark.parametrize("out_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, k", [(1, 128), (37, 200), (1000, 4096), (513, 1032)])
def test_quantize_kernel_is_the_reference_bit_for_bit(m, k, dtype, out_dtype, pow2):
    x = _input(m, k, dtype)
    if m > 2:
        x[1, : min(k, 128)] = 0
        x[2, min(k - 1, 130)] = float("inf")
        x[m - 1, k - 1] = float("nan")
    if m > 3:  # a block of zeros and denormals: the floor scale, zeros kept zero
        x[3, : min(k, 128)] = 0
        x[3, 0] = 1e-39
    want_q, want_s = R.quantize_blocks_ref(x, (1, 128), out_dtype, pow2)
    kb = -(-k // 128)
    scales = torch.full((kb, m), float("nan"), device="cuda").t()  # M-major, as a GEMM reads it
    poisoned = torch.full((m, k), 0x7F, dtype=torch.uint8, device="cuda").view(out_dtype)  # NaN
    q, s = quantize_rows(x, out_dtype, scales, poisoned, pow2)
    assert s.data_ptr() == scales.data_ptr() and q.data_ptr() == poisoned.data_ptr()
    same_nan = torch.isnan(s) == torch.isnan(want_s)
    assert bool(same_nan.all()) and torch.equal(s[~torch.isnan(s)], want_s[~torch.isnan(want_s)])
    got, want = q.view(torch.uint8), want_q.view(torch.uint8)
    nan = want_q.float().isnan()
    assert bool((q.float().isnan() == nan).all())
    assert torch.equal(got[~nan], want[~nan])


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32-scales", "pow2-scales"])
@pytest.mark.parametrize("dtype, with_gamma", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)])
@pytest.mark.parametrize("n, k", [(128, 128), (300, 1000), (4096, 4096), (1000, 136)])
def test_weight_quantize_kernel_is_the_reference_on_the_folded_weight(n, k, dtype, with_gamma, pow2):
    """``quantize_weight``: q, s of ``w * gamma`` in 128 x 128 blocks, bit for bit the reference
    on the fp32 product (ragged N and K, a NaN block, poisoned outputs)."""
    from coda_cute.elementwise_fp8 import quantize_weight

    w = _input(n, k, dtype)
    gamma = (1 + 0.1 * torch.randn(k, device="cuda")).to(dtype) if with_gamma else None
    if n > 200:
        w[130, 5] = float("nan")
    if n > 256 and k > 256:
        w[128:256, 128:256] = 0  # a weight block of zeros and a denormal: the floor scale
        w[200, 200] = 1e-39 if dtype == torch.float32 else 1e-38
    folded = w.float() * gamma.float() if with_gamma else w.float()
    want_q, want_s = R.quantize_blocks_ref(folded, (128, 128), pow2_scales=pow2)
    scales = torch.full(want_s.shape, float("nan"), device="cuda")
    poisoned = torch.full((n, k), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    q, s = quantize_weight(w, gamma, scales=scales, q=poisoned, pow2=pow2)
    assert bool((torch.isnan(s) == torch.isnan(want_s)).all())
    assert torch.equal(s[~torch.isnan(s)], want_s[~torch.isnan(want_s)])
    nan = want_q.float().isnan()
    assert bool((q.float().isnan() == nan).all())
    assert torch.equal(q.view(torch.uint8)[~nan], want_q.view(torch.uint8)[~nan])


@pytest.mark.parametrize("n, k", [(256, 128), (304, 1000), (4096, 1040), (1008, 136)])
def test_weight_quantize_kernel_writes_the_transpose_with_the_same_scales(n, k):
    """``quantize_weight(transposed=True)``: qt (K, N) is q^T byte for byte and q, s are the
    reference's (ragged N and K, a NaN block, every output NaN-poisoned first)."""
    from coda_cute.elementwise_fp8 import quantize_weight

    w = _input(n, k, torch.bfloat16)
    w[n - 3, 2] = float("nan")
    want_q, want_s = R.quantize_blocks_ref(w.float(), (128, 128))
    poison = lambda *shape: torch.full(shape, 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)  # noqa: E731
    q = poison(n, k)
    scales = torch.full(want_s.shape, float("nan"), device="cuda")
    got_q, got_s, qt = quantize_weight(w, None, scales=scales, q=q, transposed=True, qt=poison(k, n))
    assert bool((torch.isnan(got_s) == torch.isnan(want_s)).all())
    assert torch.equal(got_s[~torch.isnan(got_s)], want_s[~torch.isnan(want_s)])
    nan = want_q.float().isnan()
    assert torch.equal(got_q.view(torch.uint8)[~nan], want_q.view(torch.uint8)[~nan])
    # the transpose byte for byte (poisoned with 0x7F, a NaN: an unwritten byte of a finite
    # block differs)
    assert torch.equal(qt.view(torch.uint8), got_q.view(torch.uint8).t().contiguous())


def test_quantize_op_is_the_reference():
    """``coda.quantize_fp8`` on the GPU: both blocks, the M-major activation scales (rows padded to
    128, ``precision.block_scales_m_major``)."""
    x = _input(1000, 4096, torch.bfloat16)
    q, s = torch.ops.coda.quantize_fp8(x)
    want_q, want_s = R.quantize_blocks_ref(x, (1, 128))
    assert s.stride() == (1, 1024) and torch.equal(s, want_s)  # M-major, rows padded to 128
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    w, g = _input(4096, 1000, torch.float32), 1 + 0.1 * torch.randn(1000, device="cuda")
    qw, sw = torch.ops.coda.quantize_fp8(w, "128x128", g)
    want_qw, want_sw = R.quantize_blocks_ref(w * g, (128, 128))
    assert torch.equal(sw, want_sw) and torch.equal(qw.view(torch.uint8), want_qw.view(torch.uint8))


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32-scales", "pow2-scales"])
@pytest.mark.parametrize("rows", [True, False])
@pytest.mark.parametrize("m, k", [(16, 8), (1008, 1000), (4096, 4096), (272, 136)])
@pytest.mark.parametrize("out_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_dual_quantize_kernel_is_both_references_bit_for_bit(m, k, out_dtype, rows, pow2):
    """``quantize_dual``: x's 1 x 128 quantization and x^T's, bit for bit (values and scales),
    ragged tiles both ways, zero / inf / NaN blocks in both directions, outputs NaN-poisoned."""
    from coda_cute.elementwise_fp8 import QuantizeDualSpec
    from coda_cute.compiler import get_kernel

    x = _input(m, k, torch.bfloat16)
    if m > 100:
        x[3, :] = 0  # a zero row block (and parts of column blocks)
        x[:, 5] = 0  # a zero column block of x^T's first row block
        x[7, k - 1] = float("inf")
        x[m - 2, 2] = float("nan")
        x[9, 128:256] = 0  # a row block of zeros and a denormal: the floor scale
        x[9, 129] = -1e-39
    poison = lambda *shape: torch.full(shape, 0x7F, dtype=torch.uint8, device="cuda").view(out_dtype)  # noqa: E731
    q, qt = poison(m, k), poison(k, m)
    s = torch.full((m, -(-k // 128)), float("nan"), device="cuda")
    st = torch.full((k, -(-m // 128)), float("nan"), device="cuda")
    spec = QuantizeDualSpec("bfloat16", str(out_dtype)[6:], rows, pow2=pow2)
    get_kernel(spec).fn(x, q, s, qt, st)
    checks = [(qt, st, x.float().t())] + ([(q, s, x.float())] if rows else [])
    for got_q, got_s, src in checks:
        want_q, want_s = R.quantize_blocks_ref(src.contiguous(), (1, 128), out_dtype, pow2)
        assert bool((torch.isnan(got_s) == torch.isnan(want_s)).all())
        assert torch.equal(got_s[~torch.isnan(got_s)], want_s[~torch.isnan(want_s)])
        nan = want_q.float().isnan()
        assert bool((got_q.float().isnan() == nan).all())
        assert torch.equal(got_q.view(torch.uint8)[~nan], want_q.view(torch.uint8)[~nan])
    if not rows:
        assert bool(s.isnan().all())  # untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
# the last: strips of 4 tiles along a wide row, the last strip holding one partial tile
@pytest.mark.parametrize("m, k", [(1, 8), (37, 200), (1000, 4104), (4096, 4096), (130, 28680)])
def test_abs_max_kernel_is_torchs_amax_bit_for_bit(m, k, dtype):
    """``abs_max``: every row's and column's max |x| (atomic max on the bits across tiles),
    ragged tiles, a zero row, an inf and a NaN (their row and column NaN / inf); rows or columns
    alone."""
    from coda_cute.elementwise_fp8 import abs_max

    x = _input(m, k, dtype)
    if m > 3:
        x[1, :] = 0
        x[2, k - 1] = float("inf")
        x[m - 1, 3] = float("nan")
    a = x.float().abs()
    want_r, want_c = a.amax(1), a.amax(0)
    for rows, cols in ((True, True), (True, False), (False, True)):
        got_r, got_c = abs_max(x, rows, cols)
        for got, want, on in ((got_r, want_r, rows), (got_c, want_c, cols)):
            if not on:
                assert got is None
                continue
            assert bool((got.isnan() == want.isnan()).all())
            assert torch.equal(got[~got.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32-scales", "pow2-scales"])
@pytest.mark.parametrize("rows", [True, False])
# the last two: a row in one CTA with a partial last group, and one past one CTA (the amax pass)
@pytest.mark.parametrize("m, k", [(16, 8), (1008, 1000), (4096, 4096), (272, 136), (160, 14344), (112, 32776)])
@pytest.mark.parametrize("out_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_rowwise_quantize_kernel_is_both_references_bit_for_bit(m, k, out_dtype, rows, pow2):
    """``quantize_rowwise`` (the row-wise recipe): x with one scale per whole row and x^T with one
    per whole column of x, bit for bit against ``quantize_blocks_ref`` with blocks (1, K) and
    (1, M); a zero row and column, an inf and a NaN (their rows and columns NaN-scaled), a row of
    denormals (the floor scale); ragged tiles both ways. The kernel runs on NaN-poisoned outputs
    (every value and scale written); the launcher, which finds the amaxes, gives the same."""
    from coda_cute.compiler import get_kernel
    from coda_cute.elementwise_fp8 import QuantizeDualSpec, quantize_rowwise

    x = _input(m, k, torch.bfloat16)
    if m > 100:
        x[3, :] = 0
        x[:, 5] = 0
        x[7, k - 1] = float("inf")
        x[m - 2, 2] = float("nan")
        x[9, :] = 0
        x[9, 129] = -1e-39
    poison = lambda *shape: torch.full(shape, 0x7F, dtype=torch.uint8, device="cuda").view(out_dtype)  # noqa: E731
    q, qt = poison(m, k), poison(k, m)
    s, st = (torch.full((n, 1), float("nan"), device="cuda") for n in (m, k))
    amax = x.float().abs()
    spec = QuantizeDualSpec("bfloat16", str(out_dtype)[6:], rows, pow2=pow2, whole=True)
    get_kernel(spec).fn(x, q, s, qt, st, amax.amax(1), amax.amax(0))
    launched = quantize_rowwise(x, out_dtype, rows, pow2=pow2)
    for got, want in zip(launched, (q, s, qt, st) if rows else (None, None, qt, st)):
        assert got is None and want is None or torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if rows:  # the rows alone (amaxes found in one CTA per row, or the amax pass then the 1 x 128
        # kernel's whole build), M any
        rows_only = quantize_rowwise(x[: m - 1], out_dtype, cols=False, pow2=pow2)
        assert rows_only[2:] == (None, None)
        assert torch.equal(rows_only[0].view(torch.uint8), q[: m - 1].view(torch.uint8))
        assert torch.equal(rows_only[1].view(torch.uint8), s[: m - 1].view(torch.uint8))
    checks = [(qt, st, x.float().t())] + ([(q, s, x.float())] if rows else [])
    for got_q, got_s, src in checks:
        want_q, want_s = R.quantize_blocks_ref(src.contiguous(), (1, src.shape[1]), out_dtype, pow2)
        assert got_s.shape == want_s.shape == (src.shape[0], 1)
        assert bool((torch.isnan(got_s) == torch.isnan(want_s)).all())
        assert torch.equal(got_s[~torch.isnan(got_s)], want_s[~torch.isnan(want_s)])
        nan = want_q.float().isnan()
        assert bool((got_q.float().isnan() == nan).all())
        assert torch.equal(got_q.view(torch.uint8)[~nan], want_q.view(torch.uint8)[~nan])


def test_quantize_launchers_take_no_tokens():
    """An empty batch launches nothing (a grid of no CTAs is an error): empty values, no block
    scales, and the row-wise recipe's columns without values scale 1 (zero blocks)."""
    from coda_cute.elementwise_fp8 import abs_max, quantize_dual, quantize_rows, quantize_rowwise

    x = torch.empty(0, 256, dtype=torch.bfloat16, device="cuda")
    q, s = quantize_rows(x)
    assert q.shape == (0, 256) and s.shape == (0, 2)
    assert [tuple(t.shape) for t in quantize_dual(x)] == [(0, 256), (0, 2), (256, 0), (256, 0)]
    assert abs_max(x)[0].shape == (0,) and bool((abs_max(x)[1] == 0).all())
    q, s, qt, st = quantize_rowwise(x)
    assert q.shape == (0, 256) and s.shape == (0, 1) and qt.shape == (256, 0)
    assert bool((st == 1).all()) and st.shape == (256, 1)
    torch.cuda.synchronize()


@pytest.mark.parametrize("m, n", [(16, 16), (160, 272), (1008, 4112), (4096, 28672)])
def test_transpose_kernel_is_the_transpose_bit_for_bit(m, n):
    """``transpose_fp8``: ``q.t()`` contiguous, bit for bit over every byte pattern (NaNs
    included), ragged tiles along both axes, into an output poisoned with 0x7F (an unwritten
    16-byte group keeps it and differs from the transpose unless all 16 random bytes are 0x7F);
    a fresh output too, and an empty q launches nothing."""
    from coda_cute.elementwise_fp8 import transpose_fp8

    q = torch.randint(0, 256, (m, n), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    out = torch.full((n, m), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    got = transpose_fp8(q, out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == q.dtype
    assert torch.equal(got.view(torch.uint8), q.t().contiguous().view(torch.uint8))
    fresh = transpose_fp8(q)
    assert fresh.shape == (n, m) and fresh.is_contiguous() and fresh.dtype == q.dtype
    assert torch.equal(fresh.view(torch.uint8), q.view(torch.uint8).t())
    assert transpose_fp8(q[:0]).shape == (n, 0)


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32-scales", "pow2-scales"])
@pytest.mark.parametrize("out_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
# a row in one CTA (partial last group), one past one CTA (the amax pass), ragged tiles, dz' widths
@pytest.mark.parametrize("m, k", [(16, 16), (1008, 1008), (160, 14352), (112, 32784), (2048, 28672)])
def test_gradient_rows_and_folded_columns_are_the_reference_bit_for_bit(m, k, out_dtype, pow2):
    """``quantize_grad_rowwise_fp8`` (a gradient's rows in one read, their fold factors and the FP8
    transpose) and ``quantize_rowwise_fp8(fold=...)`` (an activation's columns after the factors
    scale its rows) against the reference path, bit for bit: a zero gradient row (factor 0: the
    activation's huge row beside it changes no column), an inf and a NaN row (NaN scale and
    factor; the columns then take a finite factor there, or every one would be NaN), a row of
    denormals (the floor scale); the activation's columns over all the rows, and with the NaN
    row's factor as it comes every column NaN (a NaN gradient row poisons the whole weight
    gradient, which the reference states)."""
    import coda_cute
    from coda_cute.ops.quantize import quantize_grad_rowwise_fp8, quantize_rowwise_fp8

    g, x = _input(m, k, torch.bfloat16), _input(m, 264, torch.bfloat16)
    if m > 100:
        g[3, :] = 0
        x[3, :] = 3e4
        g[7, k - 1] = float("inf")
        g[m - 2, 2] = float("nan")
        g[9, :] = 0
        g[9, 129] = -1e-39
    got = quantize_grad_rowwise_fp8(g, out_dtype, pow2)
    fold = torch.where(got[3].isnan(), 0.5, got[3])  # the NaN rows' factors would make every column NaN
    got_cols = quantize_rowwise_fp8(x, rows=False, pow2_scales=pow2, fold=fold)
    with coda_cute.reference_on_cpu():
        want = quantize_grad_rowwise_fp8(g.cpu(), out_dtype, pow2)
        want_cols = quantize_rowwise_fp8(x.cpu(), rows=False, pow2_scales=pow2, fold=fold.cpu())
    if m > 100:
        assert want[3][3] == 0 and want[2].shape == (k, m)
    pairs = [("q", got[0], want[0]), ("s", got[1], want[1]), ("qt", got[2], want[2]), ("fold", got[3], want[3]),
             ("x qt", got_cols[2], want_cols[2]), ("x st", got_cols[3], want_cols[3])]
    if m > 100:  # the factors as they come: the NaN row's factor makes every folded column NaN, as in the reference
        nan_cols = quantize_rowwise_fp8(x, rows=False, pow2_scales=pow2, fold=got[3])
        with coda_cute.reference_on_cpu():
            want_nan = quantize_rowwise_fp8(x.cpu(), rows=False, pow2_scales=pow2, fold=got[3].cpu())
        assert bool(want_nan[3].isnan().all()) and bool(want_nan[2].float().isnan().all())
        pairs += [("x qt, NaN factor", nan_cols[2], want_nan[2]), ("x st, NaN factor", nan_cols[3], want_nan[3])]
    for name, a, b in pairs:
        a, b = a.cpu(), b.cpu()
        assert a.shape == b.shape, name
        if a.dtype.is_floating_point and a.element_size() == 4:
            assert bool((a.isnan() == b.isnan()).all()) and torch.equal(a[~a.isnan()], b[~b.isnan()]), name
        else:
            nan = b.float().isnan()
            assert bool((a.float().isnan() == nan).all()), name
            assert torch.equal(a.view(torch.uint8)[~nan], b.view(torch.uint8)[~nan]), name
