"""``torch.ops.coda.mlp_block``: a Llama block's MLP sublayer as one autograd op, so that its
backward can fuse across the ops of its forward (coda-math 3.3).

Forward (two GEMMs; gamma folded into w_gu by the caller):

    z, h   = coda.norm_swiglu(y, w_gu, ss)             RMSNorm + gate/up + SwiGLU
    y2, ss2 = coda.residual_gemm_norm_stats(h, w_down, y)   down-proj + residual + norm stats

Backward, from dy2 = dL/dy2 (five GEMMs, 16-bit operands, fp32 accumulation, all ours):

    dz', h, zdz = coda.swiglu_backward(dy2, w_down, z, ss)  down-proj dgrad + SwiGLU backward
    dw_down     = dy2^T @ h                                  wgrad on the recomputed h
    dw_gu       = dz'^T @ y                                  wgrad (dz' = r dz serves both)
    dy          = coda.norm_backward(dz', w_gu, y, ss, zdz, residual_grad=dy2)
                                                             gate/up dgrad + RMSNorm backward
                                                             + the residual's gradient

Saved for backward: y (the residual stream, needed anyway), ss, z (M x 2f bf16, the SwiGLU
pre-activation); h (M x f) is recomputed in the SwiGLU backward's epilogue instead of kept.
"""

from __future__ import annotations

import torch

from .gemm import gemm_op
from .autocast import bf16_under_autocast
from .eager import direct
from .. import dispatch
from ..reference import norm_swiglu_ref, residual_gemm_norm_stats_ref
from .checks import BF16, F32, check_same_device, check_tensor
from .residual import check_residual, residual_impl, stats_tile_n
from .rmsnorm import norm_backward
from .swiglu import check_swiglu, norm_swiglu_impl, swiglu_backward

OP = "coda.mlp_block"


def check_mlp(y, ss, w_gu, w_down, eps, op=OP):
    m, n = check_swiglu(y, w_gu, ss, eps, op)  # y and w_gu: bf16, contiguous, 16-byte aligned
    f = n // 2
    # w_down as the down-proj's B operand here and swiglu_backward's dgrad operand takes it (TMA)
    check_tensor(op, "w_down", w_down, 2, (BF16,), aligned=True)
    if tuple(w_down.shape) != (y.shape[1], f):
        raise ValueError(f"{op}: w_down must be (d, f) = {(y.shape[1], f)} (nn.Linear: d x f), got "
                         f"{tuple(w_down.shape)}")
    check_same_device(op, y=y, w_gu=w_gu, w_down=w_down)
    return m, f


@torch.library.custom_op("coda::mlp_block", mutates_args=())
def mlp_block(y: torch.Tensor, ss: torch.Tensor, w_gu: torch.Tensor, w_down: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y2 = y + SwiGLU(RMSNorm(y; gamma) @ W_gu.T) @ W_down.T, in two GEMMs.

    y: (M, d) bf16 residual stream; ss: (M, T) fp32 its norm statistics; w_gu: (2f, d) bf16,
    gate/up rows interleaved, gamma folded in; w_down: (d, f) bf16. Returns (y2 (M, d), ss2
    (M, T2) the norm statistics of y2, z (M, 2f) the pre-activation kept for the backward: ss2
    and z carry no gradient). The backward is the module docstring's.
    """
    check_mlp(y, ss, w_gu, w_down, eps)
    z, h = norm_swiglu_impl(y, w_gu, ss, eps)
    y2, ss2 = residual_impl(h, w_down, y)
    return y2, ss2, z


@mlp_block.register_fake
def _fake(y, ss, w_gu, w_down, eps):
    m, f = check_mlp(y, ss, w_gu, w_down, eps)
    h = y.new_empty((m, f))
    check_residual(h, w_down, y)
    t = -(-y.shape[1] // stats_tile_n(h, w_down))
    return y.new_empty(y.shape), y.new_empty((m, t), dtype=F32), y.new_empty((m, 2 * f))


@mlp_block.register_kernel("cpu")
def _cpu(y, ss, w_gu, w_down, eps):
    dispatch.require_reference(OP)
    check_mlp(y, ss, w_gu, w_down, eps)
    z, h = norm_swiglu_ref(y, w_gu, ss, eps)
    y2, ss2 = residual_gemm_norm_stats_ref(h, w_down, y, stats_tile_n(h, w_down))
    return y2, ss2, z


def mlp_backward(y, ss, w_gu, w_down, eps, z, dy2, needs=(True, True, True)):
    """(dy, dw_gu, dw_down), the module docstring's five GEMMs (each skipped if not needed)."""
    dzp, h, zdz = swiglu_backward(dy2, w_down, z, ss, eps)
    dw_down = gemm_op(dy2.t(), h) if needs[2] else None
    dw_gu = gemm_op(dzp.t(), y) if needs[1] else None
    dy = norm_backward(dzp, w_gu, y, ss, zdz, eps, dy2) if needs[0] else None
    return dy, dw_gu, dw_down


def _setup(ctx, inputs, output):
    y, ss, w_gu, w_down, eps = inputs
    ctx.save_for_backward(y, ss, w_gu, w_down, output[2])
    ctx.eps = eps
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)  # no zero tensors for the outputs without a gradient


def _backward(ctx, dy2, _dss2, _dz):
    y, ss, w_gu, w_down, z = ctx.saved_tensors
    if dy2 is None:
        return (None,) * 5
    n = ctx.needs_input_grad
    dy, dw_gu, dw_down = mlp_backward(y, ss, w_gu, w_down, ctx.eps, z, dy2.contiguous(), (n[0], n[2], n[3]))
    return dy, None, dw_gu, dw_down, None


mlp_block.register_autograd(_backward, setup_context=_setup)


# torch.autocast: activations and weights in bf16 (ops.autocast)
bf16_under_autocast("coda::mlp_block", (0, 2, 3))


# Python callers skip the dispatcher where nothing needs it (ops.eager)
mlp_block = direct(mlp_block)
