"""Experiment: which tile config spends the fewest joules on each GEMM of a training step.

During a training step the H200 sits at its 700 W cap, so a GEMM's share of the step follows its
joules, not its time from a cool GPU (``coda_cute.sol.energy``). ``scripts/bench_step_gemms.py
--energy`` showed ping-pong 128 x 128 2x1 (fastest from cool) spending 1.04x cuBLAS's joules over
the 8b step's GEMMs while taking 0.965x its time. This replays every distinct GEMM shape and
layout of one CODA step (2 layers, 4 x 4096 tokens) as a plain GEMM of ours on each candidate
config and as torch's: the median ms in turns from cool (``interleaved_medians``) and, back to
back for ``--run-ms``, joules and ms per call at the cap. Its bf16 run (2026-12-04) is the data of
``dispatch._RATES_16`` and ``dispatch.COOP_EPILOGUE_K``.

``--fp8``: the same (M, N, K) but for the LM head's (which the FP8 recipes keep in bf16), as the
row-wise recipe's GEMMs with fast accumulation (e4m3, K-major, one scale per row and column) on
the FP8 candidates, against ``torch._scaled_mm(use_fast_accum=True)``: the data of
``dispatch._RATES_FP8_FAST`` and ``dispatch.COOP_EPILOGUE_K_FP8_FAST`` (2026-12-04).

``--fused``: each bf16 launch of the step as it ran, with its epilogue tree, on every candidate
config that holds the tree without spilling, each row marked with its tile inputs and whether its
tree computes more than a scaled store (``runner.computes``): the data of the cooperative
configs' charges for a tree (``runner.COOP_TREE_K``, ``runner.COOP_TILE_INPUT_K``; 2026-12-04).
``--fused --fp8``: the same for the FP8 launches of the step in the row-wise recipe with fast
accumulation, against ``_scaled_mm``: the data that moved the FP8 fast kernels' trees from a
factor measured from cool (``runner.COOP_TILE_INPUT_COST``) to the 16-bit depths (2026-12-04).

    python scripts/exp_energy_tiles.py [--configs 1b 8b] [--fp8] [--fused] [--run-ms 600] [--json out.json]
        [--only LABEL ...]                                # these candidates alone
    python scripts/exp_energy_tiles.py --fit out.json      # the rates these runs give (no GPU)

``--fit`` fits the heuristic's model to a run's back-to-back times (:func:`fit`): one rate per
config, one epilogue depth for the cooperative ones and, on a ``--fused`` run, the depths a
computing tree and each tile input add to it, by least squares on the log of the times; then,
fitted on each model's rows alone, how close its picks come on the other's. On a 16-bit run it
also gives the card's ping-pong scale against the H200's table (``dispatch.PINGPONG_16_SCALE``:
0.83 from the H100's 8b ``--fused`` run, 2026-12-06).

``pp128x128 1x2`` is ``_scaled_mm``'s own tile with fast accumulation (nvjet 128 x 128, 6
stages, 1x2 cluster). On our kernel it did no better than the 2x1 cluster (H200, 2026-12-05,
``--fused --fp8 --configs 8b``: the step's 14 FP8 launches 26.59 J / 33.81 ms from cool against
26.31 J / 33.61 ms), so it is not in ``dispatch``'s config space.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_models as TM  # noqa: E402  (the benchmark models' names)
from bench_gemm import fp8_inputs  # noqa: E402
from bench_step_gemms import label as launch_label, layout_of, step_launches  # noqa: E402

from coda_cute import dispatch  # noqa: E402
from coda_cute.epilogue import runner  # noqa: E402
from coda_cute.kernels.common.config import GemmConfig  # noqa: E402
from coda_cute.ops.gemm import gemm_impl  # noqa: E402
from coda_cute.precision import Fp8Recipe  # noqa: E402
from coda_cute.sol.energy import joules_over_run  # noqa: E402
from coda_cute.sol.timing import interleaved_medians  # noqa: E402

#: the configs each run tries (the first: the usual pick, whose numbers stand in for a config
#: that cannot run a shape in the step sums), and torch's GEMM it is measured against
CANDIDATES = {
    "pp128x128 2x1": GemmConfig(128, 128, 64, "pingpong", 2, 1),
    "coop128x256 2x1": GemmConfig(128, 256, 64, "cooperative", 2, 1),
    "coop128x256 1x2": GemmConfig(128, 256, 64, "cooperative", 1, 2),
    "coop256x128 2x1": GemmConfig(256, 128, 64, "cooperative", 2, 1),
    "coop128x192 2x1": GemmConfig(128, 192, 64, "cooperative", 2, 1),
    # the one cooperative tile 128 columns wide that holds the exp-form logits tree without
    # spilling (256 x 128 spills): the H100's config of that GEMM (lm_head_ce.EXP_CONFIGS,
    # from this script's --fused run on 2026-12-06: 1.111 of cuBLAS's joules against ping-pong's 1.149)
    "coop128x128 2x1": GemmConfig(128, 128, 64, "cooperative", 2, 1),
}
CANDIDATES_FP8 = {
    label: GemmConfig(tm, tn, 128, sched, cm, cn, fp8_fast_accum=True)
    for label, (tm, tn, sched, cm, cn) in {
        "pp128x128 2x1": (128, 128, "pingpong", 2, 1),
        "coop128x256 2x1": (128, 256, "cooperative", 2, 1),
        "coop128x256 1x2": (128, 256, "cooperative", 1, 2),
        "coop256x128 2x1": (256, 128, "cooperative", 2, 1),
        "coop128x128 2x1": (128, 128, "cooperative", 2, 1),
        # added for the second 2026-12-04 run, which measured its rate at the cap
        "coop128x192 2x1": (128, 192, "cooperative", 2, 1),
        # _scaled_mm's own tile with fast accumulation (nvjet 128x128 6 stages 1x2, 2026-12-05)
        "pp128x128 1x2": (128, 128, "pingpong", 1, 2),
    }.items()}
BASE = {False: "cuBLAS", True: "_scaled_mm fast"}


def shapes_of(name: str, layers: int, fp8: bool) -> list:
    """[((a shape, a strides, b shape, b strides), launches)] over one CODA step's bf16 GEMM
    launches, distinct operand pairs; ``fp8``: distinct (M, N, K) outside the LM head, K-major."""
    seen: dict = {}
    vocab = TM.SPECS[name].vocab_size
    for _plan, a, b, _i, _o, scales, count in step_launches(name, layers):
        if scales is not None or a.dtype != torch.bfloat16:
            continue
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        if not fp8:
            key = (tuple(a.shape), a.stride(), tuple(b.shape), b.stride())
        elif vocab in (m, n, k):
            continue
        else:
            key = ((m, k), (k, 1), (k, n), (1, k))
        seen[key] = seen.get(key, 0) + count
    torch.cuda.empty_cache()
    return list(seen.items())


def operand(shape, stride):
    """A fresh random bf16 tensor of this shape and these strides (a transposed view where the
    step's was)."""
    if stride[-1] == 1:
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    return torch.randn(shape[::-1], device="cuda", dtype=torch.bfloat16).transpose(-1, -2)


def functions(m: int, n: int, k: int, ash, ast, bsh, bst, fp8: bool):
    """(torch's GEMM, ours on a given config) on fresh random operands of the shape."""
    if fp8:
        a, b, sa, sb = fp8_inputs(m, n, k)
        return (lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True),
                lambda cfg: gemm_impl(a, b, sa, sb, use_fast_accum=True, config=cfg))
    a, b = operand(ash, ast), operand(bsh, bst)
    return (lambda: torch.mm(a, b)), (lambda cfg: gemm_impl(a, b, config=cfg))


def measure(name: str, layers: int, run_ms: float, rounds: int, fp8: bool, console: Console):
    """Each distinct GEMM of the step (plain, or ``fp8``) on every candidate config: its rows, one
    at a time."""
    for (ash, ast, bsh, bst), count in shapes_of(name, layers, fp8):
        m, k, n = ash[-2], ash[-1], bsh[-1]
        base, ours = functions(m, n, k, ash, ast, bsh, bst, fp8)
        fns = {BASE[fp8]: base}
        for label, cfg in (CANDIDATES_FP8 if fp8 else CANDIDATES).items():
            try:
                ours(cfg)
            except (ValueError, TypeError, RuntimeError) as exc:
                console.log(f"{name} {m}x{n}x{k}: {label} skipped ({str(exc)[:80]})")
                continue
            fns[label] = lambda cfg=cfg: ours(cfg)
        yield timed_row(fns, dict(config=name, fp8=fp8, m=m, n=n, k=k, count=count, layout=layout_of(ast, bst)),
                        run_ms, rounds, console)


#: the FP8 step ``--fused --fp8`` records: the row-wise recipe, every GEMM accumulating fast
FP8_FUSED_RECIPE = dict(scaling="row", fast_accum="all")


def measure_fused(name: str, layers: int, run_ms: float, rounds: int, console: Console, fp8: bool = False):
    """Each bf16 launch of the step with its epilogue tree (``--fused``) on every candidate config
    whose build fits the tree's shared memory without spilling, against ``torch.mm``: its rows,
    one at a time. ``fp8``: the FP8 launches of the step in the row-wise recipe with fast
    accumulation (``FP8_FUSED_RECIPE``) on the FP8 candidates, against ``torch._scaled_mm`` with
    unit row and column scales."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    precision = Fp8Recipe(**FP8_FUSED_RECIPE) if fp8 else None
    for plan, a, b, inputs, _o, scales, count in step_launches(name, layers, precision):
        if scales is not None or a.dtype != (torch.float8_e4m3fn if fp8 else torch.bfloat16):
            continue
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        fns = {BASE[fp8]: _scaled_mm_fast(a, b) if fp8 else lambda a=a, b=b: torch.mm(a, b)}
        for label, cfg in (CANDIDATES_FP8 if fp8 else CANDIDATES).items():
            fn = (lambda cfg=cfg, p=plan, a=a, b=b, i=inputs:
                  runner.run(p.tree, a, b, i, config=cfg, use_fast_accum=fp8, op=p.op))
            if not runner.fits(plan.tree, cfg, 1 if fp8 else 2) or runner.spills(plan.tree, cfg, fp8, sms):
                console.log(f"{name} {plan.op} {m}x{n}x{k}: {label} skipped (no room, or spills)")
                continue
            try:
                fn()
            except ValueError as exc:  # a config the tree's sinks cannot run on (quantize sinks)
                console.log(f"{name} {plan.op} {m}x{n}x{k}: {label} skipped ({str(exc)[:80]})")
                continue
            fns[label] = fn
        tiles = [i for i in plan.tree.inputs if i.kind == "tile"]
        yield timed_row(fns, dict(config=name, fp8=fp8, launch=launch_label(plan), tile_inputs=len(tiles),
                                  wide_inputs=sum(1 for i in tiles if i.wide),
                                  computes=runner.computes(plan.tree),
                                  m=m, n=n, k=k, count=count, layout=layout_of(a.stride(), b.stride())),
                        run_ms, rounds, console)


def _scaled_mm_fast(a: torch.Tensor, b: torch.Tensor):
    """``torch._scaled_mm`` of the FP8 operands with fast accumulation and unit row-wise scales."""
    sa = torch.ones(a.shape[0], 1, device=a.device)
    sb = torch.ones(1, b.shape[1], device=a.device)
    return lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True)


def timed_row(fns: dict, row: dict, run_ms: float, rounds: int, console: Console) -> dict:
    """``row`` with each function's ms from cool (in turns) and, back to back, its joules and ms
    per call under ``variants``."""
    cool = interleaved_medians(fns, rounds=rounds, settle_ms=300)
    row["variants"] = {}
    for label, fn in fns.items():
        e = joules_over_run(fn, cool[label], run_ms=run_ms)
        row["variants"][label] = dict(cool_ms=cool[label], j=e and e["j_per_call"],
                                      cap_ms=e and e["ms_per_call"], watts=e and e["watts"])
    console.log(f"{row['config']} {row.get('launch', '')} {row['m']}x{row['n']}x{row['k']} {row['layout']} "
                f"x{row['count']}: " + ", ".join(f"{lb} {v['cool_ms']:.3f}/{v['cap_ms']:.3f} ms {v['j']:.3f} J"
                                                  for lb, v in row["variants"].items()))
    return row


def report(rows: list, console: Console):
    for name, fp8 in dict.fromkeys((r["config"], r.get("fp8", False)) for r in rows):
        sel = [r for r in rows if r["config"] == name and r.get("fp8", False) == fp8]
        base, usual = BASE[fp8], next(iter(CANDIDATES_FP8 if fp8 else CANDIDATES))
        labels = [base, *(CANDIDATES_FP8 if fp8 else CANDIDATES)]
        t = Table(title=f"{name}{' FP8' if fp8 else ''}: joules per call at the cap, / {base}'s "
                        f"(ms from cool / {base}'s in brackets)")
        for col in ("M x N x K", "layout", "count", *labels):
            t.add_column(col, justify="right")
        tot = {lb: [0.0, 0.0] for lb in labels}
        for r in sel:
            ref = r["variants"][base]
            cells = []
            for lb in labels:
                v = r["variants"].get(lb)
                cells.append("-" if v is None else f"{v['j']:.3f} J ({v['cool_ms']:.3f} ms)" if lb == base
                             else f"{v['j'] / ref['j']:.3f} ({v['cool_ms'] / ref['cool_ms']:.3f})")
                v = v or r["variants"].get(usual) or next(x for k, x in r["variants"].items() if k != base)
                tot[lb][0] += r["count"] * v["j"]
                tot[lb][1] += r["count"] * v["cool_ms"]
            t.add_row(f"{r['m']}x{r['n']}x{r['k']}", r["layout"], str(r["count"]), *cells)
        best_j = sum(r["count"] * min(v["j"] for k, v in r["variants"].items() if k != base) for r in sel)
        console.print(t)
        console.print(f"{name}: step sums (J, cool ms): " + ", ".join(
            f"{lb} {tot[lb][0]:.2f} J / {tot[lb][1]:.2f} ms" for lb in labels)
            + f"; least-joule tile per shape {best_j:.2f} J")


#: cooperative epilogue depths (elements of K) :func:`fit` tries
DEPTHS = range(0, 1201, 25)


def _work(cfg: GemmConfig, m: int, n: int, sms: int) -> int:
    """Output elements the busiest CTA computes (whole tiles, whole cluster rounds) times the SMs:
    ``dispatch.predicted_time``'s wave model without its rate."""
    return -(-cfg.cluster_tiles(m, n, 1) // cfg.slots(m, n, 1, sms)) * cfg.tile_m * cfg.tile_n * sms


def _depth(cfg: GemmConfig, r: dict, depth: int, tile_depth: int, tree_depth: int = 0) -> int:
    """The k-loop a tile of ``cfg`` runs for row ``r``, its exposed cooperative epilogue included:
    ``depth`` for the plain store, ``tree_depth`` more for a tree that computes (``--fused`` rows),
    ``tile_depth`` per tile input."""
    extra = depth + r.get("tile_inputs", 0) * tile_depth + r.get("computes", False) * tree_depth
    return r["k"] + (extra if cfg.schedule == "cooperative" else 0)


def _predicted_ms(cfg, r, rate, depth, tile_depth, sms, tree_depth=0):
    return _work(cfg, r["m"], r["n"], sms) * _depth(cfg, r, depth, tile_depth, tree_depth) / rate


class Fit(NamedTuple):
    """The model fitted to a run: TFLOP/s back to back per config label, the cooperative depths
    (elements of K: the plain epilogue's, per tile input, for a computing tree) and the rms log
    error."""
    rates: dict
    depth: int
    tile_depth: int
    tree_depth: int
    rms: float


def fit(rows: list, sms: int = 132) -> Fit:
    """:class:`Fit` of ``ms = work (K + (depth + tile inputs x tile depth + computes x tree depth
    if cooperative)) / rate`` to every measured (shape, config), least squares on the logs over a
    grid of depths; the tile and tree depths are 0 where no row has a tile input or a computing
    tree (plain GEMMs)."""
    cands = CANDIDATES_FP8 if rows and rows[0].get("fp8") else CANDIDATES
    pts = [(lb, r, _work(cfg, r["m"], r["n"], sms), r["variants"][lb]["cap_ms"])
           for lb, cfg in cands.items() for r in rows if lb in r["variants"]]
    labels = sorted({p[0] for p in pts})
    group = np.array([labels.index(p[0]) for p in pts])
    coop = np.array([cands[p[0]].schedule == "cooperative" for p in pts], dtype=float)
    k = np.array([p[1]["k"] for p in pts], dtype=float)
    tiles = np.array([p[1].get("tile_inputs", 0) for p in pts], dtype=float)
    computes = np.array([p[1].get("computes", False) for p in pts], dtype=float)
    log_base = np.log([p[2] / p[3] for p in pts])
    counts = np.bincount(group)
    best = None
    for depth in DEPTHS:
        for tile_depth in (DEPTHS if tiles.any() else (0,)):
            for tree_depth in (DEPTHS if computes.any() else (0,)):
                logs = log_base + np.log(k + coop * (depth + tiles * tile_depth + computes * tree_depth))
                log_rates = np.bincount(group, logs) / counts
                err = logs - log_rates[group]
                rms = math.sqrt(float(err @ err) / len(err))
                if best is None or rms < best[0]:
                    best = (rms, log_rates, depth, tile_depth, tree_depth)
    rms, log_rates, depth, tile_depth, tree_depth = best
    rates = {lb: 2 * math.exp(lr) * 1e3 / 1e12 for lb, lr in zip(labels, log_rates)}
    return Fit(rates, depth, tile_depth, tree_depth, rms)


def picks_against_best(rows: list, f: Fit, sms: int = 132) -> tuple[float, float]:
    """(sum of back-to-back ms of the configs the fitted model picks, of the measured best ones),
    each row weighted by its launches."""
    cands = CANDIDATES_FP8 if rows and rows[0].get("fp8") else CANDIDATES
    picked = best = 0.0
    for r in rows:
        have = [lb for lb in cands if lb in r["variants"] and lb in f.rates]
        pick = min(have, key=lambda lb: _predicted_ms(cands[lb], r, f.rates[lb] * 1e12 / 2 / 1e3, f.depth,
                                                      f.tile_depth, sms, f.tree_depth))
        picked += r["count"] * r["variants"][pick]["cap_ms"]
        best += r["count"] * min(r["variants"][lb]["cap_ms"] for lb in have)
    return picked, best


def report_fit(rows: list, console: Console):
    f = fit(rows)
    console.print(f"all {len(rows)} rows: cooperative epilogue depth {f.depth}, per tile input {f.tile_depth}, "
                  f"for a computing tree {f.tree_depth}, rms error {100 * f.rms:.1f} %; TFLOP/s back to back: "
                  + ", ".join(f"{lb} {v:.0f}" for lb, v in f.rates.items()))
    pp, coop = "pp128x128 2x1", "coop128x256 2x1"
    if not (rows and rows[0].get("fp8")) and pp in f.rates and coop in f.rates:
        table = dispatch._rate(CANDIDATES[pp], False) / dispatch._rate(CANDIDATES[coop], False)
        ratio = f.rates[pp] / f.rates[coop]
        console.print(f"{pp} / {coop}: {ratio:.3f} here, {table:.3f} in the H200's table: this card's "
                      f"dispatch.PINGPONG_16_SCALE would be {ratio / table:.2f}")
    models = list(dict.fromkeys(r["config"] for r in rows))
    for train in models:
        for test in models:
            if test != train:
                picked, best = picks_against_best([r for r in rows if r["config"] == test],
                                                  fit([r for r in rows if r["config"] == train]))
                console.print(f"fitted on {train}, picking on {test}: {picked:.2f} ms against the best "
                              f"{best:.2f} ({picked / best:.4f})")


def _keep_candidates(labels: list):
    """Narrow the candidate tables to ``labels``, in that order (the first stands in for the usual
    pick in the step sums)."""
    global CANDIDATES, CANDIDATES_FP8
    unknown = set(labels) - set(CANDIDATES) - set(CANDIDATES_FP8)
    if unknown:
        sys.exit(f"--only: no candidate labelled {sorted(unknown)}")
    CANDIDATES = {lb: CANDIDATES[lb] for lb in labels if lb in CANDIDATES}
    CANDIDATES_FP8 = {lb: CANDIDATES_FP8[lb] for lb in labels if lb in CANDIDATES_FP8}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["1b", "8b"], choices=sorted(TM.SPECS))
    ap.add_argument("--fp8", action="store_true", help="the row-wise FP8 recipe's GEMMs, fast accumulation")
    ap.add_argument("--fused", action="store_true",
                    help="each launch with its epilogue tree (bf16; with --fp8 the row-wise FP8 recipe's)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--run-ms", type=float, default=600)
    ap.add_argument("--json")
    ap.add_argument("--fit", metavar="JSON", help="fit the heuristic's model to a run's --json and stop")
    ap.add_argument("--only", nargs="+", metavar="LABEL",
                    help="time these candidates alone (their labels, e.g. 'pp128x128 1x2'; the first is the usual pick)")
    args = ap.parse_args(argv)
    if args.only:
        _keep_candidates(args.only)
    if args.fit:
        return report_fit(json.loads(Path(args.fit).read_text()), Console(width=200))
    if not torch.cuda.is_available():
        sys.exit("exp_energy_tiles needs a CUDA GPU")
    console, rows = Console(width=200), []
    for name in args.configs:
        for row in (measure_fused(name, args.layers, args.run_ms, args.rounds, console, args.fp8) if args.fused
                    else measure(name, args.layers, args.run_ms, args.rounds, args.fp8, console)):
            rows.append(row)
            if args.json:  # rewritten after each row: a run cut off by a time limit keeps its rows
                Path(args.json).write_text(json.dumps(rows, indent=1))
    report(rows, console)


if __name__ == "__main__":
    main()
