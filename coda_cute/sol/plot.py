"""Roofline PNG: attainable FLOP/s against arithmetic intensity, log-log, one point per record.

Each dtype's roof is ``min(peak(dtype), bandwidth · intensity)``: the memory roof (a diagonal
of slope 1, shared) meets that dtype's compute roof at the ridge ``peak / bandwidth`` FLOP/byte.
Datasheet roofs are solid, measured roofs dashed. A measured op is a filled point at its achieved
TFLOP/s (its % of the datasheet SoL in the key); a model-only op a hollow point on its roof
(its speed of light).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

from .devices import Ceilings
from .measure import Record

_COLORS = {"bf16": "tab:blue", "fp16": "tab:cyan", "fp8": "tab:orange"}


def roofline_png(records: Sequence[Record], path: str | Path, sheet: Ceilings,
                 measured: Optional[Ceilings] = None) -> Path:
    """Write the roofline of ``records`` against ``sheet`` (and ``measured``) to ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 7), dpi=120)
    FigureCanvasAgg(fig)  # the Agg canvas without pyplot: no global backend state touched
    ax = fig.add_axes((0.07, 0.09, 0.66, 0.84))
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
    # Points crowd on the compute roofs, so each carries a number (stacked where points nearly
    # coincide) and the key beside the axes names it.
    placed: list[tuple[float, float]] = []
    key = []
    for i, r in enumerate(sorted(records, key=lambda r: (r.dtype, r.intensity)), start=1):
        timed = r.tflops is not None
        y = r.tflops if timed else r.flops / r.sol_ms / 1e9
        color = _COLORS[r.dtype]
        ax.scatter([r.intensity], [y], s=36, zorder=3, color=color, facecolors=color if timed else "none")
        near = sum(abs(math.log10(r.intensity / px)) < 0.06 and abs(math.log10(y / py)) < 0.06
                   for px, py in placed)
        placed.append((r.intensity, y))
        ax.annotate(str(i), (r.intensity, y), textcoords="offset points", xytext=(3, 4 + 8 * near),
                    fontsize=7, color=color)
        key.append(f"{i:>2} {r.op} {r.label} {r.dtype}" + (f"  {r.pct_sol:.0f}%" if timed else ""))
    fig.text(0.75, 0.92, "\n".join(key), va="top", fontsize=min(8.0, 480 / max(len(key), 1)),
             family="monospace")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(top=max(sheet.peak_flops(d) for d in dtypes) / 1e12 * 2)  # room for the numbers
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"Roofline on {sheet.name}: filled = measured, hollow = speed of light")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    path = Path(path)
    fig.savefig(path)
    return path
