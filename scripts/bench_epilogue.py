"""Benchmark epilogue trees against our plain GEMM and the plain cuBLAS GEMM of the same shape.

One run, random data, CUDA-event medians after warm-up with L2 flushed. Default shape
M = 16384, N = 28672, K = 4096, bf16 (the Llama-8B gate/up projection at 16k tokens). For each
tree: the time of the heuristic's config and of the schedules we sweep, timed in turns with
cuBLAS and our plain GEMM on the heuristic's config (coda_cute.sol.timing.interleaved_medians),
and the best config's ratio to each.

    python scripts/bench_epilogue.py [--shape M N K] [--trees SUBSTR ...] [--json out.json]
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
from coda_cute.sol.timing import interleaved_medians

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
        # gamma placement option A of coda.residual_gemm_norm_stats: also store y * gamma
        "residual + stats + y*gamma": E.Epilogue(
            E.store(acc + E.tile("residual"), "out"),
            E.store((acc + E.tile("residual")) * E.col_vec("gamma"), "y_gamma"),
            E.row_reduce(acc + E.tile("residual"), "sumsq", "ss")),
    }


def coda_trees(n):
    """The CODA block ops' trees (coda_cute.ops) at an N of this shape (Q and K: 5/6 of N)."""
    from coda_cute.ops import lm_head_ce, qkv

    n_qk = n // 6 * 5 // 128 * 128
    return {
        "coda qkv + rope": qkv.norm_rope_qkv_tree(n_qk, 128, False),
        "coda qkv + qk-norm + rope": qkv.norm_rope_qkv_tree(n_qk, 128, True),
        "coda lm head + ce": lm_head_ce.lm_head_ce_tree(),
    }


def inputs(tree, m, n, k):
    out = {}
    for i in tree.inputs:
        if i.kind == "col_vec":
            out[i.name] = torch.randn(n, device="cuda")
        elif i.kind == "tile":
            out[i.name] = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        elif i.kind == "row_vec" and i.dtype == "int32":  # positions, targets
            out[i.name] = torch.randint(0, min(n, 8192), (m,), device="cuda", dtype=torch.int32)
        elif i.kind == "row_vec":
            out[i.name] = torch.randn(m, device="cuda")
        elif i.kind == "row_sum":  # norm-stat partials of rows of unit RMS
            out[i.name] = torch.rand(m, 4, device="cuda") * (k / 2)
        elif i.kind == "lookup":  # RoPE's inv_freq (1, head_dim / 2)
            out[i.name] = 10000.0 ** -torch.linspace(0, 1, 64, device="cuda").reshape(1, -1)
        elif i.kind == "scalar":
            out[i.name] = 1.0 / k
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs=3, type=int, default=(16384, 28672, 4096), metavar=("M", "N", "K"))
    ap.add_argument("--json")
    ap.add_argument("--trees", nargs="+", metavar="SUBSTR",
                    help="only the trees whose name contains one of these")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_epilogue needs a CUDA GPU")
    torch.manual_seed(0)
    m, n, k = args.shape
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    console = Console(width=150)
    plain_tree = trees()["plain"]
    todo = {**trees(), **coda_trees(n)}
    todo = {name: t for name, t in todo.items()
            if name != "plain" and (not args.trees or any(x in name for x in args.trees))}
    rows = []
    for name, tree in todo.items():
        ins = inputs(tree, m, n, k)
        # each tree timed in turns with cuBLAS and our plain GEMM: the GPU's clocks drift by
        # several percent under sustained load, ratios of back-to-back timings would carry it
        fns = {"cuBLAS": lambda: torch.mm(a, b), "plain": lambda: E.run(plain_tree, a, b, {})}
        for cfg in [None] + SWEEP:
            try:
                E.run(tree, a, b, ins, config=cfg)
            except E.EpilogueError as err:  # the tree does not fit this config's shared memory
                console.log(f"{name} {cfg.name if cfg else 'heuristic'}: {err}")
                continue
            fns[cfg.name if cfg else "heuristic"] = lambda cfg=cfg, tree=tree, ins=ins: E.run(tree, a, b, ins, config=cfg)
        times = interleaved_medians(fns)
        cublas, plain = times.pop("cuBLAS"), times.pop("plain")
        rows.append(dict(tree=name, times=times, cublas_ms=cublas, plain_ms=plain))
        console.log(f"{name}: cuBLAS {cublas:.3f} ms, plain {plain:.3f} ms, "
                    + ", ".join(f"{c} {t:.3f} ms" for c, t in times.items()))
    t = Table(title=f"epilogue trees at {m}x{n}x{k} bf16, each timed in turns with cuBLAS and our "
                    "plain GEMM (heuristic config)")
    for col in ("tree", "best config", "ms", "vs our plain GEMM", "vs cuBLAS", "heuristic ms",
                "plain vs cuBLAS"):
        t.add_column(col, justify="right")
    for r in rows:
        best = min(r["times"], key=r["times"].get)
        ms = r["times"][best]
        r.update(best=best, ms=ms, vs_plain=ms / r["plain_ms"], vs_cublas=ms / r["cublas_ms"])
        t.add_row(r["tree"], best, f"{ms:.3f}", f"{r['vs_plain']:.3f}", f"{r['vs_cublas']:.3f}",
                  f"{r['times'].get('heuristic', float('nan')):.3f}", f"{r['plain_ms'] / r['cublas_ms']:.3f}")
    console.print(t)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"shape": [m, n, k], "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
