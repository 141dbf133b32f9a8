"""Benchmark the block-scaled FP8 GEMM (``coda.gemm_blockwise``) against ``torch._scaled_mm``
with block-wise scales where torch offers it on this GPU, and against our own row-wise FP8 GEMM
(``coda.gemm`` with per-row / per-column scales) at the same shape: the targets of the FP8
training issue (>= 1.00x torch's block-wise, else >= 0.95x our row-wise).

Llama-3-8B shapes with M = 16384 (the forward: activation x weight^T, weights 128 x 128 scaled)
plus ragged ones the heuristic was not tuned on; random data quantized by the reference
(``reference.quantize_blocks_ref``); all variants of a shape timed in turns
(``coda_cute.sol.timing.interleaved_medians``, L2 flushed, CUDA-event medians). Prints TFLOP/s and
ratios per shape, the geomean, the config the heuristic chose and the first-call compile time.

    python scripts/bench_fp8_gemm.py [--rounds 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

from coda_cute import reference as R
from coda_cute.epilogue import runner
from coda_cute.sol.timing import interleaved_medians

LLAMA_NK = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
SHAPES = [(16384, n, k) for n, k in LLAMA_NK] + [(5000, 3000, 2064), (16384, 1000, 4096)]


def tflops(m, n, k, ms):
    return 2 * m * n * k / ms / 1e9


def inputs(m, n, k):
    a_q, sa = R.quantize_blocks_ref(torch.randn(m, k, device="cuda"), (1, 128))
    b_q, sb = R.quantize_blocks_ref(torch.randn(n, k, device="cuda"), (128, 128))
    return a_q, sa.t().contiguous().t(), b_q, sb  # activation scales M-major, as DeepGEMM keeps them


def torch_blockwise(a_q, sa, b_q, sb):
    """torch._scaled_mm with 1 x 128 and 128 x 128 scales, or None where this torch / GPU has no
    such kernel (the call is tried once)."""
    def call():
        return torch._scaled_mm(a_q, b_q.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16)
    try:
        call()
        torch.cuda.synchronize()
    except (RuntimeError, ValueError, NotImplementedError):
        return None
    return call


def run_shape(m, n, k, rounds):
    a_q, sa, b_q, sb = inputs(m, n, k)
    t0 = time.perf_counter()
    torch.ops.coda.gemm_blockwise(a_q, sa, b_q, sb)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    plan = next(p for p in reversed(list(runner._plans.values())) if p.op == "coda.gemm_blockwise")
    # row-wise FP8 of the same operands: one scale per row of a and per column of b^T
    ra = a_q.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
    rb = b_q.float().abs().amax(-1, keepdim=True).clamp_min(1e-12).t().contiguous() / 448.0
    fns = {"ours block": lambda: torch.ops.coda.gemm_blockwise(a_q, sa, b_q, sb),
           "ours row": lambda: torch.ops.coda.gemm(a_q, b_q.t(), ra, rb)}
    theirs = torch_blockwise(a_q, sa, b_q, sb)
    if theirs is not None:
        fns["torch block"] = theirs
    ms = interleaved_medians(fns, rounds=rounds, settle_ms=1000)
    return dict(m=m, n=n, k=k, config=plan.config.name, first_call_s=first_s,
                **{f"{name} ms": v for name, v in ms.items()})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_fp8_gemm needs a CUDA GPU")
    rows = [run_shape(m, n, k, args.rounds) for m, n, k in SHAPES]
    t = Table(title="block-scaled FP8 GEMM (E4M3, 1x128 x 128x128 scales, bf16 out), TFLOP/s")
    for col in ("M x N x K", "config", "first call s", "ours block", "ours row", "torch block",
                "block / row", "block / torch"):
        t.add_column(col, justify="left" if col in ("M x N x K", "config") else "right")
    vs_row, vs_torch = [], []
    for r in rows:
        mnk = (r["m"], r["n"], r["k"])
        ours, row = r["ours block ms"], r["ours row ms"]
        theirs = r.get("torch block ms")
        vs_row.append(row / ours)
        if theirs is not None:
            vs_torch.append(theirs / ours)
        t.add_row(" x ".join(map(str, mnk)), r["config"], f"{r['first_call_s']:.2f}",
                  f"{tflops(*mnk, ours):.0f}", f"{tflops(*mnk, row):.0f}",
                  "-" if theirs is None else f"{tflops(*mnk, theirs):.0f}", f"{row / ours:.3f}",
                  "-" if theirs is None else f"{theirs / ours:.3f}")
    Console(width=160).print(t)
    geo = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")  # noqa: E731
    print(f"geomean speed vs our row-wise FP8: {geo(vs_row):.3f}; vs torch block-wise: "
          f"{geo(vs_torch):.3f} ({len(vs_torch)} of {len(rows)} shapes offered by torch)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
