"""CPU tests of the FP8 recipe (``coda_cute.precision``) and the quantization references
(``coda_cute.reference.quantize_blocks_ref`` and friends): the oracle the FP8 kernels are tested
against, so its rounding bounds, block layout, zero / inf / NaN blocks and argument rules are
pinned here; and the 1 x 128 quantize kernel's sm_90a build. Fresh random inputs per run (the
seed is in every failure message)."""

import math
import random

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import coda_cute
from coda_cute import reference as R
from coda_cute.compiler import spill_bytes
from coda_cute.elementwise import compile_elementwise
from coda_cute.elementwise_fp8 import QuantizeRowsSpec, QuantizeWeightSpec
from coda_cute.precision import Fp8Recipe, recipe_for
from helpers import generator, on_path

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
#: (max relative rounding error of a normal value, min normal exponent, mantissa bits)
FORMAT = {E4M3: (2.0 ** -4, -6, 3), E5M2: (2.0 ** -3, -14, 2)}


def fresh(*shape, spread=True):
    seed = random.randrange(2**31)
    g = generator(seed)
    x = torch.randn(*shape, generator=g)
    if spread:  # magnitudes over many binades, so blocks hold subnormal-range values too
        x = x * torch.exp2(torch.randint(-12, 8, shape, generator=g).float())
    return x, seed


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("block", [(1, 128), (128, 1), (128, 128)])
def test_round_trip_error_is_half_an_ulp_of_the_format(dtype, block):
    x, seed = fresh(200, 300)  # ragged: partial last blocks along both axes
    q, s = R.quantize_blocks_ref(x, block, dtype)
    assert q.dtype == dtype and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (math.ceil(200 / block[0]), math.ceil(300 / block[1]))
    rel, emin, mant = FORMAT[dtype]
    s_full = s.repeat_interleave(block[0], 0)[:200].repeat_interleave(block[1], 1)[:, :300]
    err = (R.dequantize_blocks_ref(q, s, block) - x).abs()
    # normal values: half an ulp relative; below the smallest normal: half the subnormal spacing
    bound = rel * x.abs() + 2.0 ** (emin - mant - 1) * s_full
    assert bool((err <= bound * (1 + 1e-6)).all()), (seed, float((err / bound).max()))


def test_scales_are_block_amax_over_the_format_max():
    x, seed = fresh(130, 260)
    q, s = R.quantize_blocks_ref(x, (128, 128), E4M3)
    want = torch.stack([torch.stack([x[i:i + 128, j:j + 128].abs().max() for j in (0, 128, 256)])
                        for i in (0, 128)]) / 448.0
    assert torch.equal(s, want), seed
    assert float(q.float().abs().max()) == 448.0  # each block's largest value maps to the top


def test_power_of_two_scales_round_up():
    x, seed = fresh(64, 384)
    q, s = R.quantize_blocks_ref(x, (1, 128), E4M3, pow2_scales=True)
    amax = x.abs().view(64, 3, 128).amax(-1)
    assert torch.equal(s, torch.exp2(torch.log2(s).round())), seed
    assert bool((s >= amax / 448.0).all() and (s < 2 * amax / 448.0).all()), seed
    assert bool(q.float().isfinite().all())


def test_zero_and_non_finite_blocks():
    x, _ = fresh(4, 512, spread=False)
    x[0, :128] = 0
    x[1, 130] = float("inf")
    x[2, 300] = float("nan")
    q, s = R.quantize_blocks_ref(x, (1, 128), E4M3)
    d = R.dequantize_blocks_ref(q, s, (1, 128))
    assert s[0, 0] == 1 and bool((d[0, :128] == 0).all())  # zeros: scale 1, exact
    assert math.isnan(s[1, 1]) and bool(d[1, 128:256].isnan().all())  # inf: its block is NaN
    assert math.isnan(s[2, 2]) and bool(d[2, 256:384].isnan().all())
    finite = torch.ones_like(s, dtype=torch.bool)
    finite[1, 1] = finite[2, 2] = False
    assert bool(s[finite].isfinite().all())  # the other blocks are untouched
    assert bool(d[3].isfinite().all())


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_a_block_of_denormals_keeps_a_finite_inverse_scale(dtype):
    """A block whose amax / FP8_MAX underflows (a gradient row of denormals next to exact zeros,
    as the first token's dq is) gets the floor scale 2^-126: 1 / s stays finite, so its zeros
    stay zero instead of becoming 0 * inf = NaN, and nothing dequantizes above the block's amax."""
    x, _ = fresh(2, 256, spread=False)
    x[0, :128] = 0
    x[0, 3], x[0, 77] = 1e-40, -3e-39  # fp32 denormals
    q, s = R.quantize_blocks_ref(x, (1, 128), dtype)
    assert s[0, 0] == 2.0 ** -126 and math.isfinite(1.0 / float(s[0, 0]))
    d = R.dequantize_blocks_ref(q, s, (1, 128))
    assert bool(d.isfinite().all()) and bool((d[0, :128].abs() <= 3e-39).all())
    assert bool((d[0, :128][x[0, :128] == 0] == 0).all())
    assert torch.equal(s[1], (x[1].abs().view(2, 128).amax(-1) / R.FP8_MAX[dtype]))  # untouched


def test_token_dimension_blocks_are_the_transposed_layout():
    x, seed = fresh(300, 160)
    q, s = R.quantize_blocks_ref(x, (128, 1), E4M3)
    qt, st = R.quantize_blocks_ref(x.t().contiguous(), (1, 128), E4M3)
    assert torch.equal(q.float(), qt.float().t()) and torch.equal(s, st.t()), seed


def test_block_scaled_gemm_reference_is_the_dequantized_product():
    a, seed = fresh(96, 384, spread=False)
    b, _ = fresh(80, 384, spread=False)
    aq, sa = R.quantize_blocks_ref(a, (1, 128), E4M3)
    bq, sb = R.quantize_blocks_ref(b, (128, 128), E4M3)
    out = R.block_scaled_gemm_ref(aq, sa, (1, 128), bq, sb, (128, 128), out_dtype=torch.float64)
    want = R.dequantize_blocks_ref(aq, sa, (1, 128)).double() @ R.dequantize_blocks_ref(bq, sb, (128, 128)).double().t()
    assert torch.allclose(out, want, rtol=1e-12, atol=0), seed
    exact = a.double() @ b.double().t()
    assert float((out - exact).norm() / exact.norm()) < 0.05, seed  # E4M3 operands: a few %


@pytest.mark.parametrize("args, match", [
    ((torch.randn(8), (1, 128)), "2-D floating-point"),
    ((torch.ones(4, 4, dtype=torch.int32), (1, 128)), "2-D floating-point"),
    ((torch.randn(4, 4), (0, 128)), "positive ints"),
    ((torch.randn(4, 4), [1, 128]), "positive ints"),
    ((torch.randn(4, 4), (1, 128), torch.bfloat16), "float8_e4m3fn or torch.float8_e5m2"),
])
def test_bad_quantize_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        R.quantize_blocks_ref(*args)


def test_recipe_defaults_blocks_and_validation():
    r = recipe_for("fp8")
    assert r == Fp8Recipe() and r.scaling == "block" and r.grad_dtype == E4M3 and not r.pow2_scales
    assert recipe_for("bf16") is None and recipe_for(r) is r
    assert [r.blocks(role, (4096, 1024)) for role in ("activation", "grad", "weight", "wgrad")] == \
        [(1, 128), (1, 128), (128, 128), (128, 1)]
    row = Fp8Recipe(scaling="row", grad_format="e5m2")
    assert row.grad_dtype == E5M2 and r.fast_accum == row.fast_accum == "none"
    assert Fp8Recipe(scaling="row", fast_accum="all").fast_accum == "all"
    assert [row.blocks(role, (4096, 1024)) for role in ("activation", "weight", "wgrad")] == \
        [(1, 1024), (1, 1024), (4096, 1)]
    for kw, match in [({"scaling": "tensor"}, "scaling"), ({"grad_format": "e4m3fnuz"}, "grad_format"),
                      ({"pow2_scales": 1}, "pow2_scales"), ({"scaling": "row", "fast_accum": "dgrad"}, "fast_accum"),
                      ({"fast_accum": "forward"}, "fast_accum must be 'none' with scaling='block'"),
                      ({"grad_format": ["e4m3"]}, "grad_format must be one of"),
                      ({"scaling": "row", "lm_head_fp8": True}, "the FP8 LM head runs the block recipe")]:
        with pytest.raises(ValueError, match=match):
            Fp8Recipe(**kw)
    with pytest.raises(ValueError, match="precision must be one of"):
        recipe_for("fp16")
    with pytest.raises(ValueError, match="role"):
        r.blocks("bias", (4, 4))
    with pytest.raises(ValueError, match=r"shape must be \(rows, cols\)"):
        r.blocks("weight", (4, 4, 4))


@pytest.mark.parametrize("out_dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_quantize_kernel_builds_with_wide_accesses_and_no_spills(dtype, out_dtype):
    """The 1 x 128 quantize kernel for sm_90a: 16-byte loads, 8-byte FP8 stores, the saturating
    paired FP8 conversion (the clamp to +-FP8_MAX: no min / max of the values of their own),
    IEEE divisions for the scale and its reciprocal (the reference's rounding), a NaN-keeping max
    for the amax, half-warp shuffles; no spills."""
    k = compile_elementwise(QuantizeRowsSpec(dtype, out_dtype), keep_artifacts=True)
    fmt = "e4m3" if out_dtype == "float8_e4m3fn" else "e5m2"
    for op in (".target sm_90a", f"cvt.rn.satfinite.{fmt}x2.f32", "ld.global.v4.b32", "st.global.v2.b32",
               "div.rn.f32", "max.NaN.f32", "shfl.sync.bfly.b32"):
        assert op in k.ptx, op
    assert "min.NaN.f32" not in k.ptx and "min.f32" not in k.ptx
    assert "div.approx" not in k.ptx and "div.full" not in k.ptx
    assert spill_bytes(k) == 0


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype, gamma", [("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", None)])
def test_weight_quantize_kernel_builds_with_wide_accesses_and_no_spills(dtype, gamma, transposed):
    """The fold + 128 x 128 weight quantizer for sm_90a: 16-byte loads of the weight (fp32
    masters or 16-bit), 8-byte FP8 stores, the CTA's amax through shuffles and a barrier, the
    reference's IEEE scale division; no spills. ``transposed``: the block also goes through
    shared memory (8-byte stores in, one byte per value out) to four 16-byte stores per thread of
    qt, and q's eight 8-byte stores stay."""
    k = compile_elementwise(QuantizeWeightSpec(dtype, gamma, transposed=transposed), keep_artifacts=True)
    for op in ("cvt.rn.satfinite.e4m3x2.f32", "ld.global.v4.b32", "st.global.v2.b32", "div.rn.f32",
               "shfl.sync.bfly.b32", "bar.sync"):
        assert op in k.ptx, op
    assert "ld.global.b32" not in k.ptx and "ld.global.u16" not in k.ptx  # no scalar weight loads
    assert k.ptx.count("st.global.v2.b32") == 8 and "min.NaN.f32" not in k.ptx  # the cast clamps
    assert k.ptx.count("st.global.v4.b32") == (4 if transposed else 0)
    assert (k.ptx.count("ld.shared.u8") + k.ptx.count("ld.shared.b8")) == (64 if transposed else 0)
    assert spill_bytes(k) == 0


# -- the op: coda.quantize_fp8 -------------------------------------------------------------------------
def test_quantize_op_on_the_reference_path_and_its_layouts():
    x, seed = fresh(130, 264)
    g = 1 + 0.1 * torch.randn(264)
    with coda_cute.reference_on_cpu():
        q, s = torch.ops.coda.quantize_fp8(x.to(torch.bfloat16))
        qw, sw = torch.ops.coda.quantize_fp8(x, "128x128", g, E5M2)
    want_q, want_s = R.quantize_blocks_ref(x.to(torch.bfloat16), (1, 128))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s), seed
    assert s.shape == (130, 3) and s.stride() == (1, 256)  # M-major, rows padded to 128 (block_scales_m_major)
    want_qw, want_sw = R.quantize_blocks_ref(x * g, (128, 128), E5M2)
    assert qw.dtype == E5M2 and torch.equal(qw.view(torch.uint8), want_qw.view(torch.uint8)), seed
    assert torch.equal(sw, want_sw) and sw.shape == (2, 3) and sw.is_contiguous()


def test_power_of_two_scales_on_the_reference_path():
    """``pow2_scales``: both ops' scales are the fp32 scales rounded up to powers of two (exactly:
    each is 2^e, at or above the fp32 one and below twice it), the values those scales give."""
    x, seed = fresh(130, 264)
    xb = x.to(torch.bfloat16)
    with coda_cute.reference_on_cpu():
        q, s = torch.ops.coda.quantize_fp8(xb, "1x128", None, E4M3, True)
        qw, sw = torch.ops.coda.quantize_fp8(x, "128x128", None, E4M3, True)
        _, sd, qt, st = torch.ops.coda.quantize_fp8_dual(xb[:128], E4M3, True)
    _, s32 = R.quantize_blocks_ref(xb, (1, 128))
    for got in (s, sw, sd, st):
        mant, _ = torch.frexp(got)
        assert bool((mant == 0.5).all()), seed
    assert bool((s >= s32).all() and (s < 2 * s32).all()), seed
    want_q, want_s = R.quantize_blocks_ref(xb, (1, 128), E4M3, pow2_scales=True)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s), seed
    want_qt, want_st = R.quantize_blocks_ref(xb[:128].t().contiguous(), (1, 128), E4M3, pow2_scales=True)
    assert torch.equal(qt.view(torch.uint8), want_qt.view(torch.uint8)) and torch.equal(st, want_st)


@pytest.mark.parametrize("spec", ["rows", "dual", "weight"])
def test_power_of_two_kernels_round_the_scale_on_its_bits(spec):
    """The pow2 builds add the exponent round-up (add the mantissa mask, keep sign and exponent:
    one and.b32 with 0xFF800000 per scale) and no spills; the name tells them apart."""
    from coda_cute.elementwise_fp8 import QuantizeDualSpec, QuantizeRowsSpec, QuantizeWeightSpec

    make = {"rows": lambda p: QuantizeRowsSpec("bfloat16", pow2=p), "dual": lambda p: QuantizeDualSpec("bfloat16", pow2=p),
            "weight": lambda p: QuantizeWeightSpec("float32", "bfloat16", transposed=True, pow2=p)}[spec]
    plain, pow2 = (compile_elementwise(make(p), keep_artifacts=True) for p in (False, True))
    assert pow2.spec.name == plain.spec.name + "_pow2" and spill_bytes(pow2) == 0
    mask = lambda k: k.ptx.count("-8388608") + k.ptx.count("0xFF800000")  # noqa: E731
    assert mask(plain) == 0 and mask(pow2) >= 1


def test_quantize_op_passes_opcheck_and_its_fake_matches():
    x, _ = fresh(64, 256)
    with coda_cute.reference_on_cpu():
        for args in [(x.to(torch.bfloat16),), (x, "128x128", torch.ones(256))]:
            torch.library.opcheck(torch.ops.coda.quantize_fp8.default, args,
                                  test_utils=("test_schema", "test_faketensor"))
    with FakeTensorMode():
        q, s = torch.ops.coda.quantize_fp8(torch.empty(16384, 4096, dtype=torch.bfloat16, device="cuda"))
    assert (q.shape, q.dtype, s.shape, s.stride()) == ((16384, 4096), E4M3, (16384, 32), (1, 16384))


def bad_quantize_calls():
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    yield "block", (x, "1x64"), "block must be one of"
    yield "fp32 activations", (x.float(),), "2-D tensor of"
    yield "1-D", (x[0],), "2-D tensor of"
    yield "K not a multiple of 8", (x[:, :100],), "multiple of 8"
    yield "column-major", (x.t(),), "contiguous"
    yield "dtype", (x, "1x128", None, torch.bfloat16), "float8_e4m3fn or"
    yield "gamma on activations", (x, "1x128", torch.ones(256)), "applies to weights"
    yield "gamma length", (x, "128x128", torch.ones(255)), r"gamma must be a contiguous \(256,\)"
    # the kernels assume 16-byte aligned rows: one element in, the rows still 512 bytes apart
    shifted = torch.zeros(64 * 256 + 1, dtype=torch.bfloat16)[1:].view(64, 256).copy_(x)
    yield "misaligned", (shifted,), "x's data pointer must be 16-byte aligned"
    # the weight kernel loads gamma in 16-byte vectors too (a contiguous slice was taken)
    gamma = torch.ones(257)[1:]
    yield "gamma misaligned", (x.float(), "128x128", gamma), "gamma's data pointer must be 16-byte aligned"


@pytest.mark.parametrize("case", list(bad_quantize_calls()), ids=lambda c: c[0])
@pytest.mark.parametrize("path", ["cpu", "fake"])
def test_quantize_op_bad_input_raises_on_every_path(case, path):
    _, args, match = case
    with pytest.raises(ValueError, match=match), on_path(path):
        torch.ops.coda.quantize_fp8(*args)


@pytest.mark.parametrize("path", ["cpu", "fake"])
def test_an_empty_x_takes_any_strides(path):
    """No values, nothing read: an expanded empty gradient's (0, 0) strides pass (they raised
    that x's rows must be contiguous), while K must still be a multiple of 8."""
    x = torch.ones((), dtype=torch.bfloat16).expand(0, 256)  # as a .sum() loss hands an empty gradient
    assert x.stride() == (0, 0)
    with on_path(path):
        q, s = torch.ops.coda.quantize_fp8(x)
        assert tuple(q.shape) == (0, 256) and tuple(s.shape) == (0, 2)
        with pytest.raises(ValueError, match="multiple of 8"):
            torch.ops.coda.quantize_fp8(torch.zeros(0, 12, dtype=torch.bfloat16))


# -- both 1 x 128 quantizations in one pass: coda.quantize_fp8_dual -----------------------------------
@pytest.mark.parametrize("rows", [True, False])
def test_dual_quantize_kernel_builds_with_wide_accesses_and_no_spills(rows):
    """x read once with 16-byte loads; the rows' FP8 values (8-byte stores) and the transposed
    copy's: 32 column pairs read down the shared tile per thread as 32-bit words, the quantized
    columns staged as rows of qt's tile (16-byte shared stores) and written from there with
    16-byte stores, after three barriers; IEEE scales; no spills. ``rows=False`` stores no row
    values."""
    from coda_cute.elementwise_fp8 import QuantizeDualSpec

    k = compile_elementwise(QuantizeDualSpec("bfloat16", "float8_e4m3fn", rows), keep_artifacts=True)
    ptx = k.ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "min.NaN.f32" not in ptx  # the cast clamps
    assert ptx.count("ld.global.v4.b32") == 8 and ptx.count("st.global.v4.b32") == 4
    assert ptx.count("st.global.v2.b32") == (8 if rows else 0)
    assert ptx.count("ld.shared.v2.b16") == 32 and ptx.count("ld.shared.u16") == 0
    # 8 rows of x and 4 of qt's staged groups stored, those 4 and the column amaxes (2) loaded
    assert ptx.count("st.shared.v4.b32") == 12 and ptx.count("ld.shared.v4.b32") == 6
    assert ptx.count("bar.sync") == 3
    assert "div.rn.f32" in ptx and "div.approx" not in ptx
    assert spill_bytes(k) == 0


@pytest.mark.parametrize("rows, cols", [(True, True), (True, False), (False, True)])
def test_abs_max_kernel_reads_once_and_folds_by_atomic_max(rows, cols):
    """The row-wise recipe's amaxes: x read with 16-byte loads, 8 rows of STRIP tiles per thread;
    one atomic max on the bits per row of the strip (after a half-warp butterfly, once) and per
    column of each tile (after one barrier per tile), no spills."""
    from coda_cute.elementwise_fp8 import AbsMaxSpec
    from coda_cute.kernels.elementwise.amax import STRIP

    k = compile_elementwise(AbsMaxSpec("bfloat16", rows, cols), keep_artifacts=True)
    ptx = k.ptx
    assert ptx.count("ld.global.v4.b32") == 8 * STRIP
    assert ptx.count("atom.global.max.s32") == 8 * rows + STRIP * cols
    assert ptx.count("shfl.sync.bfly") == 4 * 8 * rows and ptx.count("bar.sync") == STRIP * cols
    assert spill_bytes(k) == 0


@pytest.mark.parametrize("op", ["quantize_fp8_dual", "quantize_fp8_rowwise"])
def test_dual_ops_on_the_reference_path_are_both_quantizations(op):
    """x along K and x^T along M: 1 x 128 blocks, or the row-wise recipe's whole rows (1, K) and
    whole columns (1, M)."""
    x, seed = fresh(144, 264)
    x = x.to(torch.bfloat16)
    with coda_cute.reference_on_cpu():
        q, s, qt, st = getattr(torch.ops.coda, op)(x, E5M2)
    row = op.endswith("rowwise")
    want_q, want_s = R.quantize_blocks_ref(x.float(), (1, 264 if row else 128), E5M2)
    want_qt, want_st = R.quantize_blocks_ref(x.float().t(), (1, 144 if row else 128), E5M2)
    assert qt.is_contiguous() and qt.shape == (264, 144) and st.shape == ((264, 1) if row else (264, 2))
    for got, want in ((q, want_q), (qt, want_qt)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), seed
    assert torch.equal(s, want_s) and torch.equal(st, want_st), seed


@pytest.mark.parametrize("op", ["quantize_fp8_dual", "quantize_fp8_rowwise"])
@pytest.mark.parametrize("path", ["cpu", "fake"])
@pytest.mark.parametrize("shape, dtype, match", [
    ((100, 64), torch.float8_e4m3fn, r"rows \(M = 100\) must be a multiple of 16"),
    ((64, 60), torch.float8_e4m3fn, "K a multiple of 8"),
    ((64, 64), torch.bfloat16, "dtype must be torch.float8_e4m3fn"),
])
def test_dual_ops_reject_bad_input_on_every_path(op, path, shape, dtype, match):
    """The dual quantizer's rules, also the row-wise one's, each naming its op."""
    with on_path(path), pytest.raises(ValueError, match=rf"coda\.{op}: .*{match}"):
        getattr(torch.ops.coda, op)(torch.randn(*shape).bfloat16(), dtype)


# -- the row-wise recipe's quantization: coda.quantize_fp8_rowwise -------------------------------------
@pytest.mark.parametrize("rows", [True, False])
def test_rowwise_quantize_kernel_builds_from_the_dual_one_without_block_amaxes(rows):
    """The dual kernel's ``whole`` build: the same 16-byte loads and stores, no shuffles or
    shared column amaxes (the amaxes are given), one barrier fewer, IEEE scales, no spills."""
    from coda_cute.elementwise_fp8 import QuantizeDualSpec

    k = compile_elementwise(QuantizeDualSpec("bfloat16", "float8_e4m3fn", rows, whole=True), keep_artifacts=True)
    ptx = k.ptx
    assert k.spec.name.startswith("quantize_rowwise_")
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "shfl.sync.bfly" not in ptx
    assert ptx.count("ld.global.v4.b32") == 8 and ptx.count("st.global.v4.b32") == 4
    assert ptx.count("st.global.v2.b32") == (8 if rows else 0)
    assert ptx.count("bar.sync") == 2 and ptx.count("ld.shared.v4.b32") == 4
    assert "div.rn.f32" in ptx and "div.approx" not in ptx
    assert spill_bytes(k) == 0


def test_rowwise_rows_kernel_builds_from_the_1x128_one_without_the_butterfly():
    """The 1 x 128 kernel's ``whole`` build (the rows alone: the forward's activations): its
    loads and stores, no shuffles, no spills."""
    plain, whole = (compile_elementwise(QuantizeRowsSpec("bfloat16", whole=w), keep_artifacts=True)
                    for w in (False, True))
    assert whole.spec.name == plain.spec.name.replace("quantize_rows", "quantize_rowwise_rows")
    for op in ("ld.global.v4.b32", "st.global.v2.b32", "cvt.rn.satfinite.e4m3x2.f32"):
        assert whole.ptx.count(op) == plain.ptx.count(op) > 0, op
    assert "shfl.sync.bfly" in plain.ptx and "shfl.sync.bfly" not in whole.ptx
    assert spill_bytes(whole) == 0


@pytest.mark.parametrize("k, groups", [(4096, 2), (14336, 7), (32768, 16), (32776, 0)])
def test_whole_rows_kernel_reads_each_row_once_without_spills(k, groups):
    """The rows alone with their amaxes found in the kernel (``QuantizeWholeRowsSpec``, one CTA
    per row): a row of K values takes ceil(K / 2048) 16-byte loads per thread, as many 8-byte FP8
    stores, one warp butterfly and one barrier; no spills. Rows past 16 groups per thread take
    the amax pass instead (0)."""
    from coda_cute.elementwise_fp8 import QuantizeWholeRowsSpec, whole_row_groups

    assert whole_row_groups(k) == groups
    if not groups:
        return
    kern = compile_elementwise(QuantizeWholeRowsSpec("bfloat16", groups=groups), keep_artifacts=True)
    for op, n in (("ld.global.v4.b32", groups), ("st.global.v2.b32", groups), ("shfl.sync.bfly.b32", 5),
                  ("bar.sync", 1)):
        assert kern.ptx.count(op) == n, op
    for op in ("cvt.rn.satfinite.e4m3x2.f32", "max.NaN.f32", "div.rn.f32"):
        assert op in kern.ptx, op
    assert "div.approx" not in kern.ptx and "div.full" not in kern.ptx
    assert spill_bytes(kern) == 0


def test_rowwise_scales_are_the_row_and_column_amaxes_and_the_rows_come_alone():
    x, seed = fresh(144, 264)
    x = x.to(torch.bfloat16)
    from coda_cute.ops.quantize import quantize_rowwise_fp8
    with coda_cute.reference_on_cpu():
        q, s, qt, st = quantize_rowwise_fp8(x, E5M2)
        rows_only = quantize_rowwise_fp8(x[:100], E5M2, cols=False)  # M no multiple of 16: rows alone
    amax = x.float().abs()
    assert torch.equal(s[:, 0], amax.amax(1) / 57344.0) and torch.equal(st[:, 0], amax.amax(0) / 57344.0), seed
    assert rows_only[2:] == (None, None) and torch.equal(rows_only[1], s[:100])
    assert torch.equal(rows_only[0].view(torch.uint8), q[:100].view(torch.uint8))


def test_rowwise_op_passes_opcheck_and_its_fake_matches():
    x = torch.randn(64, 256).bfloat16()
    with coda_cute.reference_on_cpu():
        torch.library.opcheck(torch.ops.coda.quantize_fp8_rowwise.default, (x,),
                              test_utils=("test_schema", "test_faketensor"))
    with FakeTensorMode():
        out = torch.ops.coda.quantize_fp8_rowwise(torch.empty(16384, 4096, dtype=torch.bfloat16, device="cuda"))
    assert [tuple(t.shape) for t in out] == [(16384, 4096), (16384, 1), (4096, 16384), (4096, 1)]


def test_quantizers_take_no_tokens():
    """An empty batch: empty values, the scales of no blocks, and in the row-wise recipe's
    transposed layout a column without values is a zero block with scale 1, like the
    reference's zero blocks; nothing is launched on the GPU path (``elementwise``'s launchers
    skip it)."""
    from coda_cute.ops.quantize import quantize_rowwise_fp8

    x = torch.empty(0, 256).bfloat16()
    with coda_cute.reference_on_cpu():
        q, s = torch.ops.coda.quantize_fp8(x)
        assert q.shape == (0, 256) and s.shape == (0, 2)
        q, s, qt, st = quantize_rowwise_fp8(x, E4M3)
    assert q.shape == (0, 256) and s.shape == (0, 1) and qt.shape == (256, 0)
    assert torch.equal(st, torch.ones(256, 1))


# -- the FP8 transpose: coda_cute.elementwise_fp8.transpose_fp8 --------------------------------------------
def test_transpose_kernel_moves_16_bytes_per_global_access_without_spills():
    """``TransposeBytesSpec``: per thread four 16-byte loads of x and four 16-byte stores of xt,
    the tile through shared memory (four 16-byte stores, 64 byte loads down its columns, four
    16-byte stores of xt's tile and four 16-byte loads of it), two barriers, no spills."""
    from coda_cute.elementwise_fp8 import TransposeBytesSpec

    kern = compile_elementwise(TransposeBytesSpec(), keep_artifacts=True)
    assert kern.spec.name == "transpose_bytes_sm_90a"
    for op, n in (("ld.global.v4.b32", 4), ("st.global.v4.b32", 4), ("st.shared.v4.b32", 8),
                  ("ld.shared.b8", 64), ("ld.shared.v4.b32", 4), ("bar.sync", 2)):
        assert kern.ptx.count(op) == n, op
    assert "ld.global.b8" not in kern.ptx and "st.global.b8" not in kern.ptx
    assert spill_bytes(kern) == 0


# -- the row-wise recipe's gradients: rows in one read, the weight gradient's operand folded ----------
def test_gradient_rows_and_folded_columns_build_without_spills():
    """The gradient's one-read rows also write the fold factors (one 4-byte store per row, the
    same loads, stores and butterfly as the activations' build); the activation's amax and column
    quantizer scale each value by its row's factor (one multiply per value: 8 x 8 per tile in the
    amax pass, 32 x 2 in the quantizer, the factors through shared memory there), no spills."""
    from coda_cute.elementwise_fp8 import AbsMaxSpec, QuantizeDualSpec, QuantizeWholeRowsSpec

    rows, fold_rows = (compile_elementwise(QuantizeWholeRowsSpec("bfloat16", groups=14, fold=f), keep_artifacts=True)
                       for f in (False, True))
    assert fold_rows.spec.name == "quantize_rowwise_rows_amax_g14_fold_sm_90a_bf16_e4m3"
    for op in ("ld.global.v4.b32", "st.global.v2.b32", "shfl.sync.bfly.b32", "bar.sync"):
        assert fold_rows.ptx.count(op) == rows.ptx.count(op) > 0, op
    assert fold_rows.ptx.count("st.global.b32") == rows.ptx.count("st.global.b32") + 1
    amax, fold_amax = (compile_elementwise(AbsMaxSpec("bfloat16", rows=False, fold=f), keep_artifacts=True)
                       for f in (False, True))
    cols, fold_cols = (compile_elementwise(QuantizeDualSpec("bfloat16", rows=False, whole=True, fold=f),
                                           keep_artifacts=True) for f in (False, True))
    assert fold_amax.ptx.count("mul.f32") - amax.ptx.count("mul.f32") == 4 * 8 * 8  # a strip of 4 tiles
    assert fold_cols.ptx.count("mul.f32") - cols.ptx.count("mul.f32") == 32 * 2
    for plain, folded in ((amax, fold_amax), (cols, fold_cols)):
        for op in ("ld.global.v4.b32", "st.global.v4.b32", "bar.sync"):
            assert folded.ptx.count(op) == plain.ptx.count(op), op
    for k in (fold_rows, fold_amax, fold_cols):
        assert spill_bytes(k) == 0, k.spec.name
    with pytest.raises(ValueError, match="fold"):
        compile_elementwise(QuantizeDualSpec("bfloat16", rows=True, whole=True, fold=True))


def test_gradient_quantizer_refuses_a_fold_it_cannot_apply():
    """``fold`` scales the columns alone, with one fp32 factor per row of x, and a gradient's FP8
    transpose needs 16-byte rows both ways: the rules on every path, before a launch."""
    from coda_cute.ops.quantize import quantize_grad_rowwise_fp8, quantize_rowwise_fp8

    x = torch.randn(32, 64).bfloat16()
    with coda_cute.reference_on_cpu(), pytest.raises(ValueError, match="multiple of 16 for its FP8 transpose"):
        quantize_grad_rowwise_fp8(torch.randn(32, 72).bfloat16())
    with coda_cute.reference_on_cpu():
        for kw, match in (({"fold": torch.ones(32)}, "columns alone"),
                          ({"rows": False, "fold": torch.ones(31)}, r"contiguous \(32,\) fp32"),
                          ({"rows": False, "fold": torch.ones(32, dtype=torch.float64)}, "fp32")):
            with pytest.raises(ValueError, match=match):
                quantize_rowwise_fp8(x, **kw)
