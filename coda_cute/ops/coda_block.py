"""The CODA forward ops of a pre-norm Llama block (../shared/docs/coda-math.md, section 2).

Activations are 2-D (M tokens x features), bf16, row-major; weights are stored like nn.Linear
(out_features x in_features), so every projection is ``a @ w.T``. An RMSNorm between two GEMMs is
split in two: the GEMM that produces the residual stream y emits per-tile sums of squares
``ss`` (M, T) fp32, and every GEMM that consumes y finishes the row statistic in its epilogue,

    r_m = (sum_t ss[m, t] / d + eps)^(-1/2),        d = y.shape[1],

and scales its accumulator by r. The norm weight gamma is folded into the consumer's weight by
the caller, W' = W * gamma[None, :] (see :func:`residual_gemm_norm_stats` for why), so
``op(y, W', ss) = RMSNorm(y; gamma) @ W.T`` followed by the op's pointwise math. T is whatever
the producer emitted: any (M, T) of partials whose row sums are sum_n y_mn^2 works (e.g. (M, 1)
for the embedding output).

    residual_gemm_norm_stats(a, w, residual) -> (y, ss)          out-proj / down-proj
    norm_swiglu(y, w_gu, ss, eps) -> (z, h)                       gate/up + SwiGLU
    norm_rope_qkv(y, w_qkv, ss, eps, positions, inv_freq, ...)    QKV + (QK-norm) + RoPE
    norm_proj(y, w, ss, eps) -> out                               plain r-scaled projection

(``lm_head_ce`` lives in :mod:`coda_cute.ops.lm_head_ce`.) On CUDA each op is one GEMM whose
epilogue tree is built here; on CPU tensors it raises unless ``coda_cute.reference_on_cpu()`` is
active, where it computes the :mod:`coda_cute.reference` function of the same name + ``_ref``.
Every argument rule is checked before launch (also on fake tensors). The backward of every op is
plain torch math (coda-math section 3): input gradients of the r-scaling flow into ``ss``, and the
producer's backward turns d ss into d y (= 2 y d ss), which is the RMSNorm backward by the chain
rule. Backward GEMMs take fp32 operands here (correctness first; the fused backward comes later),
except the LM head's, which stay 16-bit to keep its memory O(chunk) (see ``lm_head_ce``).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from .. import dispatch
from .. import epilogue as E
from ..epilogue.runner import choose_config
from ..reference import (
    norm_proj_ref,
    norm_rope_qkv_ref,
    norm_swiglu_ref,
    qk_norm_weight,
    residual_gemm_norm_stats_ref,
    rms_rstd_ref,
    rope_pairs_ref,
)
from .gemm import reference_on_cpu_enabled

BF16 = torch.bfloat16
F32 = torch.float32
INDEX_DTYPES = (torch.int32, torch.int64)


# -- argument checks (run on real and fake tensors) -----------------------------------------------
def check_tensor(op: str, name: str, t, dims: int, dtypes: tuple):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: {name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{op}: {name} must be {dims}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous, got strides {tuple(t.stride())}")


def check_aligned(op: str, what: str, n: int):
    if n % 8:
        raise ValueError(f"{op}: {what} = {n} must be a multiple of 8 (rows of bf16 values must "
                         "start on 16-byte boundaries for TMA)")


def check_same_device(op: str, **tensors):
    devs = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devs.values())) > 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {devs}")


def check_eps(op: str, name: str, eps: float):
    if not (eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"{op}: {name} must be a finite number >= 0, got {eps}")


def check_linear(op: str, x_name: str, x, w):
    """x (M, K) @ w.T with w stored like nn.Linear (N, K), both bf16. Returns (M, N, K)."""
    check_tensor(op, x_name, x, 2, (BF16,))
    check_tensor(op, "w", w, 2, (BF16,))
    m, k = x.shape
    n, kw = w.shape
    if kw != k:
        raise ValueError(f"{op}: w is {tuple(w.shape)} but {x_name} has {k} columns (w is stored "
                         "like nn.Linear: out_features x in_features)")
    return m, n, k


def check_norm_input(op: str, y, w, ss, eps: float, store_cols: bool = True):
    """Rules shared by the ops that consume y with its norm statistics. Returns (M, N, d)."""
    m, n, d = check_linear(op, "y", y, w)
    check_tensor(op, "ss", ss, 2, (F32,))
    if ss.shape[0] != m or ss.shape[1] < 1:
        raise ValueError(f"{op}: ss must be the (M, T) norm-stat partials of y with M = {m}, got "
                         f"shape {tuple(ss.shape)}")
    check_aligned(op, "the hidden size (columns of y)", d)
    if store_cols:
        check_aligned(op, "the output width (rows of w)", n)
    check_eps(op, "eps", eps)
    check_same_device(op, y=y, w=w, ss=ss)
    return m, n, d


def _out_of_range(t: torch.Tensor, hi: int, ignore: Optional[int]) -> torch.Tensor:
    bad = (t < 0) | (t >= hi)
    if ignore is not None:
        bad &= t != ignore
    return bad


def _range_error(op: str, name: str, t, hi: int, ignore: Optional[int]) -> ValueError:
    first = int(t[_out_of_range(t, hi, ignore)][0])
    extra = "" if ignore is None else f" (or {ignore}, the ignore_index)"
    return ValueError(f"{op}: {name} must lie in [0, {hi}){extra}; found {first}")


def check_index_range(op: str, name: str, t: torch.Tensor, hi: int, ignore: Optional[int] = None):
    """Values of ``t`` must lie in [0, hi) (or equal ``ignore``). Costs one reduction and a host
    sync; a device-side assert instead would poison the CUDA context."""
    if bool(_out_of_range(t, hi, ignore).any()):
        raise _range_error(op, name, t, hi, ignore)


class PendingIndexCheck:
    """:func:`check_index_range` without stalling the GPU: the reduction is queued now and its
    flag copied to pinned host memory; :meth:`wait` blocks only until that copy has landed (the
    work queued after it, e.g. the GEMM, keeps the GPU busy meanwhile) and raises if it failed.
    A synchronous check would leave the GPU idle between the sync and the next launch."""

    def __init__(self, op: str, name: str, t: torch.Tensor, hi: int, ignore: Optional[int] = None):
        self.args = (op, name, t, hi, ignore)
        self.flag = torch.empty((), dtype=torch.bool, pin_memory=True)
        self.flag.copy_(_out_of_range(t, hi, ignore).any(), non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()

    def wait(self):
        self.done.synchronize()
        if bool(self.flag):
            raise _range_error(*self.args)


def require_reference(op: str):
    if not reference_on_cpu_enabled():
        raise ValueError(f"{op} runs on CUDA tensors (Hopper, sm_90); got CPU tensors. Wrap the "
                         "call in coda_cute.reference_on_cpu() to use the torch reference.")


# -- shared pieces of the trees and the backward ----------------------------------------------------
def rstd_node():
    """r = (sum_t ss[m, t] * inv_d + eps)^(-1/2), finished per row inside the epilogue."""
    return E.rsqrt(E.row_sum("ss") * E.scalar("inv_d") + E.scalar("eps"))


def norm_inputs(y, ss, eps: float) -> dict:
    return {"ss": ss, "inv_d": 1.0 / y.shape[1], "eps": float(eps)}


def mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b accumulated and returned in fp32 (float64 stays float64). Two 16-bit CUDA operands
    stay 16-bit (cuBLAS with an fp32 output); anything else is upcast first."""
    if a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=F32)
    wide = torch.promote_types(torch.promote_types(a.dtype, b.dtype), F32)
    return torch.mm(a.to(wide), b.to(wide))


def norm_scale_backward(y, w, ss, eps: float, acc, dx):
    """Gradients of x = r * acc, acc = y @ w.T, r = (sum_t ss / d + eps)^(-1/2), given dx = dL/dx.

    d acc = r dx;  dy = d acc @ w;  dw = d acc^T @ y;
    dr_m = sum_n dx_mn acc_mn;  d ss[m, t] = dr_m * dr/dS = -dr_m r_m^3 / (2 d)  (every t).
    """
    d = y.shape[1]
    r = rms_rstd_ref(ss, d, eps).unsqueeze(1)
    dacc = dx * r
    dy = mm32(dacc, w).to(y.dtype)
    dw = mm32(dacc.t(), y).to(w.dtype)
    ds = (dx * acc).sum(1, keepdim=True) * (-0.5 / d) * r ** 3
    return dy, dw, ds.to(ss.dtype).expand_as(ss)


def _wide(t):
    return t.to(torch.promote_types(t.dtype, F32))


# == residual GEMM + norm statistics ===============================================================
OP_RESIDUAL = "coda.residual_gemm_norm_stats"


@functools.lru_cache(maxsize=None)
def residual_norm_stats_tree() -> E.Epilogue:
    """y = acc + residual (stored bf16); ss = per-tile sum of cast(y, bf16)^2."""
    y = E.acc() + E.tile("residual")
    return E.Epilogue(E.store(y, "y", "bfloat16"),
                      E.row_reduce(E.cast(y, "bfloat16"), "sumsq", "ss"))


def check_residual(a, w, residual):
    op = OP_RESIDUAL
    m, n, k = check_linear(op, "a", a, w)
    check_tensor(op, "residual", residual, 2, (BF16,))
    if tuple(residual.shape) != (m, n):
        raise ValueError(f"{op}: residual must be (M, N) = {(m, n)}, got {tuple(residual.shape)}")
    check_aligned(op, "the inner dimension (columns of a)", k)
    check_aligned(op, "the output width (rows of w)", n)
    check_same_device(op, a=a, w=w, residual=residual)
    return m, n, k


def stats_tile_n(a, w) -> int:
    """The column-tile width of the ss partials: that of the config the runner will pick. The
    heuristic depends on (M, N, K), so symbolic shapes are specialized here (int())."""
    (m, k), n = a.shape, w.shape[0]
    return _stats_tile_n(int(m), int(n), int(k), dispatch.num_sms_or_default(a.device))


@functools.lru_cache(maxsize=1024)
def _stats_tile_n(m: int, n: int, k: int, sms: int) -> int:
    return choose_config(residual_norm_stats_tree(), m, n, k, 1, False, False, sms).tile_n


@torch.library.custom_op("coda::residual_gemm_norm_stats", mutates_args=())
def residual_gemm_norm_stats(a: torch.Tensor, w: torch.Tensor,
                             residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The new residual stream and its RMSNorm statistics, in one GEMM (out-proj, down-proj).

        y = residual + a @ w.T                                   (M, N) bf16, stored
        ss[m, t] = sum_{n in column tile t} cast(y, bf16)[m, n]^2   (M, ceil(N / tile_n)) fp32

    a: (M, K) bf16; w: (N, K) bf16; residual: (M, N) bf16; K and N multiples of 8. tile_n is
    the tile width of the GEMM config the heuristic picks (``stats_tile_n``). The squares are
    of the stored (rounded) y, so the consumer normalizes exactly the values it reads.

    Where gamma goes (coda-math 2.1) - option B, gamma folded into the consumer's weight:
    option A stores y and y*gamma, two (M, N) activation writes (as many as the unfused residual
    add + RMSNorm); option B stores only y, saving M*N*2 bytes of writes per norm (128 MiB at
    M = 16384, N = 4096) plus the activation that would stay alive until the consumer reads it.
    The cost moves to the weights: W' = W * gamma[None, :] reads and writes the consumer weight
    (and dgamma = sum_n dW' * W in the backward), a token-count-independent elementwise pass that
    is done once per optimizer step when micro-batches share the weights and once at load time
    for inference. Per forward at 16k tokens the fold traffic (2 * N_consumer * d * 2 bytes:
    96 MiB QKV, 448 MiB gate/up, 512 MiB LM head) can exceed the saved write.

    Measured on the H200 (bf16, Llama-3-8B, 16384 tokens): A's extra y*gamma store costs
    0.046 ms per norm (this op at 16384x4096x4096: 0.920 vs 0.874 ms, scripts/bench_epilogue.py
    --shape 16384 4096 4096, "residual + stats + y*gamma"), 0.09 ms per layer; B's folds cost
    0.069 ms (QKV) + 0.288 ms (gate/up) = 0.36 ms per layer and fold (scripts/bench_block.py).
    So at one forward per optimizer step A is cheaper by ~0.27 ms per layer, B from about four
    micro-batch forwards per step and at inference (no fold at all); B also keeps 128 MiB less
    activation alive per norm until the backward. B is the choice: training steps accumulate
    micro-batches and activation memory is the binding limit. (``coda_cute.nn`` still folds in
    every forward, so its block forward carries the 0.36 ms.)
    """
    check_residual(a, w, residual)
    out = E.run(residual_norm_stats_tree(), a, w.t(), {"residual": residual}, op=OP_RESIDUAL)
    return out["y"], out["ss"]


@residual_gemm_norm_stats.register_fake
def _residual_fake(a, w, residual):
    m, n, _ = check_residual(a, w, residual)
    t = -(-n // stats_tile_n(a, w))
    return a.new_empty((m, n)), a.new_empty((m, t), dtype=F32)


@residual_gemm_norm_stats.register_kernel("cpu")
def _residual_cpu(a, w, residual):
    require_reference(OP_RESIDUAL)
    check_residual(a, w, residual)
    return residual_gemm_norm_stats_ref(a, w, residual, stats_tile_n(a, w))


def residual_gemm_norm_stats_backward(a, w, y, tile_n: int, dy, dss):
    """g = dy + 2 y d ss[m, tile(n)] (the squares' gradient, straight through the bf16 rounding);
    da = g @ w, dw = g^T @ a, d residual = g."""
    g = _wide(dy) + 2 * _wide(y) * _wide(dss).repeat_interleave(tile_n, dim=1)[:, :y.shape[1]]
    return mm32(g, w).to(a.dtype), mm32(g.t(), a).to(w.dtype), g.to(y.dtype)


def _residual_setup(ctx, inputs, output):
    a, w, _ = inputs
    ctx.save_for_backward(a, w, output[0])
    ctx.tile_n = stats_tile_n(a, w)


def _residual_backward(ctx, dy, dss):
    a, w, y = ctx.saved_tensors
    return residual_gemm_norm_stats_backward(a, w, y, ctx.tile_n, dy, dss)


residual_gemm_norm_stats.register_autograd(_residual_backward, setup_context=_residual_setup)


# == norm + gate/up + SwiGLU =======================================================================
OP_SWIGLU = "coda.norm_swiglu"


@functools.lru_cache(maxsize=None)
def norm_swiglu_tree() -> E.Epilogue:
    z = E.acc() * rstd_node()
    return E.Epilogue(E.store(z, "z", "bfloat16"),
                      E.store(E.pairwise(lambda g, u: E.silu(g) * u, z), "h", "bfloat16"))


def check_swiglu(y, w_gu, ss, eps):
    m, n, d = check_norm_input(OP_SWIGLU, y, w_gu, ss, eps)
    check_aligned(OP_SWIGLU, "the SwiGLU width f (rows of w_gu / 2)", n // 2)
    return m, n


@torch.library.custom_op("coda::norm_swiglu", mutates_args=())
def norm_swiglu(y: torch.Tensor, w_gu: torch.Tensor, ss: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm-scaled gate/up projection with SwiGLU, in one GEMM.

        r_m = (sum_t ss[m, t] / d + eps)^(-1/2)
        z = r * (y @ w_gu.T)                      (M, 2f) bf16, the pre-activation (for backward)
        h_j = silu(z_2j) * z_2j+1                 (M, f) bf16, from the unrounded z

    y: (M, d) bf16; w_gu: (2f, d) bf16 with rows interleaved [g0, u0, g1, u1, ...]
    (``coda_cute.nn.convert.interleave_gate_up``) and gamma folded in; ss: (M, T) fp32 partials
    of y; d and f multiples of 8.
    """
    check_swiglu(y, w_gu, ss, eps)
    out = E.run(norm_swiglu_tree(), y, w_gu.t(), norm_inputs(y, ss, eps), op=OP_SWIGLU)
    return out["z"], out["h"]


@norm_swiglu.register_fake
def _swiglu_fake(y, w_gu, ss, eps):
    m, n = check_swiglu(y, w_gu, ss, eps)
    return y.new_empty((m, n)), y.new_empty((m, n // 2))


@norm_swiglu.register_kernel("cpu")
def _swiglu_cpu(y, w_gu, ss, eps):
    require_reference(OP_SWIGLU)
    check_swiglu(y, w_gu, ss, eps)
    return norm_swiglu_ref(y, w_gu, ss, eps)


def norm_swiglu_backward(y, w_gu, ss, eps: float, z, dz, dh):
    """SwiGLU backward from the saved pre-activation z = [g, u] pairs, added to dz:
    dg = dh u sigma(g) (1 + g (1 - sigma(g))), du = dh silu(g); then the r-scaling backward with
    acc = z / r (so dr_m = sum_n dz_mn z_mn / r_m, the sum of z * dz of coda-math 3.1)."""
    zw = _wide(z)
    g, u = zw[:, 0::2], zw[:, 1::2]
    sg = torch.sigmoid(g)
    dhw = _wide(dh)
    dzz = _wide(dz).clone()
    dzz[:, 0::2] += dhw * u * sg * (1 + g * (1 - sg))
    dzz[:, 1::2] += dhw * g * sg
    r = rms_rstd_ref(ss, y.shape[1], eps).unsqueeze(1)
    return norm_scale_backward(y, w_gu, ss, eps, zw / r, dzz)


def _swiglu_setup(ctx, inputs, output):
    y, w_gu, ss, eps = inputs
    ctx.save_for_backward(y, w_gu, ss, output[0])
    ctx.eps = eps


def _swiglu_backward(ctx, dz, dh):
    y, w_gu, ss, z = ctx.saved_tensors
    return (*norm_swiglu_backward(y, w_gu, ss, ctx.eps, z, dz, dh), None)


norm_swiglu.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


# == norm + QKV + QK-norm + RoPE ===================================================================
OP_QKV = "coda.norm_rope_qkv"


@functools.lru_cache(maxsize=None)
def norm_rope_qkv_tree(n_qk: int, head_dim: int, qk_norm: bool) -> E.Epilogue:
    """x = r * acc; on the first n_qk columns (Q and K heads): optional per-head RMSNorm (a
    segment reduction over each head's head_dim columns), then the rotation of every adjacent
    pair by theta = positions[m] * inv_freq[k], k = (n mod head_dim) // 2 the pair index within
    the head:

        (a, b) -> (a cos theta - b sin theta, a sin theta + b cos theta)   (one pairwise node)

    V columns pass through. ``qk_w`` is the QK-norm weight per column (q_norm_w over the Q heads,
    k_norm_w over the K heads).

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
    return E.Epilogue(E.store(E.where(is_qk, rot, x), "qkv", "bfloat16"))


@functools.lru_cache(maxsize=None)
def segment_widths() -> frozenset:
    """head_dims a QK-norm segment reduction supports: those dividing some config's tile_n."""
    tiles = {c.tile_n for c in dispatch.config_space(False)}
    return frozenset(w for w in range(8, 257, 8) if any(t % w == 0 for t in tiles))


def check_qkv(y, w_qkv, ss, eps, positions, inv_freq, n_heads, n_kv_heads, head_dim,
              q_norm_w, k_norm_w, qk_eps):
    op = OP_QKV
    m, n, _ = check_norm_input(op, y, w_qkv, ss, eps)
    if n_heads < 1 or n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"{op}: n_heads ({n_heads}) must be a positive multiple of n_kv_heads "
                         f"({n_kv_heads})")
    if head_dim < 8 or head_dim > 256 or head_dim % 8:
        raise ValueError(f"{op}: head_dim must be a multiple of 8 in [8, 256], got {head_dim}")
    if n != (n_heads + 2 * n_kv_heads) * head_dim:
        raise ValueError(f"{op}: w_qkv must have (n_heads + 2 n_kv_heads) * head_dim = "
                         f"{(n_heads + 2 * n_kv_heads) * head_dim} rows, got {n}")
    check_tensor(op, "positions", positions, 1, INDEX_DTYPES)
    if positions.shape[0] != m:
        raise ValueError(f"{op}: positions must have one entry per row of y ({m}), got {positions.shape[0]}")
    check_tensor(op, "inv_freq", inv_freq, 1, (F32,))
    if inv_freq.shape[0] != head_dim // 2:
        raise ValueError(f"{op}: inv_freq must be (head_dim / 2,) = ({head_dim // 2},), got "
                         f"{tuple(inv_freq.shape)}")
    if (q_norm_w is None) != (k_norm_w is None):
        raise ValueError(f"{op}: pass both q_norm_w and k_norm_w for QK-norm, or neither")
    if q_norm_w is not None:
        for name, t in (("q_norm_w", q_norm_w), ("k_norm_w", k_norm_w)):
            check_tensor(op, name, t, 1, (F32, BF16))
            if t.shape[0] != head_dim:
                raise ValueError(f"{op}: {name} must be ({head_dim},), got {tuple(t.shape)}")
        if head_dim not in segment_widths():
            raise ValueError(f"{op}: QK-norm reduces each head inside one GEMM tile, so head_dim "
                             f"must divide a tile width; supported: {sorted(segment_widths())}, "
                             f"got {head_dim}")
        check_eps(op, "qk_eps", qk_eps)
    check_same_device(op, y=y, positions=positions, inv_freq=inv_freq, q_norm_w=q_norm_w,
                      k_norm_w=k_norm_w)
    return m, n


def qkv_tree_inputs(y, ss, eps, positions, inv_freq, n_heads, n_kv_heads, head_dim,
                    q_norm_w=None, k_norm_w=None, qk_eps=1e-6) -> dict:
    """The named inputs of :func:`norm_rope_qkv_tree` for one call."""
    n_qk = (n_heads + n_kv_heads) * head_dim
    n = n_qk + n_kv_heads * head_dim
    inputs = dict(norm_inputs(y, ss, eps), positions=positions.to(torch.int32),
                  inv_freq=inv_freq.reshape(1, -1))
    if q_norm_w is not None:
        w = qk_norm_weight(q_norm_w, k_norm_w, n_heads, n_kv_heads).float().reshape(-1)
        inputs.update(qk_w=torch.cat([w, w.new_ones(n - n_qk)]), qk_eps=float(qk_eps))
    return inputs


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
    tree = norm_rope_qkv_tree((n_heads + n_kv_heads) * head_dim, head_dim, q_norm_w is not None)
    inputs = qkv_tree_inputs(y, ss, eps, positions, inv_freq, n_heads, n_kv_heads, head_dim,
                             q_norm_w, k_norm_w, qk_eps)
    return E.run(tree, y, w_qkv.t(), inputs, op=OP_QKV)["qkv"]


@norm_rope_qkv.register_fake
def _qkv_fake(y, w_qkv, ss, eps, positions, inv_freq, n_heads, n_kv_heads, head_dim,
              q_norm_w=None, k_norm_w=None, qk_eps=1e-6):
    m, n = check_qkv(y, w_qkv, ss, eps, positions, inv_freq, n_heads, n_kv_heads, head_dim,
                     q_norm_w, k_norm_w, qk_eps)
    return y.new_empty((m, n))


@norm_rope_qkv.register_kernel("cpu")
def _qkv_cpu(y, w_qkv, ss, eps, positions, inv_freq, n_heads, n_kv_heads, head_dim,
             q_norm_w=None, k_norm_w=None, qk_eps=1e-6):
    require_reference(OP_QKV)
    args = (y, w_qkv, ss, eps, positions, inv_freq, n_heads, n_kv_heads, head_dim, q_norm_w,
            k_norm_w, qk_eps)
    check_qkv(*args)
    return norm_rope_qkv_ref(*args)


def norm_rope_qkv_backward(y, w_qkv, ss, eps: float, positions, inv_freq, n_heads: int,
                           n_kv_heads: int, head_dim: int, q_norm_w, k_norm_w, qk_eps: float, dqkv):
    """Rotate the Q/K gradient back by -theta; through the QK-norm (per head, with
    x_hat = x rs, g = dout * w_norm: dx = rs (g - x_hat mean(g x_hat)), d w_norm = sum dout x_hat
    over rows and heads); then the r-scaling backward. acc = y @ w.T is recomputed: the stored
    output does not determine the pre-norm values. Returns (dy, dw, dss, dq_norm_w, dk_norm_w)."""
    m = y.shape[0]
    n_qk = (n_heads + n_kv_heads) * head_dim
    acc = mm32(y, w_qkv.t())
    dx = _wide(dqkv).clone()
    dx[:, :n_qk] = rope_pairs_ref(dx[:, :n_qk], positions, -inv_freq, head_dim)
    dqn = dkn = None
    if q_norm_w is not None:
        r = rms_rstd_ref(ss, y.shape[1], eps).unsqueeze(1)
        xh = (acc[:, :n_qk] * r).reshape(m, -1, head_dim)
        rs = torch.rsqrt(xh.square().mean(-1, keepdim=True) + qk_eps)
        x_hat = xh * rs
        g = dx[:, :n_qk].reshape(m, -1, head_dim)
        dw_heads = (g * x_hat).sum(0)
        dqn = dw_heads[:n_heads].sum(0).to(q_norm_w.dtype)
        dkn = dw_heads[n_heads:].sum(0).to(k_norm_w.dtype)
        gw = g * qk_norm_weight(q_norm_w, k_norm_w, n_heads, n_kv_heads)
        dx[:, :n_qk] = (rs * (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True))).reshape(m, n_qk)
    return (*norm_scale_backward(y, w_qkv, ss, eps, acc, dx), dqn, dkn)


def _qkv_setup(ctx, inputs, output):
    y, w, ss, eps, positions, inv_freq, h, hkv, hd, qn, kn, qk_eps = inputs
    ctx.save_for_backward(y, w, ss, positions, inv_freq, qn, kn)
    ctx.args = (eps, h, hkv, hd, qk_eps)


def _qkv_backward(ctx, dqkv):
    y, w, ss, positions, inv_freq, qn, kn = ctx.saved_tensors
    eps, h, hkv, hd, qk_eps = ctx.args
    dy, dw, dss, dqn, dkn = norm_rope_qkv_backward(y, w, ss, eps, positions, inv_freq, h, hkv, hd,
                                                   qn, kn, qk_eps, dqkv)
    return dy, dw, dss, None, None, None, None, None, None, dqn, dkn, None


norm_rope_qkv.register_autograd(_qkv_backward, setup_context=_qkv_setup)


# == plain norm-scaled projection ==================================================================
OP_PROJ = "coda.norm_proj"


@functools.lru_cache(maxsize=None)
def norm_proj_tree() -> E.Epilogue:
    return E.Epilogue(E.store(E.acc() * rstd_node(), "out", "bfloat16"))


@torch.library.custom_op("coda::norm_proj", mutates_args=())
def norm_proj(y: torch.Tensor, w: torch.Tensor, ss: torch.Tensor, eps: float) -> torch.Tensor:
    """out = r * (y @ w.T)  (M, N) bf16: RMSNorm(y; gamma) @ W.T with gamma folded into w.

    y: (M, d) bf16; w: (N, d) bf16; ss: (M, T) fp32; d and N multiples of 8. (E.g. logits for
    inference from the final norm and the LM head.)
    """
    check_norm_input(OP_PROJ, y, w, ss, eps)
    return E.run(norm_proj_tree(), y, w.t(), norm_inputs(y, ss, eps), op=OP_PROJ)["out"]


@norm_proj.register_fake
def _proj_fake(y, w, ss, eps):
    m, n, _ = check_norm_input(OP_PROJ, y, w, ss, eps)
    return y.new_empty((m, n))


@norm_proj.register_kernel("cpu")
def _proj_cpu(y, w, ss, eps):
    require_reference(OP_PROJ)
    check_norm_input(OP_PROJ, y, w, ss, eps)
    return norm_proj_ref(y, w, ss, eps)


def norm_proj_backward(y, w, ss, eps: float, out, dout):
    """The r-scaling backward with acc = out / r from the saved output."""
    r = rms_rstd_ref(ss, y.shape[1], eps).unsqueeze(1)
    return norm_scale_backward(y, w, ss, eps, _wide(out) / r, _wide(dout))


def _proj_setup(ctx, inputs, output):
    y, w, ss, eps = inputs
    ctx.save_for_backward(y, w, ss, output)
    ctx.eps = eps


def _proj_backward(ctx, dout):
    y, w, ss, out = ctx.saved_tensors
    return (*norm_proj_backward(y, w, ss, ctx.eps, out, dout), None)


norm_proj.register_autograd(_proj_backward, setup_context=_proj_setup)
