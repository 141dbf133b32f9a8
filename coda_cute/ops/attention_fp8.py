"""``torch.ops.coda.attention_block_fp8``: ``coda.attention_block`` with its projections in FP8,
block-scaled as in ``coda_cute.precision.Fp8Recipe`` (``ops.fp8_gemms``): the QKV and out-proj
GEMMs of the forward, their dgrads and their weight gradients, on the bf16 op's epilogue trees.
The attention core and the RoPE / QK-norm backward stay bf16 (the recipe's), as does everything
the epilogues compute.

Forward (Q1: 1 x 128 blocks along K; QW: 128 x 128 weight blocks):

    qkv, pre = norm_rope_qkv tree on  Q1(x) @ QW(W_qkv)^T     RMSNorm r, QK-norm, RoPE in the epilogue
    o, lse   = attention core (bf16)
    y, ss_y  = residual tree on       Q1(o) @ QW(W_o)^T + x

Backward, from dy:

    do          = Q1(dy) @ QW(W_o)                dW_o   = Q1(dy^T) @ Q1(o^T)^T   (along the tokens)
    dq, dk, dv  = attention core backward;  g, zdz = coda.rope_backward (bf16)
    dx          = norm_backward tree on  Q1(g) @ QW(W_qkv) + dy      dW_qkv = Q1(g^T) @ Q1(x^T)^T

dy and g are quantized once for their dgrad and wgrad (``coda.quantize_fp8_dual``). Saved as the
bf16 op's, plus the weights' FP8 transposes and scales (quantized with the forward's copies in
one pass). ``row_scaling``: the row-wise recipe (``ops.fp8_gemms``), one scale per whole row
along K of every operand, on the plain FP8 GEMM with the same trees; dy and g quantized per token
in one read each, their weight gradients on those FP8 bytes transposed with the token scales
folded into o and x (``fp8_gemms.wgrad``); ``fast_accum`` ("none",
"forward", "all"; row-wise only): the GEMMs of those roles accumulate in the tensor core for the
whole k-loop (``fp8_gemms.fast_for``).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import dispatch
from ..kernels.epilogue.plain import gemm_tree
from ..reference import rms_rstd_ref
from .attention import (attention_backward, attention_forward, check_attention_block, heads_to_rows,
                        qkv_heads, _core_fake)
from .autocast import bf16_under_autocast
from .checks import F32
from .eager import direct
from .beside import beside
from .fp8_gemms import (activation, check_fast_accum, check_fp8_widths, fast_for, first_projection, grad_format,
                        grad_operands, kept_weights, project, quantized_weights, residual_stats_tiles, transposable,
                        wgrad, wgrad_prepared)
from .quantize import transpose_bytes
from .qkv import norm_rope_qkv_tree, qkv_tree_inputs, rope_backward
from .residual import residual_norm_stats_tree
from .rmsnorm import norm_backward_tree, norm_inputs

OP = "coda.attention_block_fp8"
#: SMs the row-wise recipe's QKV dgrad leaves to the weight gradients' passes beside it
#: (``ops.beside``; 0: in series): dy's and g's FP8 transposes, o's and x's folded columns. The
#: four passes move about 0.7 GB at the 8b shapes, against the 1.8 GB the MLP's move beside its
#: dgrads, so the gain is small; with the GEMM beside them on ``ops.beside``'s priority stream it
#: is there on average in every reading (H100s, 2026-12-07, 16384 tokens, ms, series -> beside):
#: the 8b sublayer in turns 8.518 -> 8.420, 8.621 -> 8.525, 8.524 -> 8.400, 8.544 -> 8.557,
#: 8.603 -> 8.548, back to back 8.788 -> 8.585, 8.881 -> 8.611, 8.698 -> 8.726, 8.673 -> 8.728,
#: 8.842 -> 8.755; at 1b (d 2048, head_dim 64, not a shape it was picked on) 4.156 -> 4.133 and
#: 4.193 -> 4.183 in turns, 4.312 -> 4.221 and 4.223 -> 4.285 back to back; the whole 8b FP8
#: step, a process each, 128.718 -> 128.181 and 130.389 -> 128.945 in turns, 130.31 -> 129.96 and
#: 131.07 -> 131.25 back to back, peak memory the same (3.73 GiB). With the GEMM on the current
#: stream (before the priority stream) 16 SMs gained in turns but not back to back.
SIDE_SMS_QKV_DGRAD = 16
#: SMs the row-wise recipe's QKV forward leaves to the weights' passes beside it (W_qkv's columns,
#: W_o's rows and columns, where the op quantizes its weights: ``fp8_gemms.first_projection``; 0: in
#: series, after it). The weights are small next to the MLP's, so is the gain: one H100, 2026-12-07,
#: the 8b sublayer (16384 tokens in sequences of 4096), fast accumulation, in turns, 8.669 -> 8.605 ms.
SIDE_SMS_QKV_FORWARD = 6


def check_attention_block_fp8(x, ss, w_qkv, w_o, positions, inv_freq, eps, n_heads, n_kv_heads,
                              head_dim, q_norm_w, k_norm_w, qk_eps, fast_accum="none", row=False):
    b, s, d = check_attention_block(x, ss, w_qkv, w_o, positions, inv_freq, eps, n_heads, n_kv_heads,
                                    head_dim, q_norm_w, k_norm_w, qk_eps, op=OP)
    check_fast_accum(OP, fast_accum, row)
    check_fp8_widths(OP, **{"the model width d (columns of x)": d,
                            "n_heads * head_dim (columns of w_o)": n_heads * head_dim,
                            "the QKV width (n_heads + 2 n_kv_heads) * head_dim (rows of w_qkv)":
                                (n_heads + 2 * n_kv_heads) * head_dim})
    return b, s, d


@functools.lru_cache(maxsize=None)
def _plain_tree():
    """The out-proj dgrad's epilogue: do = acc, bf16."""
    return gemm_tree("none", "none", "bfloat16")


@torch.library.custom_op("coda::attention_block_fp8", mutates_args=())
def attention_block_fp8(x: torch.Tensor, ss: torch.Tensor, w_qkv: torch.Tensor, w_o: torch.Tensor,
                        positions: torch.Tensor, inv_freq: torch.Tensor, eps: float, n_heads: int,
                        n_kv_heads: int, head_dim: int, q_norm_w: Optional[torch.Tensor] = None,
                        k_norm_w: Optional[torch.Tensor] = None, qk_eps: float = 1e-6, e5m2_grads: bool = False,
                        pow2_scales: bool = False, qkv_q: Optional[torch.Tensor] = None,
                        qkv_s: Optional[torch.Tensor] = None, qkv_qt: Optional[torch.Tensor] = None,
                        o_q: Optional[torch.Tensor] = None, o_s: Optional[torch.Tensor] = None,
                        o_qt: Optional[torch.Tensor] = None, row_scaling: bool = False,
                        fast_accum: str = "none"
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                   torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``coda.attention_block`` with FP8 projections (module docstring). Arguments as that op's,
    ``e5m2_grads``: the backward's gradients in E5M2 rather than E4M3, and ``pow2_scales``: every
    scale rounded up to a power of two (``Fp8Recipe.pow2_scales``); ``qkv_q, qkv_s, qkv_qt``,
    ``o_q, o_s, o_qt``: the weights quantized as ``fp8_gemms.weight(w, pow2_scales, row_scaling)``
    returns them, kept by the caller once per version of the weights (``nn.fold.WeightQuantCache``),
    or none of them for the op to quantize; ``row_scaling``: the row-wise recipe; ``fast_accum``:
    which of its GEMMs accumulate in the tensor core (module docstring). d, n_heads *
    head_dim (hence the QKV width) multiples of 16. Returns the bf16 op's six outputs, then the
    quantized weights kept for the backward (W_qkv's FP8 transpose and its scales, 128 x 128 or
    row-wise (N + K, 1), W_o's; empty when the caller passed them,
    which the backward then uses); only y carries a gradient."""
    if x.device.type == "cpu":
        dispatch.require_reference(OP)
    b, s, d = check_attention_block_fp8(x, ss, w_qkv, w_o, positions, inv_freq, eps, n_heads, n_kv_heads,
                                        head_dim, q_norm_w, k_norm_w, qk_eps, fast_accum, row_scaling)
    x2 = x.view(b * s, d)
    given = [qkv_q, qkv_s, qkv_qt, o_q, o_s, o_qt]
    row, fast = row_scaling, fast_for(fast_accum, "forward")
    act = lambda t: activation(t, pow2_scales, row)  # noqa: E731
    qk_norm = q_norm_w is not None
    tree = norm_rope_qkv_tree((n_heads + n_kv_heads) * head_dim, head_dim, qk_norm, qk_norm)
    inputs = qkv_tree_inputs(x2, ss, eps, positions, inv_freq, n_heads, n_kv_heads, head_dim, q_norm_w,
                             k_norm_w, qk_eps)
    x_q, x_s = act(x2)
    out, ((qkv_q, qkv_s, qkv_qt), (o_q, o_s, o_qt)) = first_projection(
        OP, lambda q, s, sms: project(OP, tree, x_q, x_s, q, s, inputs, row=row, fast=fast, sms=sms), given,
        pow2_scales, row, x.device, SIDE_SMS_QKV_FORWARD, w_qkv=w_qkv, w_o=w_o)
    qkv = out["qkv"]
    q, k, v = qkv_heads(qkv, b, n_heads, n_kv_heads, head_dim)
    o, lse = attention_forward(q, k, v)
    res = project(OP, residual_norm_stats_tree(), *act(heads_to_rows(o)), o_q, o_s, {"residual": x2}, row=row,
                  fast=fast)
    pre = out["pre"] if qk_norm else qkv.new_empty((0,))
    kept = ((*kept_weights(w_qkv, True), *kept_weights(w_o, True)) if given[0] is not None
            else (qkv_qt, qkv_s, o_qt, o_s))
    return (res["y"].view(b, s, d), res["ss"], qkv, o, lse, pre, *kept)


@attention_block_fp8.register_fake
def _fake(x, ss, w_qkv, w_o, positions, inv_freq, eps, n_heads, n_kv_heads, head_dim,
          q_norm_w=None, k_norm_w=None, qk_eps=1e-6, e5m2_grads=False, pow2_scales=False, qkv_q=None,
          qkv_s=None, qkv_qt=None, o_q=None, o_s=None, o_qt=None, row_scaling=False, fast_accum="none"):
    b, s, d = check_attention_block_fp8(x, ss, w_qkv, w_o, positions, inv_freq, eps, n_heads, n_kv_heads,
                                        head_dim, q_norm_w, k_norm_w, qk_eps, fast_accum, row_scaling)
    given = [qkv_q, qkv_s, qkv_qt, o_q, o_s, o_qt]
    cached = qkv_q is not None
    if any(t is not None for t in given):
        quantized_weights(OP, given, pow2_scales, row_scaling, w_qkv=w_qkv, w_o=w_o)
    m, n, hh = b * s, w_qkv.shape[0], n_heads * head_dim
    qkv = x.new_empty((m, n))
    q, k, v = qkv_heads(qkv, b, n_heads, n_kv_heads, head_dim)
    o, lse = _core_fake(q, k, v)
    t = residual_stats_tiles(m, d, hh, x.device, row_scaling, fast_for(fast_accum, "forward"))
    pre = x.new_empty((m, n) if q_norm_w is not None else (0,))
    return (x.new_empty(x.shape), x.new_empty((m, t), dtype=F32), qkv, o, lse, pre,
            *kept_weights(w_qkv, cached, row_scaling), *kept_weights(w_o, cached, row_scaling))


def _setup(ctx, inputs, output):
    x, ss, _w_qkv, _w_o, positions, inv_freq, eps, h, hkv, hd, qn, kn, qk_eps, e5m2_grads, pow2 = inputs[:15]
    _, _, qkv, o, lse, pre, qkv_qt, qkv_s, o_qt, o_s = output
    if inputs[15] is not None:  # the caller's copies
        qkv_s, qkv_qt, o_s, o_qt = inputs[16], inputs[17], inputs[19], inputs[20]
    ctx.save_for_backward(x, ss, positions, inv_freq, qn, kn, qkv, o, lse, pre,
                          qkv_qt, qkv_s, o_qt, o_s)
    ctx.args = (eps, h, hkv, hd, qk_eps, grad_format(e5m2_grads), pow2, inputs[21], inputs[22])
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, *_):
    (x, ss, positions, inv_freq, qn, kn, qkv, o, lse, pre,
     qkv_qt, qkv_s, o_qt, o_s) = ctx.saved_tensors
    if dy is None:
        return (None,) * 23
    eps, h, hkv, hd, qk_eps, grad_dtype, pow2, row, fast_accum = ctx.args
    fast_d, fast_w = fast_for(fast_accum, "dgrad"), fast_for(fast_accum, "wgrad")
    n = ctx.needs_input_grad
    b, s, d = x.shape
    x2 = x.view(b * s, d)
    dy2 = dy.reshape(b * s, d).contiguous()
    # row-wise: the gradients' rows now, their FP8 transposes beside the QKV dgrad (below)
    dy_q, dy_s, dyt_q, dyt_s = grad_operands(dy2, grad_dtype, pow2, row, wgrad_form=not row)
    do = project(OP, _plain_tree(), dy_q, dy_s, o_qt, o_s, {}, transposed=True, row=row, fast=fast_d)["out"]
    if not row:
        dw_o = wgrad(dy2, dyt_q, dyt_s, heads_to_rows(o), pow2, fast=fast_w) if n[3] else None
    q, k, v = qkv_heads(qkv, b, h, hkv, hd)
    dq, dk, dv = attention_backward(do.view(b, s, h, hd).transpose(1, 2), q, k, v, o, lse)
    r = rms_rstd_ref(ss, d, eps)
    g, zdz, dqn, dkn = rope_backward(dq, dk, dv, qkv, r, positions, inv_freq, pre if qn is not None else None,
                                     qn, kn, qk_eps)
    g_q, g_s, gt_q, gt_s = grad_operands(g, grad_dtype, pow2, row, wgrad_form=not row)

    def dgrad(sms=None):
        inputs = dict(norm_inputs(d, ss, eps), zdz=zdz, y=x2, dres=dy2)
        return project(OP, norm_backward_tree(True), g_q, g_s, qkv_qt, qkv_s, inputs, transposed=True, row=row,
                       fast=fast_d, sms=sms)["dy"].view(b, s, d)

    if row:
        def wgrad_operands():  # read by the two weight gradients alone (mlp_fp8._row_backward's form)
            dw_o = wgrad_prepared(dy2, transpose_bytes(dy_q) if transposable(dy2) else None, dyt_s,
                                  heads_to_rows(o), pow2, True, fast_w) if n[3] else None
            dw_qkv = wgrad_prepared(g, transpose_bytes(g_q) if transposable(g) else None, gt_s, x2, pow2, True,
                                    fast_w) if n[2] else None
            return dw_o, dw_qkv

        dx, (dw_o, dw_qkv) = (beside(dgrad, wgrad_operands, x.device, SIDE_SMS_QKV_DGRAD) if n[0]
                              else (None, wgrad_operands()))
        dw_o, dw_qkv = dw_o() if dw_o else None, dw_qkv() if dw_qkv else None
    else:
        dx = dgrad() if n[0] else None
        dw_qkv = wgrad(g, gt_q, gt_s, x2, pow2, fast=fast_w) if n[2] else None
    if qn is None:
        dqn = dkn = None
    return (dx, None, dw_qkv, dw_o, None, None, None, None, None, None, dqn, dkn) + (None,) * 11


attention_block_fp8.register_autograd(_backward, setup_context=_setup)


# torch.autocast: activations and weights in bf16 (ops.autocast), then quantized
bf16_under_autocast("coda::attention_block_fp8", (0, 2, 3, 10, 11))


# Python callers skip the dispatcher where nothing needs it (ops.eager)
attention_block_fp8 = direct(attention_block_fp8)
