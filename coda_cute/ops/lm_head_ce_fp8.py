"""``torch.ops.coda.lm_head_ce_train_fp8``: ``coda.lm_head_ce_train`` with its three GEMMs in
block-scaled FP8 (the FP8 recipe's ``lm_head_fp8``, ``coda_cute.precision``; the LM head stays
bf16 by default). Per row chunk (``lm_head_ce.plan_chunks``), Q1 1 x 128 blocks along K, QW
128 x 128 blocks, Q1t 1 x 128 blocks along the tokens:

    logits = r * (Q1(u) @ QW(W)^T)        the logits tree: logits stored bf16, LSE partials,
                                           the target logit (u = y * gamma)
    dl'    = r c (softmax - onehot)        the in-place cross-entropy gradient kernel
    dy     = Q1(dl') @ QW(W) ...          the RMSNorm-backward dgrad tree on W's FP8 transpose
    dW    += Q1t(dl')^T @ Q1t(u)           the weight-gradient form, accumulated in fp32

dl' and each chunk of u are quantized once for both of their GEMMs (``coda.quantize_fp8_dual``;
a chunk whose token count is no multiple of 16 takes the bf16 weight gradient). Unlike the
bf16 op, every chunk's weight gradient runs in the forward, into an fp32 (V, d) sum that the
backward scales by dloss (one pass over it; the bf16 op folds dloss into its last chunk's GEMM):
the FP8 head is an experiment's switch, memory is not its point. The reference is
``reference.lm_head_ce_fp8_ref``. Evaluation (no gradient) takes the bf16 ``coda.lm_head_ce``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import dispatch
from .. import epilogue as E
from ..elementwise import cross_entropy_grad_, lse_combine
from ..reference import ce_coef, lm_head_ce_fp8_ref, rms_rstd_ref
from .autocast import bf16_under_autocast
from .checks import F32, PendingIndexCheck, check_index_range
from .eager import direct
from .fold import scale
from .fp8_gemms import FP8, check_fp8_widths, grad_format, grad_operands, project, weight
from .gemm_blockwise import gemm_blockwise
from .lm_head_ce import (_add_wgrad, _padded_width, _scaled_input, accumulate_tree, check_lm_head,
                         finalize_ce, lm_head_ce, logits_tree, plan_chunks)
from .rmsnorm import norm_backward_tree, norm_inputs

OP = "coda.lm_head_ce_train_fp8"


def check_lm_head_fp8(y, w_lm, ss, eps, targets, reduction, gamma):
    m = check_lm_head(y, w_lm, ss, eps, targets, reduction, gamma, op=OP)
    v, d = w_lm.shape
    check_fp8_widths(OP, **{"the vocabulary size V (rows of w_lm)": v, "the model width d (columns of y)": d})
    return m


@torch.library.custom_op("coda::lm_head_ce_train_fp8", mutates_args=())
def lm_head_ce_train_fp8(y: torch.Tensor, w_lm: torch.Tensor, ss: torch.Tensor, eps: float,
                         targets: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
                         gamma: Optional[torch.Tensor] = None, e5m2_grads: bool = False,
                         pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss of ``coda.lm_head_ce_train`` (reduction "mean" or "sum") with FP8 GEMMs (module
    docstring), V and d multiples of 16; ``e5m2_grads``: dl' in E5M2; ``pow2_scales``: every scale
    rounded up to a power of two. Returns (loss, LSE, dy,
    dgamma (fp32, empty without gamma), dW (fp32)), the gradients for dloss = 1; only loss carries
    a gradient."""
    if y.device.type == "cpu":
        dispatch.require_reference(OP)
    check_lm_head_fp8(y, w_lm, ss, eps, targets, reduction, gamma)
    target_check = PendingIndexCheck(OP, "targets", targets, w_lm.shape[0], ignore_index)
    loss, lse, dy, dgamma, dw = _chunked_fp8(y, w_lm, ss, eps, targets, ignore_index, reduction, gamma,
                                             grad_format(e5m2_grads), pow2_scales)
    target_check.wait()
    return loss, lse, dy, dgamma if dgamma is not None else y.new_empty((0,), dtype=F32), dw


def _chunked_fp8(y, w_lm, ss, eps, targets, ignore_index, reduction, gamma, grad_dtype, pow2):
    m, d = y.shape
    v = w_lm.shape[0]
    u = _scaled_input(y, gamma)
    r = rms_rstd_ref(ss, d, eps)
    coef = ce_coef(targets, ignore_index, reduction)
    tgt = targets.to(torch.int32)
    rows, _ = plan_chunks(m, v, d)
    w_q, w_s, w_qt = weight(w_lm, pow2)
    buf = torch.empty((rows, _padded_width(v)), dtype=y.dtype, device=y.device)
    dy = torch.empty_like(y)
    lse = torch.empty(m, dtype=F32, device=y.device)
    target_logit = torch.empty(m, dtype=F32, device=y.device)
    dgamma = None if gamma is None else torch.zeros(d, dtype=F32, device=y.device)
    gamma_col = None if gamma is None else gamma.to(F32)
    dw = None
    for i in range(0, m, rows):
        s = slice(i, min(i + rows, m))
        dl = buf[: s.stop - i, :v]
        stats = norm_inputs(d, ss[s], eps)
        u_q, u_s, ut_q, ut_s = grad_operands(u[s], FP8, pow2)
        out = project(OP, logits_tree(), u_q, u_s, w_q, w_s, dict(stats, targets=tgt[s]),
                      outputs={"logits": dl})
        lse_combine(*out["lse"], out=lse[s])
        target_logit[s] = out["target_logit"]
        zdz = cross_entropy_grad_(dl, lse[s], r[s], coef[s], tgt[s], target_logit[s])
        dl_q, dl_s, dlt_q, dlt_s = grad_operands(dl, grad_dtype, pow2)
        inputs = dict(stats, zdz=zdz, y=y[s])
        if gamma is not None:
            inputs["gamma"] = gamma_col
        out = project(OP, norm_backward_tree(False, gamma is not None), dl_q, dl_s, w_qt, w_s, inputs,
                      transposed=True, outputs={"dy": dy[s]})
        if gamma is not None:
            dgamma += out["dgamma"].sum(-1)
        if dlt_q is None:  # a chunk of a token count that is no multiple of 16: bf16
            dw = _add_wgrad(dw, dl, u[s], torch.float32)
        elif dw is None:
            dw = gemm_blockwise(dlt_q, dlt_s, ut_q, ut_s, torch.float32, "1x128")
        else:
            E.run(accumulate_tree("float32"), dlt_q, ut_q.t(), {"prev": dw}, outputs={"out": dw}, op=OP,
                  block_scales=(dlt_s, ut_s), b_block="1x128")
    loss = finalize_ce(lse, target_logit, targets, ignore_index, reduction)
    return loss, lse, dy, dgamma, dw


@lm_head_ce_train_fp8.register_fake
def _fake(y, w_lm, ss, eps, targets, ignore_index=-100, reduction="mean", gamma=None, e5m2_grads=False,
          pow2_scales=False):
    m = check_lm_head_fp8(y, w_lm, ss, eps, targets, reduction, gamma)
    d = y.shape[1]
    dg = y.new_empty((d if gamma is not None else 0,), dtype=F32)
    return (y.new_empty((), dtype=F32), y.new_empty((m,), dtype=F32), y.new_empty(y.shape), dg,
            w_lm.new_empty(w_lm.shape, dtype=F32))


@lm_head_ce_train_fp8.register_kernel("cpu")
def _cpu(y, w_lm, ss, eps, targets, ignore_index=-100, reduction="mean", gamma=None, e5m2_grads=False,
         pow2_scales=False):
    dispatch.require_reference(OP)
    check_lm_head_fp8(y, w_lm, ss, eps, targets, reduction, gamma)
    check_index_range(OP, "targets", targets, w_lm.shape[0], ignore_index)
    rows, _ = plan_chunks(y.shape[0], w_lm.shape[0], y.shape[1])
    loss, lse, dy, dgamma, dw = lm_head_ce_fp8_ref(y, w_lm, ss, eps, targets, ignore_index, reduction, gamma,
                                                   grad_format(e5m2_grads), rows, pow2_scales)
    return loss, lse, dy, dgamma if dgamma is not None else y.new_empty((0,), dtype=F32), dw


def _setup(ctx, inputs, output):
    y, w_lm, ss, eps, targets, ignore_index, reduction, gamma, e5m2_grads, pow2_scales = inputs
    ctx.save_for_backward(gamma, *output[2:])
    ctx.w_dtype = w_lm.dtype
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward(ctx, dloss, *_):
    gamma, dy, dgamma, dw = ctx.saved_tensors
    if dloss is None:
        return (None,) * 10
    dloss = dloss.to(F32)
    dg = (dgamma * dloss).to(gamma.dtype) if gamma is not None else None
    return scale(dy, dloss), scale(dw, dloss, ctx.w_dtype), None, None, None, None, None, dg, None, None


lm_head_ce_train_fp8.register_autograd(_backward, setup_context=_setup)


def cross_entropy_fp8(y, w_lm, ss, eps: float, targets, ignore_index: int = -100, reduction: str = "mean",
                      gamma=None, e5m2_grads: bool = False, pow2_scales: bool = False):
    """The loss through ``coda.lm_head_ce_train_fp8`` where a gradient is wanted and the reduction
    is "mean" or "sum", else through the bf16 ``coda.lm_head_ce`` (evaluation)."""
    wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (y, w_lm, gamma))
    if wants_grad and reduction in ("mean", "sum"):
        return lm_head_ce_train_fp8(y, w_lm, ss, eps, targets, ignore_index, reduction, gamma, e5m2_grads,
                                    pow2_scales)[0]
    return lm_head_ce(y, w_lm, ss, eps, targets, ignore_index, reduction, gamma)[0]


# torch.autocast: activations and weights in bf16 (ops.autocast), then quantized
bf16_under_autocast("coda::lm_head_ce_train_fp8", (0, 1, 7))


# Python callers skip the dispatcher where nothing needs it (ops.eager)
lm_head_ce_train_fp8 = direct(lm_head_ce_train_fp8)
