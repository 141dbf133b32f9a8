"""Benchmark the bandwidth-bound FP8 quantize kernels against the device's copy bandwidth.

The FP8 training issue asks every quantize pass of ours that no GEMM epilogue absorbs to run at
>= 85 % of copy bandwidth. For each kernel and shape: its median time, the bytes it moves (the
16-bit input read once; each layout's FP8 values and fp32 1 x 128 scales written), the
bandwidth that makes, and that bandwidth over a ``torch.Tensor.copy_`` of the same input's bytes
timed in the same turns (CUDA-event medians, L2 flushed, ``sol.timing.interleaved_medians``).

Kernels: ``quantize_rows`` (1 x 128 along the rows: y, h, the attention output for the forward),
``quantize_dual`` (both layouts: the gradients dy2 and dz'), ``quantize_dual(rows=False)`` (the
transposed layout alone: h, y along the tokens for the weight gradients), and the row-wise recipe's
``quantize_rowwise`` (both layouts, columns alone, rows alone: one scale per whole row or column,
its time including the launcher's amax pass, ``abs_max``, which reads x once more; the bytes
counted are the quantize pass's own, so the ratio's best is about 2/3 for both layouts; also with
``fold``, a weight gradient's activation columns scaled by the gradient rows' factors), and the
columns' amax pass alone (``abs_max``: x read once).
Shapes: the Llama-3-8B MLP's at 16384 tokens (d 4096, ffn 14336, 2 ffn) and a ragged one.

    python scripts/bench_quantize.py [--rounds 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from rich.console import Console
from rich.table import Table

from coda_cute.elementwise_fp8 import abs_max, quantize_dual, quantize_rows, quantize_rowwise
from coda_cute.sol.timing import interleaved_medians

FP8 = torch.float8_e4m3fn
SHAPES = [(16384, 4096), (16384, 14336), (16384, 28672), (12304, 5000)]
TARGET = 0.85


def moved_bytes(m: int, k: int, rows: bool, cols: bool, whole: bool = False) -> int:
    """The input read once (2 bytes an element), then per layout its FP8 values and fp32 scales:
    along the rows m x ceil(k / 128) of them, along the columns k x ceil(m / 128) (``whole``: the
    row-wise recipe's m and k)."""
    row_scales, col_scales = (m, k) if whole else (m * -(-k // 128), k * -(-m // 128))
    return 2 * m * k + rows * (m * k + 4 * row_scales) + cols * (m * k + 4 * col_scales)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    console = Console(width=140)
    if not torch.cuda.is_available():
        console.print("[red]bench_quantize needs a CUDA GPU[/]")
        return 2
    t = Table(title=f"FP8 quantize kernels against copy bandwidth (target {TARGET:.0%}; median of {args.rounds})")
    for col in ("kernel", "M x K", "ms", "GB moved", "TB/s", "copy TB/s", "/ copy"):
        t.add_column(col, justify="left" if col == "kernel" else "right")
    records = []
    for m, k in SHAPES:
        x = torch.randn(m, k, device="cuda").bfloat16()
        dst = torch.empty_like(x)
        fold = torch.rand(m, device="cuda") + 0.5  # a gradient's row scales, folded into x's rows
        kernels = {"quantize_rows": (lambda: quantize_rows(x, FP8), (True, False)),
                   "quantize_dual": (lambda: quantize_dual(x, FP8), (True, True)),
                   "quantize_dual(rows=False)": (lambda: quantize_dual(x, FP8, rows=False), (False, True)),
                   "quantize_rowwise": (lambda: quantize_rowwise(x, FP8), (True, True, True)),
                   "quantize_rowwise(rows=False)": (lambda: quantize_rowwise(x, FP8, rows=False), (False, True, True)),
                   "quantize_rowwise(cols=False)": (lambda: quantize_rowwise(x, FP8, cols=False), (True, False, True)),
                   # a weight gradient's folded activation columns, and their amax pass alone
                   "quantize_rowwise(rows=False, fold)": (lambda: quantize_rowwise(x, FP8, rows=False, fold=fold),
                                                          (False, True, True)),
                   "abs_max(columns, fold)": (lambda: abs_max(x, rows=False, fold=fold), (False, False, True))}
        fns = {"copy": lambda: dst.copy_(x), **{name: fn for name, (fn, _) in kernels.items()}}
        ms = interleaved_medians(fns, rounds=args.rounds, settle_ms=200)
        copy_tbs = 2 * 2 * m * k / ms["copy"] / 1e9
        for name, (_, layouts) in kernels.items():
            gb = moved_bytes(m, k, *layouts) / 1e9
            tbs = gb / ms[name]
            records.append(dict(kernel=name, m=m, k=k, ms=ms[name], gb=gb, tbs=tbs, copy_tbs=copy_tbs,
                                ratio=tbs / copy_tbs))
            t.add_row(name, f"{m} x {k}", f"{ms[name]:.3f}", f"{gb:.3f}", f"{tbs:.2f}", f"{copy_tbs:.2f}",
                      f"{tbs / copy_tbs:.3f}")
    console.print(t)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
