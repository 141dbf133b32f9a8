"""CPU tests of ``torch.ops.coda.mlp_block_fp8`` (the MLP sublayer with FP8 forward and dgrad GEMMs):
the reference path against ``reference.mlp_block_fp8_ref`` and against float64 math with its error
next to the bf16 op's, the fake implementation, bad input on every path, and the kernels of its
four epilogue trees built for sm_90a without spills; each in both recipes (block-scaled and
row-wise, ``row_scaling``)."""

import pytest
import torch

import coda_cute
from coda_cute import reference as R
from coda_cute.epilogue.runner import choose_config, ranked_configs, spills
from coda_cute.nn.llama import embedding_norm_stats
from coda_cute.ops.fp8_gemms import row_scaled
from coda_cute.ops.residual import residual_norm_stats_tree, stats_tile_n
from coda_cute.ops.rmsnorm import norm_backward_tree
from coda_cute.ops.swiglu import norm_swiglu_tree, swiglu_backward_tree
from helpers import generator, on_path, rel_err

EPS = 1e-5


def _inputs(m, d, f, seed):
    g = generator(seed)
    y = torch.randn(m, d, generator=g).bfloat16()
    w_gu = (torch.randn(2 * f, d, generator=g) * d ** -0.5).bfloat16()
    w_down = (torch.randn(d, f, generator=g) * f ** -0.5).bfloat16()
    dy2 = torch.randn(m, d, generator=g).bfloat16()
    with coda_cute.reference_on_cpu():
        ss = embedding_norm_stats(y)
    return y, ss, w_gu, w_down, dy2


def _mlp64(y, w_gu, w_down):
    r = torch.rsqrt(y.square().mean(-1, keepdim=True) + EPS)
    z = r * (y @ w_gu.T)
    return y + (torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]) @ w_down.T


def _grads(op, y, ss, w_gu, w_down, dy2, **kw):
    leaves = [t.clone().requires_grad_() for t in (y, w_gu, w_down)]
    with coda_cute.reference_on_cpu():
        y2 = op(leaves[0], ss, leaves[1], leaves[2], EPS, **kw)[0]
        y2.backward(dy2)
    return y2, [t.grad for t in leaves]


RECIPES = pytest.mark.parametrize("row", [False, True], ids=["block", "row-wise"])


def _kept(w, row):
    """What the op keeps of W (N, K) for the backward: (qt, scales) - W's FP8 transpose with the
    128 x 128 scales of W itself, or in the row-wise recipe W^T quantized per column of W, with
    W's row scales and then its column scales."""
    if not row:
        q, s = R.quantize_blocks_ref(w.float(), (128, 128))
        return q.t().contiguous(), s
    s = R.quantize_blocks_ref(w.float(), (1, w.shape[1]))[1]
    qt, st = R.quantize_blocks_ref(w.float().t().contiguous(), (1, w.shape[0]))
    return qt, torch.cat([s, st])


@RECIPES
@pytest.mark.parametrize("m, d, f", [(200, 256, 384), (77, 272, 208)])  # whole and ragged 128-blocks
def test_forward_is_the_reference_on_the_fp8_operands(m, d, f, row):
    """The block recipe's path matched its reference bit for bit over 43 seeds. The row-wise one
    applies its scales to the products (as the kernel does) where the reference dequantizes
    first: z differs by a bf16 ulp here and there, and an h that then rounds to the neighbouring
    FP8 code moves a few elements of y2 by up to 0.06 (rel_err of y2, ss2, z at most 1.2e-3,
    3.7e-4, 1e-4 over those seeds; elementwise 1e-2 bounds failed on 3 seeds in 14)."""
    y, ss, w_gu, w_down, _ = _inputs(m, d, f, 1)
    with coda_cute.reference_on_cpu():
        y2, ss2, z, gu_qt, gu_s, down_qt, down_s, *_ = torch.ops.coda.mlp_block_fp8(y, ss, w_gu, w_down, EPS,
                                                                                    row_scaling=row)
    want = R.mlp_block_fp8_ref(y, ss, w_gu, w_down, EPS, stats_tile_n(torch.empty(m, f), w_down), row=row)
    for got, ref in zip((y2, ss2, z), want):
        assert got.shape == ref.shape and got.dtype == ref.dtype
        assert rel_err(got, ref) < 5e-3
    assert gu_qt.shape == (d, 2 * f) and gu_qt.is_contiguous()
    for (qt, s), w in (((gu_qt, gu_s), w_gu), ((down_qt, down_s), w_down)):
        want_qt, want_s = _kept(w, row)
        assert torch.equal(qt.view(torch.uint8), want_qt.view(torch.uint8)) and torch.equal(s, want_s)


@RECIPES
@pytest.mark.parametrize("e5m2_grads", [False, True])
def test_gradients_against_float64_next_to_the_bf16_op(e5m2_grads, row):
    """FP8 rounds every GEMM operand (2^-4 relative for E4M3, 2^-3 for E5M2): the error against
    float64 math is several times bf16's, bounded, and the quantization visibly happened."""
    y, ss, w_gu, w_down, dy2 = _inputs(256, 256, 384, 2)
    leaves = [t.double().requires_grad_() for t in (y, w_gu, w_down)]
    exact = _mlp64(*leaves)
    exact.backward(dy2.double())
    fp8_out, fp8_grads = _grads(torch.ops.coda.mlp_block_fp8, y, ss, w_gu, w_down, dy2, e5m2_grads=e5m2_grads,
                                row_scaling=row)
    bf16_out, bf16_grads = _grads(torch.ops.coda.mlp_block, y, ss, w_gu, w_down, dy2)
    delta = exact - leaves[0]  # the sublayer's own output, without the residual
    err = lambda out: rel_err(out.double() - y.double(), delta)  # noqa: E731
    assert err(bf16_out) < err(fp8_out) < 0.08
    bound = 0.16 if e5m2_grads else 0.08
    for name, f8, b16, leaf in zip(("dy", "dw_gu", "dw_down"), fp8_grads, bf16_grads, leaves):
        e8, e16 = rel_err(f8.double(), leaf.grad), rel_err(b16.double(), leaf.grad)
        assert e16 < e8 < bound, (name, e8, e16)


@RECIPES
@pytest.mark.parametrize("fused", [False, True], ids=["separate-quantize", "fused-quantize"])
def test_fake_outputs_are_the_cpu_outputs(fused, row, monkeypatch):
    """Also with ``FUSED_QUANT`` (M = 80: a multiple of 16, h^T (f, M) among the outputs; the
    row-wise recipe does not take it, and returns h's FP8 rows (M, f) there either way)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from coda_cute.ops import mlp_fp8

    monkeypatch.setattr(mlp_fp8, "FUSED_QUANT", fused)
    y, ss, w_gu, w_down, _ = _inputs(80 if fused else 77, 272, 208, 3)
    with coda_cute.reference_on_cpu():
        real = torch.ops.coda.mlp_block_fp8(y, ss, w_gu, w_down, EPS, row_scaling=row)
    with FakeTensorMode() as mode:
        fake = torch.ops.coda.mlp_block_fp8(*(mode.from_tensor(t) for t in (y, ss, w_gu, w_down)), EPS,
                                            row_scaling=row)
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
    m = y.shape[0]
    assert tuple(real[7].shape) == ((m, 208) if row else (208, 80) if fused else (0,))
    assert tuple(real[8].shape) == ((m,) if row else (208, 1) if fused else (0,))


@pytest.mark.parametrize("path", ["cpu", "fake"])
@pytest.mark.parametrize("d, f, e5m2_grads, match", [
    (136, 128, False, "the model width d .* must be a multiple of 16 for FP8"),
    (128, 200, False, "the SwiGLU width f must be a multiple of 16 for FP8"),
])
def test_bad_input_is_refused_on_every_path(path, d, f, e5m2_grads, match):
    y, ss, w_gu, w_down, _ = _inputs(64, d, f, 4)
    with on_path(path), pytest.raises(ValueError, match=match):
        torch.ops.coda.mlp_block_fp8(y, ss, w_gu, w_down, EPS, e5m2_grads)


@pytest.mark.parametrize("path", ["cpu", "fake"])
@pytest.mark.parametrize("arg, match", [
    ("y", r"coda\.mlp_block_fp8: y must be torch\.bfloat16"),
    ("w_gu", r"coda\.mlp_block_fp8: w_gu must be torch\.bfloat16"),
])
def test_errors_name_this_op_and_its_argument(path, arg, match):
    """The rules it shares with the bf16 sublayers speak of ``coda.mlp_block_fp8`` and of its
    own argument names (they said ``coda.norm_swiglu`` and ``w``)."""
    y, ss, w_gu, w_down, _ = _inputs(64, 128, 128, 4)
    args = {"y": y, "w_gu": w_gu}
    args[arg] = args[arg].float()
    with on_path(path), pytest.raises(TypeError, match=match):
        torch.ops.coda.mlp_block_fp8(args["y"], ss, args["w_gu"], w_down, EPS)


@pytest.mark.parametrize("path", ["cpu", "fake"])
@pytest.mark.parametrize("kw, match", [
    ({"fast_accum": "dgrad", "row_scaling": True}, "fast_accum must be one of"),
    ({"fast_accum": "forward"}, "fast_accum must be 'none' with block scaling"),
], ids=["unknown", "block-recipe"])
def test_fast_accum_is_checked_on_every_path(path, kw, match):
    """Both FP8 sublayers: a role set they do not know, and fast accumulation with block scales
    (promoted per k-block), refused before anything runs."""
    import test_attention_fp8_cpu as A

    y, ss, w_gu, w_down, _ = _inputs(64, 128, 128, 4)
    with on_path(path), pytest.raises(ValueError, match="coda.mlp_block_fp8: " + match):
        torch.ops.coda.mlp_block_fp8(y, ss, w_gu, w_down, EPS, **kw)
    with on_path(path), pytest.raises(ValueError, match="coda.attention_block_fp8: " + match):
        torch.ops.coda.attention_block_fp8(*A._args(2), **kw)


@pytest.mark.parametrize("tree, n, k", [
    (norm_swiglu_tree(), 28672, 4096),       # gate/up: (M, 2f) from d
    (residual_norm_stats_tree(), 4096, 14336),  # down-proj + residual + norm statistics
    (swiglu_backward_tree(), 14336, 4096),   # down-proj dgrad + SwiGLU backward
    (swiglu_backward_tree(False), 14336, 4096),  # the same without h (the row-wise recipe keeps it)
    (norm_backward_tree(True), 4096, 28672),  # gate/up dgrad + RMSNorm backward + residual grad
], ids=["norm_swiglu", "residual", "swiglu_backward", "swiglu_backward_kept_h", "norm_backward"])
@pytest.mark.parametrize("row, fast", [(False, False), (True, False), (True, True)],
                         ids=["block", "row-wise", "row-wise-fast-accum"])
def test_kernels_of_the_trees_build_without_spills(tree, n, k, row, fast):
    """Block-scaled, or the row-wise recipe's trees (the scales on the accumulator) on the plain
    FP8 kernel, with or without fast accumulation: the config the runner picks (the first of its
    ranking that builds without spills)."""
    tree = row_scaled(tree) if row else tree
    cfg = choose_config(tree, 16384, n, k, 1, True, fast, 132, block_scaled=not row)
    assert cfg.fp8_fast_accum is fast and not spills(tree, cfg, True, 132, block_scaled=not row)


def test_row_wise_swiglu_backward_without_h_keeps_its_tile():
    """Without the h store (the row-wise recipe keeps h from its forward) the double-width dz'
    store takes one store buffer, claimed after the math, where two fit the same A/B ring: with
    two, both claims spilled on ping-pong 128 x 128 and sent the fast-accumulation down dgrad to
    64 x 128."""
    from coda_cute.kernels.sm90.epilogue import Sm90TreeEpilogue

    tree = row_scaled(swiglu_backward_tree(recompute_h=False))
    cfg = choose_config(tree, 16384, 14336, 4096, 1, True, True, 132)
    assert (cfg.schedule, cfg.tile_m, cfg.tile_n) == ("pingpong", 128, 128)
    epi = Sm90TreeEpilogue(tree, cfg, 1)
    assert epi.stages == 1 and epi.late_claim


def test_fp8_ops_pass_opcheck():
    """Schema, autograd registration and fake tensors of the FP8 sublayer ops and the dual
    quantizer (``test_aot_dispatch_dynamic`` too for the quantizer: it sums every output to make a
    loss, which torch cannot do for the sublayers' FP8 weight outputs on the CPU)."""
    import test_attention_fp8_cpu as A

    basic = ("test_schema", "test_autograd_registration", "test_faketensor")
    y, ss, w_gu, w_down, _ = _inputs(64, 128, 128, 1)
    attn = tuple(t.requires_grad_() if i in (0, 2, 3) else t for i, t in enumerate(A._args(2, qk_norm=True)))
    with coda_cute.reference_on_cpu():
        torch.library.opcheck(torch.ops.coda.mlp_block_fp8.default,
                              (y.requires_grad_(), ss, w_gu.requires_grad_(), w_down.requires_grad_(), EPS),
                              test_utils=basic)
        torch.library.opcheck(torch.ops.coda.mlp_block_fp8.default, (y, ss, w_gu, w_down, EPS),
                              {"row_scaling": True, "fast_accum": "all"}, test_utils=basic)
        torch.library.opcheck(torch.ops.coda.attention_block_fp8.default, attn, test_utils=basic)
        torch.library.opcheck(torch.ops.coda.attention_block_fp8.default, attn,
                              {"row_scaling": True, "fast_accum": "forward"}, test_utils=basic)
        torch.library.opcheck(torch.ops.coda.quantize_fp8_dual.default, (torch.randn(48, 40).bfloat16(),),
                              test_utils=basic + ("test_aot_dispatch_dynamic",))


def _shifted(t):
    """A contiguous copy of ``t`` whose data pointer is one byte past a 16-byte boundary."""
    raw = torch.zeros(t.numel() * t.element_size() + 1, dtype=torch.uint8)[1:]
    return raw.view(t.dtype).view(t.shape).copy_(t)


def _quantized(*ws):
    from coda_cute.ops.fp8_gemms import weight

    with coda_cute.reference_on_cpu():
        return [t for w in ws for t in weight(w)]


def test_given_quantized_weights_are_used_and_not_returned():
    """The caller's quantized weights (``nn.fold.WeightQuantCache``) give the self-quantizing
    op's outputs and gradients exactly; the op returns empty tensors for them (a custom op may
    not return its inputs) and its backward uses the given transposes."""
    y, ss, w_gu, w_down, dy2 = _inputs(77, 272, 208, 5)
    given = _quantized(w_gu, w_down)
    out, grads = _grads(torch.ops.coda.mlp_block_fp8, y, ss, w_gu, w_down, dy2)
    leaves = [t.clone().requires_grad_() for t in (y, w_gu, w_down)]
    with coda_cute.reference_on_cpu():
        res = torch.ops.coda.mlp_block_fp8(leaves[0], ss, leaves[1], leaves[2], EPS, False, False, *given)
        res[0].backward(dy2)
    assert torch.equal(res[0], out) and all(t.numel() == 0 for t in res[3:])
    assert all(torch.equal(t.grad, g) for t, g in zip(leaves, grads))
    with coda_cute.reference_on_cpu():  # the backward reads the given qt: a changed one changes dy
        bad = list(given)
        bad[2] = torch.zeros_like(bad[2])
        leaves[0].grad = None
        torch.ops.coda.mlp_block_fp8(leaves[0], ss, leaves[1], leaves[2], EPS, False, False, *bad)[0].backward(dy2)
    assert not torch.equal(leaves[0].grad, grads[0])


@pytest.mark.parametrize("path", ["cpu", "fake"])
@pytest.mark.parametrize("change, match", [
    (lambda g: g[:5] + [None], "pass every quantized weight"),
    (lambda g: [g[0][:-1].contiguous()] + g[1:], r"w_gu's quantized q must be a contiguous torch.float8_e4m3fn \(416, 272\)"),
    (lambda g: g[:4] + [g[4].double()] + g[5:], "w_down's quantized scales must be"),
    (lambda g: g[:5] + [g[5].t()], "w_down's quantized qt must be a contiguous"),
    # the GEMMs' operands, which TMA reads (the reference path named them b, qt's in the backward
    # only; tracing took them)
    (lambda g: [_shifted(g[0])] + g[1:], "w_gu's quantized q's data pointer must be 16-byte aligned"),
    (lambda g: g[:5] + [_shifted(g[5])], "w_down's quantized qt's data pointer must be 16-byte aligned"),
])
def test_bad_given_weights_are_refused_on_every_path(path, change, match):
    y, ss, w_gu, w_down, _ = _inputs(64, 272, 208, 6)
    given = change(_quantized(w_gu, w_down))
    with on_path(path), pytest.raises(ValueError, match=match):
        torch.ops.coda.mlp_block_fp8(y, ss, w_gu, w_down, EPS, False, False, *given)


def test_attention_op_takes_given_quantized_weights():
    import test_attention_fp8_cpu as A

    args = A._args(7, qk_norm=True)
    dy = torch.randn(A.B, A.S, A.D, generator=generator(7)).bfloat16()
    want = A._run(torch.ops.coda.attention_block_fp8, args, dy)
    given = _quantized(args[2], args[3])
    got = A._run(lambda *a: torch.ops.coda.attention_block_fp8(*a, False, False, *given), args, dy)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.fixture
def fused_quant(monkeypatch):
    from coda_cute.ops import mlp_fp8

    monkeypatch.setattr(mlp_fp8, "FUSED_QUANT", True)


@pytest.mark.parametrize("e5m2_grads", [False, True])
def test_fused_quantization_keeps_the_gradients(fused_quant, e5m2_grads):
    """``FUSED_QUANT``: h^T quantized in the gate/up GEMM (kept for the down-proj weight gradient)
    and dz' in the down dgrad's, both layouts. The forward is the unfused one bit for bit; h^T is
    the reference quantization of the forward's bf16 h; the gradients stay within the unfused op's
    bound against float64 and close to its (the down-proj weight gradient now reads the forward's
    h, not the backward's recomputation from the bf16 z)."""
    from coda_cute.ops import mlp_fp8

    y, ss, w_gu, w_down, dy2 = _inputs(256, 256, 384, 9)
    with coda_cute.reference_on_cpu():
        out = torch.ops.coda.mlp_block_fp8(y, ss, w_gu, w_down, EPS)
    from coda_cute.ops.fp8_gemms import FP8, project, weight
    from coda_cute.ops.quantize import quantize_fp8
    from coda_cute.ops.rmsnorm import norm_inputs

    with coda_cute.reference_on_cpu():  # the bf16 h the same FP8 forward computes
        gu_q, gu_s, _ = weight(w_gu)
        h = project("test", norm_swiglu_tree(), *quantize_fp8(y, "1x128", None, FP8, False), gu_q, gu_s,
                    norm_inputs(y.shape[1], ss, EPS))["h"]
    want_q, want_s = R.quantize_blocks_ref(h.float().t(), (1, 128))
    assert out[7].shape == (384, 256) and torch.equal(out[7].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(out[8], want_s)
    leaves = [t.double().requires_grad_() for t in (y, w_gu, w_down)]
    _mlp64(*leaves).backward(dy2.double())
    fused_out, fused = _grads(torch.ops.coda.mlp_block_fp8, y, ss, w_gu, w_down, dy2, e5m2_grads=e5m2_grads)
    mlp_fp8.FUSED_QUANT = False
    plain_out, plain = _grads(torch.ops.coda.mlp_block_fp8, y, ss, w_gu, w_down, dy2, e5m2_grads=e5m2_grads)
    assert torch.equal(fused_out, plain_out)
    bound = 0.16 if e5m2_grads else 0.08
    for name, f, p, leaf in zip(("dy", "dw_gu", "dw_down"), fused, plain, leaves):
        assert rel_err(f.double(), leaf.grad) < bound, name
        assert rel_err(f.double(), p.double()) < bound / 2, name


def test_fused_quantization_passes_opcheck(fused_quant):
    y, ss, w_gu, w_down, _ = _inputs(64, 128, 128, 10)
    with coda_cute.reference_on_cpu():
        torch.library.opcheck(torch.ops.coda.mlp_block_fp8.default,
                              (y.requires_grad_(), ss, w_gu.requires_grad_(), w_down.requires_grad_(), EPS),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("tree", ["forward", "backward"])
def test_fused_quantization_trees_build_without_spills_on_the_block_scaled_kernel(tree):
    from coda_cute.ops import mlp_fp8

    t, (n, k) = ((mlp_fp8.norm_swiglu_fp8_tree(False), (28672, 4096)) if tree == "forward"
                 else (mlp_fp8.swiglu_backward_fp8_tree("float8_e4m3fn", False), (14336, 4096)))
    cfg = ranked_configs(t, 16384, n, k, 1, True, False, 132, block_scaled=True)[0]
    assert cfg.schedule == "cooperative" and cfg.tile_m == 128 and cfg.poll_full  # the forward form polls
    assert not spills(t, cfg, True, 132, block_scaled=True)


@RECIPES
@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["reference", "cuda-branch"])
@pytest.mark.parametrize("shape, dtype, match", [
    ((200, 256), torch.bfloat16, r"N \(rows of the weight, .*\) must be a multiple of 16"),
    ((256, 256), torch.float64, "x must be a 2-D tensor of"),
    ((256, 100), torch.bfloat16, "K a multiple of 8"),
], ids=["N", "dtype", "K"])
def test_weights_are_checked_before_their_quantization_on_every_path(row, device, shape, dtype, match):
    """``fp8_gemms.weight`` (how callers make the given quantized weights, ``nn.fold.WeightQuantCache``
    among them): the quantizers' rules on the reference path and, on fake CUDA tensors, before
    its CUDA branch's launch, which checked nothing. The reference took the block recipe's
    N = 200 (a multiple of 16 in both recipes: the kernel's FP8 transpose cannot store it) and
    the row-wise recipe cast an fp64 weight to bf16."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from coda_cute.ops.fp8_gemms import weight

    with coda_cute.reference_on_cpu() if device == "cpu" else FakeTensorMode():
        w = torch.zeros(shape, dtype=dtype, device=device)
        with pytest.raises(ValueError, match=r"coda\.quantize_fp8: .*" + match):
            weight(w, row=row)


def test_row_wise_weights_take_fp32_masters_through_bf16():
    """The row-wise quantizer reads 16-bit rows: an fp32 master weight (a cached fold under
    autocast) is rounded to bf16 first, and quantizes as that bf16 weight does."""
    from coda_cute.ops.fp8_gemms import weight

    w = torch.randn(160, 144)
    with coda_cute.reference_on_cpu():
        got, want = weight(w, row=True), weight(w.bfloat16(), row=True)
    for g, t in zip(got, want):
        assert torch.equal(g.view(torch.uint8), t.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32-master"])
def test_first_projection_quantizes_each_weight_as_weight_does(dtype):
    """``fp8_gemms.first_projection`` in the row-wise recipe: its GEMM gets the first weight's rows
    and their scales alone, and every weight it returns is ``weight``'s (the cache's) bit for bit,
    though the first one's rows and columns come from two passes (on the reference path the
    passes run after the GEMM, in series)."""
    from coda_cute.ops.fp8_gemms import first_projection, weight

    ws = {"w_a": torch.randn(96, 160, dtype=dtype), "w_b": torch.randn(160, 48, dtype=dtype)}
    seen = []
    with coda_cute.reference_on_cpu():
        out, got = first_projection("op", lambda q, s, sms: seen.append((q, s, sms)) or "out", [None] * 6, False, True,
                                    torch.device("cpu"), 6, **ws)
        want = [weight(w, row=True) for w in ws.values()]
    assert out == "out" and len(seen) == 1 and seen[0][2] is None
    q, s, _ = seen[0]
    assert torch.equal(q.view(torch.uint8), want[0][0].view(torch.uint8))
    assert torch.equal(s, want[0][1][:96])
    for g, t in zip(got, want):
        for a, b in zip(g, t):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("m", [96, 40])  # 40: no FP8 transposes, the bf16 weight gradients
def test_every_side_stream_switch_keeps_the_row_wise_gradients(m, monkeypatch):
    """The row-wise op with each of its passes-beside switches on (the weights beside the gate/up
    forward, the weight gradients' passes beside the dgrads, dz''s rows beside the down weight
    gradient) and all off: on the reference path ``ops.beside`` runs GEMM then passes in series, so
    the two orders of each branch give the same output and gradients bit for bit."""
    from coda_cute.ops import mlp_fp8

    y, ss, w_gu, w_down, dy2 = _inputs(m, 256, 384, 5)
    names = ("SIDE_SMS_GATE_UP_FORWARD", "SIDE_SMS_DOWN_DGRAD", "SIDE_SMS_GATE_UP_DGRAD", "SIDE_SMS_DOWN_WGRAD")
    runs = []
    for sms in (0, 16):
        for name in names:
            monkeypatch.setattr(mlp_fp8, name, sms)
        out, grads = _grads(torch.ops.coda.mlp_block_fp8, y, ss, w_gu, w_down, dy2, row_scaling=True,
                            fast_accum="all")
        runs.append([out, *grads])
    for name, a, b in zip(("y2", "dy", "dw_gu", "dw_down"), *runs):
        assert torch.isfinite(a).all() and torch.equal(a, b), name


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["reference", "cuda-branch"])
def test_first_projection_checks_every_weight_before_its_gemm(device):
    """A later weight that breaks a rule is refused before the first weight's quantization and its
    GEMM launch (its own passes would run beside that GEMM), on the reference path and, on fake
    CUDA tensors, before the CUDA branch."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from coda_cute.ops.fp8_gemms import first_projection

    calls = []
    with coda_cute.reference_on_cpu() if device == "cpu" else FakeTensorMode():
        ws = {"w_a": torch.zeros(96, 160, dtype=torch.bfloat16, device=device),
              "w_b": torch.zeros(200, 48, dtype=torch.bfloat16, device=device)}
        with pytest.raises(ValueError, match=r"coda\.quantize_fp8: N \(rows of the weight"):
            first_projection("op", lambda *a: calls.append(a), [None] * 6, False, True, torch.device(device), 6, **ws)
    assert not calls


@RECIPES
@pytest.mark.parametrize("fused", [False, True], ids=["separate-quantize", "fused-quantize"])
def test_an_empty_batch_runs_forward_and_backward(row, fused, monkeypatch):
    """No tokens: empty outputs and dy, and weight gradients of zeros (a sum over no tokens); with
    ``FUSED_QUANT`` too (0 is a multiple of 16, but an (f, 0) h^T has no rows for the sink: the
    op quantizes separately then)."""
    from coda_cute.ops import mlp_fp8

    monkeypatch.setattr(mlp_fp8, "FUSED_QUANT", fused)
    y, ss, w_gu, w_down, dy2 = _inputs(16, 128, 128, 5)
    y2, (dy, dw_gu, dw_down) = _grads(torch.ops.coda.mlp_block_fp8, y[:0], ss[:0], w_gu, w_down, dy2[:0],
                                      row_scaling=row)
    assert y2.shape == (0, 128) and dy.shape == (0, 128)
    assert dw_gu.shape == w_gu.shape and not dw_gu.any() and dw_down.shape == w_down.shape and not dw_down.any()


@RECIPES
def test_an_empty_batch_takes_a_sum_loss_and_any_empty_strides(row):
    """No tokens under a ``.sum()`` loss, whose gradient is an expanded (0, d) tensor of strides
    (0, 0), and statistics of strides (1, 0): nothing is read, so no layout rule applies (both
    raised before, in the quantizer and in the runner's row-sum rule)."""
    y, ss, w_gu, w_down, _ = _inputs(16, 128, 128, 6)
    ss0 = (ss[:0] * 2).as_strided((0, 1), (1, 0))
    leaves = [t.clone().requires_grad_() for t in (y[:0], w_gu, w_down)]
    with coda_cute.reference_on_cpu():
        torch.ops.coda.mlp_block_fp8(leaves[0], ss0, leaves[1], leaves[2], EPS, row_scaling=row)[0].sum().backward()
    assert leaves[0].grad.shape == (0, 128)
    assert not leaves[1].grad.any() and not leaves[2].grad.any()


@pytest.mark.parametrize("m", [96, 77])  # M a multiple of 16 (the FP8 transpose), ragged (bf16 wgrad)
def test_row_wise_weight_gradient_folds_the_gradient_rows_scales(m):
    """The row-wise recipe's weight gradient dW = G^T X: G's bytes transposed (one scale per token,
    found in the one read that also quantizes G for its dgrad) with X's rows scaled by those
    scales before X's columns are quantized (checked bit for bit; dW against the product of the
    quantized operands); a zero row of G (scale 1) gets factor 0, so a huge X row beside it changes
    no column scale and no bit of dW. Given G's transpose, G itself is not read: a meta tensor of
    its shape gives the same dW (the MLP's backward frees dz' in bf16 that way)."""
    from coda_cute.ops.fp8_gemms import grad_operands, wgrad, wgrad_prepared
    from coda_cute.ops.quantize import quantize_rowwise_fp8

    g = generator(21)
    dy = (torch.randn(m, 160, generator=g) * torch.exp2(torch.randint(-6, 6, (m, 1), generator=g).float())).bfloat16()
    x = torch.randn(m, 272, generator=g).bfloat16()
    dy[5] = 0
    with coda_cute.reference_on_cpu():
        q, s, qt, fold = grad_operands(dy, torch.float8_e4m3fn, row=True)
        dw = wgrad(dy, qt, fold, x, row=True)
        x_big = x.clone()
        x_big[5] = 3e4
        dw_big = wgrad(dy, qt, fold, x_big, row=True)
        if m % 16 == 0:
            _, _, xt_q, xt_s = quantize_rowwise_fp8(x, rows=False, fold=fold)
            dw_meta = wgrad_prepared(torch.empty_like(dy, device="meta"), qt, fold, x, row=True)()
    if m % 16:  # no FP8 transpose: the bf16 GEMM
        assert qt is None and torch.equal(dw, (dy.float().t() @ x.float()).bfloat16())
        return
    assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))
    amax = dy.float().abs().amax(1)
    assert fold[5] == 0 and s[5, 0] == 1 and torch.equal(fold[amax > 0], s[amax > 0, 0])
    want_q, want_s = R.quantize_blocks_ref((x.float() * fold[:, None]).t().contiguous(), (1, m))
    assert torch.equal(xt_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(xt_s, want_s)
    want = (q.float().t() @ (want_q.float() * want_s).t()).bfloat16()
    torch.testing.assert_close(dw.float(), want.float(), rtol=1e-2, atol=1e-6 * want.float().abs().max().item())
    assert torch.equal(dw_big, dw) and torch.equal(dw_meta, dw)
    exact = dy.double().t() @ x.double()
    assert rel_err(dw.double(), exact) < 0.08


@pytest.mark.parametrize("m", [96, 77])  # M a multiple of 16 (the FP8 transpose), ragged (bf16 wgrad)
def test_row_wise_weight_gradient_takes_the_kept_rows_of_the_wider_operand(m):
    """The mirrored form (``fp8_gemms.wgrad_kept``, the down-proj's dW = dy2^T h with h wider than
    dy2): X's FP8 rows as its forward quantized them, their bytes transposed, G's rows scaled by
    X's fold factors before G's columns are quantized (checked bit for bit; dW against the product
    of the quantized operands and within FP8's bound of float64); a zero row of X (scale 1) gets
    factor 0, so a huge G row beside it changes no column scale and no bit of dW; ragged tokens:
    the bf16 GEMM on X dequantized."""
    from coda_cute.ops.fp8_gemms import wgrad_kept
    from coda_cute.ops.quantize import quantize_grad_rowwise_fp8, quantize_rowwise_fp8

    g = generator(22)
    dy = torch.randn(m, 160, generator=g).bfloat16()
    x = (torch.randn(m, 272, generator=g) * torch.exp2(torch.randint(-6, 6, (m, 1), generator=g).float())).bfloat16()
    x[5] = 0
    with coda_cute.reference_on_cpu():
        xq, xs, xt, fold = quantize_grad_rowwise_fp8(x, torch.float8_e4m3fn, transposed=False)
        dw = wgrad_kept(dy, xq, fold, torch.float8_e4m3fn)
        dy_big = dy.clone()
        dy_big[5] = 3e4
        dw_big = wgrad_kept(dy_big, xq, fold, torch.float8_e4m3fn)
        if m % 16 == 0:
            _, _, dyt_q, dyt_s = quantize_rowwise_fp8(dy, rows=False, fold=fold)
    assert xt is None and fold[5] == 0 and xs[5, 0] == 1
    assert torch.equal(dw_big, dw)
    if m % 16:
        x_deq = (xq.float() * fold[:, None]).bfloat16()
        assert torch.equal(dw, (dy.float().t() @ x_deq.float()).bfloat16())
        return
    want_q, want_s = R.quantize_blocks_ref((dy.float() * fold[:, None]).t().contiguous(), (1, m))
    assert torch.equal(dyt_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(dyt_s, want_s)
    want = ((want_q.float() * want_s) @ xq.float()).bfloat16()
    torch.testing.assert_close(dw.float(), want.float(), rtol=1e-2, atol=1e-6 * want.float().abs().max().item())
    assert rel_err(dw.double(), dy.double().t() @ x.double()) < 0.08


def test_row_wise_gradient_of_ragged_width_takes_the_bf16_weight_gradient():
    """A gradient whose width is no multiple of 16 (its FP8 rows could not be transposed) keeps its
    row quantization for the dgrad and leaves the weight gradient to bf16, as a token count that is
    no multiple of 16 does."""
    from coda_cute.ops.fp8_gemms import grad_operands, wgrad

    dy, x = torch.randn(32, 72).bfloat16(), torch.randn(32, 48).bfloat16()
    with coda_cute.reference_on_cpu():
        q, s, qt, fold = grad_operands(dy, torch.float8_e4m3fn, row=True)
        dw = wgrad(dy, qt, fold, x, row=True)
    assert q.shape == (32, 72) and s.shape == (32, 1) and qt is None
    assert torch.equal(dw, (dy.float().t() @ x.float()).bfloat16())
