"""Benchmark coda.gemm against cuBLAS (torch.mm) and torch._scaled_mm (FP8 row-wise scales).

One run, random data, CUDA-event medians after warm-up with L2 flushed between runs, the torch
baseline and our configs of a shape timed in turns (coda_cute.sol.timing.interleaved_medians).
Prints TFLOP/s per shape, the ratio to the torch baseline and the
geomean; ``--sweep`` also times every config of the config space (ping-pong vs cooperative, tiles,
clusters) and, for 16-bit inputs, split-K by 2, 3, 4 and 8; ``--json`` writes all numbers.

    python scripts/bench_gemm.py [--dtype bf16 fp8] [--sweep] [--json out.json]
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

from coda_cute import dispatch
from coda_cute.compiler import compiled_kernels
from coda_cute.ops.gemm import gemm_impl
from coda_cute.sol.timing import interleaved_medians

LLAMA_NK = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (32768, 4096)]
SHAPES = [(16384, n, k) for n, k in LLAMA_NK] + [(8192, 8192, 8192)] + [
    (m, n, k) for m in (128, 1024) for n, k in LLAMA_NK
]


SPLITS = (2, 3, 4, 8)
#: per shape, run the launches in turns this long before timing: a GPU coming from idle (the
#: first shape) runs several percent faster for a while, which favoured whichever launch took
#: more of that time (cuBLAS 811 TFLOP/s at 16384 x 6144 x 4096 bf16 as the first shape, ~700 later)
SETTLE_MS = 1500


def tflops(m, n, k, ms):
    return 2 * m * n * k / ms / 1e9


def fp8_inputs(m, n, k):
    a32 = torch.randn(m, k, device="cuda")
    w32 = torch.randn(n, k, device="cuda")
    sa = a32.abs().amax(-1, keepdim=True) / 448.0
    sw = w32.abs().amax(-1, keepdim=True) / 448.0
    a = (a32 / sa).to(torch.float8_e4m3fn)
    b = (w32 / sw).to(torch.float8_e4m3fn).t()
    return a, b, sa.contiguous(), sw.t().contiguous()


def run_shape(m, n, k, dtype, sweep, rows, sms):
    """Time torch's GEMM(s) and ours (heuristic config, and with ``sweep`` every config) on one
    shape, all in turns (``interleaved_medians``): the GPU's clocks drift by several percent under
    sustained load, and back-to-back timings would carry that into the ratios."""
    if dtype == "bf16":
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
        base = {"cuBLAS": lambda: torch.mm(a, b)}
        variants = {"coda": lambda cfg=None: gemm_impl(a, b, config=cfg)}
        fp8 = False
    else:
        a, b, sa, sb = fp8_inputs(m, n, k)
        base = {
            "_scaled_mm": lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16),
            "_scaled_mm fast": lambda: torch._scaled_mm(
                a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True),
        }
        variants = {
            "coda": lambda cfg=None: gemm_impl(a, b, sa, sb, config=cfg),
            "coda fast": lambda cfg=None: gemm_impl(a, b, sa, sb, use_fast_accum=True, config=cfg),
        }
        fp8 = True
    fns, ours = dict(base), {}
    for label, fn in variants.items():
        fast = label.endswith("fast")
        cfgs = [None]
        if sweep:
            cfgs += [c for c in dispatch.config_space(fp8) if c.fp8_fast_accum == fast or not fp8]
        for cfg in cfgs:
            chosen = cfg or dispatch.select_config(m, n, k, 1, fp8, fast, sms)
            key = f"{label} {cfg.name if cfg else 'heuristic'}"
            fns[key] = lambda fn=fn, cfg=cfg: fn(cfg)
            ours[key] = (label if cfg is None else "sweep", chosen.name,
                         "_scaled_mm fast" if (fp8 and fast) else next(iter(base)))
    if sweep and not fp8:  # split-K (16-bit only): K slices as one batched launch + a torch sum
        for split in SPLITS:
            if k % (split * 64) == 0:
                chosen = dispatch.select_config(m, n, k // split, split, False, False, sms)
                key = f"coda split_k={split}"
                fns[key] = lambda split=split: gemm_impl(a, b, split_k=split)
                ours[key] = ("sweep", f"{chosen.name}+split_k{split}", "cuBLAS")
    times = interleaved_medians(fns, settle_ms=SETTLE_MS)
    for label in base:
        ms = times[label]
        rows.append(dict(dtype=dtype, m=m, n=n, k=k, impl=label, config="", ms=ms, tflops=tflops(m, n, k, ms)))
    for key, (impl, config, ref) in ours.items():
        ms = times[key]
        rows.append(dict(dtype=dtype, m=m, n=n, k=k, impl=impl, config=config, ms=ms,
                         tflops=tflops(m, n, k, ms), ratio=times[ref] / ms))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    ap.add_argument("--sweep", action="store_true", help="also time every config of the config space")
    ap.add_argument("--shapes", default="all", choices=["all", "large", "small"],
                    help="large: M=16384 and 8192^3; small: M=128 and 1024")
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_gemm needs a CUDA GPU")
    torch.manual_seed(0)
    sms = dispatch.num_sms(torch.device("cuda", torch.cuda.current_device()))
    shapes = {"all": SHAPES, "large": SHAPES[:6], "small": SHAPES[6:]}[args.shapes]
    console = Console(width=160)
    rows = []
    t0 = time.perf_counter()
    for dtype in args.dtype:
        for m, n, k in shapes:
            run_shape(m, n, k, dtype, args.sweep, rows, sms)
            console.log(f"{dtype} {m}x{n}x{k} done ({time.perf_counter() - t0:.0f} s)")
    compiled = compiled_kernels()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows,
                       "compile_seconds": {c.spec.name: c.compile_seconds for c in compiled}}, fh, indent=1)
    if args.sweep:
        t = Table(title="config sweep (TFLOP/s)")
        for col in ("dtype", "shape", "best config", "best", "heuristic", "heur. config"):
            t.add_column(col)
        for dtype in args.dtype:
            for m, n, k in shapes:
                sw = [r for r in rows if r["dtype"] == dtype and (r["m"], r["n"], r["k"]) == (m, n, k) and r["impl"] == "sweep"]
                for label in (["coda"] if dtype == "bf16" else ["coda", "coda fast"]):
                    heur = next(r for r in rows if r["dtype"] == dtype and (r["m"], r["n"], r["k"]) == (m, n, k) and r["impl"] == label)
                    fast = label.endswith("fast")
                    cands = [r for r in sw if ("fastacc" in r["config"]) == fast] or sw
                    best = max(cands, key=lambda r: r["tflops"])
                    t.add_row(f"{dtype}{' fast' if fast else ''}", f"{m}x{n}x{k}", best["config"],
                              f"{best['tflops']:.0f}", f"{heur['tflops']:.0f}", heur["config"])
        console.print(t)
    for dtype in args.dtype:
        t = Table(title=f"{dtype}: TFLOP/s, coda vs torch (median of CUDA-event timings)")
        base_names = ["cuBLAS"] if dtype == "bf16" else ["_scaled_mm", "_scaled_mm fast"]
        ours = ["coda"] if dtype == "bf16" else ["coda", "coda fast"]
        for col in ["shape (MxNxK)", *base_names, *ours, *(f"{o} ratio" for o in ours), "config"]:
            t.add_column(col, justify="right")
        ratios = {o: [] for o in ours}
        large_min = {o: math.inf for o in ours}
        for m, n, k in shapes:
            sel = {r["impl"]: r for r in rows if r["dtype"] == dtype and (r["m"], r["n"], r["k"]) == (m, n, k)}
            cells = [f"{m}x{n}x{k}"] + [f"{sel[b]['tflops']:.0f}" for b in base_names] + [f"{sel[o]['tflops']:.0f}" for o in ours]
            for o in ours:
                ratios[o].append(sel[o]["ratio"])
                if m >= 8192:
                    large_min[o] = min(large_min[o], sel[o]["ratio"])
            cells += [f"{sel[o]['ratio']:.3f}" for o in ours] + [sel[ours[0]]["config"]]
            t.add_row(*cells)
        console.print(t)
        for o in ours:
            g = math.exp(sum(math.log(r) for r in ratios[o]) / len(ratios[o]))
            console.print(f"{dtype} {o}: geomean ratio {g:.3f} over {len(ratios[o])} shapes; "
                          f"min over large shapes {large_min[o]:.3f}")
    cs = [c.compile_seconds for c in compiled if c.compile_seconds > 0]
    if cs:
        console.print(f"compile time per kernel: first {cs[0]:.2f} s, median {sorted(cs)[len(cs)//2]:.2f} s, "
                      f"max {max(cs):.2f} s over {len(cs)} kernels"
                      f" ({len(compiled) - len(cs)} more loaded from the disk cache)")


if __name__ == "__main__":
    main()
