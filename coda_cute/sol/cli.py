"""``coda-cute sol``: the speed-of-light table, JSON and roofline plot.

With a CUDA GPU every op that has a kernel is timed next to its shadow (unless ``--model-only``);
without one the model runs for the ``--device`` named (default h200).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..argtypes import positive_int
from . import devices
from .measure import DEFAULT_OPS, Record, estimate, measure
from .registry import OPS, groups
from .shapes import DEFAULT_TOKENS, LLAMA3, parse_shapes


def op_name(name: str) -> str:
    """argparse type of ``--ops``: an op or a group of the registry."""
    known = list(groups()) + list(OPS)
    if name not in known:
        raise argparse.ArgumentTypeError(f"unknown op {name!r}; known: {', '.join(known)}")
    return name


def shape_spec(spec: str) -> str:
    """argparse type of ``--shapes``: a preset or M,N,K with positive sizes."""
    try:
        shapes = parse_shapes(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if any(min(s.m, s.n, s.k) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"shape {spec!r}: M, N and K must be positive")
    return spec


def add_arguments(p) -> None:
    p.add_argument("--ops", nargs="+", type=op_name, default=list(DEFAULT_OPS), metavar="OP",
                   help=f"ops or groups ({', '.join(list(groups()) + list(OPS))}); default: %(default)s")
    p.add_argument("--shapes", nargs="+", type=shape_spec, default=["llama3-8b"], metavar="SHAPE",
                   help=f"presets ({', '.join(LLAMA3)}: one block's GEMMs + LM head) or M,N,K")
    p.add_argument("--tokens", type=positive_int, default=DEFAULT_TOKENS, help="token rows M of the presets")
    p.add_argument("--dtype", nargs="+", default=["bf16"], choices=["bf16", "fp16", "fp8"])
    p.add_argument("--device", help="datasheet to compare with: " + ", ".join(devices.known_devices())
                   + " (default: the GPU present, else h200)")
    p.add_argument("--model-only", action="store_true", help="no timing even with a GPU")
    p.add_argument("--recalibrate", action="store_true", help="measure the device ceilings again")
    p.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    p.add_argument("--plot", metavar="PATH", help="write a roofline PNG")


def run(args) -> int:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=180)
    timed = torch.cuda.is_available() and not args.model_only
    measured = None
    try:
        sheet = devices.datasheet(args.device or (torch.cuda.get_device_name() if timed else "h200"))
    except KeyError as e:
        console.print(f"[red]{e.args[0]}[/]: name one with --device")
        return 2
    if timed:
        records = _measure_with_progress(args, console, sheet)
        measured = devices.measured_ceilings()
    else:
        records = estimate(args.ops, args.shapes, args.dtype, sheet, args.tokens)
    console.print(_ceilings_line(sheet))
    if measured:
        console.print(_ceilings_line(measured))
    console.print(table(records, sheet.name))
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_dict() for r in records], indent=1))
        console.print(f"wrote {args.json}")
    if args.plot:
        from .plot import roofline_png

        roofline_png(records, args.plot, sheet, measured)
        console.print(f"wrote {args.plot}")
    return 0


def _measure_with_progress(args, console, sheet: devices.Ceilings) -> list[Record]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("sol", total=None)

        def report(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what)

        return measure(args.ops, args.shapes, args.dtype, sheet, args.tokens,
                       recalibrate=args.recalibrate, progress=report)


def _ceilings_line(c: devices.Ceilings) -> str:
    rates = ", ".join(f"{d} {v / 1e12:.0f}" for d, v in c.peak.items())
    return f"[bold]{c.name}[/] {c.source}: {c.bandwidth / 1e12:.2f} TB/s; TFLOP/s {rates}"


def _f(v) -> str:
    """Three significant digits, thousands as plain grouped integers; blank when missing."""
    if v is None:
        return ""
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def table(records: list[Record], device: str):
    """A rich Table of records; the timing columns appear when any record was timed."""
    from rich.table import Table

    timed = any(r.time_ms is not None for r in records)
    t = Table(title=f"Speed of light on {device}" + ("" if timed else " (model only)"))
    cols = ["op", "layer", "M×N×K", "dtype", "GFLOP", "MB", "FLOP/B", "bound", "SoL ms", "SoL/shadow"]
    if timed:
        cols += ["ms", "TFLOP/s", "GB/s", "% SoL", "% SoL meas", "× shadow"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("op", "layer", "dtype", "bound") else "right")
    for r in records:
        row = [r.op, r.label if r.model else "", "×".join(map(str, r.shape)), r.dtype, _f(r.flops / 1e9),
               _f(r.bytes / 1e6), _f(r.intensity), r.bound, _f(r.sol_ms), f"{r.sol_ms / r.shadow_sol_ms:.3f}"]
        if timed:
            row += [_f(r.time_ms), _f(r.tflops), _f(r.gbps), _f(r.pct_sol), _f(r.pct_sol_measured),
                    "" if r.shadow_ratio is None else f"{r.shadow_ratio:.3f}"]
        t.add_row(*row)
    return t
