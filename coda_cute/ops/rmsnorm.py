"""The RMSNorm split across GEMMs (coda-math 1, 3.1): the consumer's scale and the backward GEMM.

Forward: the GEMM that produces the residual stream y emits ``ss`` (M, T), per-tile sums of
y^2; every GEMM that consumes y finishes the row statistic in its epilogue,

    r_m = (sum_t ss[m, t] / d + eps)^(-1/2),        d = y.shape[1],

and scales its accumulator: z = r * (y @ W'.T) with W' = W * gamma[None, :] folded by the caller.
``ss`` is a statistic of y, not an independent input: the ops' gradients with respect to y
include the norm's dependence through it, and ss itself carries no gradient.

Backward: with dz = dL/dz and dz' = r * dz (the r scale is row-uniform, so one tensor serves
the consumer's dgrad and wgrad),

    dL/dy = dz' @ W' - r^2 s y,      s_m = (1/d) sum_j dz_mj z_mj,
    dL/dW' = dz'^T @ y                                        (then the gamma fold's backward).

s is not tile-local where dz' @ W' is produced, but the op that produces dz' has z and dz side
by side: it emits ``zdz``, per-tile partials of sum_j dz_mj z_mj (the SwiGLU backward epilogue,
the RoPE backward kernel, the cross-entropy gradient), which :func:`norm_backward`'s epilogue
finishes next to r. With a residual connection the epilogue also adds the incoming residual
gradient, so the residual stream's gradient is stored once, complete.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import dispatch
from .. import epilogue as E
from ..epilogue.runner import config_on
from ..reference import norm_backward_ref
from .eager import direct
from .checks import (BF16, check_aligned, check_dgrad, check_eps, check_norm_width, check_same_device, check_shape,
                     check_stats, check_tensor)

OP = "coda.norm_backward"


def rstd_node():
    """r = (sum_t ss[m, t] * inv_d + eps)^(-1/2), finished per row inside the epilogue."""
    return E.rsqrt(E.row_sum("ss") * E.scalar("inv_d") + E.scalar("eps"))


def tile_n_of(tree: E.Epilogue, m: int, n: int, k: int, device, block_scaled: bool = False, fp8: bool = False,
              fast_accum: bool = False) -> int:
    """The tile width of the config the runner picks for ``tree`` at (M, N, K) on ``device``
    (``config_on``; ``block_scaled``: the block-scaled FP8 GEMM's, ``fp8``: the plain FP8 GEMM's,
    ``fast_accum`` with fast accumulation): the width of its row-reduction partials (which the
    fake implementations must size)."""
    return _tile_n_on(tree, m, n, k, dispatch.num_sms_or_default(device), device.type, dispatch.card_of(device),
                      block_scaled, fp8, fast_accum)


@functools.lru_cache(maxsize=1024)
def _tile_n_on(tree, m, n, k, sms, device_type, card, block_scaled, fp8, fast_accum) -> int:
    return config_on(device_type, tree, m, n, k, 1, block_scaled or fp8, fast_accum, sms, block_scaled,
                     card=card).tile_n


def norm_inputs(d: int, ss, eps: float) -> dict:
    """The inputs of :func:`rstd_node` for a normalized width ``d``."""
    return {"ss": ss, "inv_d": 1.0 / d, "eps": float(eps)}


@functools.lru_cache(maxsize=None)
def norm_backward_tree(residual: bool, gamma: bool = False) -> E.Epilogue:
    """dy = [dres +] acc [* gamma] - r^2 (sum_t zdz[m, t] / d) y,  acc = dz' @ W.

    ``gamma`` (the LM head, whose norm weight is applied to the activations rather than folded
    into its V x d weight): acc is the gradient of the normalized-and-weighted input, so it is
    scaled by gamma per column, and d gamma = sum_m acc * y comes out as per-row-tile column
    partials."""
    r = rstd_node()
    s = E.row_sum("zdz") * E.scalar("inv_d")
    y = E.tile("y")
    acc = E.acc() * E.col_vec("gamma") if gamma else E.acc()
    dy = acc - (r * r * s) * y
    if residual:
        dy = dy + E.tile("dres")
    sinks = [E.store(dy, "dy", "bfloat16")]
    if gamma:
        sinks.append(E.col_reduce(E.acc() * y, "sum", "dgamma"))
    return E.Epilogue(*sinks)


def check_norm_backward(g, w, y, ss, zdz, eps, residual_grad):
    op = OP
    m, _, d = check_dgrad(op, "g", g, "w", w, "the consumer's output width N")
    check_norm_width(op, "columns of w", d)
    check_tensor(op, "y", y, 2, (BF16,), aligned=True)
    check_shape(op, "y", y, (m, d), "the consumer's input (M, d) = ")
    check_aligned(op, "the normalized width d (columns of w)", d)
    check_stats(op, "ss", ss, m)
    check_stats(op, "zdz", zdz, m)
    check_eps(op, "eps", eps)
    if residual_grad is not None:
        check_tensor(op, "residual_grad", residual_grad, 2, (BF16,), aligned=True)
        check_shape(op, "residual_grad", residual_grad, (m, d), "(M, d) = ")
    check_same_device(op, g=g, w=w, y=y, ss=ss, zdz=zdz, residual_grad=residual_grad)
    return m, d


@torch.library.custom_op("coda::norm_backward", mutates_args=())
def norm_backward(g: torch.Tensor, w: torch.Tensor, y: torch.Tensor, ss: torch.Tensor,
                  zdz: torch.Tensor, eps: float,
                  residual_grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The RMSNorm backward in the consumer's dgrad epilogue, in one GEMM:

        dy = residual_grad + g @ w - r^2 s y,   r_m = (sum_t ss / d + eps)^(-1/2),
        s_m = sum_t zdz[m, t] / d

    g: (M, N) bf16, the consumer's output gradient already scaled by r (dz' above); w: (N, d)
    bf16, the consumer's (gamma-folded) weight as stored; y: (M, d) bf16, the normalized input
    (the residual stream); ss: (M, T) fp32, y's norm statistics; zdz: (M, T') fp32 partials of
    sum_j dz_mj z_mj from the op that produced g; residual_grad: (M, d) bf16 or None. N and d
    multiples of 8. Returns dy (M, d) bf16.
    """
    check_norm_backward(g, w, y, ss, zdz, eps, residual_grad)
    inputs = dict(norm_inputs(y.shape[1], ss, eps), zdz=zdz, y=y)
    if residual_grad is not None:
        inputs["dres"] = residual_grad
    return E.run(norm_backward_tree(residual_grad is not None), g, w, inputs, op=OP)["dy"]


@norm_backward.register_fake
def _fake(g, w, y, ss, zdz, eps, residual_grad=None):
    m, d = check_norm_backward(g, w, y, ss, zdz, eps, residual_grad)
    return y.new_empty((m, d))


@norm_backward.register_kernel("cpu")
def _cpu(g, w, y, ss, zdz, eps, residual_grad=None):
    dispatch.require_reference(OP)
    check_norm_backward(g, w, y, ss, zdz, eps, residual_grad)
    return norm_backward_ref(g, w, y, ss, zdz, eps, residual_grad)


# Python callers skip the dispatcher where nothing needs it (ops.eager)
norm_backward = direct(norm_backward)
