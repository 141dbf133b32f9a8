"""GPU tests of ``torch.ops.coda.mlp_block_fp8``: the kernels of its four epilogue trees, block-scaled
and row-wise (``row_scaling``: the plain FP8 GEMM with the scales on the accumulator), against
``reference.mlp_block_fp8_ref`` (the forward on the FP8 operands, float math) and the gradients
against float64 math next to the bf16 op's, at whole and ragged 128-blocks."""

import pytest
import torch

from coda_cute import dispatch
from coda_cute import reference as R
from coda_cute.nn.llama import embedding_norm_stats
from coda_cute.ops.fp8_gemms import row_scaled
from coda_cute.ops.residual import residual_norm_stats_tree
from coda_cute.ops.rmsnorm import tile_n_of
from helpers import rel_err

pytestmark = pytest.mark.gpu

EPS = 1e-5


def _inputs(m, d, f):
    y = torch.randn(m, d, device="cuda").bfloat16()
    w_gu = (torch.randn(2 * f, d, device="cuda") * d ** -0.5).bfloat16()
    w_down = (torch.randn(d, f, device="cuda") * f ** -0.5).bfloat16()
    return y, embedding_norm_stats(y), w_gu, w_down, torch.randn(m, d, device="cuda").bfloat16()


OUTPUTS = ("y2", "ss2", "z", "dy", "dw_gu", "dw_down")


def _forward_backward(y, ss, w_gu, w_down, dy2, **kw) -> list:
    """``OUTPUTS`` of one forward and backward of the FP8 op (keywords its own)."""
    ins = [t.clone().requires_grad_() for t in (y, w_gu, w_down)]
    out = torch.ops.coda.mlp_block_fp8(ins[0], ss, ins[1], ins[2], EPS, **kw)
    out[0].backward(dy2)
    return list(out[:3]) + [t.grad for t in ins]


def _off_and_on(monkeypatch, switch: str, check, inputs, **kw) -> dict:
    """{False: ..., True: ...}: :func:`_forward_backward` with ``runner.<switch>`` off, then on;
    ``check(value)`` first asserts what the switch does to the heuristic's pick."""
    from coda_cute.epilogue import runner

    runs = {}
    for value in (False, True):
        monkeypatch.setattr(runner, switch, value)
        check(value)
        runs[value] = _forward_backward(*inputs, **kw)
    return runs


RECIPES = pytest.mark.parametrize("row", [False, True], ids=["block", "row-wise"])


@RECIPES
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32-scales", "pow2-scales"])
@pytest.mark.parametrize("m, d, f", [(1000, 1024, 2816), (333, 272, 208), (4096, 4096, 1536)])
def test_forward_is_the_reference_on_the_fp8_operands(m, d, f, pow2, row):
    y, ss, w_gu, w_down, _ = _inputs(m, d, f)
    y2, ss2, z, *_ = torch.ops.coda.mlp_block_fp8(y, ss, w_gu, w_down, EPS, False, pow2, row_scaling=row)
    tree = row_scaled(residual_norm_stats_tree()) if row else residual_norm_stats_tree()
    tile_n = tile_n_of(tree, m, d, f, y.device, block_scaled=not row, fp8=True)
    want = R.mlp_block_fp8_ref(y, ss, w_gu, w_down, EPS, tile_n, pow2, row)
    for name, got, ref in zip(("y2", "ss2", "z"), (y2, ss2, z), want):
        assert got.shape == ref.shape and got.dtype == ref.dtype, name
        assert not got.float().isnan().any(), name
        # h is rounded to bf16 and quantized again: a last-bit difference in h can move one FP8
        # step of that element, so the comparison is statistical, not element-wise exact
        assert rel_err(got.float(), ref.float()) < 5e-3, name


@RECIPES
@pytest.mark.parametrize("e5m2_grads", [False, True])
def test_gradients_against_float64_next_to_the_bf16_op(e5m2_grads, row):
    y, ss, w_gu, w_down, dy2 = _inputs(2048, 1024, 2816)
    leaves = [t.double().requires_grad_() for t in (y, w_gu, w_down)]
    r = torch.rsqrt(leaves[0].square().mean(-1, keepdim=True) + EPS)
    zz = r * (leaves[0] @ leaves[1].T)
    exact = leaves[0] + (torch.nn.functional.silu(zz[:, 0::2]) * zz[:, 1::2]) @ leaves[2].T
    exact.backward(dy2.double())
    errors = {}
    for name, op, kw in (("fp8", torch.ops.coda.mlp_block_fp8, {"e5m2_grads": e5m2_grads, "row_scaling": row}),
                         ("bf16", torch.ops.coda.mlp_block, {})):
        ins = [t.clone().requires_grad_() for t in (y, w_gu, w_down)]
        out = op(ins[0], ss, ins[1], ins[2], EPS, **kw)[0]
        out.backward(dy2)
        errors[name] = [rel_err(out.double() - y.double(), exact - leaves[0])] + [
            rel_err(t.grad.double(), leaf.grad) for t, leaf in zip(ins, leaves)]
    bound = 0.16 if e5m2_grads else 0.08
    for e8, e16 in zip(errors["fp8"], errors["bf16"]):
        assert e16 < e8 < bound, errors


@pytest.mark.parametrize("fast", [False, True], ids=["promoted", "fast-accum"])
@pytest.mark.parametrize("m", [4096, 1008, 1000])  # 1000: no FP8 transpose, the bf16 GEMM
def test_row_wise_down_proj_weight_gradient_is_the_product_of_its_fp8_operands(m, fast):
    """``fp8_gemms.wgrad_kept`` on the GPU (the row-wise down-proj's dW = dy2^T h from h's FP8 rows
    kept by the forward): h's rows, scales and fold factors and dy2's folded columns bit for bit
    the CPU reference's; dW the product of those FP8 operands in float64 up to the bf16 output's
    rounding, and within FP8's bound of float64 on the unquantized tensors; a zero row of h
    (factor 0) keeps a huge dy2 row beside it out of every column scale and every bit of dW."""
    import coda_cute
    from coda_cute.ops.fp8_gemms import wgrad_kept
    from coda_cute.ops.quantize import quantize_grad_rowwise_fp8, quantize_rowwise_fp8

    fp8 = torch.float8_e4m3fn
    dy = torch.randn(m, 1024, device="cuda").bfloat16()
    x = (torch.randn(m, 2816, device="cuda") * torch.exp2(torch.randint(-6, 6, (m, 1), device="cuda").float())).bfloat16()
    x[3] = 0
    xq, xs, _, fold = quantize_grad_rowwise_fp8(x, fp8, transposed=False)
    dw = wgrad_kept(dy, xq, fold, fp8, fast=fast)
    dy_big = dy.clone()
    dy_big[3] = 3e4
    assert torch.equal(wgrad_kept(dy_big, xq, fold, fp8, fast=fast), dw)
    with coda_cute.reference_on_cpu():
        want = quantize_grad_rowwise_fp8(x.cpu(), fp8, transposed=False)
    for got, ref in zip((xq, xs, fold), (want[0], want[1], want[3])):
        assert torch.equal(got.cpu().view(torch.uint8) if got.dtype == fp8 else got.cpu(),
                           ref.view(torch.uint8) if ref.dtype == fp8 else ref)
    assert fold[3] == 0
    if m % 16:
        operands = dy.double().t() @ (xq.double() * fold.double()[:, None]).bfloat16().double()
    else:
        _, _, dyt_q, dyt_s = quantize_rowwise_fp8(dy, fp8, rows=False, fold=fold)
        want_q, want_s = R.quantize_blocks_ref((dy.cpu().float() * fold.cpu()[:, None]).t().contiguous(), (1, m))
        assert torch.equal(dyt_q.cpu().view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(dyt_s.cpu(), want_s)
        operands = (dyt_q.double() * dyt_s.double()) @ xq.double()
    assert rel_err(dw.double(), operands) < 4e-3
    assert rel_err(dw.double(), dy.double().t() @ x.double()) < 0.08


@pytest.mark.parametrize("fast", ["forward", "all"])
@pytest.mark.parametrize("m", [2048, 1000])
def test_fast_accumulation_keeps_the_row_wise_recipes_errors(m, fast):
    """``fast_accum`` (row-wise): the GEMMs of its roles accumulate in the tensor core for the
    whole k-loop, on their own configs (ping-pong 128 x 128 where promotion's second accumulator
    left the down dgrad 64 x 128). Its rounding is far below FP8's: the output and every
    gradient within 10 % of the promoting op's error against float64 (and inside its bound),
    and the forward within 2e-2 of it (measured on the H200: 1.07-1.09e-2, where each is about
    6.5e-2 from float64; a last-bit change of z moves h's FP8 rounding)."""
    y, ss, w_gu, w_down, dy2 = _inputs(m, 1024, 2816)
    leaves = [t.double().requires_grad_() for t in (y, w_gu, w_down)]
    r = torch.rsqrt(leaves[0].square().mean(-1, keepdim=True) + EPS)
    zz = r * (leaves[0] @ leaves[1].T)
    exact = leaves[0] + (torch.nn.functional.silu(zz[:, 0::2]) * zz[:, 1::2]) @ leaves[2].T
    exact.backward(dy2.double())
    errors, outs = {}, {}
    for mode in ("none", fast):
        ins = [t.clone().requires_grad_() for t in (y, w_gu, w_down)]
        out = torch.ops.coda.mlp_block_fp8(ins[0], ss, ins[1], ins[2], EPS, row_scaling=True, fast_accum=mode)[0]
        out.backward(dy2)
        outs[mode] = out.detach()
        errors[mode] = [rel_err(out.double() - y.double(), exact - leaves[0])] + [
            rel_err(t.grad.double(), leaf.grad) for t, leaf in zip(ins, leaves)]
    apart = rel_err(outs[fast].double() - y.double(), outs["none"].double() - y.double())
    print(f"fast_accum={fast}, M {m}: forward {apart:.4f} from the promoting op's; errors against float64 "
          f"(output, dy, dw_gu, dw_down) {errors}")
    assert apart < 2e-2
    for e_fast, e_promoted in zip(errors[fast], errors["none"]):
        assert e_fast < min(1.1 * e_promoted, 0.08), errors


@pytest.mark.parametrize("m", [2048, 1000])
def test_two_by_two_clusters_leave_the_row_wise_mlp_bit_identical(m, monkeypatch):
    """``runner.FP8_PINGPONG_2X2`` (an experiment switch): the gate/up GEMM's ping-pong pick moves
    to a 2x2 cluster, whose tiles do the same math in the same order, so the row-wise fast op's
    output and every gradient are the 2x1 run's bit for bit (ragged M: clusters straddling the
    last tile row)."""
    from coda_cute.epilogue import runner
    from coda_cute.ops.swiglu import norm_swiglu_tree

    d, f = 1024, 2816
    y, ss, w_gu, w_down, dy2 = _inputs(m, d, f)
    sms = dispatch.num_sms(y.device)

    def check(wide):
        cfg = runner.choose_config(row_scaled(norm_swiglu_tree()), m, 2 * f, d, 1, True, True, sms)
        assert (cfg.schedule, cfg.cluster_m, cfg.cluster_n) == ("pingpong", 2, 2 if wide else 1), cfg
    runs = _off_and_on(monkeypatch, "FP8_PINGPONG_2X2", check, (y, ss, w_gu, w_down, dy2), row_scaling=True,
                       fast_accum="all")
    for name, a, b in zip(OUTPUTS, runs[False], runs[True]):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("m", [2048, 1000])
def test_tail_carry_leaves_the_block_mlp_bit_identical(m, monkeypatch):
    """``runner.TAIL_CARRY``: the block recipe's forward-form GEMMs whose K makes whole promotion
    groups carry each tile's last group into the next tile (``GemmConfig.tail_carry``): at
    2048 tokens the gate/up norm + SwiGLU, the down residual and the gate/up dgrad's norm
    backward (K 1024, 1536, 3072), at 1000 (ragged M) the gate/up one. The promotions run in the
    same order, so the output and every gradient are those without it bit for bit."""
    from coda_cute.epilogue import runner
    from coda_cute.ops.swiglu import norm_swiglu_tree

    d, f = 1024, 1536
    y, ss, w_gu, w_down, dy2 = _inputs(m, d, f)
    sms = dispatch.num_sms(y.device)

    def check(carry):
        cfg = runner.choose_config(norm_swiglu_tree(), m, 2 * f, d, 1, True, False, sms, True)
        assert cfg.tail_carry == carry, cfg.name
    runs = _off_and_on(monkeypatch, "TAIL_CARRY", check, (y, ss, w_gu, w_down, dy2))
    for name, a, b in zip(OUTPUTS, runs[False], runs[True]):
        assert torch.isfinite(b.float()).all() and torch.equal(a, b), name


@pytest.mark.parametrize("m", [8192, 1000])  # 1000: no FP8 transposes, the bf16 weight gradients
def test_passes_beside_the_dgrads_leave_the_row_wise_mlp_unchanged(m, monkeypatch):
    """The weight gradients' passes on a side stream beside the two dgrads, and dz''s rows beside
    the down weight gradient (``ops.beside``, the default), against the same passes in series: the
    fork and the join order every read after its write, so the output and every gradient match.
    The GEMMs then run on fewer SMs, where the heuristic may pick other tiles: the same products in
    the same k order, whose per-tile row partials (the norm statistics) may group differently; bit
    for bit where the picks agree."""
    from coda_cute.ops import mlp_fp8

    d, f = 1024, 2816
    y, ss, w_gu, w_down, dy2 = _inputs(m, d, f)
    runs = {}
    for side in ((0, 0, 0), (8, 10, 16), (24, 24, 24)):
        for name, sms in zip(("SIDE_SMS_DOWN_DGRAD", "SIDE_SMS_GATE_UP_DGRAD", "SIDE_SMS_DOWN_WGRAD"), side):
            monkeypatch.setattr(mlp_fp8, name, sms)
        runs[side] = _forward_backward(y, ss, w_gu, w_down, dy2, row_scaling=True, fast_accum="all")
    for side in ((8, 10, 16), (24, 24, 24)):
        for name, a, b in zip(OUTPUTS, runs[(0, 0, 0)], runs[side]):
            assert torch.isfinite(b).all(), (side, name)
            assert torch.equal(a, b) or rel_err(b, a) < 1e-5, (side, name, rel_err(b, a))


@pytest.mark.parametrize("m", [8192, 1000])
def test_weights_beside_the_gate_up_forward_leave_the_row_wise_mlp_unchanged(m, monkeypatch):
    """The weights' passes beside the gate/up forward (``fp8_gemms.first_projection``: W_gu's
    columns and W_down on a side stream) against the weights quantized in series before it: the
    same FP8 bytes and scales (W_gu's rows alone take the one-read kernel, whose amax and cast are
    the two-pass kernel's), so the output and every gradient match (bit for bit where the gate/up
    pick on fewer SMs is the same tile)."""
    from coda_cute.ops import mlp_fp8

    d, f = 1024, 2816
    y, ss, w_gu, w_down, dy2 = _inputs(m, d, f)
    runs = {}
    for side in (0, 6, 24):
        monkeypatch.setattr(mlp_fp8, "SIDE_SMS_GATE_UP_FORWARD", side)
        runs[side] = _forward_backward(y, ss, w_gu, w_down, dy2, row_scaling=True, fast_accum="all")
    for side in (6, 24):
        for name, a, b in zip(OUTPUTS, runs[0], runs[side]):
            assert torch.isfinite(b).all(), (side, name)
            assert torch.equal(a, b) or rel_err(b, a) < 1e-5, (side, name, rel_err(b, a))


def test_weights_quantized_by_halves_are_the_weights_quantized_at_once():
    """W's rows by the one-read kernel and its columns alone (``first_projection``'s halves) are
    the bytes and scales ``fp8_gemms.weight`` makes in one dual pass (the cache's), bit for bit."""
    from coda_cute.ops.fp8_gemms import FP8, weight
    from coda_cute.ops.quantize import quantize_rowwise_fp8

    for n, k in ((2 * 2816, 1024), (1024, 2816), (208, 272)):
        w = torch.randn(n, k, device="cuda").bfloat16() * 0.02
        q, s, qt = weight(w, row=True)
        q_rows, s_rows, _, _ = quantize_rowwise_fp8(w, FP8, cols=False)
        _, _, qt_cols, s_cols = quantize_rowwise_fp8(w, FP8, rows=False)
        assert torch.equal(q.view(torch.uint8), q_rows.view(torch.uint8)), (n, k)
        assert torch.equal(qt.view(torch.uint8), qt_cols.view(torch.uint8)), (n, k)
        assert torch.equal(s, torch.cat([s_rows, s_cols])), (n, k)


@RECIPES
def test_model_with_cached_fp8_weights_is_the_uncached_model(row):
    """CodaLlama(precision="fp8", cache_folds=True) on the GPU: the layers' quantized weights
    (``nn.fold.WeightQuantCache``, quantized by the weight kernel) reused by a second micro-batch;
    the loss bit for bit that of the model quantizing on each forward, every gradient equal up to
    the attention backward's nondeterminism (cuDNN's atomics; FP8 requantizes its last bits)."""
    from coda_cute.nn import CodaLlama, LlamaConfig
    from coda_cute.precision import Fp8Recipe

    cfg = LlamaConfig(dim=512, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=1408, vocab_size=1000,
                      head_dim=64, precision=Fp8Recipe(scaling="row" if row else "block"))
    plain = CodaLlama(cfg, device="cuda")
    cached = CodaLlama(cfg, device="cuda", cache_folds=True)
    cached.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 1000, (2, 256), device="cuda")
    targets = torch.roll(tokens, -1, 1)
    losses = {}
    for step in range(2):
        for name, model in (("plain", plain), ("cached", cached)):
            loss = model(tokens, targets)
            loss.backward()
            losses.setdefault(name, []).append(loss.detach())
        if step == 0:
            kept = [c.value for c in cached.layers[0]._quants]
    assert all(c.value is v for c, v in zip(cached.layers[0]._quants, kept))
    assert all(torch.equal(a, b) for a, b in zip(losses["plain"], losses["cached"]))
    for (name, p), q in zip(plain.named_parameters(), cached.parameters()):
        assert rel_err(q.grad.float(), p.grad.float()) < 2e-3, name


@pytest.mark.parametrize("m", [2048, 1040])
def test_fused_quantization_keeps_the_gradients(m, monkeypatch):
    """``mlp_fp8.FUSED_QUANT`` on the GPU: h^T quantized in the gate/up GEMM and dz' in the down
    dgrad's epilogue (both layouts). The forward bit for bit the unfused one, h^T of shape (f, M),
    every gradient within the unfused op's bound against float64 and within half of it of the
    unfused op's (the down-proj weight gradient now reads the forward's h)."""
    from coda_cute.ops import mlp_fp8

    y, ss, w_gu, w_down, dy2 = _inputs(m, 1024, 2816)
    leaves = [t.double().requires_grad_() for t in (y, w_gu, w_down)]
    r = torch.rsqrt(leaves[0].square().mean(-1, keepdim=True) + EPS)
    zz = r * (leaves[0] @ leaves[1].T)
    (leaves[0] + (torch.nn.functional.silu(zz[:, 0::2]) * zz[:, 1::2]) @ leaves[2].T).backward(dy2.double())
    results = {}
    for fused in (False, True):
        monkeypatch.setattr(mlp_fp8, "FUSED_QUANT", fused)
        ins = [t.clone().requires_grad_() for t in (y, w_gu, w_down)]
        out = torch.ops.coda.mlp_block_fp8(ins[0], ss, ins[1], ins[2], EPS)
        out[0].backward(dy2)
        results[fused] = (out, [t.grad for t in ins])
    (fo, fg), (po, pg) = results[True], results[False]
    assert torch.equal(fo[0], po[0]) and po[7].numel() == 0 and fo[7].shape == (2816, m)
    for f, p, leaf in zip(fg, pg, leaves):
        assert rel_err(f.double(), leaf.grad) < 0.08
        assert rel_err(f.double(), p.double()) < 0.04


@RECIPES
def test_an_empty_batch_runs_forward_and_backward(row):
    """No tokens on the GPU: no quantize or GEMM launch fails, dy is empty, the weight gradients
    are zeros (a sum over no tokens)."""
    y, ss, w_gu, w_down, dy2 = _inputs(16, 256, 256)
    leaves = [t.clone().requires_grad_() for t in (y[:0], w_gu, w_down)]
    out = torch.ops.coda.mlp_block_fp8(leaves[0], ss[:0], leaves[1], leaves[2], EPS, row_scaling=row)[0]
    out.backward(dy2[:0])
    torch.cuda.synchronize()
    assert out.shape == (0, 256) and leaves[0].grad.shape == (0, 256)
    assert not leaves[1].grad.any() and not leaves[2].grad.any()
