"""First-call compile time of the FP8 recipes' kernels: the FP8 training issue's target of at most
2 s per kernel.

The kernels are every block-scaled GEMM of the FP8 sublayers and the FP8 LM head
(``report.coda_fp8_specs``): the forward form's trees, the plain dgrad and the weight-gradient form,
each on the config its heuristic picks at the Llama-3-8B layer. With ``--row`` the row-wise
recipe's kernels (promoted, and with fast accumulation) are measured too.

An op's first call asks the heuristic for its config (``runner.choose_config``), which compiles
candidate builds until one does not spill; the launch then takes that build from the process
cache. For each kernel the table gives:

- **kernel**: ``compile_seconds`` of the launched build (tracing, the MLIR passes and ptxas), as
  ``coda_cute.compiler`` times it. The target applies to this.
- **builds**: how many builds the heuristic compiled.
- **first call**: the heuristic's whole time, which is what the op's first call waits for.

Each round runs in a fresh process, with the on-disk kernel cache off. Each process first
compiles a bf16 GEMM, untimed, because the DSL's start-up (about 1 s) is paid once per process,
not per kernel. The binaries are the same on any machine, since they are cross-compiled for
sm_90a, so this runs without a GPU; the times depend on the host's CPU. The table gives medians
over the rounds, and the maximum of the kernel's time.

    python scripts/bench_compile.py [--rounds 3] [--row] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

#: the issue's bound on a kernel's first-call compile
TARGET_S = 2.0


def worker(row: bool) -> dict:
    """{label: first call, builds, kernel seconds, config} of one process."""
    from coda_cute import compiler, report

    compiler.compile_gemm(compiler.GemmSpec("bfloat16", "bfloat16", "bfloat16", "k", "k",
                                            report.default_config(False), arch=report.ARCH))
    calls = []  # (seconds, builds) per choose_config call, in coda_fp8_specs' order
    choose = report.choose_config

    def timed_choose(*args, **kwargs):
        n0, t0 = len(compiler.compiled_kernels()), time.perf_counter()
        cfg = choose(*args, **kwargs)
        calls.append((time.perf_counter() - t0, len(compiler.compiled_kernels()) - n0))
        return cfg

    report.choose_config = timed_choose
    try:
        specs = report.coda_fp8_specs()
        if row:
            specs += report.coda_fp8_specs(row=True) + report.coda_fp8_specs(row=True, fast=True)
    finally:
        report.choose_config = choose
    assert len(calls) == len(specs), (len(calls), len(specs))
    return {s.label: {"first_call": t, "builds": n, "kernel": compiler.get_gemm(s).compile_seconds,
                      "config": s.config.name}
            for s, (t, n) in zip(specs, calls)}


def table(rounds: list[dict]) -> tuple[Table, list[dict]]:
    rows = []
    for lb in rounds[0]:
        kernel = [r[lb]["kernel"] for r in rounds]
        rows.append(dict(kernel=lb, config=rounds[0][lb]["config"], builds=rounds[0][lb]["builds"],
                         seconds=statistics.median(kernel), max=max(kernel),
                         first_call=statistics.median(r[lb]["first_call"] for r in rounds), rounds=kernel))
    t = Table(title=f"first-call compile per kernel (s), {len(rounds)} rounds, target <= {TARGET_S:.0f} s")
    for col in ("kernel", "config", "seconds", "max", f"<= {TARGET_S:.0f} s", "builds", "first call"):
        t.add_column(col, justify="left" if col in ("kernel", "config") else "right")
    for r in rows:
        t.add_row(r["kernel"], r["config"], f"{r['seconds']:.2f}", f"{r['max']:.2f}",
                  "yes" if r["seconds"] <= TARGET_S else "[red]no[/red]", str(r["builds"]),
                  f"{r['first_call']:.2f}")
    return t, rows


def summary(rows: list[dict]) -> str:
    secs = [r["seconds"] for r in rows]
    over = sum(s > TARGET_S for s in secs)
    return (f"{len(rows)} kernels: median {statistics.median(secs):.2f} s, max {max(secs):.2f} s, "
            f"{over} over {TARGET_S:.0f} s; {sum(r['builds'] for r in rows)} builds for their first calls, "
            f"{sum(r['first_call'] for r in rows):.1f} s in all")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="fresh processes, each compiling every kernel once")
    p.add_argument("--row", action="store_true", help="also the row-wise recipe's kernels")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.worker:
        print(json.dumps(worker(args.row)))
        return 0
    console = Console(width=max(Console().width, 120))
    env = dict(os.environ, CODA_CUTE_CACHE_DIR="0")  # every kernel compiled, none loaded
    rounds = []
    for i in range(args.rounds):
        cmd = [sys.executable, __file__, "--worker"] + (["--row"] if args.row else [])
        with console.status(f"round {i + 1} / {args.rounds}: compiling in a fresh process"):
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        rounds.append(json.loads(out.strip().splitlines()[-1]))
    t, rows = table(rounds)
    console.print(t)
    console.print(summary(rows), highlight=False)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
