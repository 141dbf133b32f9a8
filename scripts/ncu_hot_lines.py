"""The hottest SASS lines of each kernel in an ncu source-page export, as a short text table.

A device call brings back only small files, and a report with SourceCounters is tens of MB: the
device side exports the source page as CSV (``ncu --import R --page source --csv --print-source
sass``) and this keeps, per kernel, the lines that hold most of the warp-stall samples, with each
line's share and its largest stall-reason columns (where the export has them), then the kernel's
samples by stall reason and by opcode (a sleep after an mbarrier poll shows as ``NANOSLEEP``).

    python scripts/ncu_hot_lines.py SOURCE.csv [--top 40]

The export is read loosely: a table starts at a header row with an ``Address`` column and a
``Source`` column; the line before it (if not a table row) names the kernel; the sample column is
the first whose header holds "Sampling" and "All" (else "Sampling").
"""

from __future__ import annotations

import argparse
import csv
import sys


def tables(rows: list[list[str]]):
    """(title, header, data rows) for each table of the export."""
    title, i = "", 0
    while i < len(rows):
        row = rows[i]
        if "Address" in row and "Source" in row:
            header, data = row, []
            i += 1
            while i < len(rows) and len(rows[i]) == len(header) and not ("Address" in rows[i]):
                data.append(rows[i])
                i += 1
            yield title, header, data
            continue
        if row and any(cell.strip() for cell in row):
            title = " ".join(cell.strip() for cell in row if cell.strip())
        i += 1


def sample_column(header: list[str]) -> int | None:
    """The index of the all-samples warp-stall column."""
    for want in (("Sampling", "All"), ("Sampling",)):
        for j, name in enumerate(header):
            if all(w in name for w in want):
                return j
    return None


def number(cell: str) -> float:
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return 0.0


def hot_lines(title: str, header: list[str], data: list[list[str]], top: int) -> list[str]:
    col = sample_column(header)
    if col is None or not data:
        return [f"== {title[:160]}: no sampling column ({len(data)} rows)"]
    total = sum(number(r[col]) for r in data) or 1.0
    addr, src = header.index("Address"), header.index("Source")
    reasons = [j for j, name in enumerate(header) if name.lower().startswith("stall") or "stall_" in name.lower()]
    out = [f"== {title[:160]}: {len(data)} SASS lines, {total:.0f} samples"]
    for r in sorted(data, key=lambda r: -number(r[col]))[:top]:
        big = sorted(((number(r[j]), header[j]) for j in reasons if number(r[j]) > 0), reverse=True)[:3]
        why = ", ".join(f"{name} {v:.0f}" for v, name in big)
        out.append(f"{100 * number(r[col]) / total:5.1f}%  {r[addr]:>8}  {r[src].strip()[:90]:<90}  {why}")
    return out


def opcode(source: str) -> str:
    """A SASS line's opcode without its predicate and modifiers (``@!P0 NANOSLEEP.SYNCS 0x...``
    -> ``NANOSLEEP``)."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def summary(header: list[str], data: list[list[str]]) -> list[str]:
    """Two lines for a kernel: the shares of its samples by stall reason (issued or not) and by
    opcode, largest first: where a whole kernel waits, next to its hottest lines."""
    col = sample_column(header)
    if col is None or not data:
        return []
    total = sum(number(r[col]) for r in data) or 1.0
    src = header.index("Source")
    reasons = {name: sum(number(r[j]) for r in data) for j, name in enumerate(header)
               if (name.lower().startswith("stall") or "stall_" in name.lower()) and "not issued" not in name.lower()}
    ops: dict[str, float] = {}
    for r in data:
        op = opcode(r[src])
        ops[op] = ops.get(op, 0.0) + number(r[col])

    def shares(d, n):
        return ", ".join(f"{k.removeprefix('stall_')} {100 * v / total:.1f} %"
                         for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n] if v > 0)
    lines = (("by stall reason", shares(reasons, 8)), ("by opcode", shares(ops, 10)))
    return [f"   {what}: {text}" for what, text in lines if text]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    with open(args.csv, newline="") as fh:
        rows = list(csv.reader(fh))
    found = False
    for title, header, data in tables(rows):
        found = True
        print("\n".join(hot_lines(title, header, data, args.top) + summary(header, data)))
    if not found:
        print(f"{args.csv}: no source table (a header row with Address and Source columns)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
