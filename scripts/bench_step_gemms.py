"""Every GEMM launch of one CODA training step, replayed: its fused epilogue against our plain
GEMM and cuBLAS on the same operands, timed in turns.

One step (forward + ``loss.backward()``) of the 2-layer ``CodaLlama`` of ``scripts/bench_train.py``
runs with the epilogue runner's launches recorded (tree, operands, inputs, preallocated outputs).
Each distinct launch is then timed as it ran (``fused``), as a plain bf16 GEMM of ours on the same
operands (``plain``: what the epilogue costs) and as ``torch.mm`` (``cuBLAS``), all in turns with
L2 flushed (``coda_cute.sol.timing.interleaved_times``; each launch's fused / cuBLAS also as the
median and quartiles of its per-round ratios, ``paired_ratios``). The sums weighted by how often
each launch ran say how far the step's GEMMs are from the shadow's, and which trees carry the gap.

``--cooperative``: also each ping-pong launch's tree on the cooperative 128 x 256 tile the step's
other bf16 launches run (``fused coop``, in the same turns): on H100s (2026-12-06) ping-pong trees
took up to 1.38x cuBLAS's time where the cooperative ones took at most 1.015x. With it, our plain
GEMM is also timed on the ping-pong pick's own tile (``plain tile``): what that tile's mainloop
costs on the shape, so that fused / plain tile is the tree's own cost there.

``--once``: no timing; each launch of the ops ``--only`` names (every launch without it) runs each
variant once inside the NVTX range ``gemms``, for ncu (``--nvtx --nvtx-include "gemms/"``), after a
warm-up call outside it: the profiler's kernels in the order the log names them.

``--energy``: also each launch's joules per call, the three run back to back for about
``ENERGY_RUN_MS`` each (``coda_cute.sol.energy.joules_over_run``). Under the H200's power cap a
step's time follows its joules, so a launch as fast as cuBLAS from idle but hungrier falls behind
it in a sustained step; fused / plain says what the epilogue costs in joules, plain / cuBLAS what
the mainloop does.

    python scripts/bench_step_gemms.py [--configs 1b 8b] [--rounds 10] [--cooperative] [--energy] [--json out.json]
    python scripts/bench_step_gemms.py --configs 8b --cooperative --once --only coda.lm_head_ce coda.norm_swiglu
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_models as TM  # noqa: E402  (the benchmark models of scripts/bench_train.py)

from coda_cute.epilogue import runner  # noqa: E402
from coda_cute.kernels.common.config import GemmConfig  # noqa: E402
from coda_cute.nn.llama import CodaLlama, LlamaConfig  # noqa: E402
from coda_cute.ops.gemm import gemm_impl  # noqa: E402
from coda_cute.sol.energy import joules_over_run  # noqa: E402
from coda_cute.sol.timing import calls_in_range, interleaved_times, paired_ratios, ratio_text  # noqa: E402

#: milliseconds of back-to-back calls per launch and variant for its joules (``--energy``)
ENERGY_RUN_MS = 1000
VARIANTS = ("fused", "plain", "cublas")
#: ``--cooperative``: the tile a ping-pong launch's tree is also timed on
COOPERATIVE = GemmConfig(128, 256, 64, "cooperative", 2, 1)


def record_launches(step) -> list:
    """Run ``step()`` once with every epilogue launch recorded: [(plan, a, b, inputs, outputs)],
    one entry per distinct plan with the number of launches it made."""
    seen: dict = {}
    original = runner.Plan.launch

    def launch(plan, a, b, inputs, outputs=None, block_scales=None):
        entry = seen.get(id(plan))
        if entry is None:
            seen[id(plan)] = entry = [plan, a, b, dict(inputs), dict(outputs or {}), block_scales, 0]
        entry[6] += 1
        return original(plan, a, b, inputs, outputs, block_scales)

    runner.Plan.launch = launch
    try:
        step()
        torch.cuda.synchronize()
    finally:
        runner.Plan.launch = original
    return list(seen.values())


def layout_of(a_stride, b_stride) -> str:
    """The operands' majors as the training layouts name them: "kk" (forward), "kn" (dgrad),
    "mn" (wgrad)."""
    return ("k" if a_stride[-1] == 1 else "m") + ("k" if b_stride[-2] == 1 else "n")


def label(plan) -> str:
    return f"{plan.op} [{'+'.join(o.name for o in plan.tree.outputs)}]"


def step_launches(name: str, layers: int, precision=None) -> list:
    """:func:`record_launches` of one training step of ``scripts/bench_train.py``'s CODA model
    ``name`` (``layers`` layers, 4 x 4096 tokens), after a first step that compiles every kernel;
    ``precision``: the model's (``CodaLlama``'s argument: "fp8" or an ``Fp8Recipe``)."""
    spec = TM.SPECS[name]
    torch.manual_seed(0)
    model = CodaLlama(LlamaConfig(**spec.coda_kwargs(layers)), device="cuda", precision=precision)
    model.train()
    tokens = TM.random_tokens(4, 4096, spec.vocab_size).cuda()
    step = TM.coda_step(model, tokens, TM.shift_labels(tokens), list(model.parameters()))
    step()
    return record_launches(step)


def cooperative_plan(plan, a, b, inputs):
    """``plan``'s tree on :data:`COOPERATIVE`, or None where it runs there already or cannot."""
    if plan.config.schedule != "pingpong" or a.dtype != torch.bfloat16:
        return None
    try:
        return runner._make_plan(plan.tree, a, b, inputs, COOPERATIVE, False, plan.op + " (cooperative)")
    except ValueError:  # the tree's shared memory or segment widths rule the tile out (EpilogueError)
        return None


def launch_functions(plan, a, b, inputs, outputs, scales, cooperative: bool) -> dict:
    """The variants of one recorded launch, by name (:data:`VARIANTS`; with ``cooperative`` and a
    ping-pong pick also ``fused_coop`` and ``plain_tile``)."""
    mm = torch.bmm if a.dim() == 3 else torch.mm
    fns = {"fused": lambda: plan.launch(a, b, inputs, outputs or None, scales),
           "plain": lambda: gemm_impl(a, b),
           "cublas": lambda: mm(a, b)}
    coop = cooperative_plan(plan, a, b, inputs) if cooperative else None
    if coop is not None:
        fns["fused_coop"] = lambda: coop.launch(a, b, inputs, outputs or None)
        fns["plain_tile"] = lambda: gemm_impl(a, b, config=plan.config)
    return fns


def profile_config(name: str, layers: int, only: list, console: Console):
    """``--once``: each variant of the launches whose op is one of ``only`` (all without it),
    once to warm up and once inside the NVTX range ``gemms`` (``sol.timing.calls_in_range``)."""
    for plan, a, b_, inputs, outputs, scales, _count in step_launches(name, layers):
        if only and plan.op not in only:
            continue
        what = f"{name} {label(plan)} {tuple(a.shape)} x {tuple(b_.shape)} ({plan.config.name})"
        fns = launch_functions(plan, a, b_, inputs, outputs, scales, True)
        calls_in_range(fns, log=lambda variant, what=what: console.log(f"{what}: {variant}"))


def time_config(name: str, layers: int, rounds: int, console: Console, energy: bool = False,
                cooperative: bool = False) -> list:
    rows = []
    for plan, a, b_, inputs, outputs, scales, count in step_launches(name, layers):
        fns = launch_functions(plan, a, b_, inputs, outputs, scales, cooperative)
        times = interleaved_times(fns, rounds=rounds, settle_ms=300)
        t = {key: statistics.median(v) for key, v in times.items()}
        m, k = a.shape[-2:]
        n = b_.shape[-1]
        rows.append(dict(config=name, launch=label(plan), count=count, m=m, n=n, k=k,
                         layout=layout_of(a.stride(), b_.stride()),
                         tile=plan.config.name, **{f"{key}_ms": v for key, v in t.items()},
                         fused_per_round=list(paired_ratios(times, "cublas")["fused"])))
        r = rows[-1]
        if energy:
            for key in VARIANTS:
                e = joules_over_run(fns[key], t[key], run_ms=ENERGY_RUN_MS)
                r[f"{key}_j"] = None if e is None else e["j_per_call"]
        console.log(f"{name} {r['launch']} {m}x{n}x{k} x{count}: fused {r['fused_ms']:.3f} plain "
                    f"{r['plain_ms']:.3f} cuBLAS {r['cublas_ms']:.3f}, fused / cuBLAS per round "
                    + ratio_text(r["fused_per_round"])
                    + (f" fused coop {r['fused_coop_ms']:.3f} plain tile {r['plain_tile_ms']:.3f}"
                       if 'fused_coop_ms' in r else "")
                    + ("".join(f", {key} {r[f'{key}_j']:.4f} J" for key in VARIANTS if r.get(f"{key}_j"))))
    return rows


#: per unit of a launch table: what its values are, their format, and the sums line's lead
UNITS = {"ms": ("ms per launch; ratios > 1: slower than cuBLAS", "{:.3f}", "sum over the step's launches"),
         "j": ("joules per launch, back to back; ratios > 1: more than cuBLAS", "{:.4f}",
               "joules over the step's launches")}


def report(rows: list, console: Console):
    for name in dict.fromkeys(r["config"] for r in rows):
        sel = [r for r in rows if r["config"] == name]
        print_launches(name, sel, "ms", console)
        if all(r.get(f"{k}_j") for r in sel for k in VARIANTS):
            print_launches(name, sel, "j", console)


def print_launches(name: str, sel: list, unit: str, console: Console):
    """One config's launches in ``unit`` ("ms", or "j" with ``--energy``), the heaviest first
    (per launch times its count), and their sums over the step."""
    what, fmt, lead = UNITS[unit]
    t = Table(title=f"{name}: the step's GEMM launches ({what})")
    rounds = unit == "ms" and all("fused_per_round" in r for r in sel)
    for col in ("launch", "M x N x K", "layout", "count", "config", "fused", "plain", "cuBLAS",
                "fused / cuBLAS", "plain / cuBLAS") + (("fused / cuBLAS per round",) if rounds else ()):
        t.add_column(col, justify="left" if col in ("launch", "config") else "right")
    for r in sorted(sel, key=lambda r: -r[f"fused_{unit}"] * r["count"]):
        fused, plain, cublas = (r[f"{k}_{unit}"] for k in VARIANTS)
        t.add_row(r["launch"], f"{r['m']}x{r['n']}x{r['k']}", r["layout"], str(r["count"]), r["tile"],
                  fmt.format(fused), fmt.format(plain), fmt.format(cublas), f"{fused / cublas:.3f}",
                  f"{plain / cublas:.3f}", *((ratio_text(r["fused_per_round"]),) if rounds else ()))
    console.print(t)
    tot = {k: sum(r[f"{k}_{unit}"] * r["count"] for r in sel) for k in VARIANTS}
    u = " ms" if unit == "ms" else " J"
    console.print(f"{name}: {lead}: fused {tot['fused']:.2f}{u}, plain {tot['plain']:.2f}{u}, cuBLAS "
                  f"{tot['cublas']:.2f}{u} (fused / cuBLAS {tot['fused'] / tot['cublas']:.3f}, plain / cuBLAS "
                  f"{tot['plain'] / tot['cublas']:.3f})")
    coop = [r for r in sel if f"fused_coop_{unit}" in r]
    if coop:
        best = tot["fused"] - sum((r[f"fused_{unit}"] - min(r[f"fused_{unit}"], r[f"fused_coop_{unit}"])) * r["count"]
                                  for r in coop)
        for r in coop:
            console.print(f"  {r['launch']} {r['m']}x{r['n']}x{r['k']}: {r['tile']} {fmt.format(r[f'fused_{unit}'])}, "
                          f"cooperative {fmt.format(r[f'fused_coop_{unit}'])} "
                          f"({r[f'fused_coop_{unit}'] / r[f'cublas_{unit}']:.3f} of cuBLAS); plain on "
                          f"{r['tile']} {r[f'plain_tile_{unit}'] / r[f'cublas_{unit}']:.3f} of cuBLAS")
        console.print(f"{name}: each ping-pong tree on the faster of its tile and the cooperative one: "
                      f"{best:.2f}{u} (/ cuBLAS {best / tot['cublas']:.3f})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["1b", "8b"], choices=sorted(TM.SPECS))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--cooperative", action="store_true",
                    help="also each ping-pong tree on the cooperative 128 x 256 tile (module docstring)")
    ap.add_argument("--energy", action="store_true", help="also each launch's joules per call (module docstring)")
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--once", action="store_true", help="no timing: each variant once in an NVTX range (ncu)")
    ap.add_argument("--only", nargs="+", default=[], metavar="OP",
                    help="--once: the launches of these ops (e.g. coda.norm_swiglu)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_step_gemms needs a CUDA GPU")
    console = Console(width=180)
    if args.once:
        for name in args.configs:
            profile_config(name, args.layers, args.only, console)
        return
    rows = []
    for name in args.configs:
        rows += time_config(name, args.layers, args.rounds, console, args.energy, args.cooperative)
        torch.cuda.empty_cache()
    report(rows, console)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
