"""The attention projection on the CODA ops: RMSNorm-scaled fused QKV with QK-norm and RoPE in
its epilogue (``coda.norm_rope_qkv``), and its backward after attention's
(``coda.rope_backward``, a bandwidth-bound kernel of ours, then ``coda.norm_backward``).

Forward, columns [Q: n_heads | K: n_kv_heads | V: n_kv_heads] x head_dim:

    x = r * (y @ W_qkv'.T);  Q/K heads: optional per-head RMSNorm (QK-norm), then each adjacent
    pair (2k, 2k+1) rotated by theta = positions[m] * inv_freq[k]; V as is.

Backward (coda-math 3.2): the attention core's dq, dk, dv are rotated back by -theta, taken
through the QK-norm (which needs the pre-norm x: the block op stores it in the forward, the
standalone op recomputes it), scaled by r, and the RMSNorm statistic zdz = sum_j z_j dz_j comes
out of the same pass (without QK-norm it is sum qkv . dqkv: the rotation is orthogonal). Then
dy = g @ W_qkv' - r^2 s y (+ the residual gradient, in the block) and dW_qkv' = g^T @ y.
"""

from __future__ import annotations

import functools
from .eager import direct
from .gemm import gemm_op
from .autocast import bf16_under_autocast
from typing import Optional

import torch

from .. import dispatch
from .. import epilogue as E
from ..elementwise import rope_backward_kernel
from ..reference import (norm_rope_qkv_ref, qk_norm_weight, rms_rstd_ref, rope_backward_ref)
from .checks import (BF16, F32, INDEX_DTYPES, check_eps, check_norm_input, check_pointer_aligned,
                     check_same_device, check_shape, check_tensor)
from .proj import norm_proj
from .rmsnorm import norm_backward, norm_inputs, rstd_node

OP = "coda.norm_rope_qkv"
OP_BWD = "coda.rope_backward"


@functools.lru_cache(maxsize=None)
def norm_rope_qkv_tree(n_qk: int, head_dim: int, qk_norm: bool, store_pre: bool = False) -> E.Epilogue:
    """x = r * acc; on the first n_qk columns (Q and K heads): optional per-head RMSNorm (a
    segment reduction over each head's head_dim columns), then the rotation of every adjacent
    pair by theta = positions[m] * inv_freq[k], k = (n mod head_dim) // 2 the pair index within
    the head:

        (a, b) -> (a cos theta - b sin theta, a sin theta + b cos theta)   (one pairwise node)

    V columns pass through. ``qk_w`` is the QK-norm weight per column (q_norm_w over the Q heads,
    k_norm_w over the K heads). ``store_pre``: also store x (the pre-QK-norm values the QK-norm
    backward needs) as output "pre".

    cos and sin are computed in the epilogue, not read from (max_pos, head_dim / 2) tables: such
    a table read is a scattered 8-row global load per pair that cost ~9 % of the GEMM at
    16384x6144x4096 (measured: 1.311 ms with table reads vs 1.208 ms computing them, plain GEMM
    1.172 ms). inv_freq (head_dim / 2 values shared by all rows) stays in L1.
    """
    r = rstd_node()
    is_qk = E.col_index() < n_qk
    if qk_norm:
        # mean((r acc)^2) = r^2 mean(acc^2) per head, and one per-element scale for both paths:
        # no r * acc in the segment pass, one multiply less per element.
        mean_sq = E.segment_reduce(E.acc(), "sumsq", head_dim) * (1.0 / head_dim) * r * r
        x = E.acc() * E.where(is_qk, r * E.rsqrt(mean_sq + E.scalar("qk_eps")) * E.col_vec("qk_w"), r)
    else:
        x = E.acc() * r
    k = E.col_index() % head_dim // 2
    # Inside the pair's body: evaluated once per pair.
    theta = E.to_float(E.row_vec("positions", "int32")) * E.lookup("inv_freq", E.const(0, "int32"), k)
    cos, sin = E.cos(theta), E.sin(theta)
    rot = E.pairwise(lambda a, b: (a * cos - b * sin, a * sin + b * cos), x)
    sinks = [E.store(E.where(is_qk, rot, x), "qkv", "bfloat16")]
    if store_pre:
        sinks.append(E.store(E.acc() * r, "pre", "bfloat16"))
    return E.Epilogue(*sinks)


@functools.lru_cache(maxsize=None)
def segment_widths() -> frozenset:
    """head_dims a QK-norm segment reduction supports: those dividing some config's tile_n."""
    tiles = {c.tile_n for c in dispatch.config_space(False)}
    return frozenset(w for w in range(8, 257, 8) if any(t % w == 0 for t in tiles))


def check_heads(op: str, n_heads: int, n_kv_heads: int, head_dim: int):
    if n_heads < 1 or n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"{op}: n_heads ({n_heads}) must be a positive multiple of n_kv_heads "
                         f"({n_kv_heads})")
    if head_dim < 8 or head_dim > 256 or head_dim % 8:
        raise ValueError(f"{op}: head_dim must be a multiple of 8 in [8, 256], got {head_dim}")


def check_rope(op: str, m: int, positions, inv_freq, head_dim: int):
    check_tensor(op, "positions", positions, 1, INDEX_DTYPES)
    if positions.shape[0] != m:
        raise ValueError(f"{op}: positions must have one entry per row ({m}), got {positions.shape[0]}")
    # 16-byte aligned: the RoPE backward kernel reads it in 16-byte vectors (assumed_align=16),
    # checked here too so that a forward whose autograd runs that backward rejects it up front
    check_tensor(op, "inv_freq", inv_freq, 1, (F32,), aligned=True)
    if inv_freq.shape[0] != head_dim // 2:
        raise ValueError(f"{op}: inv_freq must be (head_dim / 2,) = ({head_dim // 2},), got "
                         f"{tuple(inv_freq.shape)}")


def check_qk_norm(op: str, q_norm_w, k_norm_w, head_dim: int, qk_eps: float):
    if (q_norm_w is None) != (k_norm_w is None):
        raise ValueError(f"{op}: pass both q_norm_w and k_norm_w for QK-norm, or neither")
    if q_norm_w is None:
        return
    for name, t in (("q_norm_w", q_norm_w), ("k_norm_w", k_norm_w)):
        check_tensor(op, name, t, 1, (F32, BF16))
        if t.shape[0] != head_dim:
            raise ValueError(f"{op}: {name} must be ({head_dim},), got {tuple(t.shape)}")
    if int(head_dim) not in segment_widths():  # (a symbolic head_dim is specialized here)
        raise ValueError(f"{op}: QK-norm reduces each head inside one GEMM tile, so head_dim "
                         f"must divide a tile width; supported: {sorted(segment_widths())}, "
                         f"got {head_dim}")
    check_eps(op, "qk_eps", qk_eps)


def check_qkv(y, w_qkv, ss, eps, positions, inv_freq, n_heads, n_kv_heads, head_dim,
              q_norm_w, k_norm_w, qk_eps, op: str = OP, y_name: str = "y"):
    m, n, _ = check_norm_input(op, y, w_qkv, ss, eps, w_name="w_qkv", y_name=y_name)
    check_heads(op, n_heads, n_kv_heads, head_dim)
    if n != (n_heads + 2 * n_kv_heads) * head_dim:
        raise ValueError(f"{op}: w_qkv must have (n_heads + 2 n_kv_heads) * head_dim = "
                         f"{(n_heads + 2 * n_kv_heads) * head_dim} rows, got {n}")
    check_rope(op, m, positions, inv_freq, head_dim)
    check_qk_norm(op, q_norm_w, k_norm_w, head_dim, qk_eps)
    check_same_device(op, **{y_name: y}, positions=positions, inv_freq=inv_freq, q_norm_w=q_norm_w,
                      k_norm_w=k_norm_w)
    return m, n


def qkv_tree_inputs(y, ss, eps, positions, inv_freq, n_heads, n_kv_heads, head_dim,
                    q_norm_w=None, k_norm_w=None, qk_eps=1e-6) -> dict:
    """The named inputs of :func:`norm_rope_qkv_tree` for one call."""
    n_qk = (n_heads + n_kv_heads) * head_dim
    n = n_qk + n_kv_heads * head_dim
    inputs = dict(norm_inputs(y.shape[1], ss, eps), positions=positions.to(torch.int32),
                  inv_freq=inv_freq.reshape(1, -1))
    if q_norm_w is not None:
        w = qk_norm_weight(q_norm_w, k_norm_w, n_heads, n_kv_heads).float().reshape(-1)
        inputs.update(qk_w=torch.cat([w, w.new_ones(n - n_qk)]), qk_eps=float(qk_eps))
    return inputs


def norm_rope_qkv_impl(y, w_qkv, ss, eps, positions, inv_freq, n_heads, n_kv_heads, head_dim,
                       q_norm_w=None, k_norm_w=None, qk_eps=1e-6, store_pre: bool = False):
    """The op's CUDA forward: (qkv, pre) with pre None unless ``store_pre``."""
    qk_norm = q_norm_w is not None
    tree = norm_rope_qkv_tree((n_heads + n_kv_heads) * head_dim, head_dim, qk_norm, store_pre)
    inputs = qkv_tree_inputs(y, ss, eps, positions, inv_freq, n_heads, n_kv_heads, head_dim,
                             q_norm_w, k_norm_w, qk_eps)
    out = E.run(tree, y, w_qkv.t(), inputs, op=OP)
    return out["qkv"], out.get("pre")


@torch.library.custom_op("coda::norm_rope_qkv", mutates_args=())
def norm_rope_qkv(y: torch.Tensor, w_qkv: torch.Tensor, ss: torch.Tensor, eps: float,
                  positions: torch.Tensor, inv_freq: torch.Tensor, n_heads: int,
                  n_kv_heads: int, head_dim: int, q_norm_w: Optional[torch.Tensor] = None,
                  k_norm_w: Optional[torch.Tensor] = None, qk_eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm-scaled fused QKV projection with optional QK-norm and RoPE, in one GEMM.

        x = r * (y @ w_qkv.T),  columns [Q: n_heads | K: n_kv_heads | V: n_kv_heads] x head_dim
        QK-norm (optional), per Q/K head h:  x_h <- x_h * (mean(x_h^2) + qk_eps)^(-1/2) * w_norm
        RoPE on Q/K, per adjacent pair (2k, 2k+1) of each head, theta = positions[m] * inv_freq[k]:
            a' = a cos(theta) - b sin(theta),   b' = a sin(theta) + b cos(theta)
        V unchanged.  Returns qkv (M, (n_heads + 2 n_kv_heads) * head_dim) bf16.

    y: (M, d) bf16; w_qkv: ((n_heads + 2 n_kv_heads) head_dim, d) bf16, gamma folded, Q/K rows
    permuted within each head to the adjacent-pair convention (``coda_cute.nn.convert.fuse_qkv``);
    ss: (M, T) fp32; positions: (M,) int32/int64; inv_freq: (head_dim / 2,) fp32, the rotary
    frequencies with any scaling applied (``coda_cute.reference.rope_inv_freq``); q_norm_w,
    k_norm_w: (head_dim,) fp32 or bf16, both or neither, in the permuted order too. head_dim a
    multiple of 8 (with QK-norm: dividing a GEMM tile width, 8...256); n_heads a multiple of
    n_kv_heads.

    theta is the fp32 product positions[m] * inv_freq[k], as in the reference and HF; cos and
    sin of it are computed in the epilogue (the hardware approximations after an exact reduction
    into [-pi, pi], ~1e-6 absolute for |theta| < 4e5) rather than read from tables.
    """
    check_qkv(y, w_qkv, ss, eps, positions, inv_freq, n_heads, n_kv_heads, head_dim, q_norm_w,
              k_norm_w, qk_eps)
    return norm_rope_qkv_impl(y, w_qkv, ss, eps, positions, inv_freq, n_heads, n_kv_heads,
                              head_dim, q_norm_w, k_norm_w, qk_eps)[0]


@norm_rope_qkv.register_fake
def _fake(y, w_qkv, ss, eps, positions, inv_freq, n_heads, n_kv_heads, head_dim,
          q_norm_w=None, k_norm_w=None, qk_eps=1e-6):
    m, n = check_qkv(y, w_qkv, ss, eps, positions, inv_freq, n_heads, n_kv_heads, head_dim,
                     q_norm_w, k_norm_w, qk_eps)
    return y.new_empty((m, n))


@norm_rope_qkv.register_kernel("cpu")
def _cpu(y, w_qkv, ss, eps, positions, inv_freq, n_heads, n_kv_heads, head_dim,
         q_norm_w=None, k_norm_w=None, qk_eps=1e-6):
    dispatch.require_reference(OP)
    args = (y, w_qkv, ss, eps, positions, inv_freq, n_heads, n_kv_heads, head_dim, q_norm_w,
            k_norm_w, qk_eps)
    check_qkv(*args)
    return norm_rope_qkv_ref(*args)


def pre_norm_values(y, w_qkv, ss, eps):
    """x = r * (y @ w_qkv.T), the standalone op's pre-QK-norm values for its backward (the block
    op stores them in its forward instead)."""
    return norm_proj(y, w_qkv, ss, eps)


def qkv_backward(y, w_qkv, ss, eps, positions, inv_freq, qkv, dq, dk, dv, pre, q_norm_w, k_norm_w,
                 qk_eps, residual_grad=None, needs=(True, True)):
    """(dy, dW_qkv', dq_norm_w, dk_norm_w) from the attention core's dq, dk, dv ((B, heads, S,
    head_dim)): ``coda.rope_backward``, then ``coda.norm_backward`` (adding ``residual_grad``)
    and the wgrad, on our kernels."""
    r = rms_rstd_ref(ss, y.shape[1], eps)
    g, zdz, dqn, dkn = rope_backward(dq, dk, dv, qkv, r, positions, inv_freq, pre, q_norm_w,
                                     k_norm_w, qk_eps)
    dy = norm_backward(g, w_qkv, y, ss, zdz, eps, residual_grad) if needs[0] else None
    dw = gemm_op(g.t(), y) if needs[1] else None
    if q_norm_w is None:
        dqn = dkn = None
    return dy, dw, dqn, dkn


def _setup(ctx, inputs, output):
    y, w, ss, eps, positions, inv_freq, h, hkv, hd, qn, kn, qk_eps = inputs
    ctx.save_for_backward(y, w, ss, positions, inv_freq, qn, kn, output)
    ctx.args = (eps, h, hkv, hd, qk_eps)


def _backward(ctx, dqkv):
    y, w, ss, positions, inv_freq, qn, kn, qkv = ctx.saved_tensors
    eps, h, hkv, hd, qk_eps = ctx.args
    pre = pre_norm_values(y, w, ss, eps) if qn is not None else None
    # The standalone op's gradient comes as one (M, N) tensor: view its heads as the attention
    # core would hand them over, (1, heads, M, head_dim).
    heads = dqkv.contiguous().view(1, dqkv.shape[0], -1, hd).transpose(1, 2)
    dq, dk, dv = heads.split([h, hkv, hkv], dim=1)
    dy, dw, dqn, dkn = qkv_backward(y, w, ss, eps, positions, inv_freq, qkv, dq, dk, dv, pre, qn, kn,
                                    qk_eps, needs=ctx.needs_input_grad[:2])
    return dy, dw, None, None, None, None, None, None, None, dqn, dkn, None


norm_rope_qkv.register_autograd(_backward, setup_context=_setup)


# == the RoPE (+ QK-norm) backward =================================================================
def check_rope_backward(dq, dk, dv, qkv, rstd, positions, inv_freq, pre, q_norm_w, k_norm_w, qk_eps):
    op = OP_BWD
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        if not isinstance(t, torch.Tensor) or t.dtype != BF16 or t.dim() != 4:
            raise TypeError(f"{op}: {name} must be a 4-D bf16 tensor (batch, heads, seq, head_dim)")
        if t.stride(3) != 1 or any(st % 8 for st in t.stride()[:3]):
            raise ValueError(f"{op}: {name} must have a contiguous head_dim and other strides in "
                             f"multiples of 8 elements (16-byte vectors), got strides {tuple(t.stride())}")
        check_pointer_aligned(t, name, op)  # the kernel's 16-byte vector loads (assumed_align=16)
    b, h, s, hd = dq.shape
    hkv = dk.shape[1]
    for name, t in (("dk", dk), ("dv", dv)):
        if (t.shape[0], t.shape[2], t.shape[3]) != (b, s, hd) or t.shape[1] != hkv:
            raise ValueError(f"{op}: {name} must be ({b}, {hkv}, {s}, {hd}) like dk, got {tuple(t.shape)}")
    check_heads(op, h, hkv, hd)
    m, n = b * s, (h + 2 * hkv) * hd
    check_tensor(op, "qkv", qkv, 2, (BF16,), aligned=True)
    check_shape(op, "qkv", qkv, (m, n), "the forward output (B * S, (H + 2 Hkv) head_dim) = ")
    check_tensor(op, "rstd", rstd, 1, (F32,))
    check_shape(op, "rstd", rstd, (m,), "one per row ")
    check_rope(op, m, positions, inv_freq, hd)
    check_qk_norm(op, q_norm_w, k_norm_w, hd, qk_eps)
    if (pre is None) != (q_norm_w is None):
        raise ValueError(f"{op}: pre (the pre-QK-norm values) goes with q_norm_w / k_norm_w")
    if pre is not None:
        check_tensor(op, "pre", pre, 2, (BF16,), aligned=True)
        check_shape(op, "pre", pre, (m, n), "like qkv ")
    check_same_device(op, dq=dq, dk=dk, dv=dv, qkv=qkv, rstd=rstd, positions=positions,
                      inv_freq=inv_freq, pre=pre, q_norm_w=q_norm_w, k_norm_w=k_norm_w)
    return m, n, hd


@torch.library.custom_op("coda::rope_backward", mutates_args=())
def rope_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, qkv: torch.Tensor,
                  rstd: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                  pre: Optional[torch.Tensor] = None, q_norm_w: Optional[torch.Tensor] = None,
                  k_norm_w: Optional[torch.Tensor] = None,
                  qk_eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradient of ``norm_rope_qkv``'s r-scaled pre-rotation (pre-QK-norm) values:

        g = r * dz (M, N) bf16,  zdz = sum_j z_j dz_j (M, 1) fp32, dq_norm_w, dk_norm_w (head_dim,)

    (``coda_cute.reference.rope_backward_ref`` spells the math out.) dq: (B, H, S, head_dim),
    dk, dv: (B, Hkv, S, head_dim) bf16 from the attention core's backward, any strides with a
    contiguous head_dim; qkv: (B * S, N) bf16, the forward output; rstd: (B * S,) fp32 the norm's
    r; positions, inv_freq as in the forward; with QK-norm, pre (B * S, N) bf16 the forward's
    pre-norm values, q_norm_w, k_norm_w and qk_eps. Without QK-norm the two weight gradients are
    empty tensors. One pass of a bandwidth-bound kernel of ours on CUDA.
    """
    m, n, hd = check_rope_backward(dq, dk, dv, qkv, rstd, positions, inv_freq, pre, q_norm_w,
                                   k_norm_w, qk_eps)
    q_w = k_w = None
    if pre is not None:  # the kernel reads both weights as they are, in one dtype
        wdt = q_norm_w.dtype if q_norm_w.dtype == k_norm_w.dtype else F32
        q_w, k_w = q_norm_w.to(wdt).contiguous(), k_norm_w.to(wdt).contiguous()
    g, zdz, dws = rope_backward_kernel(dq, dk, dv, qkv, rstd, positions.to(torch.int32), inv_freq,
                                       pre, q_w, k_w, qk_eps)
    if dws is None:
        return g, zdz, qkv.new_empty((0,), dtype=F32), qkv.new_empty((0,), dtype=F32)
    # in the weights' dtype already, unless they differ (then fp32 from the kernel)
    return g, zdz, dws[0].to(q_norm_w.dtype), dws[1].to(k_norm_w.dtype)


@rope_backward.register_fake
def _rope_fake(dq, dk, dv, qkv, rstd, positions, inv_freq, pre=None, q_norm_w=None, k_norm_w=None,
               qk_eps=1e-6):
    m, n, hd = check_rope_backward(dq, dk, dv, qkv, rstd, positions, inv_freq, pre, q_norm_w,
                                   k_norm_w, qk_eps)
    w = hd if q_norm_w is not None else 0
    return (qkv.new_empty((m, n)), qkv.new_empty((m, 1), dtype=F32),
            qkv.new_empty((w,), dtype=q_norm_w.dtype if w else F32),
            qkv.new_empty((w,), dtype=k_norm_w.dtype if w else F32))


@rope_backward.register_kernel("cpu")
def _rope_cpu(dq, dk, dv, qkv, rstd, positions, inv_freq, pre=None, q_norm_w=None, k_norm_w=None,
              qk_eps=1e-6):
    dispatch.require_reference(OP_BWD)
    check_rope_backward(dq, dk, dv, qkv, rstd, positions, inv_freq, pre, q_norm_w, k_norm_w, qk_eps)
    g, zdz, dqn, dkn = rope_backward_ref(dq, dk, dv, qkv, rstd, positions, inv_freq, pre, q_norm_w,
                                         k_norm_w, qk_eps)
    if dqn is None:
        dqn, dkn = qkv.new_empty((0,), dtype=F32), qkv.new_empty((0,), dtype=F32)
    return g, zdz, dqn, dkn


# torch.autocast: activations and weights in bf16 (ops.autocast)
bf16_under_autocast("coda::norm_rope_qkv", (0, 1, 9, 10))


# Python callers skip the dispatcher where nothing needs it (ops.eager)
norm_rope_qkv = direct(norm_rope_qkv)
rope_backward = direct(rope_backward)
