"""How the row-wise recipe's weight gradient rounds, folded against column-scaled (CPU or GPU).

dW = G^T X over M tokens, G a gradient (M, N), X an activation (M, K), both bf16. Two FP8
forms against float64 G^T X of the bf16 operands, each quantized by
``reference.quantize_blocks_ref`` and multiplied in float64 (the GEMM's own rounding left out):

  columns  G's columns and X's columns each with one scale per feature over the tokens (the
           row-wise recipe before 2026-12-04: G read twice, for the amaxes and the quantizer)
  folded   G's rows with one scale per token (the same FP8 bytes its dgrad takes), X's rows
           scaled by those scales (0 for a zero row) and its columns quantized per feature
           (``fp8_gemms.wgrad``: G read once)

(since 2026-12-05 the op folds dy2 with h the other way, h's kept rows and dy2's folded columns:
``fp8_gemms.wgrad_kept``; this compares the two forms above as they were measured)
on the MLP sublayer's two weight gradients (dz' with y, dy2 with h) from one bf16 forward +
backward on random weights, and on the same with the gradient rows spread over 2^-8 .. 2^8 (token
weights, padding-like rows of tiny gradients), E4M3 and E5M2 gradients.

    python scripts/exp_fold_wgrad.py [--tokens 2048] [--dim 1024] [--ffn 2816]
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

from coda_cute.reference import fold_factors_ref, quantize_blocks_ref


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def deq(q, s):
    return q.double() * s.double()


def forms(g, x, grad_dtype):
    """{form: dW} of ``g`` (M, N), ``x`` (M, K) as the module docstring names them."""
    m = g.shape[0]
    gq, gs = quantize_blocks_ref(g.float().t().contiguous(), (1, m), grad_dtype)
    xq, xs = quantize_blocks_ref(x.float().t().contiguous(), (1, m))
    columns = deq(gq, gs) @ deq(xq, xs).t()
    rq, rs = quantize_blocks_ref(g.float(), (1, g.shape[1]), grad_dtype)
    fold = fold_factors_ref(g.float().abs().amax(1), rs[:, 0])
    fq, fs = quantize_blocks_ref((x.float() * fold[:, None]).t().contiguous(), (1, m))
    folded = rq.double().t() @ deq(fq, fs).t()
    return {"columns": columns, "folded": folded}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    args = ap.parse_args(argv)
    m, d, f = args.tokens, args.dim, args.ffn
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    y = torch.randn(m, d, device=dev, generator=gen).bfloat16()
    w_gu = (torch.randn(2 * f, d, device=dev, generator=gen) * d ** -0.5).bfloat16()
    w_down = (torch.randn(d, f, device=dev, generator=gen) * f ** -0.5).bfloat16()
    dy2 = torch.randn(m, d, device=dev, generator=gen).bfloat16()
    # the sublayer in float64 for its gradients' exact values, rounded to bf16 as the op holds them
    yy = y.double().requires_grad_()
    r = torch.rsqrt(yy.square().mean(-1, keepdim=True) + 1e-5)
    z = (r * (yy @ w_gu.double().T)).detach().requires_grad_()
    h = torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]
    (h @ w_down.double().T).backward(dy2.double())
    dz = (z.grad * r.detach()).bfloat16()
    pairs = {"dW_gu = dz'^T y": (dz, y), "dW_down = dy2^T h": (dy2, h.detach().bfloat16())}
    spread = torch.exp2(torch.randint(-8, 9, (m, 1), device=dev, generator=gen).double())
    t = Table(title=f"weight-gradient error against float64, M {m}, d {d}, ffn {f} ({dev})")
    for col in ("gradient", "G rows", "G dtype", "columns", "folded", "folded / columns"):
        t.add_column(col, justify="left" if col in ("gradient", "G rows", "G dtype") else "right")
    for name, (g, x) in pairs.items():
        for rows, gg in (("as computed", g), ("spread 2^-8..2^8", (g.double() * spread).bfloat16())):
            exact = gg.double().t() @ x.double()
            for gd in (torch.float8_e4m3fn, torch.float8_e5m2):
                e = {k: rel(v, exact) for k, v in forms(gg, x, gd).items()}
                t.add_row(name, rows, str(gd)[6:], f"{e['columns']:.4f}", f"{e['folded']:.4f}",
                          f"{e['folded'] / e['columns']:.3f}")
    Console(width=160).print(t)


if __name__ == "__main__":
    main()
