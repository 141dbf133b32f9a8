"""A Llama block's attention sublayer as one autograd op (``coda.attention_block``), and the
attention core it runs (``coda.attention_forward`` / ``coda.attention_backward``: causal
scaled-dot-product attention with grouped KV heads, on the kernel ``scaled_dot_product_attention``
would pick: cuDNN's or flash's).

Forward (gamma folded into w_qkv by the caller):

    qkv        = coda.norm_rope_qkv(x, w_qkv, ss, ...)       RMSNorm + QKV + (QK-norm) + RoPE
    q, k, v    = views of qkv as (B, heads, S, head_dim)       no copies
    o, lse     = attention core (causal, GQA)
    y, ss_y    = coda.residual_gemm_norm_stats(o, w_o, x)    out-proj + residual + norm stats

Backward from dy = dL/dy (four GEMMs of ours, the attention core's backward, one pass of the
RoPE backward kernel):

    do          = dy @ w_o                 out-proj dgrad;   dw_o = dy^T @ o
    dq, dk, dv  = attention core backward
    g, zdz      = coda.rope_backward(dq, dk, dv, qkv, r, ...)   (+ the QK-norm weight gradients)
    dw_qkv      = g^T @ x
    dx          = coda.norm_backward(g, w_qkv, x, ss, zdz, residual_grad=dy)
                                           QKV dgrad + RMSNorm backward + the residual's gradient

Saved: x, ss, qkv (the attention core keeps q, k, v anyway: they are views of it), o, lse and,
with QK-norm, the pre-norm values ``pre`` (M x N bf16).
"""

from __future__ import annotations

import functools
from .eager import direct
from .autocast import bf16_under_autocast
from typing import Optional

import torch

from .. import dispatch
from ..reference import (attention_backward_ref, attention_ref, norm_rope_qkv_ref,
                         residual_gemm_norm_stats_ref, rms_rstd_ref)
from .checks import BF16, F32, check_same_device, check_tensor
from .qkv import check_qkv, norm_rope_qkv_impl, qkv_backward
from .residual import residual_backward, residual_impl, stats_tile_n

OP = "coda.attention_block"
OP_FWD = "coda.attention_forward"
OP_BWD = "coda.attention_backward"


def qkv_heads(qkv: torch.Tensor, batch: int, n_heads: int, n_kv_heads: int, head_dim: int):
    """q (B, H, S, hd), k, v (B, Hkv, S, hd): views of qkv (B * S, (H + 2 Hkv) hd)."""
    heads = qkv.view(batch, -1, n_heads + 2 * n_kv_heads, head_dim).transpose(1, 2)
    return heads.split([n_heads, n_kv_heads, n_kv_heads], dim=1)


def heads_to_rows(o: torch.Tensor) -> torch.Tensor:
    """(B, H, S, hd) -> (B * S, H * hd); a view when o is laid out (B, S, H, hd) in memory, as
    the attention core writes it."""
    b, h, s, hd = o.shape
    return o.transpose(1, 2).reshape(b * s, h * hd)


# -- the attention core ---------------------------------------------------------------------------
def check_core(op: str, q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dtype != BF16 or t.dim() != 4:
            raise TypeError(f"{op}: {name} must be a 4-D bf16 tensor (batch, heads, seq, head_dim)")
        if t.stride(3) != 1:
            raise ValueError(f"{op}: {name} must be contiguous along head_dim, got strides {tuple(t.stride())}")
    if k.shape != v.shape or (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(f"{op}: k and v must be (B, Hkv, S, hd) with q's B, S, hd; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{op}: q's heads ({q.shape[1]}) must be a multiple of k's ({k.shape[1]})")
    check_same_device(op, q=q, k=k, v=v)


#: ``scaled_dot_product_attention``'s backend numbers (``torch.nn.attention.SDPBackend``)
FLASH, CUDNN = 1, 3


@functools.lru_cache(maxsize=None)
def _backend_for(head_dim: int, groups: int, deterministic: bool, flags: tuple = ()) -> int:
    """The backend ``scaled_dot_product_attention`` picks for causal bf16 attention with this
    head_dim and GQA group size on the current GPU (cuDNN on an H200 with torch 2.11: 0.64 ms
    against flash's 0.99 ms at 4 x 32 x 4096 x 64), flash where it picks neither or without
    a GPU. Cached per (head_dim, groups, deterministic, ``flags``: the current device and torch's
    SDPA backend switches): the probe allocates and asks torch on every call otherwise."""
    if not torch.cuda.is_available():
        return FLASH
    q = torch.empty(1, groups, 128, head_dim, dtype=BF16, device="cuda")
    k = torch.empty(1, 1, 128, head_dim, dtype=BF16, device="cuda")
    choice = int(torch._fused_sdp_choice(q, k, k, None, 0.0, True, enable_gqa=True))
    return CUDNN if choice == CUDNN else FLASH


def _backend(q, k) -> int:
    flags = ()
    if torch.cuda.is_available():
        b = torch.backends.cuda
        flags = (torch.cuda.current_device(), b.cudnn_sdp_enabled(), b.flash_sdp_enabled())
    return _backend_for(int(q.shape[3]), int(q.shape[1] // k.shape[1]),
                        torch.are_deterministic_algorithms_enabled(), flags)


# The ops' outputs must not depend on the backend: the backend is process state (the SDPA
# switches, the deterministic flag) that no traced graph and no inductor cache key holds, so a
# graph traced under one backend and run under the other would meet tensors of other shapes.
# Both kernels' log-sum-exp is the same quantity (natural log, of the scaled scores), which
# they return as (B, H, S, 1) (cuDNN) or (B, H, S) (flash); the ops carry it as (B, H, S),
# and each backward takes it from either forward. Without dropout the kernels' random-number
# state is never read: the backward passes placeholders of the form each kernel takes.
def _no_rng_state(backend: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Placeholders for the kernel's random-number state, unread without dropout (uninitialized:
    no launch)."""
    if backend == CUDNN:  # philox seed and offset
        return (torch.empty((), dtype=torch.int64, device=device),) * 2
    return (torch.empty(2, dtype=torch.uint64, device=device),  # flash's rng_state, unused slot
            torch.empty((), dtype=torch.uint64, device=device))


def _core(q, k, v, backend: int):
    """(o, lse (B, H, S) fp32) of the backend's aten op."""
    b, h, s, _ = q.shape
    if backend == CUDNN:
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)
    else:
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)
    return out[0], out[1].reshape(b, h, s)


@torch.library.custom_op("coda::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention with GQA: o = softmax(q k^T / sqrt(hd) + causal mask) v per head, k and v
    heads shared by n_heads / n_kv_heads query heads. q: (B, H, S, hd), k, v: (B, Hkv, S, hd)
    bf16, head_dim contiguous. Returns o (B, H, S, hd), in q's dimension order, and
    lse (B, H, S) fp32 contiguous: log sum_j exp(q_i k_j / sqrt(hd)) over the unmasked j, what
    the backward takes back. Both are the same shapes and layouts whichever kernel ran."""
    check_core(OP_FWD, q, k, v)
    return _core(q, k, v, _backend(q, k))


@attention_forward.register_fake
def _core_fake(q, k, v):
    check_core(OP_FWD, q, k, v)
    return _core(q, k, v, FLASH)  # the aten op's meta implementation: both backends' layout


@attention_forward.register_kernel("cpu")
def _core_cpu(q, k, v):
    dispatch.require_reference(OP_FWD)
    check_core(OP_FWD, q, k, v)
    o, lse = attention_ref(q, k, v)
    return _like(q, o), lse.reshape(q.shape[:3]).contiguous()


def _like(layout: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` in a tensor laid out like ``layout`` (``torch.empty_like``'s dimension order)."""
    return torch.empty_like(layout).copy_(values)


def check_core_backward(op: str, do, q, k, v, o, lse):
    """:func:`check_core` and what the backward takes besides: do (the output gradient) and o
    (the forward's output) (B, H, S, hd) bf16 like q, contiguous along head_dim (one rule for
    both backends: either would otherwise re-lay them out, a copy); lse the forward's (B, H, S)
    fp32 log-sum-exp, contiguous; all on q's device."""
    check_core(op, q, k, v)
    for name, t in (("do", do), ("o", o)):
        if not isinstance(t, torch.Tensor) or t.dtype != BF16 or t.dim() != 4:
            raise TypeError(f"{op}: {name} must be a 4-D bf16 tensor (batch, heads, seq, head_dim), got "
                            f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        if t.shape != q.shape:
            raise ValueError(f"{op}: {name} must be (B, H, S, hd) like q, {tuple(q.shape)}, got {tuple(t.shape)}")
        if t.stride(3) != 1:
            raise ValueError(f"{op}: {name} must be contiguous along head_dim, got strides {tuple(t.stride())}")
    if not isinstance(lse, torch.Tensor) or lse.dtype != F32:
        raise TypeError(f"{op}: lse must be a float32 tensor (the forward's log-sum-exp), got "
                        f"{getattr(lse, 'dtype', type(lse).__name__)}")
    if tuple(lse.shape) != tuple(q.shape[:3]):
        raise ValueError(f"{op}: lse must be the forward's log-sum-exp, (B, H, S) = {tuple(q.shape[:3])}, "
                         f"got {tuple(lse.shape)}")
    if not lse.is_contiguous():
        raise ValueError(f"{op}: lse must be contiguous (the kernels read it densely), got strides "
                         f"{tuple(lse.stride())}")
    check_same_device(op, q=q, do=do, o=o, lse=lse)


@torch.library.custom_op("coda::attention_backward", mutates_args=())
def attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`attention_forward`'s o for the output gradient ``do`` (B, H, S, hd)
    bf16; o and lse as the forward returned them (:func:`check_core_backward`), from either
    backend: this one runs the backend the SDPA switches pick now."""
    check_core_backward(OP_BWD, do, q, k, v, o, lse)
    s = q.shape[2]
    backend = _backend(q, k)
    rng_a, rng_b = _no_rng_state(backend, q.device)
    if backend == CUDNN:
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, o, lse.unsqueeze(-1), rng_a, rng_b, None, None, None, s, s, 0.0, True)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do, q, k, v, o, lse, None, None, s, s, 0.0, True, rng_a, rng_b)


@attention_backward.register_fake
def _core_bwd_fake(do, q, k, v, o, lse):
    check_core_backward(OP_BWD, do, q, k, v, o, lse)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@attention_backward.register_kernel("cpu")
def _core_bwd_cpu(do, q, k, v, o, lse):
    dispatch.require_reference(OP_BWD)
    check_core_backward(OP_BWD, do, q, k, v, o, lse)
    return tuple(_like(t, g) for t, g in zip((q, k, v), attention_backward_ref(do, q, k, v)))


# -- the sublayer -----------------------------------------------------------------------------------
def check_attention_block(x, ss, w_qkv, w_o, positions, inv_freq, eps, n_heads, n_kv_heads,
                          head_dim, q_norm_w, k_norm_w, qk_eps, op: str = OP):
    check_tensor(op, "x", x, 3, (BF16,), aligned=True)
    b, s, d = x.shape
    if b * s == 0:  # its heads' reshapes and the RoPE backward need a token
        raise ValueError(f"{op}: x must hold at least one token, got shape {tuple(x.shape)}")
    x2 = x.view(b * s, d)
    check_qkv(x2, w_qkv, ss, eps, positions, inv_freq, n_heads, n_kv_heads, head_dim, q_norm_w,
              k_norm_w, qk_eps, op=op, y_name="x")
    check_tensor(op, "w_o", w_o, 2, (BF16,), aligned=True)
    if tuple(w_o.shape) != (d, n_heads * head_dim):
        raise ValueError(f"{op}: w_o must be (d, n_heads * head_dim) = {(d, n_heads * head_dim)} "
                         f"(nn.Linear: out x in), got {tuple(w_o.shape)}")
    check_same_device(op, x=x, w_o=w_o)
    return b, s, d


@torch.library.custom_op("coda::attention_block", mutates_args=())
def attention_block(x: torch.Tensor, ss: torch.Tensor, w_qkv: torch.Tensor, w_o: torch.Tensor,
                    positions: torch.Tensor, inv_freq: torch.Tensor, eps: float, n_heads: int,
                    n_kv_heads: int, head_dim: int, q_norm_w: Optional[torch.Tensor] = None,
                    k_norm_w: Optional[torch.Tensor] = None, qk_eps: float = 1e-6
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                               torch.Tensor]:
    """y = x + Attention(RMSNorm(x; gamma)) @ W_o.T: norm, QKV, RoPE, causal GQA attention,
    out-proj and residual (module docstring).

    x: (B, S, d) bf16 residual stream; ss: (B * S, T) fp32 its norm statistics; w_qkv, positions
    ((B * S,) int32/int64, restarting per sequence as the caller wants), inv_freq, q_norm_w,
    k_norm_w, qk_eps as for ``coda.norm_rope_qkv``; w_o: (d, n_heads * head_dim) bf16.
    Returns (y (B, S, d), ss_y (B * S, T2) its norm statistics, then what the backward keeps:
    qkv, o, lse and pre (the pre-QK-norm values, empty without QK-norm)); only y carries a
    gradient.
    """
    b, s, d = check_attention_block(x, ss, w_qkv, w_o, positions, inv_freq, eps, n_heads,
                                    n_kv_heads, head_dim, q_norm_w, k_norm_w, qk_eps)
    x2 = x.view(b * s, d)
    qkv, pre = norm_rope_qkv_impl(x2, w_qkv, ss, eps, positions, inv_freq, n_heads, n_kv_heads,
                                  head_dim, q_norm_w, k_norm_w, qk_eps, store_pre=q_norm_w is not None)
    q, k, v = qkv_heads(qkv, b, n_heads, n_kv_heads, head_dim)
    o, lse = attention_forward(q, k, v)
    y, ss_y = residual_impl(heads_to_rows(o), w_o, x2)
    pre = pre if pre is not None else qkv.new_empty((0,))
    return y.view(b, s, d), ss_y, qkv, o, lse, pre


@attention_block.register_fake
def _fake(x, ss, w_qkv, w_o, positions, inv_freq, eps, n_heads, n_kv_heads, head_dim,
          q_norm_w=None, k_norm_w=None, qk_eps=1e-6):
    b, s, d = check_attention_block(x, ss, w_qkv, w_o, positions, inv_freq, eps, n_heads,
                                    n_kv_heads, head_dim, q_norm_w, k_norm_w, qk_eps)
    m, n = b * s, w_qkv.shape[0]
    qkv = x.new_empty((m, n))
    q, k, v = qkv_heads(qkv, b, n_heads, n_kv_heads, head_dim)
    o, lse = _core_fake(q, k, v)
    o2 = x.new_empty((m, n_heads * head_dim))
    t = -(-d // stats_tile_n(o2, w_o))
    pre = x.new_empty((m, n) if q_norm_w is not None else (0,))
    return x.new_empty(x.shape), x.new_empty((m, t), dtype=F32), qkv, o, lse, pre


@attention_block.register_kernel("cpu")
def _cpu(x, ss, w_qkv, w_o, positions, inv_freq, eps, n_heads, n_kv_heads, head_dim,
         q_norm_w=None, k_norm_w=None, qk_eps=1e-6):
    dispatch.require_reference(OP)
    b, s, d = check_attention_block(x, ss, w_qkv, w_o, positions, inv_freq, eps, n_heads,
                                    n_kv_heads, head_dim, q_norm_w, k_norm_w, qk_eps)
    x2 = x.view(b * s, d)
    qkv = norm_rope_qkv_ref(x2, w_qkv, ss, eps, positions, inv_freq, n_heads, n_kv_heads, head_dim,
                            q_norm_w, k_norm_w, qk_eps)
    pre = qkv.new_empty((0,))
    if q_norm_w is not None:
        r = rms_rstd_ref(ss, d, eps).unsqueeze(1)
        pre = (r * (x2.float() @ w_qkv.float().t())).to(x.dtype)
    q, k, v = qkv_heads(qkv, b, n_heads, n_kv_heads, head_dim)
    o, lse = _core_cpu(q, k, v)
    o2 = heads_to_rows(o)
    y, ss_y = residual_gemm_norm_stats_ref(o2, w_o, x2, stats_tile_n(o2, w_o))
    return y.view(b, s, d), ss_y, qkv, o, lse, pre


def _setup(ctx, inputs, output):
    x, ss, w_qkv, w_o, positions, inv_freq, eps, h, hkv, hd, qn, kn, qk_eps = inputs
    _, _, qkv, o, lse, pre = output
    ctx.save_for_backward(x, ss, w_qkv, w_o, positions, inv_freq, qn, kn, qkv, o, lse, pre)
    ctx.args = (eps, h, hkv, hd, qk_eps)
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # no zero tensors for the outputs without a gradient


def _backward(ctx, dy, *_):
    x, ss, w_qkv, w_o, positions, inv_freq, qn, kn, qkv, o, lse, pre = ctx.saved_tensors
    if dy is None:
        return (None,) * 13
    eps, h, hkv, hd, qk_eps = ctx.args
    n = ctx.needs_input_grad
    b, s, d = x.shape
    x2 = x.view(b * s, d)
    dy2 = dy.reshape(b * s, d).contiguous()
    do, dw_o, _ = residual_backward(heads_to_rows(o), w_o, dy2, (True, n[3], False))
    q, k, v = qkv_heads(qkv, b, h, hkv, hd)
    dq, dk, dv = attention_backward(do.view(b, s, h, hd).transpose(1, 2), q, k, v, o, lse)
    dx, dw_qkv, dqn, dkn = qkv_backward(x2, w_qkv, ss, eps, positions, inv_freq, qkv, dq, dk, dv,
                                        pre if qn is not None else None, qn, kn, qk_eps,
                                        residual_grad=dy2, needs=(n[0], n[2]))
    dx = dx.view(b, s, d) if dx is not None else None
    return dx, None, dw_qkv, dw_o, None, None, None, None, None, None, dqn, dkn, None


attention_block.register_autograd(_backward, setup_context=_setup)


# torch.autocast: activations and weights in bf16 (ops.autocast)
bf16_under_autocast("coda::attention_block", (0, 2, 3, 10, 11))


# Python callers skip the dispatcher where nothing needs it (ops.eager)
attention_forward = direct(attention_forward)
attention_backward = direct(attention_backward)
attention_block = direct(attention_block)
