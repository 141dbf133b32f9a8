"""Numerics of a cross-entropy backward without the cross-entropy-gradient pass (CPU, float64 oracle).

Until the fourteenth session ``coda.lm_head_ce_train`` stored each chunk's logits (bf16) from the
logits GEMM, and a bandwidth-bound kernel (``kernels.elementwise.ce_grad``, now the FP8 LM head's)
turned them in place into the GEMM operand dl' = r dl, dl = c (softmax - onehot): it read and
rewrote the chunk, 2.0 ms of the 8b step's 151.5 ms of GPU time. This script checked the numerics
of a form of the operand that the logits GEMM can store directly, before it was built; the op
now runs its variant "exp form, -others at the target" (``coda_cute.ops.lm_head_ce``, with the
target's own logit as K's anchor, SHIFT 0 there, and the tile as the segment):

    e'_mv = exp(logit_mv - K_m,tau)  with the target's own column set to 0 (bf16),
    K_m,tau = max(T_m, max_{v in tile tau} logit_mv - GUARD)   (T_m = target logit + SHIFT)

After the GEMM the row's LSE is known; tiles whose K differs from the row's largest K'_m (only in
rows where some logit exceeds the target's by more than SHIFT + GUARD nats) are rescaled by
exp(K - K'_m) in a sparse fix-up, and then

    dl = s e' + a onehot,   s_m = c_m exp(K'_m - LSE_m),   a_m = c_m (p_t - 1) in fp32
    G  = dl' @ W = r s (e' @ W) + r a W[t]            (a row scale and a gathered row)
    dW = dl'^T @ u = e'^T @ (r s u) + sum_m onehot(t_m) r a u_m   (a row-scaled operand and a
                                                                    sparse, per-target sum)

The bf16 rounding moves from dl to e', a relative rounding of the same size, except at the target,
where dl_t = c (p_t - 1) is small when the model is confident: a separate term keeps it, taken as
a = -c (1 - p_t) = -s sum_{v != t} e'_v (the others' share, from fp32 per-tile row sums the
logits epilogue can emit), which keeps its relative precision however close p_t is to 1. Today's
training op computes p_t from the logit it stored in bf16: a rounding of up to 2^-9 of the logit
(0.03 at 15) moves p_t by that much relative, far more than 1 - p_t of a confident row, so the
target's term is mostly rounding there. The recompute path (the loss-only op's backward) has the
fp32 logit, but c (p_t - 1) still cancels to 0 once 1 - p_t is below the fp32 rounding of the
LSE. The variant "exp form, -others at the target" writes a / s = -sum_{v != t} e'_v into e' at the
target (bf16) instead, so that both GEMMs take e' with the row scale alone (no gathered row in
the dgrad, no per-target sums in dW): one bf16 rounding of the row's largest entry, like today's
operand, without the cancellation. The variant "exp form, target in e'" keeps the target column
in e' (a = -c instead) to show why the target needs its own term. Here s and a are formed in
float64 from the fp32 partials (in the kernels: fp32).

Scenarios (logits given, fp32; u, W random): ``init`` (N(0, 1), p_t ~ 1/V), ``confident`` (the
target 15 nats up: p_t ~ 0.999), ``certain`` (25 up: 1 - p_t ~ 4e-8), ``wide`` (N(0, 30)),
``spike`` (a few rows with one logit 150 nats above the target: the fix-up path), ``ignored``
(a third of the rows ignored). Prints the relative error (Frobenius) of G and dW against float64
for the bf16 dl' operand of today's training op and of the recompute path, and the three exp forms.

    python scripts/exp_lm_head_exp_form.py [--rows 256] [--vocab 2000] [--dim 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from rich.console import Console
from rich.table import Table

BF16, F64 = torch.bfloat16, torch.float64
TILE = 128
SHIFT, GUARD = 20.0, 60.0
IGNORE = -100


def scenario(name: str, m: int, v: int, g: torch.Generator):
    logits = torch.randn(m, v, generator=g)
    targets = torch.randint(0, v, (m,), generator=g)
    rows = torch.arange(m)
    if name == "confident":
        logits[rows, targets] += 15.0
    elif name == "certain":
        logits[rows, targets] += 25.0
    elif name == "wide":
        logits *= 30.0
    elif name == "spike":
        spiked = rows[:: max(1, m // 8)]
        logits[spiked, torch.randint(0, v, (len(spiked),), generator=g)] = logits[spiked, targets[spiked]] + 150.0
    elif name == "ignored":
        targets[::3] = IGNORE
    return logits.float(), targets


def coef(targets):
    valid = targets != IGNORE
    return torch.where(valid, 1.0 / valid.sum().clamp(min=1), 0.0).to(F64)


def exact(logits, targets, r, w, u):
    """G and dW in float64 from the fp32 logits."""
    c = coef(targets)
    dl = torch.softmax(logits.to(F64), -1) * c[:, None]
    valid = targets != IGNORE
    rows = torch.arange(len(targets))
    dl[rows[valid], targets[valid]] -= c[valid]
    dlp = r[:, None] * dl
    return dlp @ w.to(F64), dlp.t() @ u.to(F64)


def bf16_operand(logits, targets, r, w, u, stored_logits):
    """dl' = r c (exp(l - LSE) - onehot) in fp32, rounded to bf16 as the GEMM operand, the GEMMs
    exact on it; LSE from the fp32 logits (the epilogue's partials), l the logits as read."""
    c = coef(targets).float()
    lse = torch.logsumexp(logits, -1)
    dl = torch.exp(stored_logits - lse[:, None]) * c[:, None]
    valid = targets != IGNORE
    rows = torch.arange(len(targets))
    dl[rows[valid], targets[valid]] -= c[valid]
    dlp = (r[:, None] * dl).to(BF16).to(F64)
    return dlp @ w.to(F64), dlp.t() @ u.to(F64)


def training_op(logits, targets, r, w, u):
    """Today's ``lm_head_ce_train``: the logits GEMM stores the logits in bf16 and the ce_grad
    kernel computes exp(l_bf16 - LSE) from them."""
    return bf16_operand(logits, targets, r, w, u, logits.to(BF16).float())


def recompute(logits, targets, r, w, u):
    """The loss-only op's backward (``dlogits_tree``): the logits GEMM recomputed, dl from the
    fp32 logits in registers."""
    return bf16_operand(logits, targets, r, w, u, logits)


def exp_form(logits, targets, r, w, u, exact_target: bool = True, written: bool = False):
    """The exp form (module docstring): e' in bf16 with per-tile shifts, the fix-up, the row scale
    and, with ``exact_target``, the target's term in fp32; ``written``: that term instead written
    into e' at the target as -(the others' share) in bf16, so that both GEMMs take e' alone."""
    m, v = logits.shape
    valid = targets != IGNORE
    rows = torch.arange(m)
    tgt = targets.clamp(min=0)
    t_logit = logits[rows, tgt]
    shift = torch.where(valid, t_logit + SHIFT, 0.0)
    pad = -v % TILE
    tiles = torch.nn.functional.pad(logits, (0, pad), value=-math.inf).view(m, -1, TILE)
    tile_max = tiles.amax(-1)
    k = torch.maximum(shift[:, None], tile_max - GUARD)                       # K_m,tau
    e = torch.exp(tiles - k[..., None]).view(m, -1)[:, :v]
    if exact_target:
        e[rows[valid], tgt[valid]] = 0.0
    k_row = k.amax(-1)                                                          # K'_m
    fix = torch.exp(k - k_row[:, None])                                         # 1 but in spiked rows
    # the others' share sum_{v != t} e'_v exp(K - K'), from fp32 partials per tile (a row_reduce)
    others = (torch.nn.functional.pad(e, (0, pad)).view(m, -1, TILE).sum(-1).to(F64) * fix.to(F64)).sum(-1)
    e = e.to(BF16)                                                              # what the GEMM stores
    e = (torch.nn.functional.pad(e.float(), (0, pad)).view(m, -1, TILE) * fix[..., None]).view(m, -1)[:, :v]
    e = e.to(BF16)                                                              # the fix-up rewrites bf16
    if written:  # s e'_t = a: the target's entry is -(the others' share), one bf16 rounding
        e[rows[valid], tgt[valid]] = (-others[valid]).to(BF16)
    e = e.to(F64)
    lse = torch.logsumexp(logits, -1)
    c = coef(targets)
    s = c * torch.exp((k_row - lse).to(F64))
    if written:
        a = torch.zeros_like(s)  # in e' already
    elif exact_target:  # a = c (p_t - 1) = -c (1 - p_t) = -s sum_{v != t} e'_v: no cancellation
        a = torch.where(valid, -s * others, 0.0)
    else:
        a = -c
    rs = (r.to(F64) * s)
    g = rs[:, None] * (e @ w.to(F64)) + (r.to(F64) * a)[:, None] * w.to(F64)[tgt] * valid[:, None]
    us = (rs[:, None] * u.to(F64)).to(BF16).to(F64)                            # the wgrad's B operand
    dw = e.t() @ us
    dw.index_add_(0, tgt[valid], (r.to(F64) * a)[valid, None] * u.to(F64)[valid])
    return g, dw


def rel(x, ref):
    return float((x - ref).norm() / ref.norm().clamp(min=1e-300))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the errors here")
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(args.seed)
    w = (torch.randn(args.vocab, args.dim, generator=g) * args.dim ** -0.5).to(BF16)
    u = torch.randn(args.rows, args.dim, generator=g).to(BF16)
    r = torch.rand(args.rows, generator=g) + 0.5
    table = Table(title=f"relative error against float64: {args.rows} rows, vocabulary {args.vocab}, d {args.dim}")
    labels = {"training": "training op (bf16 logits)", "recompute": "recompute (fp32 logits)",
              "exp": "exp form", "exp_written": "exp form, -others at the target",
              "exp_target_in_e": "exp form, target in e'"}
    table.add_column("scenario")
    for part in ("G", "dW"):
        for label in labels.values():
            table.add_column(f"{part}: {label}", justify="right")
    out = {}
    for name in ("init", "confident", "certain", "wide", "spike", "ignored"):
        logits, targets = scenario(name, args.rows, args.vocab, g)
        ref_g, ref_w = exact(logits, targets, r, w, u)
        errs = {}
        for label, (gg, ww) in (("training", training_op(logits, targets, r, w, u)),
                                ("recompute", recompute(logits, targets, r, w, u)),
                                ("exp", exp_form(logits, targets, r, w, u)),
                                ("exp_written", exp_form(logits, targets, r, w, u, written=True)),
                                ("exp_target_in_e", exp_form(logits, targets, r, w, u, exact_target=False))):
            errs[label] = (rel(gg, ref_g), rel(ww, ref_w))
        out[name] = errs
        table.add_row(name, *(f"{errs[k][i]:.2e}" for i in (0, 1) for k in labels))
    Console(width=240).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "errors": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
