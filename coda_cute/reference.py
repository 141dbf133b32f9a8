"""Torch reference implementations (CPU-runnable, fp32 math): the oracle for every test.

Each function computes exactly what the matching ``torch.ops.coda`` op is specified to compute,
in fp32 on the inputs' device, and rounds once to the output dtype at the end.
"""

from __future__ import annotations

import math

import torch


def gemm_ref(a: torch.Tensor, b: torch.Tensor, scale_a=None, scale_b=None, out_dtype=None,
             round_output: bool = True) -> torch.Tensor:
    """``(a @ b) * scale_a * scale_b`` in fp32.

    ``a``: (M, K) or (L, M, K); ``b``: (K, N) or (L, K, N). ``scale_a`` is a single number or one
    per row of A ((M, 1), (M,), or per batch (L, M, 1)); ``scale_b`` a single number or one per
    column of B ((1, N), (N,), (L, 1, N)). ``round_output=False`` returns the fp32 result.
    """
    acc = torch.matmul(a.float(), b.float())
    if scale_a is not None:
        acc = acc * _row_scale(scale_a, a)
    if scale_b is not None:
        acc = acc * _col_scale(scale_b, b)
    if out_dtype is None:
        out_dtype = torch.bfloat16 if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else a.dtype
    return acc.to(out_dtype) if round_output else acc


def _row_scale(s: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    s = s.float()
    if s.numel() == 1:
        return s.reshape(())
    m = a.shape[-2]
    return s.reshape(*a.shape[:-2], m, 1)


def _col_scale(s: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    s = s.float()
    if s.numel() == 1:
        return s.reshape(())
    n = b.shape[-1]
    return s.reshape(*b.shape[:-2], 1, n)


# -- CODA block ops (coda_cute.ops.*) -----------------------------------------------------------------
# Each reference computes in fp32 (float64 inputs stay float64, for gradient checks) and rounds
# once to the activation dtype, exactly as the op is specified. The forward references are
# differentiable by torch autograd; the backward ops' references below are the analytic
# formulas the kernels implement, which the tests hold against autograd of the forward ones.

def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _project(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y @ w.T in fp32 (w stored like nn.Linear: out x in)."""
    return _wide(y) @ _wide(w).t()


def tile_partials_ref(x: torch.Tensor, tile_n: int) -> torch.Tensor:
    """p[m, t] = sum over the columns n of tile t (width ``tile_n``) of x[m, n]: (M, ceil(N/tile_n))."""
    m, n = x.shape
    t = -(-n // tile_n)
    x = _wide(x)
    x = torch.cat([x, x.new_zeros(m, t * tile_n - n)], dim=1)
    # Summed in float64 like coda_cute.epilogue.evaluate, so the two agree bit for bit.
    return x.double().reshape(m, t, tile_n).sum(-1).to(x.dtype)


def norm_stats_partials_ref(y: torch.Tensor, tile_n: int) -> torch.Tensor:
    """p[m, t] = sum over the columns n of tile t (width ``tile_n``) of y[m, n]^2: (M, ceil(N/tile_n))."""
    return tile_partials_ref(_wide(y).square(), tile_n)


def rms_rstd_ref(ss: torch.Tensor, d: int, eps: float) -> torch.Tensor:
    """r[m] = (sum_t ss[m, t] / d + eps)^(-1/2): the RMSNorm scale from norm-stat partials."""
    return torch.rsqrt(_wide(ss).sum(-1) / d + eps)


def residual_gemm_norm_stats_ref(a, w, residual, tile_n: int):
    """y = residual + a @ w.T rounded to a's dtype; ss = per-tile sums of squares of the rounded y."""
    y = (_project(a, w) + _wide(residual)).to(a.dtype)
    return y, norm_stats_partials_ref(y, tile_n)


def _scaled(y, w, ss, eps):
    return rms_rstd_ref(ss, y.shape[-1], eps).unsqueeze(-1) * _project(y, w)


def norm_swiglu_ref(y, w_gu, ss, eps: float):
    """z = r * (y @ w_gu.T) (rows of w_gu interleaved gate/up); h_j = silu(z_2j) * z_2j+1 from the
    unrounded z. Returns (z, h) rounded to y's dtype."""
    z = _scaled(y, w_gu, ss, eps)
    h = torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]
    return z.to(y.dtype), h.to(y.dtype)


def rope_cos_sin(positions, inv_freq, dtype):
    """cos and sin of theta[m, k] = positions[m] * inv_freq[k] (the product in fp32, as HF and
    the kernel form it; cos / sin evaluated in float64), (M, head_dim / 2) in ``dtype``."""
    theta = (positions.to(torch.float32).unsqueeze(1) * inv_freq.to(torch.float32)).double()
    return theta.cos().to(dtype), theta.sin().to(dtype)


def rope_pairs_ref(x, positions, inv_freq, head_dim: int):
    """Rotate adjacent pairs (2k, 2k+1) of every head of x (M, heads * head_dim) by
    theta = positions[m] * inv_freq[k]: a' = a cos - b sin, b' = a sin + b cos."""
    m = x.shape[0]
    c, s = (t.unsqueeze(1) for t in rope_cos_sin(positions, inv_freq, x.dtype))
    pairs = x.reshape(m, -1, head_dim // 2, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).reshape(x.shape)


def head_rms_norm_ref(x, weight, head_dim: int, eps: float):
    """RMSNorm over each head's head_dim values of x (M, heads * head_dim); ``weight`` is
    (heads, head_dim) (one norm weight per head row, e.g. q_norm repeated over the Q heads)."""
    h = x.reshape(x.shape[0], -1, head_dim)
    h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * _wide(weight)
    return h.reshape(x.shape)


def qk_norm_weight(q_norm_w, k_norm_w, n_heads: int, n_kv_heads: int):
    """(n_heads + n_kv_heads, head_dim): q_norm_w for every Q head, then k_norm_w for every K head."""
    return torch.cat([_wide(q_norm_w).expand(n_heads, -1), _wide(k_norm_w).expand(n_kv_heads, -1)])


def norm_rope_qkv_ref(y, w_qkv, ss, eps: float, positions, inv_freq, n_heads: int, n_kv_heads: int,
                      head_dim: int, q_norm_w=None, k_norm_w=None, qk_eps: float = 1e-6):
    """x = r * (y @ w_qkv.T) with columns [Q heads | K heads | V heads]; on the Q and K columns an
    optional per-head RMSNorm (times q_norm_w / k_norm_w), then the adjacent-pair rotation; V as
    is. Rounded once to y's dtype: (M, (n_heads + 2 n_kv_heads) head_dim)."""
    x = _scaled(y, w_qkv, ss, eps)
    n_qk = (n_heads + n_kv_heads) * head_dim
    qk = x[:, :n_qk]
    if q_norm_w is not None:
        qk = head_rms_norm_ref(qk, qk_norm_weight(q_norm_w, k_norm_w, n_heads, n_kv_heads), head_dim, qk_eps)
    qk = rope_pairs_ref(qk, positions, inv_freq, head_dim)
    return torch.cat([qk, x[:, n_qk:]], dim=1).to(y.dtype)


def norm_proj_ref(y, w, ss, eps: float):
    """r * (y @ w.T) rounded to y's dtype."""
    return _scaled(y, w, ss, eps).to(y.dtype)


def scale_columns_ref(x, gamma):
    """x * gamma[None, :], the product in fp32 rounded once to x's dtype (``coda.fold_gamma``);
    x itself when gamma is None."""
    return x if gamma is None else (_wide(x) * _wide(gamma)).to(x.dtype)


def lm_head_ce_ref(y, w_lm, ss, eps: float, targets, ignore_index: int = -100, reduction: str = "mean",
                   gamma=None):
    """Cross-entropy of logits = r * ((y * gamma) @ w_lm.T) (fp32, materialized here, never in
    the op; y * gamma rounded to y's dtype first, as the op forms it; no gamma: y as is).

    LSE_m = log sum_v exp(logits[m, v]); loss_m = LSE_m - logits[m, targets_m], 0 where
    targets_m == ignore_index. reduction: "mean" (over the other rows; NaN if there are none, as
    in torch), "sum" or "none" ((M,)). Returns (loss, LSE) in fp32.
    """
    logits = _scaled(scale_columns_ref(y, gamma), w_lm, ss, eps)
    lse = torch.logsumexp(logits, dim=-1)
    valid = targets != ignore_index
    tgt = logits.gather(1, targets.long().clamp(0, logits.shape[1] - 1).unsqueeze(1)).squeeze(1)
    loss = torch.where(valid, lse - tgt, 0.0)
    return reduce_loss(loss, valid, reduction), lse


def ce_coef(targets, ignore_index: int, reduction: str, dloss=None):
    """Per-row weight c_m of the cross-entropy gradient dlogits = c (softmax - onehot): dloss_m
    ("none"), dloss ("sum") or dloss / #valid ("mean"); 0 on ignored rows. dloss None means 1."""
    valid = targets != ignore_index
    one = torch.ones((), dtype=torch.float32, device=targets.device)
    c = one if dloss is None else _wide(dloss)
    c = c.expand(targets.shape) if c.dim() == 0 else c
    if reduction == "mean":
        c = c / valid.sum()
    return torch.where(valid, c, 0.0)


def ce_dlogits_ref(y, w_lm, ss, eps: float, targets, ignore_index: int = -100, reduction: str = "mean",
                   gamma=None, dloss=None, dlse=None):
    """(logits, dl) in fp32: dl = softmax (c + dlse) - onehot c, c = :func:`ce_coef`."""
    r = rms_rstd_ref(ss, y.shape[1], eps).unsqueeze(1)
    logits = r * (_wide(scale_columns_ref(y, gamma)) @ _wide(w_lm).t())
    c = ce_coef(targets, ignore_index, reduction, dloss).unsqueeze(1)
    extra = 0.0 if dlse is None else _wide(dlse).unsqueeze(1)
    dl = torch.softmax(logits, dim=-1) * (c + extra)
    rows = torch.arange(y.shape[0], device=y.device)
    valid = targets != ignore_index
    dl[rows[valid], targets[valid].long()] -= c[valid, 0]
    return logits, dl


def lm_head_ce_grad_ref(y, w_lm, ss, eps: float, targets, ignore_index: int = -100,
                        reduction: str = "mean", gamma=None, dloss=None, dlse=None):
    """The gradients of :func:`lm_head_ce_ref`'s loss (times dloss, default 1) plus LSE times
    dlse, with ss standing for y's norm statistic (coda-math 3.1, the ops' convention):

        dl = softmax (c + dlse) - onehot c      (c = :func:`ce_coef`),   G = (r dl) @ W
        dy = G [* gamma] - r^2 s y,   s_m = sum_v dl_mv logits_mv / d
        dW = (r dl)^T @ (y * gamma),  dgamma = sum_m G * y
    Returns (dy, dW, dgamma or None) in the dtypes of y, w_lm and fp32."""
    d = y.shape[1]
    u = scale_columns_ref(y, gamma)
    r = rms_rstd_ref(ss, d, eps).unsqueeze(1)
    logits, dl = ce_dlogits_ref(y, w_lm, ss, eps, targets, ignore_index, reduction, gamma, dloss, dlse)
    s = (dl * logits).sum(1, keepdim=True) / d
    g = (r * dl) @ _wide(w_lm)
    dy = (g * _wide(gamma) if gamma is not None else g) - r * r * s * _wide(y)
    dw = (r * dl).t() @ _wide(u)
    dgamma = (g * _wide(y)).sum(0) if gamma is not None else None
    return dy.to(y.dtype), dw.to(w_lm.dtype), dgamma


def target_logits_ref(u, w, targets, rstd):
    """rstd_m (u_m . w[t_m]) in fp32 (float64 sums), t_m clamped into [0, V)
    (``kernels.elementwise.target_logits``)."""
    t = targets.long().clamp(0, w.shape[0] - 1)
    return (rstd.double() * (u.double() * w[t].double()).sum(1)).float()


def exp_logits_ref(logits, tl, tile: int, guard: float):
    """The exp-form logits epilogue (``coda_cute.ops.lm_head_ce.exp_logits_tree``): for fp32
    logits (M, V) and the targets' fp32 logits tl (M,), per ``tile``-column tile j (the last one
    ragged) K_mj = max(tl_m, max_{v in j} l_mv - guard); returns (e = exp(l - K) bf16 (M, V),
    se = sum_{v in j} e (M, T) fp32)."""
    m, v = logits.shape
    nt = -(-v // tile)
    pad = torch.full((m, nt * tile), float("-inf"), dtype=torch.float64, device=logits.device)
    pad[:, :v] = logits.double()
    k = torch.maximum(tl.double().unsqueeze(1), pad.view(m, nt, tile).amax(-1) - guard)
    e = torch.exp(pad.view(m, nt, tile) - k.unsqueeze(-1))
    return e.reshape(m, -1)[:, :v].to(torch.bfloat16), e.sum(-1).float()


#: how far above T a recovered tile K must be to replace it (``kernels.elementwise.exp_combine``)
EXP_K_MARGIN = 2.0 ** -10


def exp_tile_k_ref(e, se, u, w, tl, rstd, tile: int, guard: float):
    """The row step's tile K (float64, (M, T)): T, but in tiles whose sum reaches e^(guard - 1)
    the logit of the tile's largest e recomputed from u and w, less guard, where that exceeds T
    by more than ``EXP_K_MARGIN`` (``kernels.elementwise.exp_combine``'s ``_recovered_k``)."""
    m, v = e.shape
    nt = se.shape[1]
    k = tl.double().unsqueeze(1).expand(m, nt).clone()
    pad = torch.full((m, nt * tile), -1.0, dtype=torch.float64, device=e.device)
    pad[:, :v] = e.double()
    arg = pad.view(m, nt, tile).argmax(-1) + torch.arange(nt, device=e.device) * tile
    for i, j in (se.double() >= math.exp(guard - 1.0)).nonzero().tolist():
        top = float(rstd[i]) * float(u[i].double() @ w[arg[i, j]].double()) - guard
        if top > float(tl[i]) + EXP_K_MARGIN:
            k[i, j] = top
    return k


def exp_combine_ref(e, se, u, w, tl, targets, coef, rstd, tile: int, guard: float):
    """``kernels.elementwise.exp_combine`` in float64 (its docstring has the math): returns
    (e' bf16, lse, rs), e' = e rescaled to the row's largest K with -(the others' share) at the
    target, so that diag(rs) e' = r c (softmax - onehot)."""
    m, v = e.shape
    k64 = exp_tile_k_ref(e, se, u, w, tl, rstd, tile, guard)
    kp = k64.amax(1, keepdim=True)
    f = torch.exp(k64 - kp)
    total = (f * se.double()).sum(1)
    col_tile = torch.arange(v, device=e.device) // tile
    scaled = e.double() * f[:, col_tile]
    valid = (targets >= 0) & (targets < v)
    tgt = targets.long().clamp(0, v - 1)
    rows = torch.arange(m, device=e.device)
    jt = torch.where(valid, tgt // tile, -1)
    in_jt = col_tile.unsqueeze(0) == jt.unsqueeze(1)
    not_t = torch.ones_like(in_jt)
    not_t[rows[valid], tgt[valid]] = False
    other_tiles = torch.arange(se.shape[1], device=e.device).unsqueeze(0) != jt.unsqueeze(1)
    others = (torch.where(other_tiles, f * se.double(), 0.0).sum(1)
              + torch.where(in_jt & not_t, scaled, 0.0).sum(1))
    out = torch.where(not_t, scaled, -others.unsqueeze(1))
    return out.to(torch.bfloat16), (kp.squeeze(1) + torch.log(total)).float(), (rstd.double() * coef.double() / total).float()


def lm_head_rows_ref(dy, y, gamma, r, zdz, rs):
    """``kernels.elementwise.lm_head_rows``: (dy - r^2 (zdz / d) y, rs y gamma), each rounded
    once to bf16 from float64."""
    d = y.shape[1]
    y64 = y.double()
    proj = (r.double() ** 2 * zdz.double() / d).unsqueeze(1) * y64
    return ((dy.double() - proj).to(dy.dtype),
            (rs.double().unsqueeze(1) * y64 * gamma.double()).to(y.dtype))


def reduce_loss(loss: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss
    total = loss.sum()
    return total / valid.sum() if reduction == "mean" else total


# -- backward ops ----------------------------------------------------------------------------------
def norm_backward_ref(g, w, y, ss, zdz, eps: float, residual_grad=None):
    """dy = residual_grad + g @ w - r^2 s y, s_m = sum_t zdz[m, t] / d (``coda.norm_backward``)."""
    d = y.shape[1]
    r = rms_rstd_ref(ss, d, eps).unsqueeze(1)
    s = _wide(zdz).sum(1, keepdim=True) / d
    dy = _wide(g) @ _wide(w) - r * r * s * _wide(y)
    if residual_grad is not None:
        dy = dy + _wide(residual_grad)
    return dy.to(y.dtype)


def swiglu_grad_ref(z, dh):
    """(dg, du) of h = silu(g) u at the pairs (g, u) = (z[:, 0::2], z[:, 1::2]), in fp32."""
    zw = _wide(z)
    g, u = zw[:, 0::2], zw[:, 1::2]
    sg = torch.sigmoid(g)
    dh = _wide(dh)
    return g, u, dh * u * sg * (1 + g * (1 - sg)), dh * g * sg


def swiglu_backward_ref(dy, w_down, z, ss, eps: float, tile_n: int):
    """``coda.swiglu_backward``: dh = dy @ w_down; dz' = r [dg, du] interleaved, h = silu(g) u,
    zdz = per-tile (width ``tile_n``) sums of g dg + u du. Returns (dz', h, zdz)."""
    dh = _wide(dy) @ _wide(w_down)
    g, u, dg, du = swiglu_grad_ref(z, dh)
    r = rms_rstd_ref(ss, w_down.shape[0], eps).unsqueeze(1)
    dz = (torch.stack((dg, du), -1).flatten(-2) * r).to(z.dtype)
    h = (torch.nn.functional.silu(g) * u).to(z.dtype)
    return dz, h, tile_partials_ref(g * dg + u * du, tile_n)


def heads_as_rows(t):
    """(B, heads, S, D) -> (B * S, heads * D): token rows, head-major columns (a copy if needed)."""
    b, h, s, d = t.shape
    return t.transpose(1, 2).reshape(b * s, h * d)


def rope_backward_ref(dq, dk, dv, qkv, rstd, positions, inv_freq, pre=None, q_norm_w=None,
                      k_norm_w=None, qk_eps: float = 1e-6):
    """``coda.rope_backward``: the gradient of ``norm_rope_qkv``'s r-scaled, pre-QK-norm,
    pre-rotation values from the attention core's dq, dk, dv ((B, heads, S, D)):

        Q/K: dqn = R(-theta) [dq | dk] (the inverse rotation); with QK-norm per head
             (x = pre, rs = (mean x^2 + qk_eps)^(-1/2), xh = x rs, gw = dqn w):
             dz = rs (gw - xh mean(gw xh)), d w += sum dqn xh; without it dz = dqn
        V:   dz = dv
        g = r dz (bf16), zdz_m = sum_j z_mj dz_mj (z: pre on Q/K with QK-norm, qkv elsewhere;
        without QK-norm the rotation is orthogonal, so qkv . dqkv)
    Returns (g, zdz (M, 1), dq_norm_w, dk_norm_w) (the last two None without QK-norm)."""
    n_heads, head_dim = dq.shape[1], dq.shape[3]
    n_kv = dk.shape[1]
    n_qk = (n_heads + n_kv) * head_dim
    dqkv = torch.cat([_wide(heads_as_rows(t)) for t in (dq, dk, dv)], dim=1)
    m = dqkv.shape[0]
    rot = rope_pairs_ref(dqkv[:, :n_qk], positions, -inv_freq, head_dim)
    dz = dqkv.clone()
    dqn_w = dkn_w = None
    if pre is None:
        dz[:, :n_qk] = rot
        zdz = (_wide(qkv) * dqkv).sum(1, keepdim=True)
    else:
        x = _wide(pre[:, :n_qk]).reshape(m, -1, head_dim)
        rs = torch.rsqrt(x.square().mean(-1, keepdim=True) + qk_eps)
        xh = x * rs
        dqn = rot.reshape(m, -1, head_dim)
        gw = dqn * qk_norm_weight(q_norm_w, k_norm_w, n_heads, n_kv)
        dx = rs * (gw - xh * (gw * xh).mean(-1, keepdim=True))
        dz[:, :n_qk] = dx.reshape(m, n_qk)
        zdz = (x * dx).sum((1, 2)).unsqueeze(1) + (_wide(qkv[:, n_qk:]) * dqkv[:, n_qk:]).sum(1, keepdim=True)
        dw_heads = (dqn * xh).sum(0)
        dqn_w = dw_heads[:n_heads].sum(0).to(q_norm_w.dtype)
        dkn_w = dw_heads[n_heads:].sum(0).to(k_norm_w.dtype)
    return (dz * _wide(rstd).unsqueeze(1)).to(qkv.dtype), zdz, dqn_w, dkn_w


def _attention_probs(q, k):
    """Causal softmax probabilities (B, H, S, S) in fp32, k's heads repeated for GQA; and lse."""
    rep = q.shape[1] // k.shape[1]
    s = _wide(q) @ _wide(k).repeat_interleave(rep, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    n = s.shape[-1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, -1), torch.logsumexp(s, -1)


def attention_ref(q, k, v):
    """Causal attention with GQA (k, v heads shared by n_heads / n_kv_heads query heads), in fp32:
    (o in q's dtype, (B, H, S, D); lse (B, H, S) fp32, the log-sum-exp of each query's scaled,
    masked scores)."""
    p, lse = _attention_probs(q, k)
    return (p @ _wide(v).repeat_interleave(q.shape[1] // k.shape[1], 1)).to(q.dtype), lse


def attention_backward_ref(do, q, k, v):
    """(dq, dk, dv) of :func:`attention_ref`'s output for the output gradient ``do``:
    dV = P^T dO, dS = P (dO V^T - rowsum(dO O)), dQ = dS K / sqrt(D), dK = dS^T Q / sqrt(D), the
    K and V gradients summed over each KV head's query heads."""
    rep = q.shape[1] // k.shape[1]
    p, _ = _attention_probs(q, k)
    vw, dow = _wide(v).repeat_interleave(rep, 1), _wide(do)
    dp = dow @ vw.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * q.shape[-1] ** -0.5
    dq = ds @ _wide(k).repeat_interleave(rep, 1)
    dk = ds.transpose(-1, -2) @ _wide(q)
    dv = p.transpose(-1, -2) @ dow
    b, h, s, d = q.shape

    def grouped(t):
        return t.reshape(b, h // rep, rep, s, d).sum(2)

    return dq.to(q.dtype), grouped(dk).to(k.dtype), grouped(dv).to(v.dtype)


# -- the plain (unfused) Llama block, HF / torchtitan conventions ----------------------------------
# The comparison baseline for coda_cute.nn: RMSNorm with weight, q/k/v and concatenated gate/up
# projections, rotate-half RoPE, SDPA with GQA. Runs in the parameters' dtype like the HF model
# (bf16 for the unfused bf16 path, fp32/fp64 for the fp32 reference).

def rms_norm_ref(x, weight, eps: float):
    """HF LlamaRMSNorm: normalize in fp32, round to x's dtype, then scale by the weight."""
    h = _wide(x)
    h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, device=None):
    """The unscaled rotary frequencies theta^(-2k / head_dim), k < head_dim / 2, fp32 (as HF)."""
    return (theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)).float()


def rope_rotate_half_ref(x, positions, inv_freq):
    """HF rotate-half RoPE on x (B, heads, S, head_dim): element k pairs with k + head_dim / 2;
    cos / sin rounded to x's dtype first, as HF does."""
    c, s = rope_cos_sin(positions, inv_freq, x.dtype)
    c, s = torch.cat([c, c], -1), torch.cat([s, s], -1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * c + torch.cat([-x2, x1], dim=-1) * s


def gate_up_weight(p: dict) -> torch.Tensor:
    """The concatenated [gate; up] weight (2f, d) of an HF block dict (either layout)."""
    if "mlp.gate_up_proj.weight" in p:
        return p["mlp.gate_up_proj.weight"]
    return torch.cat([p["mlp.gate_proj.weight"], p["mlp.up_proj.weight"]])


def llama_block_ref(x, p: dict, positions, inv_freq, n_heads: int, n_kv_heads: int, head_dim: int,
                    eps: float, qk_eps: float = 1e-6):
    """One pre-norm Llama decoder block on x (B, S, d), the standard unfused way.

    ``p`` holds HF names relative to the layer ("self_attn.q_proj.weight", ...; gate/up separate
    or as "mlp.gate_up_proj.weight"; optional "self_attn.q_norm.weight" / "k_norm" for QK-norm,
    applied per head before RoPE). RoPE angles positions[s] * inv_freq[k], positions (S,).
    """
    bsz, seq, _ = x.shape
    h = rms_norm_ref(x, p["input_layernorm.weight"], eps)

    def heads(w, n):
        return (h @ w.t()).reshape(bsz, seq, n, head_dim)

    q = heads(p["self_attn.q_proj.weight"], n_heads)
    k = heads(p["self_attn.k_proj.weight"], n_kv_heads)
    v = heads(p["self_attn.v_proj.weight"], n_kv_heads)
    if "self_attn.q_norm.weight" in p:
        q = rms_norm_ref(q, p["self_attn.q_norm.weight"], qk_eps)
        k = rms_norm_ref(k, p["self_attn.k_norm.weight"], qk_eps)
    q = rope_rotate_half_ref(q.transpose(1, 2), positions, inv_freq)
    k = rope_rotate_half_ref(k.transpose(1, 2), positions, inv_freq)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True,
                                                         enable_gqa=True)
    x = x + o.transpose(1, 2).reshape(bsz, seq, -1) @ p["self_attn.o_proj.weight"].t()
    g, u = (rms_norm_ref(x, p["post_attention_layernorm.weight"], eps) @ gate_up_weight(p).t()).chunk(2, -1)
    return x + (torch.nn.functional.silu(g) * u) @ p["mlp.down_proj.weight"].t()


def llama_head_ce_ref(y, norm_w, w_lm, targets, eps: float, ignore_index: int = -100,
                      reduction: str = "mean"):
    """Final RMSNorm + LM head + cross-entropy, unfused: the logits (..., V) are materialized in
    y's dtype and the loss computed in fp32 (as HF does)."""
    logits = rms_norm_ref(y, norm_w, eps) @ w_lm.t()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             targets.reshape(-1), ignore_index=ignore_index,
                                             reduction=reduction)


# -- FP8 block scaling (coda_cute.precision's recipes) --------------------------------------------
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
#: the smallest block scale, 2^-126 (the smallest normal fp32): 1 / s stays finite
MIN_SCALE = 2.0 ** -126


def embedding_backward_ref(grad: torch.Tensor, ids: torch.Tensor, num_rows: int, padding_idx: int = -1):
    """dE (num_rows, d) of ``weight[ids]``: each row the fp32 sum of the gradient rows of the tokens
    that read it, in token order, rounded once to grad's dtype; ``padding_idx`` (>= 0) and rows
    no token reads are zeros."""
    d = grad.shape[-1]
    out = torch.zeros((num_rows, d), dtype=torch.float32, device=grad.device)
    out.index_add_(0, ids.reshape(-1).long(), grad.reshape(-1, d).float())
    if padding_idx >= 0:
        out[padding_idx] = 0
    return out.to(grad.dtype)


def quantize_blocks_ref(x: torch.Tensor, block: tuple[int, int], dtype=torch.float8_e4m3fn,
                        pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): ``x`` (R, C) in FP8 with one fp32 scale per ``block`` = (rows, cols) block
    (the last blocks along each axis may be partial), current scaling:

        amax_b = max |x| over block b;  s_b = max(amax_b / FP8_MAX, 2^-126)  (``pow2_scales``:
        the power of two at or above it, so no value overflows);
        q = cast(clamp(x * (1 / s_b), +-FP8_MAX), dtype)   (1 / s_b rounded to fp32 once)

    x ~= q * s_b. (1, 128) blocks are the activations' and gradients' (along K), (128, 1) the
    same along the token dimension (weight gradients), (128, 128) the weights'. A block of zeros
    gets s = 1 (q = 0, exact); the floor at the smallest normal fp32 keeps 1 / s finite for a
    block of denormals (else its zeros would become 0 * inf = NaN). A block holding inf or NaN
    gets s = NaN, so all its values dequantize to NaN: the non-finite value spreads to its block,
    never silently clipped.
    Returns q (R, C) of ``dtype`` and scales (ceil(R / rows), ceil(C / cols)) fp32."""
    fmax = _check_quantize(x, block, dtype)
    (r, c), (br, bc) = x.shape, block
    gr, gc = -(-r // br), -(-c // bc)
    padded = torch.nn.functional.pad(x.float(), (0, gc * bc - c, 0, gr * br - r))
    blocks = padded.view(gr, br, gc, bc)
    amax = blocks.abs().amax(dim=(1, 3))
    # a tensor divisor: CUDA turns `tensor / python_scalar` into a multiply by the scalar's
    # rounded reciprocal, which is not the IEEE quotient the kernels compute
    scale = (amax / torch.full_like(amax, fmax)).clamp_min(MIN_SCALE)
    if pow2_scales:  # exactly: frexp's mantissa is 0.5 only on a power of two
        mant, exp = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), torch.where(mant == 0.5, exp - 1, exp))
    finite = torch.isfinite(amax)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    inv = 1.0 / scale  # fp32, once per block: the kernels multiply by it
    q = (blocks * inv[:, None, :, None]).clamp(-fmax, fmax)  # NaN stays NaN through clamp
    q = q.reshape(gr * br, gc * bc)[:r, :c].to(dtype)
    return q, scale


def fp8_roundtrip_ref(x: torch.Tensor, block: tuple[int, int], dtype=torch.float8_e4m3fn,
                      pow2_scales: bool = False) -> torch.Tensor:
    """x quantized in ``block`` blocks and dequantized (fp32): what an FP8 GEMM multiplies."""
    return dequantize_blocks_ref(*quantize_blocks_ref(x.float(), block, dtype, pow2_scales), block)


def fold_factors_ref(amax: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The row-wise recipe's fold factors of a gradient's rows (``kernels.common.fp8_math.fold_factor``):
    each row's scale ``s``, 0 where its ``amax`` is 0 (a zero row: its scale 1 must not reach the
    weight gradient's other operand), NaN where the scale is."""
    return torch.where(amax == 0, torch.zeros_like(s), s)


def mlp_block_fp8_ref(y, ss, w_gu, w_down, eps: float, tile_n: int, pow2_scales: bool = False,
                      row: bool = False):
    """``coda.mlp_block_fp8``'s forward: ``coda.mlp_block``'s math on the FP8 operands (y and h
    in 1 x 128 blocks, the weights in 128 x 128; ``row``: every operand with one scale per whole
    row along K, the row-wise recipe; ``pow2_scales``: scales powers of two), products in fp32, h
    rounded to bf16 before it is quantized. Returns (y2, ss2, z) in y's dtype."""
    act, wgt = (1, 128), (128, 128)

    def rt(t, block):
        return fp8_roundtrip_ref(t, (1, t.shape[-1]) if row else block, pow2_scales=pow2_scales)

    z = rms_rstd_ref(ss, y.shape[-1], eps).unsqueeze(-1) * (rt(y, act) @ rt(w_gu, wgt).T)
    h = (torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]).to(y.dtype)
    y2 = (rt(h, act) @ rt(w_down, wgt).T + _wide(y)).to(y.dtype)
    return y2, norm_stats_partials_ref(y2, tile_n), z.to(y.dtype)


def lm_head_ce_fp8_ref(y, w_lm, ss, eps: float, targets, ignore_index: int = -100, reduction: str = "mean",
                       gamma=None, grad_dtype=torch.float8_e4m3fn, chunk_rows: int | None = None,
                       pow2_scales: bool = False):
    """``coda.lm_head_ce_train_fp8``: the LM head + cross-entropy with its three GEMMs in
    block-scaled FP8 (Q1: 1 x 128 blocks along K, QW: 128 x 128, Q1t: 1 x 128 along the tokens),
    the rest as :func:`lm_head_ce_grad_ref` (fp32, ss standing for y's statistic):

        u = y * gamma;  logits = r * (Q1(u) @ QW(W)^T);  loss, LSE as :func:`lm_head_ce_ref`
        dl = softmax c - onehot c,  dl' = r dl,  s_m = sum_v dl_mv logits_mv / d
        G = Q1(dl') @ QW(W),  dy = G [* gamma] - r^2 s y,  dgamma = sum_m G * y
        dW = Q1t(dl')^T @ Q1t(u)  per chunk of ``chunk_rows`` tokens (all: one chunk), in bf16
             (dl'^T @ u) for a chunk whose token count is no multiple of 16

    dl' in ``grad_dtype``; ``pow2_scales``: every scale a power of two. Returns (loss, LSE, dy in
    y's dtype, dgamma fp32 or None, dW fp32)."""
    d = y.shape[1]
    u = scale_columns_ref(y, gamma)
    r = rms_rstd_ref(ss, d, eps).unsqueeze(1)
    wq = fp8_roundtrip_ref(w_lm, (128, 128), pow2_scales=pow2_scales)
    logits = r * (fp8_roundtrip_ref(u, (1, 128), pow2_scales=pow2_scales) @ wq.t())
    lse = torch.logsumexp(logits, dim=-1)
    valid = targets != ignore_index
    tgt = logits.gather(1, targets.long().clamp(0, logits.shape[1] - 1).unsqueeze(1)).squeeze(1)
    loss = reduce_loss(torch.where(valid, lse - tgt, 0.0), valid, reduction)
    c = ce_coef(targets, ignore_index, reduction).unsqueeze(1)
    dl = torch.softmax(logits, dim=-1) * c
    rows = torch.arange(y.shape[0], device=y.device)
    dl[rows[valid], targets[valid].long()] -= c[valid, 0]
    s = (dl * logits).sum(1, keepdim=True) / d
    dlp = r * dl
    g = fp8_roundtrip_ref(dlp, (1, 128), grad_dtype, pow2_scales) @ wq
    dy = (g * _wide(gamma) if gamma is not None else g) - r * r * s * _wide(y)
    step = y.shape[0] if chunk_rows is None else chunk_rows
    dw = torch.zeros(w_lm.shape, dtype=torch.float32, device=y.device)
    for i in range(0, y.shape[0], step):
        a, b = dlp[i:i + step], _wide(u[i:i + step])
        if a.shape[0] % 16 == 0:
            a, b = (fp8_roundtrip_ref(t.t().contiguous(), (1, 128), dt, pow2_scales).t()
                    for t, dt in ((a, grad_dtype), (b, torch.float8_e4m3fn)))
        dw += a.t() @ b
    dgamma = (g * _wide(y)).sum(0) if gamma is not None else None
    return loss, lse, dy.to(y.dtype), dgamma, dw


def dequantize_blocks_ref(q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """q * s_b in fp32: the inverse of :func:`quantize_blocks_ref` up to FP8 rounding."""
    (r, c), (br, bc) = q.shape, block
    expanded = scales.repeat_interleave(br, 0)[:r].repeat_interleave(bc, 1)[:, :c]
    return q.float() * expanded


def block_scaled_gemm_ref(a_q, a_scales, a_block, b_q, b_scales, b_block, out_dtype=torch.bfloat16):
    """a @ b.T on the dequantized operands in float64, rounded once to ``out_dtype``: the oracle of
    the block-scaled FP8 GEMM. a_q (M, K) with ``a_block`` scales, b_q (N, K) with ``b_block``'s
    (both K-major, as the kernels read them)."""
    a = dequantize_blocks_ref(a_q, a_scales, a_block).double()
    b = dequantize_blocks_ref(b_q, b_scales, b_block).double()
    return (a @ b.t()).to(out_dtype)


def _check_quantize(x, block, dtype) -> float:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"quantize: x must be a 2-D floating-point tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} of shape {tuple(getattr(x, 'shape', ()))}")
    if (not isinstance(block, tuple) or len(block) != 2
            or not all(isinstance(v, int) and v >= 1 for v in block)):
        raise ValueError(f"quantize: block must be (rows, cols) of positive ints, got {block!r}")
    if dtype not in FP8_MAX:
        raise ValueError(f"quantize: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    return FP8_MAX[dtype]
