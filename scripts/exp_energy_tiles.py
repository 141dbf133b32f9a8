"""Experiment: which tile config spends the fewest joules on each GEMM of a training step.

During a training step the H200 sits at its 700 W cap, so a GEMM's share of the step follows its
joules, not its time from a cool GPU (``coda_cute.sol.energy``). ``scripts/bench_step_gemms.py
--energy`` showed the heuristic's pick (ping-pong 128 x 128 2x1, fastest from cool) spending 1.04x
cuBLAS's joules over the 8b step's GEMMs while taking 0.965x its time. This replays every distinct
GEMM shape and layout of one CODA step (2 layers, 4 x 4096 tokens) as a plain bf16 GEMM of ours on
each candidate config and as ``torch.mm``: the median ms in turns from cool
(``interleaved_medians``) and, back to back for ``--run-ms``, joules and ms per call at the cap.

    python scripts/exp_energy_tiles.py [--configs 1b 8b] [--run-ms 600] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_models as TM  # noqa: E402  (the benchmark models' names)
from bench_step_gemms import step_launches  # noqa: E402

from coda_cute.kernels.common.config import GemmConfig  # noqa: E402
from coda_cute.ops.gemm import gemm_impl  # noqa: E402
from coda_cute.sol.energy import joules_over_run  # noqa: E402
from coda_cute.sol.timing import interleaved_medians  # noqa: E402

CANDIDATES = {
    "pp128x128 2x1": GemmConfig(128, 128, 64, "pingpong", 2, 1),
    "coop128x256 2x1": GemmConfig(128, 256, 64, "cooperative", 2, 1),
    "coop128x256 1x2": GemmConfig(128, 256, 64, "cooperative", 1, 2),
    "coop256x128 2x1": GemmConfig(256, 128, 64, "cooperative", 2, 1),
    "coop128x192 2x1": GemmConfig(128, 192, 64, "cooperative", 2, 1),
}


def shapes_of(name: str, layers: int) -> list:
    """The distinct (a, b) operand pairs (shape, strides) of one CODA step's bf16 GEMM launches,
    with how many launches each made."""
    seen: dict = {}
    for _plan, a, b, _i, _o, scales, count in step_launches(name, layers):
        if scales is None and a.dtype == torch.bfloat16:
            key = (tuple(a.shape), a.stride(), tuple(b.shape), b.stride())
            seen[key] = seen.get(key, 0) + count
    torch.cuda.empty_cache()
    return list(seen.items())


def operand(shape, stride):
    """A fresh random bf16 tensor of this shape and these strides (a transposed view where the
    step's was)."""
    if stride[-1] == 1:
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    return torch.randn(shape[::-1], device="cuda", dtype=torch.bfloat16).transpose(-1, -2)


def measure(name: str, layers: int, run_ms: float, rounds: int, console: Console) -> list:
    rows = []
    for (ash, ast, bsh, bst), count in shapes_of(name, layers):
        a, b = operand(ash, ast), operand(bsh, bst)
        m, k, n = ash[-2], ash[-1], bsh[-1]
        fns = {"cuBLAS": lambda: torch.mm(a, b)}
        for label, cfg in CANDIDATES.items():
            try:
                gemm_impl(a, b, config=cfg)
            except (ValueError, TypeError, RuntimeError) as exc:
                console.log(f"{name} {m}x{n}x{k}: {label} skipped ({str(exc)[:80]})")
                continue
            fns[label] = lambda cfg=cfg: gemm_impl(a, b, config=cfg)
        cool = interleaved_medians(fns, rounds=rounds, settle_ms=300)
        row = dict(config=name, m=m, n=n, k=k, count=count,
                   layout=("k" if ast[-1] == 1 else "m") + ("k" if bst[-2] == 1 else "n"), variants={})
        for label, fn in fns.items():
            e = joules_over_run(fn, cool[label], run_ms=run_ms)
            row["variants"][label] = dict(cool_ms=cool[label], j=e and e["j_per_call"],
                                          cap_ms=e and e["ms_per_call"], watts=e and e["watts"])
        rows.append(row)
        console.log(f"{name} {m}x{n}x{k} {row['layout']} x{count}: " + ", ".join(
            f"{lb} {v['cool_ms']:.3f}/{v['cap_ms']:.3f} ms {v['j']:.3f} J" for lb, v in row["variants"].items()))
    return rows


def report(rows: list, console: Console):
    labels = ["cuBLAS", *CANDIDATES]
    for name in dict.fromkeys(r["config"] for r in rows):
        sel = [r for r in rows if r["config"] == name]
        t = Table(title=f"{name}: joules per call at the cap, / cuBLAS's (ms from cool / cuBLAS's in brackets)")
        for col in ("M x N x K", "layout", "count", *labels):
            t.add_column(col, justify="right")
        tot = {lb: [0.0, 0.0] for lb in labels}
        for r in sel:
            base = r["variants"]["cuBLAS"]
            cells = []
            for lb in labels:
                v = r["variants"].get(lb)
                if v is None:
                    cells.append("-")
                    continue
                cells.append(f"{v['j'] / base['j']:.3f} ({v['cool_ms'] / base['cool_ms']:.3f})"
                             if lb != "cuBLAS" else f"{v['j']:.3f} J ({v['cool_ms']:.3f} ms)")
            t.add_row(f"{r['m']}x{r['n']}x{r['k']}", r["layout"], str(r["count"]), *cells)
            for lb in labels:
                v = r["variants"].get(lb) or r["variants"]["pp128x128 2x1"]  # skipped: the usual pick
                tot[lb][0] += r["count"] * v["j"]
                tot[lb][1] += r["count"] * v["cool_ms"]
        best_j = sum(r["count"] * min(v["j"] for k, v in r["variants"].items() if k != "cuBLAS") for r in sel)
        console.print(t)
        console.print(f"{name}: step sums (J, cool ms): " + ", ".join(
            f"{lb} {tot[lb][0]:.2f} J / {tot[lb][1]:.2f} ms" for lb in labels)
            + f"; least-joule tile per shape {best_j:.2f} J")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["1b", "8b"], choices=sorted(TM.SPECS))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--run-ms", type=float, default=600)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("exp_energy_tiles needs a CUDA GPU")
    console, rows = Console(width=200), []
    for name in args.configs:  # the JSON is rewritten after each model: a cut-off run keeps the first
        rows += measure(name, args.layers, args.run_ms, args.rounds, console)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    report(rows, console)


if __name__ == "__main__":
    main()
