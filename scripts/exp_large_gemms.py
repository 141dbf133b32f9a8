"""Experiment: why our bf16 GEMM falls behind cuBLAS on the largest training GEMMs.

``bench_train_gemms.py --widths 8192 --tokens 32768`` (H200, 2026-12-02): our heuristic's
ping-pong 128x128 2x1 at 0.69-0.83 of cuBLAS on the GEMMs with an operand of 1.9 GB or more
(gate/up dgrad 32768x8192x57344 0.711, gate/up wgrad 57344x8192x32768 0.692, down fwd
32768x8192x28672 0.761) while cuBLAS held 640-670 TFLOP/s; the same (M, N) at K = 8192 ran at
1.01-1.05. This times those GEMMs, in their training layouts, against cuBLAS in turns with the
raster band (``raster_group``) and the tile shape varied, and samples the SM clock and power
through the run (``nvidia-smi``, 50 ms) to tell a slower kernel from a throttled one.

    python scripts/exp_large_gemms.py [--rounds 5] [--log clocks.csv]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from coda_cute import dispatch
from coda_cute.ops.gemm import gemm_impl
from coda_cute.sol.timing import interleaved_medians

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train_gemms as BTG  # noqa: E402  (the training layouts' operands)

#: (label, kind, tokens, out_features, in_features): the slow ones, and one that was not
CASES = [("gate_up.dgrad", "dgrad", 32768, 57344, 8192), ("gate_up.wgrad", "wgrad", 32768, 57344, 8192),
         ("down.fwd", "fwd", 32768, 8192, 28672), ("gate_up.dgrad K-short", "dgrad", 8192, 57344, 8192)]
GROUPS = (2, 4, 16, 32)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--log", help="write nvidia-smi's SM clock and power samples here (CSV)")
    args = ap.parse_args()
    smi = None
    if args.log:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                                "--format=csv", "-lms", "50", "-f", args.log])
    console = Console(width=150)
    sms = dispatch.num_sms(torch.device("cuda"))
    table = Table(title="large training GEMMs: cuBLAS time / ours per variant (> 1: ours faster)")
    for col in ("GEMM", "M x N x K", "cuBLAS TFLOP/s", "variant", "ratio"):
        table.add_column(col, justify="right")
    try:
        for label, kind, m, n_out, k_in in CASES:
            a, b = BTG.operands(kind, m, n_out, k_in)
            mm, kk, nn = a.shape[0], a.shape[1], b.shape[1]
            cfg = dispatch.select_config(mm, nn, kk, 1, False, False, sms)
            fns = {"cublas": lambda a=a, b=b: torch.mm(a, b), f"ours {cfg.name}": lambda a=a, b=b: gemm_impl(a, b)}
            for g in GROUPS:
                c = cfg.with_(raster_group=g)
                fns[f"g{g}"] = lambda a=a, b=b, c=c: gemm_impl(a, b, config=c)
            for c in (dispatch.GemmConfig(128, 256, 64, "cooperative", 2, 1),
                      dispatch.GemmConfig(128, 128, 64, "pingpong", 1, 1)):
                fns[c.name] = lambda a=a, b=b, c=c: gemm_impl(a, b, config=c)
            want = torch.mm(a, b).float()
            err = float((gemm_impl(a, b).float() - want).norm() / want.norm())
            console.log(f"{label} {mm}x{nn}x{kk}: ours vs cuBLAS rel. difference {err:.2e}")
            del want
            t = interleaved_medians(fns, rounds=args.rounds, settle_ms=300)
            tflops = 2 * mm * nn * kk / t["cublas"] / 1e9
            for name, ms in t.items():
                if name != "cublas":
                    table.add_row(label, f"{mm}x{nn}x{kk}", f"{tflops:.0f}", name, f"{t['cublas'] / ms:.3f}")
                    console.log(f"{label} {name}: {t['cublas'] / ms:.3f}")
            del a, b
            torch.cuda.empty_cache()
    finally:
        if smi is not None:
            smi.terminate()
    console.print(table)


if __name__ == "__main__":
    main()
