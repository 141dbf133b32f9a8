"""``torch.ops.coda.norm_proj``: a plain RMSNorm-scaled projection, out = r * (y @ w.T) (e.g. the
logits for inference from the final norm and the LM head), and its backward on our kernels:

    g = r * dout;  zdz_m = sum_n dout_mn out_mn;  dy = coda.norm_backward(g, w, y, ...);
    dw = g^T @ y
"""

from __future__ import annotations

import functools

import torch

from .gemm import gemm_op
from .autocast import bf16_under_autocast
from .eager import direct
from .. import dispatch
from .. import epilogue as E
from ..reference import norm_proj_ref, rms_rstd_ref
from .checks import check_norm_input
from .rmsnorm import norm_backward, norm_inputs, rstd_node

OP = "coda.norm_proj"


@functools.lru_cache(maxsize=None)
def norm_proj_tree() -> E.Epilogue:
    return E.Epilogue(E.store(E.acc() * rstd_node(), "out", "bfloat16"))


@torch.library.custom_op("coda::norm_proj", mutates_args=())
def norm_proj(y: torch.Tensor, w: torch.Tensor, ss: torch.Tensor, eps: float) -> torch.Tensor:
    """out = r * (y @ w.T)  (M, N) bf16: RMSNorm(y; gamma) @ W.T with gamma folded into w.

    y: (M, d) bf16; w: (N, d) bf16; ss: (M, T) fp32; d and N multiples of 8.
    """
    check_norm_input(OP, y, w, ss, eps)
    return E.run(norm_proj_tree(), y, w.t(), norm_inputs(y.shape[1], ss, eps), op=OP)["out"]


@norm_proj.register_fake
def _fake(y, w, ss, eps):
    m, n, _ = check_norm_input(OP, y, w, ss, eps)
    return y.new_empty((m, n))


@norm_proj.register_kernel("cpu")
def _cpu(y, w, ss, eps):
    dispatch.require_reference(OP)
    check_norm_input(OP, y, w, ss, eps)
    return norm_proj_ref(y, w, ss, eps)


def _setup(ctx, inputs, output):
    y, w, ss, eps = inputs
    ctx.save_for_backward(y, w, ss, output)
    ctx.eps = eps


def _backward(ctx, dout):
    y, w, ss, out = ctx.saved_tensors
    r = rms_rstd_ref(ss, y.shape[1], ctx.eps).unsqueeze(1)
    g = (dout.float() * r).to(y.dtype)
    zdz = (dout.float() * out.float()).sum(1, keepdim=True)
    dy = norm_backward(g, w, y, ss, zdz, ctx.eps) if ctx.needs_input_grad[0] else None
    dw = gemm_op(g.t(), y) if ctx.needs_input_grad[1] else None
    return dy, dw, None, None


norm_proj.register_autograd(_backward, setup_context=_setup)


# torch.autocast: activations and weights in bf16 (ops.autocast)
bf16_under_autocast("coda::norm_proj", (0, 1))


# Python callers skip the dispatcher where nothing needs it (ops.eager)
norm_proj = direct(norm_proj)
