"""``torch.ops.coda.lm_head_ce``: final RMSNorm + LM head + cross-entropy without logits.

The GEMM's epilogue r-scales the logits and reduces them to per-(row, column tile) partials: the
tile max m_t and s_t = sum exp(logit - m_t), plus the target logit gathered by the tile that owns
column target_m. A tiny torch finalize combines them (coda-math section 2, "CE finalize"):

    LSE_m = M + log sum_t s_t exp(m_t - M),  M = max_t m_t
    loss_m = LSE_m - logit[m, target_m]      (0 where target_m == ignore_index)

The backward recomputes logits in chunks (rows for dy and d ss, vocabulary columns for dw), so
neither pass holds more than ~``CHUNK_ELEMS`` fp32 logits at a time:

    dlogits = softmax * (c_m + dLSE_m) - onehot(target_m) * c_m,
    c_m = dloss_m (none) | dloss (sum) | dloss / #valid (mean), 0 on ignored rows.
"""

from __future__ import annotations

import functools

import torch

from .. import epilogue as E
from ..reference import lm_head_ce_ref, reduce_loss, rms_rstd_ref
from .coda_block import (
    F32,
    INDEX_DTYPES,
    PendingIndexCheck,
    check_index_range,
    check_norm_input,
    check_tensor,
    mm32,
    norm_inputs,
    require_reference,
    rstd_node,
)

OP = "coda.lm_head_ce"
REDUCTIONS = ("mean", "sum", "none")
# fp32 logits per backward chunk: 32 MiB, a few such buffers live at a time.
CHUNK_ELEMS = 1 << 23


@functools.lru_cache(maxsize=None)
def lm_head_ce_tree() -> E.Epilogue:
    logits = E.acc() * rstd_node()
    return E.Epilogue(E.row_reduce(logits, "lse", "lse"),
                      E.gather(logits, E.row_vec("targets", "int32"), "target_logit"))


def check_lm_head(y, w_lm, ss, eps, targets, reduction):
    # The logits are never stored, so the vocabulary size has no alignment rule.
    m, _, _ = check_norm_input(OP, y, w_lm, ss, eps, store_cols=False)
    check_tensor(OP, "targets", targets, 1, INDEX_DTYPES)
    if targets.shape[0] != m:
        raise ValueError(f"{OP}: targets must have one entry per row of y ({m}), got {targets.shape[0]}")
    if targets.device != y.device:
        raise ValueError(f"{OP}: targets is on {targets.device} but y is on {y.device}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{OP}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return m


def finalize_ce(lse, target_logit, targets, ignore_index: int, reduction: str):
    valid = targets != ignore_index
    return reduce_loss(torch.where(valid, lse - target_logit, 0.0), valid, reduction)


@torch.library.custom_op("coda::lm_head_ce", mutates_args=())
def lm_head_ce(y: torch.Tensor, w_lm: torch.Tensor, ss: torch.Tensor, eps: float,
               targets: torch.Tensor, ignore_index: int = -100,
               reduction: str = "mean") -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of logits = r * (y @ w_lm.T), the logits never materialized.

        r_m = (sum_t ss[m, t] / d + eps)^(-1/2)
        LSE_m = log sum_v exp(logits[m, v]),  loss_m = LSE_m - logits[m, targets_m]

    y: (M, d) bf16 (the last residual stream); w_lm: (V, d) bf16 with the final norm's gamma
    folded in; ss: (M, T) fp32 partials of y; targets: (M,) int64/int32 in [0, V) or
    ignore_index. d a multiple of 8; V any. Returns (loss, LSE): loss fp32 () for "mean" (over
    rows whose target is not ignore_index; NaN if none, as torch) and "sum", (M,) for "none"
    (0 on ignored rows); LSE (M,) fp32 (kept for the backward). Targets out of range raise
    ValueError before the op returns: their check is queued ahead of the GEMM and read back
    while the GEMM runs (``PendingIndexCheck``), so the GPU never waits for the host; the wait
    rules out CUDA-graph capture of the op. (The kernel's gather skips an out-of-range target,
    so the GEMM that ran meanwhile wrote nothing out of bounds.)
    """
    check_lm_head(y, w_lm, ss, eps, targets, reduction)
    target_check = PendingIndexCheck(OP, "targets", targets, w_lm.shape[0], ignore_index)
    inputs = dict(norm_inputs(y, ss, eps), targets=targets.to(torch.int32))
    out = E.run(lm_head_ce_tree(), y, w_lm.t(), inputs, op=OP)
    lse = E.finalize_lse(*out["lse"])
    loss = finalize_ce(lse, out["target_logit"], targets, ignore_index, reduction)
    target_check.wait()
    return loss, lse


@lm_head_ce.register_fake
def _lm_head_fake(y, w_lm, ss, eps, targets, ignore_index=-100, reduction="mean"):
    m = check_lm_head(y, w_lm, ss, eps, targets, reduction)
    loss = y.new_empty((m,) if reduction == "none" else (), dtype=F32)
    return loss, y.new_empty((m,), dtype=F32)


@lm_head_ce.register_kernel("cpu")
def _lm_head_cpu(y, w_lm, ss, eps, targets, ignore_index=-100, reduction="mean"):
    require_reference(OP)
    check_lm_head(y, w_lm, ss, eps, targets, reduction)
    check_index_range(OP, "targets", targets, w_lm.shape[0], ignore_index)
    return lm_head_ce_ref(y, w_lm, ss, eps, targets, ignore_index, reduction)


def _softmax_grad_(logits, lse, coef, dlse, tgt_local):
    """In place on ``logits`` (rows x a column chunk): softmax * (coef + dlse) - onehot * coef,
    the one-hot at column ``tgt_local`` where that lies inside the chunk."""
    grad = logits.sub_(lse.unsqueeze(1)).exp_().mul_((coef + dlse).unsqueeze(1))
    inside = (tgt_local >= 0) & (tgt_local < grad.shape[1])
    idx = tgt_local.clamp(0, grad.shape[1] - 1).unsqueeze(1)
    return grad.scatter_add_(1, idx, (-coef * inside).unsqueeze(1))


def lm_head_ce_backward(y, w_lm, ss, eps: float, targets, lse, ignore_index: int, reduction: str,
                        dloss, dlse, needs=(True, True, True)):
    """(dy, dw_lm, dss), each None where ``needs`` (y, w_lm, ss) is False.

    Pass 1, over row chunks (dy, d ss): logits for the chunk's rows over the whole vocabulary;
    dy = (r dlogits) @ w_lm; dr_m = sum_v dlogits acc; d ss = -dr r^3 / (2 d).
    Pass 2, over vocabulary chunks (dw_lm): logits for all rows over the chunk's columns;
    dw_lm[chunk] = (r dlogits)^T @ y - each slice of dw computed whole, nothing accumulated
    across chunks. dlogits are rounded to y's dtype as GEMM operands; products accumulate in fp32.
    """
    m, d = y.shape
    v = w_lm.shape[0]
    wide = torch.promote_types(y.dtype, F32)
    r = rms_rstd_ref(ss, d, eps)
    lse = lse.to(wide)
    dlse = dlse.to(wide)
    valid = targets != ignore_index
    dloss = dloss.to(wide)
    coef = dloss if reduction == "none" else dloss.expand(m)
    if reduction == "mean":
        coef = coef / valid.sum()
    coef = torch.where(valid, coef, 0.0)
    tgt = targets.long()
    dy = dw = dss = None
    if needs[0] or needs[2]:
        dy = torch.empty_like(y) if needs[0] else None
        dr = torch.empty(m, dtype=wide, device=y.device)
        rows = max(1, CHUNK_ELEMS // max(v, 1))
        for i in range(0, m, rows):
            s = slice(i, i + rows)
            acc = mm32(y[s], w_lm.t())
            grad = _softmax_grad_(acc * r[s].unsqueeze(1), lse[s], coef[s], dlse[s], tgt[s])
            dr[s] = acc.mul_(grad).sum(1)
            del acc
            if dy is not None:
                dy[s] = mm32(grad.mul_(r[s].unsqueeze(1)).to(y.dtype), w_lm).to(y.dtype)
        if needs[2]:
            dss = (dr * (-0.5 / d) * r ** 3).to(ss.dtype).unsqueeze(1).expand_as(ss)
    if needs[1]:
        dw = torch.empty_like(w_lm)
        cols = max(1, CHUNK_ELEMS // max(m, 1))
        for j in range(0, v, cols):
            logits = mm32(y, w_lm[j:j + cols].t()).mul_(r.unsqueeze(1))
            grad = _softmax_grad_(logits, lse, coef, dlse, tgt - j).mul_(r.unsqueeze(1))
            dw[j:j + cols] = mm32(grad.to(y.dtype).t(), y).to(w_lm.dtype)
    return dy, dw, dss


def _lm_head_setup(ctx, inputs, output):
    y, w_lm, ss, eps, targets, ignore_index, reduction = inputs
    ctx.save_for_backward(y, w_lm, ss, targets, output[1])
    ctx.args = (eps, ignore_index, reduction)


def _lm_head_backward(ctx, dloss, dlse):
    y, w_lm, ss, targets, lse = ctx.saved_tensors
    eps, ignore_index, reduction = ctx.args
    dy, dw, dss = lm_head_ce_backward(y, w_lm, ss, eps, targets, lse, ignore_index, reduction,
                                      dloss, dlse, ctx.needs_input_grad[:3])
    return dy, dw, dss, None, None, None, None


lm_head_ce.register_autograd(_lm_head_backward, setup_context=_lm_head_setup)
