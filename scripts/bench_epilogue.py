"""Benchmark epilogue trees against our plain GEMM and the plain cuBLAS GEMM of the same shape.

One run, random data, CUDA-event medians after warm-up (triton.testing.do_bench). Default shape
M = 16384, N = 28672, K = 4096, bf16 (the Llama-8B gate/up projection at 16k tokens). For each
tree: the time of the heuristic's config and of the schedules we sweep, the ratio to our plain
GEMM (same config family, best of the sweep) and to cuBLAS.

    python scripts/bench_epilogue.py [--shape M N K] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from rich.console import Console
from rich.table import Table

from coda_cute import epilogue as E
from coda_cute.kernels.common.config import GemmConfig

SWEEP = [
    GemmConfig(128, 256, 64, "cooperative", 2, 1),
    GemmConfig(128, 128, 64, "pingpong", 2, 1),
    GemmConfig(128, 192, 64, "pingpong", 1, 2),
]


def trees():
    acc = E.acc()
    return {
        "plain": E.Epilogue(E.store(acc, "out")),
        "colvec + tile + aux store": E.Epilogue(
            E.store(acc + E.col_vec("bias") + E.tile("residual"), "out"),
            E.store(acc + E.col_vec("bias"), "aux")),
        "swiglu (N/2 out)": E.Epilogue(E.store(E.pairwise(lambda g, u: E.silu(g) * u, acc), "out")),
        "bias + gelu + residual": E.Epilogue(
            E.store(E.gelu(acc + E.col_vec("bias")) + E.tile("residual"), "out")),
        "residual + norm stats": E.Epilogue(
            E.store(acc + E.tile("residual"), "out"),
            E.row_reduce(acc + E.tile("residual"), "sumsq", "ss")),
        "lse partials (no store)": E.Epilogue(E.row_reduce(acc, "lse", "lse")),
    }


def inputs(tree, m, n):
    out = {}
    for i in tree.inputs:
        if i.kind == "col_vec":
            out[i.name] = torch.randn(n, device="cuda")
        elif i.kind == "tile":
            out[i.name] = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        elif i.kind == "row_vec":
            out[i.name] = torch.randn(m, device="cuda")
    return out


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=50, rep=200, return_mode="median")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs=3, type=int, default=(16384, 28672, 4096), metavar=("M", "N", "K"))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_epilogue needs a CUDA GPU")
    torch.manual_seed(0)
    m, n, k = args.shape
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    cublas = bench_ms(lambda: torch.mm(a, b))
    console = Console(width=150)
    rows = []
    for name, tree in trees().items():
        ins = inputs(tree, m, n)
        times = {}
        for cfg in [None] + SWEEP:
            try:
                E.run(tree, a, b, ins, config=cfg)
            except E.EpilogueError as err:  # the tree does not fit this config's shared memory
                console.log(f"{name} {cfg.name if cfg else 'heuristic'}: {err}")
                continue
            times[cfg.name if cfg else "heuristic"] = bench_ms(lambda cfg=cfg: E.run(tree, a, b, ins, config=cfg))
        rows.append(dict(tree=name, times=times))
        console.log(f"{name}: " + ", ".join(f"{c} {t:.3f} ms" for c, t in times.items()))
    plain = min(rows[0]["times"].values())
    t = Table(title=f"epilogue trees at {m}x{n}x{k} bf16 (cuBLAS {cublas:.3f} ms, our plain GEMM {plain:.3f} ms)")
    for col in ("tree", "best config", "ms", "vs our plain GEMM", "vs cuBLAS", "heuristic ms"):
        t.add_column(col, justify="right")
    for r in rows:
        best = min(r["times"], key=r["times"].get)
        ms = r["times"][best]
        r.update(best=best, ms=ms, vs_plain=ms / plain, vs_cublas=ms / cublas)
        t.add_row(r["tree"], best, f"{ms:.3f}", f"{ms / plain:.3f}", f"{ms / cublas:.3f}",
                  f"{r['times'].get('heuristic', float('nan')):.3f}")
    console.print(t)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"shape": [m, n, k], "cublas_ms": cublas, "plain_ms": plain, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
