"""GPU test of ``torch.ops.coda.attention_block_fp8``: its projection kernels, block-scaled and
row-wise (``row_scaling``; also with every GEMM accumulating in the tensor core), (QKV with
RMSNorm, RoPE and QK-norm in the epilogue; out-proj + residual + norm statistics; both dgrads with
the RMSNorm backward; the weight gradients along the tokens) inside the sublayer's forward and
backward, against float64 autograd through the references, next to the bf16 op's errors."""

import pytest
import torch

import test_attention_fp8_cpu as C
from coda_cute import reference as R
from coda_cute.nn.llama import embedding_norm_stats
from helpers import rel_err

pytestmark = pytest.mark.gpu


def _case(monkeypatch, b, s, d, h, hkv, hd):
    """Random (x, w_qkv, w_o, positions) of a batch of ``b`` sequences of ``s`` tokens, the CPU
    test module's shape switched to it."""
    monkeypatch.setattr(C, "B", b)
    monkeypatch.setattr(C, "S", s)
    x = torch.randn(b, s, d, device="cuda").bfloat16()
    w_qkv = (torch.randn((h + 2 * hkv) * hd, d, device="cuda") * d ** -0.5).bfloat16()
    w_o = (torch.randn(d, h * hd, device="cuda") * (h * hd) ** -0.5).bfloat16()
    return x, w_qkv, w_o, torch.arange(s, dtype=torch.int32, device="cuda").repeat(b)


@pytest.mark.parametrize("row, fast", [(False, "none"), (True, "none"), (True, "all")],
                         ids=["block", "row-wise", "row-wise-fast-accum"])
@pytest.mark.parametrize("h, hkv, hd, qk_norm", [(16, 4, 64, False), (8, 2, 128, True)], ids=["hd64", "hd128-qk_norm"])
def test_output_and_gradients_next_to_the_bf16_op(monkeypatch, h, hkv, hd, qk_norm, row, fast):
    b, s, d = 2, 1000, 1024  # ragged: 2000 tokens
    x, w_qkv, w_o, pos = _case(monkeypatch, b, s, d, h, hkv, hd)
    extra = ()
    if qk_norm:
        extra = tuple((1 + 0.1 * torch.randn(hd, device="cuda")).bfloat16() for _ in range(2)) + (1e-6,)
    args = (x, embedding_norm_stats(x.reshape(b * s, d)), w_qkv, w_o, pos,
            R.rope_inv_freq(hd, 10000.0).cuda(), 1e-5, h, hkv, hd) + extra
    dy = torch.randn(b, s, d, device="cuda").bfloat16()
    exact = C._exact(args, dy)
    fp8 = C._run(torch.ops.coda.attention_block_fp8, args, dy, row_scaling=row, fast_accum=fast)
    bf16 = C._run(torch.ops.coda.attention_block, args, dy)
    xd = x.double()
    errors = []
    for i in range(4):
        want = exact[i] - xd if i == 0 else exact[i]
        e8 = rel_err((fp8[i].double() - xd) if i == 0 else fp8[i].double(), want)
        e16 = rel_err((bf16[i].double() - xd) if i == 0 else bf16[i].double(), want)
        errors.append((e8, e16))
        assert e16 < e8 < 0.1, errors
    print(f"attention fp8 errors (fp8, bf16) for y - x, dx, dw_qkv, dw_o: {errors}")


@pytest.mark.parametrize("s", [2048, 1000])  # 2 x 1000 tokens: ragged, still FP8 transposes (multiples of 16)
def test_passes_beside_the_qkv_dgrad_leave_the_row_wise_sublayer_unchanged(monkeypatch, s):
    """The row-wise backward's weight-gradient passes beside the QKV dgrad (``ops.beside``, on 16
    SMs by default) against the same passes in series: the output and every gradient match (bit
    for bit where the dgrad's pick on fewer SMs is the same tile; its per-tile norm partials
    group otherwise)."""
    from coda_cute.ops import attention_fp8

    b, d, h, hkv, hd = 2, 1024, 16, 4, 64
    x, w_qkv, w_o, pos = _case(monkeypatch, b, s, d, h, hkv, hd)
    args = (x, embedding_norm_stats(x.reshape(b * s, d)), w_qkv, w_o, pos,
            R.rope_inv_freq(hd, 10000.0).cuda(), 1e-5, h, hkv, hd)
    dy = torch.randn(b, s, d, device="cuda").bfloat16()
    runs = {}
    for side in (0, 16, 32):
        monkeypatch.setattr(attention_fp8, "SIDE_SMS_QKV_DGRAD", side)
        runs[side] = C._run(torch.ops.coda.attention_block_fp8, args, dy, row_scaling=True, fast_accum="all")
    for side in (16, 32):
        for i, (a, got) in enumerate(zip(runs[0], runs[side])):
            assert torch.isfinite(got).all(), (side, i)
            assert torch.equal(a, got) or rel_err(got, a) < 1e-5, (side, i, rel_err(got, a))


@pytest.mark.parametrize("s", [2048, 1000])
def test_weights_beside_the_qkv_forward_leave_the_row_wise_sublayer_unchanged(monkeypatch, s):
    """The weights' passes beside the QKV forward (``fp8_gemms.first_projection``: W_qkv's columns
    and W_o on a side stream) against the weights quantized in series before it: every output of
    the op, the quantized weights kept for the backward among them, matches (bit for bit where the
    QKV pick on fewer SMs is the same tile), so the backward runs on the same operands. (Its
    gradients are not compared: cuDNN's attention backward is nondeterministic, and FP8 moves its
    last-bit differences by a whole FP8 step.)"""
    from coda_cute.ops import attention_fp8

    b, d, h, hkv, hd = 2, 1024, 16, 4, 64
    x, w_qkv, w_o, pos = _case(monkeypatch, b, s, d, h, hkv, hd)
    args = (x, embedding_norm_stats(x.reshape(b * s, d)), w_qkv, w_o, pos,
            R.rope_inv_freq(hd, 10000.0).cuda(), 1e-5, h, hkv, hd)
    runs = {}
    for side in (0, 6, 24):
        monkeypatch.setattr(attention_fp8, "SIDE_SMS_QKV_FORWARD", side)
        runs[side] = [t.float() for t in torch.ops.coda.attention_block_fp8(*args, row_scaling=True,
                                                                            fast_accum="all")]
    for side in (6, 24):
        for i, (a, got) in enumerate(zip(runs[0], runs[side])):
            assert got.shape == a.shape and torch.isfinite(got).all(), (side, i)
            assert torch.equal(a, got) or rel_err(got, a) < 1e-5, (side, i, rel_err(got, a))
