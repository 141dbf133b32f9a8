"""Roofline PNG: attainable FLOP/s against arithmetic intensity, log-log, one point per record.

Each dtype's roof is ``min(peak(dtype), bandwidth · intensity)``: the memory roof (a diagonal
of slope 1, shared) meets that dtype's compute roof at the ridge ``peak / bandwidth`` FLOP/byte.
Datasheet roofs are solid, measured roofs dashed. A measured op is a filled point at its achieved
TFLOP/s (its % of the datasheet SoL in the key); a model-only op a hollow point on its roof
(its speed of light). Each fused op also gets an x: the same math unfused (its plain GEMM, then
one memory-bound pass over the GEMM's output), at that pair's speed of light, joined to the
fused point, so the bytes the fusion saves show as the distance between the two.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

from .devices import Ceilings
from .measure import Record

_COLORS = {"bf16": "tab:blue", "fp16": "tab:cyan", "fp8": "tab:orange"}


def _merged_labels(spots, close: float = 0.05):
    """(x, y, "i,j,...", color) per group of points less than ``close`` decades apart in both
    axes (one label above the group instead of labels stacked on each other)."""
    groups: list[list] = []
    for x, y, text, color in spots:
        for g in groups:
            gx, gy = g[0][0], g[0][1]
            if abs(math.log10(x / gx)) < close * 3 and abs(math.log10(y / gy)) < close and g[0][3] == color:
                g.append((x, y, text, color))
                break
        else:
            groups.append([(x, y, text, color)])
    out = []
    for g in groups:
        xs = [p[0] for p in g]
        out.append((math.sqrt(min(xs) * max(xs)), max(p[1] for p in g), ",".join(p[2] for p in g), g[0][3]))
    return out


def roofline_png(records: Sequence[Record], path: str | Path, sheet: Ceilings,
                 measured: Optional[Ceilings] = None) -> Path:
    """Write the roofline of ``records`` against ``sheet`` (and ``measured``) to ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 7), dpi=120)
    FigureCanvasAgg(fig)  # the Agg canvas without pyplot: no global backend state touched
    ax = fig.add_axes((0.06, 0.09, 0.56, 0.84))
    dtypes = sorted({r.dtype for r in records}, key=list(_COLORS).index)
    xs = [r.intensity for r in records]
    ridges = [sheet.peak_flops(d) / sheet.bandwidth for d in dtypes]
    lo, hi = min(xs + ridges) / 8, max(xs + ridges) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    for ceil, style in ((sheet, "-"), (measured, "--")):
        if ceil is None:
            continue
        for dt in dtypes:
            if dt not in ceil.peak:
                continue
            peak = ceil.peak_flops(dt)
            ax.plot(grid, [min(peak, ceil.bandwidth * x) / 1e12 for x in grid], style,
                    color=_COLORS[dt], lw=1.5 if style == "-" else 1.0,
                    label=f"{dt} roof, {ceil.source} ({peak / 1e12:.0f} TFLOP/s, "
                          f"{ceil.bandwidth / 1e12:.2f} TB/s)")
    # Points crowd on the compute roofs: each carries a number, points that nearly coincide share
    # one label ("3,4,5"), and the key beside the axes names them.
    key, spots = [], []
    for i, r in enumerate(sorted(records, key=lambda r: (r.dtype, r.intensity)), start=1):
        timed = r.tflops is not None
        y = r.tflops if timed else r.flops / r.sol_ms / 1e9
        color = _COLORS[r.dtype]
        ax.scatter([r.intensity], [y], s=36, zorder=3, color=color, facecolors=color if timed else "none")
        if r.unfused_bytes:
            ux, uy = r.flops / r.unfused_bytes, r.flops / r.unfused_sol_ms / 1e9
            ax.scatter([ux], [uy], s=30, marker="x", zorder=3, color=color, alpha=0.7)
            ax.plot([ux, r.intensity], [uy, y], ":", color=color, lw=0.8, alpha=0.7)
        spots.append((r.intensity, y, str(i), color))
        saved = f"  unfused {r.unfused_bytes / r.bytes:.1f}x bytes" if r.unfused_bytes else ""
        key.append(f"{i:>2} {r.op} {r.label} {r.dtype}" + (f"  {r.pct_sol:.0f}%" if timed else "") + saved)
    for x, y, text, color in _merged_labels(spots):
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=7,
                    color=color)
    fig.text(0.64, 0.92, "\n".join(key), va="top", fontsize=min(8.0, 480 / max(len(key), 1)),
             family="monospace")
    timed_any = any(r.tflops is not None for r in records)
    fig.text(0.64, 0.12, ("filled: measured on this GPU; " if timed_any else "model only (no GPU timing): ")
             + "hollow: the op's speed of light;\n"
             "x: the same math unfused (plain GEMM + one memory-bound pass), its speed of light",
             fontsize=7, va="bottom")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(top=max(sheet.peak_flops(d) for d in dtypes) / 1e12 * 2)  # room for the numbers
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"Roofline on {sheet.name}" + ("" if timed_any else " (model only)"))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    path = Path(path)
    fig.savefig(path)
    return path
