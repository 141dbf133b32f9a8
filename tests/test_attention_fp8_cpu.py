"""CPU tests of ``torch.ops.coda.attention_block_fp8`` (the attention sublayer with its projection
GEMMs in FP8, block-scaled or row-wise): the reference path's output and gradients next to the
bf16 op's against float64 autograd through the references, with and without QK-norm; the
fake implementation; bad input on every path; the QKV kernels (RoPE, QK-norm in the epilogue)
of both recipes built for sm_90a without spills."""

import pytest
import torch

import coda_cute
from coda_cute import reference as R
from coda_cute.epilogue.runner import choose_config, spills
from coda_cute.nn.llama import embedding_norm_stats
from coda_cute.ops.fp8_gemms import row_scaled
from coda_cute.ops.qkv import norm_rope_qkv_tree
from helpers import generator, on_path, rel_err

B, S, D, H, HKV, HD = 2, 48, 128, 4, 2, 32
EPS = 1e-5


def _args(seed, qk_norm=False, d=D, h=H, hkv=HKV, hd=HD):
    g = generator(seed)
    x = torch.randn(B, S, d, generator=g).bfloat16()
    w_qkv = (torch.randn((h + 2 * hkv) * hd, d, generator=g) * d ** -0.5).bfloat16()
    w_o = (torch.randn(d, h * hd, generator=g) * (h * hd) ** -0.5).bfloat16()
    with coda_cute.reference_on_cpu():
        ss = embedding_norm_stats(x.reshape(B * S, d))
    pos = torch.arange(S, dtype=torch.int32).repeat(B)
    extra = ()
    if qk_norm:
        extra = tuple((1 + 0.1 * torch.randn(hd, generator=g)).bfloat16() for _ in range(2)) + (1e-6,)
    return (x, ss, w_qkv, w_o, pos, R.rope_inv_freq(hd, 10000.0), EPS, h, hkv, hd) + extra


def _run(op, args, dy, **kw):
    """(y, dx, dw_qkv, dw_o) of ``op`` on the reference path."""
    x, ss, w_qkv, w_o = (t.clone().requires_grad_() for t in args[:4])
    with coda_cute.reference_on_cpu():
        y = op(x, ss.detach(), w_qkv, w_o, *args[4:], **kw)[0]
        y.backward(dy)
    return y.detach(), x.grad, w_qkv.grad, w_o.grad


def _exact(args, dy):
    """The same in float64 autograd through the references (r from x itself)."""
    x, _, w_qkv, w_o, pos, inv_freq, eps, h, hkv, hd, *qk = args
    x, w_qkv, w_o = (t.double().requires_grad_() for t in (x, w_qkv, w_o))
    qn, kn, qk_eps = (qk[0].double(), qk[1].double(), qk[2]) if qk else (None, None, 1e-6)
    x2 = x.reshape(B * S, -1)
    qkv = R.norm_rope_qkv_ref(x2, w_qkv, x2.square().sum(-1, keepdim=True), eps, pos, inv_freq, h, hkv, hd,
                              qn, kn, qk_eps)
    heads = qkv.view(B, S, h + 2 * hkv, hd).transpose(1, 2).split([h, hkv, hkv], dim=1)
    o, _ = R.attention_ref(*heads)
    y = x2 + o.transpose(1, 2).reshape(B * S, h * hd) @ w_o.T
    y.backward(dy.double().reshape(B * S, -1))
    return y.detach().view(x.shape), x.grad, w_qkv.grad, w_o.grad


RECIPES = pytest.mark.parametrize("row", [False, True], ids=["block", "row-wise"])


@RECIPES
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
def test_output_and_gradients_next_to_the_bf16_op(qk_norm, row):
    args = _args(1, qk_norm)
    dy = torch.randn(B, S, D, generator=generator(2)).bfloat16()
    exact = _exact(args, dy)
    fp8 = _run(torch.ops.coda.attention_block_fp8, args, dy, row_scaling=row)
    bf16 = _run(torch.ops.coda.attention_block, args, dy)
    x = args[0].double()
    for i, name in enumerate(("y - x", "dx", "dw_qkv", "dw_o")):
        want = exact[i] - x if i == 0 else exact[i]
        e8 = rel_err((fp8[i].double() - x) if i == 0 else fp8[i].double(), want)
        e16 = rel_err((bf16[i].double() - x) if i == 0 else bf16[i].double(), want)
        assert e16 < e8 < 0.1, (name, e8, e16)


@RECIPES
def test_fake_outputs_are_the_cpu_outputs(row):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _args(3, qk_norm=True)
    with coda_cute.reference_on_cpu():
        real = torch.ops.coda.attention_block_fp8(*args, row_scaling=row)
    with FakeTensorMode() as mode:
        fake = torch.ops.coda.attention_block_fp8(
            *(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args), row_scaling=row)
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]


@pytest.mark.parametrize("path", ["cpu", "fake"])
@pytest.mark.parametrize("over, match", [
    (dict(h=3, hkv=1, hd=8), r"n_heads \* head_dim \(columns of w_o\) must be a multiple of 16"),
    (dict(d=136), "the model width d .* must be a multiple of 16"),
])
def test_bad_input_is_refused_on_every_path(path, over, match):
    args = _args(4, **over)
    with on_path(path), pytest.raises(ValueError, match=match):
        torch.ops.coda.attention_block_fp8(*args)


@pytest.mark.parametrize("path", ["cpu", "fake"])
@pytest.mark.parametrize("batch, seq", [(0, 48), (2, 0)])
def test_no_tokens_are_refused_on_every_path(path, batch, seq):
    """An empty batch or sequence: a clear error (a raw reshape error before; with no sequence,
    in the backward only)."""
    args = list(_args(4))
    args[0] = args[0][:batch, :seq]
    args[1], args[4] = args[1][:batch * seq], args[4][:batch * seq]
    with on_path(path), pytest.raises(ValueError, match="x must hold at least one token"):
        torch.ops.coda.attention_block_fp8(*args)


@pytest.mark.parametrize("path", ["cpu", "fake"])
def test_errors_name_w_qkv_and_x(path):
    """The QKV rules it shares speak of its own arguments (they said ``w`` and ``y``)."""
    args = list(_args(4))
    args[2] = args[2][:, :64].contiguous()  # w_qkv with half of x's columns
    with on_path(path), pytest.raises(ValueError, match=r"w_qkv is \(\d+, 64\) but x has 128 columns"):
        torch.ops.coda.attention_block_fp8(*args)


@RECIPES
@pytest.mark.parametrize("head_dim, qk_norm", [(64, False), (128, True)], ids=["hd64", "hd128-qk_norm"])
def test_qkv_kernels_build_without_spills(head_dim, qk_norm, row):
    """Block-scaled, or the row-wise recipe's tree (the scales on the accumulator) on the plain
    FP8 kernel: the config the runner picks (the first of its ranking that builds without spills)."""
    n_heads, n_kv = 4096 // head_dim, 8
    tree = norm_rope_qkv_tree((n_heads + n_kv) * head_dim, head_dim, qk_norm, qk_norm)
    tree = row_scaled(tree) if row else tree
    cfg = choose_config(tree, 16384, (n_heads + 2 * n_kv) * head_dim, 4096, 1, True, False, 132,
                        block_scaled=not row)
    assert not spills(tree, cfg, True, 132, block_scaled=not row)
