"""SwiGLU on the CODA ops: the RMSNorm-scaled gate/up projection with SwiGLU in its epilogue
(``coda.norm_swiglu``) and the SwiGLU backward in the epilogue of the down-proj dgrad
(``coda.swiglu_backward``).

Forward, gate/up rows of W_gu interleaved [g0, u0, g1, u1, ...] (coda-math 2.2):

    z = r * (y @ W_gu'.T)      (M, 2f), the pre-activation, pairs (g_j, u_j) = (z_2j, z_2j+1)
    h_j = silu(g_j) * u_j      (M, f)

Backward (coda-math 3.2), from the saved z and the gradient dh of h:

    dg = dh u sigma(g) (1 + g (1 - sigma(g))),   du = dh silu(g)
    dz' = r * [dg, du] (interleaved, the form both consumers take: the gate/up dgrad
    dz' @ W_gu' and wgrad dz'^T @ y), zdz = per-tile sum_j (g dg + u du) (the RMSNorm backward
    statistic, :mod:`coda_cute.ops.rmsnorm`), and h recomputed for the down-proj's wgrad.

In a Llama block dh = dy @ W_down is the down-proj's dgrad: ``swiglu_backward`` is that GEMM,
with every value above computed in its epilogue from the tile of z it loads (each output
column j reads the pair (g_j, u_j) and writes the pair (dg_j, du_j): a wide tile and a
double-width store of the epilogue vocabulary).
"""

from __future__ import annotations

import functools

import torch

from .gemm import gemm_op
from .autocast import bf16_under_autocast
from .eager import direct
from .. import dispatch
from .. import epilogue as E
from ..reference import norm_swiglu_ref, rms_rstd_ref, swiglu_backward_ref, swiglu_grad_ref
from .checks import (BF16, F32, check_aligned, check_dgrad, check_eps, check_norm_input, check_norm_width,
                     check_same_device, check_shape, check_stats, check_tensor)
from .rmsnorm import norm_backward, norm_inputs, rstd_node, tile_n_of

OP = "coda.norm_swiglu"
OP_BWD = "coda.swiglu_backward"


@functools.lru_cache(maxsize=None)
def norm_swiglu_tree() -> E.Epilogue:
    z = E.acc() * rstd_node()
    return E.Epilogue(E.store(z, "z", "bfloat16"),
                      E.store(E.pairwise(lambda g, u: E.silu(g) * u, z), "h", "bfloat16"))


def check_swiglu(y, w_gu, ss, eps, op=OP):
    """``op``: the op whose arguments these are (errors name it)."""
    m, n, d = check_norm_input(op, y, w_gu, ss, eps, w_name="w_gu")
    check_aligned(op, "the SwiGLU width f (rows of w_gu / 2)", n // 2)
    return m, n


def norm_swiglu_impl(y, w_gu, ss, eps):
    out = E.run(norm_swiglu_tree(), y, w_gu.t(), norm_inputs(y.shape[1], ss, eps), op=OP)
    return out["z"], out["h"]


@torch.library.custom_op("coda::norm_swiglu", mutates_args=())
def norm_swiglu(y: torch.Tensor, w_gu: torch.Tensor, ss: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm-scaled gate/up projection with SwiGLU, in one GEMM.

        r_m = (sum_t ss[m, t] / d + eps)^(-1/2)
        z = r * (y @ w_gu.T)                      (M, 2f) bf16, the pre-activation (for backward)
        h_j = silu(z_2j) * z_2j+1                 (M, f) bf16, from the unrounded z

    y: (M, d) bf16; w_gu: (2f, d) bf16 with rows interleaved [g0, u0, g1, u1, ...]
    (``coda_cute.nn.convert.interleave_gate_up``) and gamma folded in; ss: (M, T) fp32 partials
    of y; d and f multiples of 8. Backward: dy through the RMSNorm (ss carries no gradient) and
    dw_gu, on our GEMMs (:func:`swiglu_grad` + ``coda.norm_backward``).
    """
    check_swiglu(y, w_gu, ss, eps)
    return norm_swiglu_impl(y, w_gu, ss, eps)


@norm_swiglu.register_fake
def _fake(y, w_gu, ss, eps):
    m, n = check_swiglu(y, w_gu, ss, eps)
    return y.new_empty((m, n)), y.new_empty((m, n // 2))


@norm_swiglu.register_kernel("cpu")
def _cpu(y, w_gu, ss, eps):
    dispatch.require_reference(OP)
    check_swiglu(y, w_gu, ss, eps)
    return norm_swiglu_ref(y, w_gu, ss, eps)


def swiglu_grad(z, dh, r):
    """dz' = r * [dg, du] (bf16, interleaved) and zdz = sum_j (g dg + u du) (M, 1) fp32, with
    torch elementwise math: the standalone op's backward, where no GEMM produces dh."""
    g, u, dg, du = swiglu_grad_ref(z, dh)
    zdz = (g * dg + u * du).sum(1, keepdim=True)
    return (torch.stack((dg, du), -1).flatten(-2) * r.unsqueeze(1)).to(z.dtype), zdz


def _setup(ctx, inputs, output):
    y, w_gu, ss, eps = inputs
    ctx.save_for_backward(y, w_gu, ss, output[0])
    ctx.eps = eps


def _backward(ctx, dz, dh):
    """z's own gradient (if z was used) adds to the SwiGLU one: z = r * acc, so dz' gains r dz
    and zdz gains z dz."""
    y, w_gu, ss, z = ctx.saved_tensors
    r = rms_rstd_ref(ss, y.shape[1], ctx.eps)
    dzp, zdz = swiglu_grad(z, dh, r)
    if dz is not None:
        dzp = (dzp.float() + dz.float() * r.unsqueeze(1)).to(z.dtype)
        zdz = zdz + (z.float() * dz.float()).sum(1, keepdim=True)
    dy = norm_backward(dzp, w_gu, y, ss, zdz, ctx.eps) if ctx.needs_input_grad[0] else None
    dw = gemm_op(dzp.t(), y) if ctx.needs_input_grad[1] else None
    return dy, dw, None, None


norm_swiglu.register_autograd(_backward, setup_context=_setup)


# == the down-proj dgrad with the SwiGLU backward in its epilogue ================================
@functools.lru_cache(maxsize=None)
def swiglu_backward_tree(recompute_h: bool = True) -> E.Epilogue:
    """The down-proj dgrad's epilogue: acc = dy @ W_down = dh; (g, u) = the wide tile z at each
    output column; dz' (M, 2f), h recomputed (M, f) (for the down-proj weight gradient; without
    ``recompute_h`` where the caller kept the forward's h), zdz partials."""
    z = E.wide_tile("z")
    g = E.pairwise(lambda a, b: a, z)
    u = E.pairwise(lambda a, b: b, z)
    dh = E.acc()
    sg = E.sigmoid(g)
    silu = g * sg
    dg = dh * u * sg * (1 + g * (1 - sg))
    du = dh * silu
    h = (E.store(silu * u, "h", "bfloat16"),) if recompute_h else ()
    return E.Epilogue(E.store(E.interleave(dg, du) * rstd_node(), "dz", "bfloat16"), *h,
                      E.row_reduce(g * dg + u * du, "sum", "zdz"))


def check_swiglu_backward(dy, w_down, z, ss, eps):
    op = OP_BWD
    m, _, f = check_dgrad(op, "dy", dy, "w_down", w_down, "the model width d")
    check_norm_width(op, "columns of dy", dy.shape[1])
    check_tensor(op, "z", z, 2, (BF16,), aligned=True)
    check_shape(op, "z", z, (m, 2 * f), "the saved pre-activation (M, 2f) = ")
    check_aligned(op, "the SwiGLU width f (columns of w_down)", f)
    check_stats(op, "ss", ss, m)
    check_eps(op, "eps", eps)
    check_same_device(op, dy=dy, w_down=w_down, z=z, ss=ss)
    return m, f


@torch.library.custom_op("coda::swiglu_backward", mutates_args=())
def swiglu_backward(dy: torch.Tensor, w_down: torch.Tensor, z: torch.Tensor, ss: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The down-proj dgrad dh = dy @ w_down with the SwiGLU backward in its epilogue:

        (g_j, u_j) = (z_2j, z_2j+1);  dg = dh u sigma(g) (1 + g (1 - sigma(g))),  du = dh silu(g)
        dz' = r * [dg, du]  (M, 2f) bf16 interleaved;   h = silu(g) u  (M, f) bf16 (recomputed)
        zdz[m, t] = sum_{j in tile t} (g dg + u du)     (M, T) fp32

    dy: (M, d) bf16 (the residual stream's gradient); w_down: (d, f) bf16; z: (M, 2f) bf16, the
    saved pre-activation of ``coda.norm_swiglu``; ss: (M, T) fp32, the norm statistics that op
    consumed (r as in its forward). d and f multiples of 8. No autograd (a backward op).
    """
    check_swiglu_backward(dy, w_down, z, ss, eps)
    out = E.run(swiglu_backward_tree(), dy, w_down, dict(norm_inputs(w_down.shape[0], ss, eps), z=z),
                op=OP_BWD)
    return out["dz"], out["h"], out["zdz"]


def zdz_tile_n(dy, w_down) -> int:
    """The column-tile width of the zdz partials: that of the config the runner picks."""
    m, f, d = int(dy.shape[0]), int(w_down.shape[1]), int(w_down.shape[0])
    return tile_n_of(swiglu_backward_tree(), m, f, d, dy.device)


@swiglu_backward.register_fake
def _bwd_fake(dy, w_down, z, ss, eps):
    m, f = check_swiglu_backward(dy, w_down, z, ss, eps)
    t = -(-f // zdz_tile_n(dy, w_down))
    return z.new_empty((m, 2 * f)), z.new_empty((m, f)), z.new_empty((m, t), dtype=F32)


@swiglu_backward.register_kernel("cpu")
def _bwd_cpu(dy, w_down, z, ss, eps):
    dispatch.require_reference(OP_BWD)
    check_swiglu_backward(dy, w_down, z, ss, eps)
    return swiglu_backward_ref(dy, w_down, z, ss, eps, zdz_tile_n(dy, w_down))


# torch.autocast: activations and weights in bf16 (ops.autocast)
bf16_under_autocast("coda::norm_swiglu", (0, 1))


# Python callers skip the dispatcher where nothing needs it (ops.eager)
norm_swiglu = direct(norm_swiglu)
swiglu_backward = direct(swiglu_backward)
