"""Experiment (CPU, numerics only): what storing the SwiGLU pre-activation z in FP8 would cost the
MLP's gradients.

z = r (y @ W_gu^T) (M, 2f) is the largest tensor the MLP keeps from forward to backward: the
gate/up GEMM writes it in bf16 and the down-proj dgrad's SwiGLU backward reads it (about 0.94 GB
each way per 8B layer at 16384 tokens). DeepSeek-V3 caches its SwiGLU inputs in FP8 with 1 x 128
blocks. Kept so, z would halve both transfers and the memory it holds. The quantization is
tile-local (a 128-column block of z is one gate/up tile's row segment), so no pass is needed. The
cost is numerics: the backward's dg and du see z rounded to E4M3 instead of bf16.

This runs the MLP's math in float64 with every FP8 GEMM operand rounded as the row-wise recipe
rounds it (one scale per row along K) and z kept in bf16, in E4M3 1 x 128 blocks or in E5M2.
It prints each gradient's relative error against exact float64 math with no rounding.

Measured (2026-12-06, M 2048, d 1024, f 2816, seed 0):
- With bf16 GEMM operands, the z rounding adds 2.9e-2 to dz', dy and dW_gu for E4M3, against
  1.9e-3 for bf16.
- With the recipe's FP8 operands, the errors are 5.58e-2 with z in bf16 and 6.29e-2 with z in
  E4M3 (the two add in quadrature). dW_down does not depend on z.

Not built. Our quantize sinks need cooperative 128-row tiles, and the FP8 gate/up forward's pick
is ping-pong 128 x 128. On cooperative 128 x 256 that GEMM ran 1.164x `_scaled_mm` fast,
against 1.111x on the pick (H100, 2026-12-05). The backward would also need an FP8 wide tile input.

    python scripts/exp_saved_z_fp8.py [--tokens 2048] [--d 1024] [--ffn 2816] [--seed 0]
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

from coda_cute import reference as R

#: how z is kept between forward and backward: name -> its round trip (float64 in, float64 out)
Z_FORMATS = {
    "bf16": lambda z: z.bfloat16().double(),
    "e4m3 1x128": lambda z: R.fp8_roundtrip_ref(z.float(), (1, 128)).double(),
    "e5m2 1x128": lambda z: R.fp8_roundtrip_ref(z.float(), (1, 128), torch.float8_e5m2).double(),
}


def row_wise(x: torch.Tensor) -> torch.Tensor:
    """x as the row-wise recipe multiplies it: E4M3 with one scale per whole row (along K)."""
    return R.fp8_roundtrip_ref(x.float(), (1, x.shape[1])).double()


def mlp_grads(y, w_gu, w_down, dy2, keep_z=None, fp8_operands=False) -> dict:
    """The MLP's gradients (norm left out: r = 1) in float64. ``keep_z``: the round trip z takes
    between the forward and the SwiGLU backward (None: exact); ``fp8_operands``: every GEMM operand
    rounded row-wise (the weights as their K-major rows)."""
    q = row_wise if fp8_operands else (lambda x: x)
    z = q(y) @ q(w_gu).t()  # interleaved pairs (g, u)
    h = torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]
    dh = q(dy2) @ q(w_down.t().contiguous()).t()
    _, _, dg, du = R.swiglu_grad_ref(z if keep_z is None else keep_z(z), dh)
    dz = torch.stack((dg, du), -1).flatten(-2)
    return {"dz'": dz, "dy": dz @ w_gu, "dW_gu": dz.t() @ y, "dW_down": dy2.t() @ h}


def errors(m: int, d: int, f: int, seed: int) -> dict:
    """{(fp8 operands, z format): {gradient: relative error against exact float64}}."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(m, d, generator=gen, dtype=torch.float64)
    w_gu = torch.randn(2 * f, d, generator=gen, dtype=torch.float64) / d ** 0.5
    w_down = torch.randn(d, f, generator=gen, dtype=torch.float64) / f ** 0.5
    dy2 = torch.randn(m, d, generator=gen, dtype=torch.float64)
    exact = mlp_grads(y, w_gu, w_down, dy2)
    out = {}
    for fp8 in (False, True):
        for name, keep in Z_FORMATS.items():
            got = mlp_grads(y, w_gu, w_down, dy2, keep, fp8)
            out[fp8, name] = {k: float((v - exact[k]).norm() / exact[k].norm()) for k, v in got.items()}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    res = errors(args.tokens, args.d, args.ffn, args.seed)
    grads = list(next(iter(res.values())))
    table = Table(title=f"relative error against float64, M {args.tokens}, d {args.d}, f {args.ffn}")
    for col in ("GEMM operands", "z kept as", *grads):
        table.add_column(col, justify="right")
    for (fp8, name), errs in res.items():
        table.add_row("FP8 row-wise" if fp8 else "exact", name, *(f"{errs[g]:.2e}" for g in grads))
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
