"""GPU tests of the epilogue's quantize sink (``E.quantize``): the FP8 values and 1 x 128 scales a
GEMM writes are bit for bit ``reference.quantize_blocks_ref`` of the same value stored in fp32 by
the same launch, into outputs poisoned with NaN, on ragged shapes, both FP8 formats and
power-of-two scales, 128 x 128 and 128 x 256 tiles; rows of zeros get scale 1, a row holding inf
or NaN a NaN scale; a block-scaled FP8 GEMM's quantized output feeds the next block-scaled GEMM."""

import pytest
import torch

from coda_cute import epilogue as E
from coda_cute import reference as R
from coda_cute.kernels.common.config import GemmConfig

pytestmark = pytest.mark.gpu

FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def _tree(dtype, pow2):
    y = E.acc() * E.col_vec("c") + E.tile("res")
    return E.Epilogue(E.store(y, "x", "float32"), E.quantize(y, "y_q", dtype, pow2))


def _poisoned(m, n, dtype):
    q = torch.full((m, n), float("nan"), device="cuda").to(FP8[dtype])
    return q, torch.full((m, -(-n // 128)), float("nan"), device="cuda")


def _operands(m, n, k):
    a = torch.randn(m, k, device="cuda").bfloat16()
    b = (torch.randn(k, n, device="cuda") / k ** 0.5).bfloat16()
    return a, b, {"c": torch.rand(n, device="cuda") + 0.5, "res": torch.randn(m, n, device="cuda").bfloat16()}


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("m, n, k", [(4096, 4096, 1024), (1000, 1040, 264), (77, 16, 64)])
def test_values_and_scales_are_the_reference_of_the_stored_value(dtype, pow2, m, n, k):
    a, b, inputs = _operands(m, n, k)
    q, s = _poisoned(m, n, dtype)
    out = E.run(_tree(dtype, pow2), a, b, inputs, outputs={"y_q": (q, s)})
    want_q, want_s = R.quantize_blocks_ref(out["x"], (1, 128), FP8[dtype], pow2)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("cfg", [GemmConfig(128, 128, 64, "cooperative", 2, 1),
                                 GemmConfig(128, 256, 64, "cooperative", 1, 1),
                                 GemmConfig(128, 256, 64, "cooperative", 2, 1)], ids=lambda c: c.name)
def test_every_tile_and_sub_tile_writes_its_own_blocks(cfg):
    """Explicit configs, the quantized value alone (the 128 x 256 builds that do not spill), ragged
    in both dimensions; against float64 within half an FP8 step of each value."""
    m, n, k = 1100, 1296, 256
    a, b, inputs = _operands(m, n, k)
    tree = E.Epilogue(E.quantize(E.acc() * E.col_vec("c"), "y_q"))
    q, s = _poisoned(m, n, "float8_e4m3fn")
    E.run(tree, a, b, {"c": inputs["c"]}, outputs={"y_q": (q, s)}, config=cfg)
    x = (a.double() @ b.double()) * inputs["c"].double()
    assert not s.isnan().any() and not q.float().isnan().any()
    deq = R.dequantize_blocks_ref(q, s, (1, 128)).double()
    scale = s.repeat_interleave(128, 1)[:, :n].double()
    # half a step of E4M3 (3 mantissa bits): 2^-4 relative, 2^-10 of the scale among denormals;
    # plus the fp32 accumulation's own error
    assert bool(((deq - x).abs() <= (2.0 ** -4 + 1e-5) * x.abs() + 2.0 ** -10 * scale).all())


def test_zero_rows_get_scale_one_and_nonfinite_rows_a_nan_scale():
    m, n, k = 256, 384, 128
    a, b, inputs = _operands(m, n, k)
    a[3] = 0
    inputs["res"][3] = 0  # row 3 all zeros
    inputs["res"][7, 200] = float("inf")  # row 7, block 1
    inputs["res"][9, 5] = float("nan")  # row 9, block 0
    q, s = _poisoned(m, n, "float8_e4m3fn")
    E.run(_tree("float8_e4m3fn", False), a, b, inputs, outputs={"y_q": (q, s)})
    assert torch.equal(s[3], torch.ones(3, device="cuda")) and not q[3].float().any()
    assert s[7, 1].isnan() and s[9, 0].isnan()
    assert not s[7, 0].isnan() and not s[7, 2].isnan() and not s[9, 1].isnan()


def test_a_block_scaled_output_quantized_feeds_the_next_block_scaled_gemm():
    """x1 = Q(a) @ QW(w1)^T quantized by its own epilogue, then x2 = Q(x1) @ QW(w2)^T: the chain
    against float64 on the dequantized operands, and the first GEMM's quantization bit for bit
    the reference of its bf16-free fp32 value."""
    m, d, f = 2048, 1024, 1536
    x = torch.randn(m, d, device="cuda")
    w1 = torch.randn(f, d, device="cuda") / d ** 0.5
    w2 = torch.randn(d, f, device="cuda") / f ** 0.5
    a_q, a_s = R.quantize_blocks_ref(x, (1, 128))
    w1_q, w1_s = R.quantize_blocks_ref(w1, (128, 128))
    w2_q, w2_s = R.quantize_blocks_ref(w2, (128, 128))
    tree = E.Epilogue(E.store(E.acc(), "x1", "float32"), E.quantize(E.acc(), "x1_q"))
    out = E.run(tree, a_q, w1_q.t(), {}, block_scales=(a_s, w1_s))
    h_q, h_s = out["x1_q"]
    want_q, want_s = R.quantize_blocks_ref(out["x1"], (1, 128))
    assert torch.equal(h_s, want_s) and torch.equal(h_q.view(torch.uint8), want_q.view(torch.uint8))
    y = E.run(E.Epilogue(E.store(E.acc(), "y", "float32")), h_q, w2_q.t(), {}, block_scales=(h_s, w2_s))["y"]
    want = R.block_scaled_gemm_ref(h_q, h_s, (1, 128), w2_q, w2_s, (128, 128), torch.float64)
    # the FP8 tensor cores' adder keeps about 14 bits within a k-block (test_block_scaled_gpu's bound)
    mag = R.block_scaled_gemm_ref(h_q.float().abs(), h_s, (1, 128), w2_q.float().abs(), w2_s, (128, 128),
                                  torch.float64)
    err = (y.double() - want).abs()
    assert bool((err <= 2.0 ** -11 * mag + 2.0 ** -23 * want.abs()).all())
    assert ((y.double() - want).norm() / want.norm()) < 5e-4


@pytest.mark.parametrize("m, n, k", [(4096, 2048, 512), (1040, 1296, 264), (16, 128, 64)])
@pytest.mark.parametrize("dtype, pow2", [("float8_e4m3fn", False), ("float8_e4m3fn", True), ("float8_e5m2", False)])
def test_both_layouts_in_one_pass_are_the_references_of_the_stored_value(m, n, k, dtype, pow2):
    """The row sink (1 x 128 along N) and the transposed one (x^T, 128-row blocks) of the same value
    in one launch, into NaN-poisoned outputs: each bit for bit the reference quantization of the
    value the launch stores in fp32 (ragged M and N: a partial last row block and column block)."""
    a, b, inputs = _operands(m, n, k)
    y = E.acc() * E.col_vec("c") + E.tile("res")
    tree = E.Epilogue(E.store(y, "x", "float32"), E.quantize(y, "y_q", dtype, pow2),
                      E.quantize(y, "y_t", dtype, pow2, transposed=True))
    q, s = _poisoned(m, n, dtype)
    qt, st = _poisoned(n, m, dtype)
    out = E.run(tree, a, b, inputs, outputs={"y_q": (q, s), "y_t": (qt, st)})
    for (got_q, got_s), x in (((q, s), out["x"]), ((qt, st), out["x"].t())):
        want_q, want_s = R.quantize_blocks_ref(x, (1, 128), FP8[dtype], pow2)
        assert torch.equal(got_s, want_s)
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("cfg", [GemmConfig(128, 128, 64, "cooperative", 2, 1),
                                 GemmConfig(128, 256, 64, "cooperative", 1, 1)], ids=lambda c: c.name)
def test_a_transposed_output_is_the_weight_gradient_operand(cfg):
    """dY from a GEMM, quantized transposed in its epilogue (dY^T in 1 x 128 blocks along the
    tokens), then dW = dY^T X on the block-scaled weight-gradient form: against float64 on the
    dequantized operands; the transposed values bit for bit the reference of dY^T."""
    t, d_out, d_in = 2048, 768, 512
    a, b, _ = _operands(t, d_out, 256)
    tree = E.Epilogue(E.store(E.acc(), "dy", "float32"), E.quantize(E.acc(), "dy_t", transposed=True))
    out = E.run(tree, a, b, {}, config=cfg)
    dyt_q, dyt_s = out["dy_t"]
    want_q, want_s = R.quantize_blocks_ref(out["dy"].t(), (1, 128))
    assert torch.equal(dyt_s, want_s) and torch.equal(dyt_q.view(torch.uint8), want_q.view(torch.uint8))
    xt_q, xt_s = R.quantize_blocks_ref(torch.randn(d_in, t, device="cuda"), (1, 128))
    dw = torch.ops.coda.gemm_blockwise(dyt_q, dyt_s.t().contiguous().t(), xt_q, xt_s, torch.float32, "1x128")
    want = R.block_scaled_gemm_ref(dyt_q, dyt_s, (1, 128), xt_q, xt_s, (1, 128), torch.float64)
    mag = R.block_scaled_gemm_ref(dyt_q.float().abs(), dyt_s, (1, 128), xt_q.float().abs(), xt_s, (1, 128),
                                  torch.float64)
    assert bool(((dw.double() - want).abs() <= 2.0 ** -11 * mag + 2.0 ** -23 * want.abs()).all())


def test_zero_columns_get_scale_one_and_nonfinite_columns_a_nan_scale():
    """The transposed sink's column blocks: a column of zeros gets scale 1 and zeros, a column
    holding inf or NaN in one 128-row block a NaN scale there only."""
    m, n, k = 384, 256, 128
    a, b, inputs = _operands(m, n, k)
    b[:, 5] = 0
    inputs["res"][:, 5] = 0  # column 5 all zeros
    inputs["res"][200, 17] = float("inf")  # column 17, row block 1
    inputs["res"][3, 40] = float("nan")  # column 40, row block 0
    tree = E.Epilogue(E.quantize(E.acc() * E.col_vec("c") + E.tile("res"), "y_t", transposed=True))
    qt, st = _poisoned(n, m, "float8_e4m3fn")
    E.run(tree, a, b, inputs, outputs={"y_t": (qt, st)})
    assert torch.equal(st[5], torch.ones(3, device="cuda")) and not qt[5].float().any()
    assert st[17, 1].isnan() and st[40, 0].isnan()
    assert not st[17, 0].isnan() and not st[17, 2].isnan() and not st[40, 1].isnan()


@pytest.mark.parametrize("m, n, k", [(4096, 1024, 512), (1040, 648, 264)])
def test_double_width_values_are_the_reference_of_the_stored_pairs(m, n, k):
    """A double-width value (two per output column, like the SwiGLU backward's dz'), rounded to
    bf16, stored and quantized in the same launch: values (M, 2N) and scales (M, ceil(2N / 128))
    bit for bit the reference quantization of the stored pairs (ragged: 2N = 1296 ends in a
    partial block), into NaN-poisoned outputs."""
    a, b, inputs = _operands(m, n, k)
    dz = E.cast(E.interleave(E.acc() * E.col_vec("c"), E.acc() + E.tile("res")), "bfloat16")
    tree = E.Epilogue(E.store(dz, "dz"), E.quantize(dz, "dz_q"))
    q, s = _poisoned(m, 2 * n, "float8_e4m3fn")
    out = E.run(tree, a, b, inputs, outputs={"dz_q": (q, s)})
    want_q, want_s = R.quantize_blocks_ref(out["dz"].float(), (1, 128))
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("m, n, k", [(4096, 1024, 512), (1040, 656, 264)])  # h: N / 2 a multiple of 8
def test_transposed_half_and_double_width_values(m, n, k):
    """h (one value per column pair) and dz' (two per column), rounded to bf16, stored and quantized
    transposed in the same launch: h^T (N / 2, M) and dz'^T (2N, M) with their scales bit for bit
    the reference quantization of the stored values' transposes (ragged M: a partial row block)."""
    a, b, inputs = _operands(m, n, k)
    h = E.cast(E.pairwise(lambda g, u: g * u, E.acc() * E.col_vec("c")), "bfloat16")
    dz = E.cast(E.interleave(E.acc() * E.col_vec("c"), E.acc() + E.tile("res")), "bfloat16")
    tree = E.Epilogue(E.store(h, "h"), E.quantize(h, "h_t", transposed=True),
                      E.store(dz, "dz"), E.quantize(dz, "dz_t", transposed=True))
    ht, hs = _poisoned(n // 2, m, "float8_e4m3fn")
    dzt, dzs = _poisoned(2 * n, m, "float8_e4m3fn")
    out = E.run(tree, a, b, inputs, outputs={"h_t": (ht, hs), "dz_t": (dzt, dzs)})
    for (q, s), stored in (((ht, hs), out["h"]), ((dzt, dzs), out["dz"])):
        want_q, want_s = R.quantize_blocks_ref(stored.float().t(), (1, 128))
        assert torch.equal(s, want_s)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
