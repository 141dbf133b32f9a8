"""Benchmark the RoPE (+ QK-norm) backward (``coda.rope_backward``) against the device's copy
bandwidth.

The training-step issue asks for this bandwidth-bound kernel of ours at >= 85 % of the measured
copy bandwidth. For each shape: its median time, the bytes it moves (dq, dk, dv read, and once per
element the values z: the forward's qkv, with QK-norm its pre-norm values on the Q/K columns
instead; r and the positions read; g written in bf16 and the statistic zdz in fp32; the QK-norm
weights' per-CTA partial sums, at most a few MB, not counted), that bandwidth, and its ratio to a ``torch.Tensor.copy_`` of a bf16 tensor of the
kernel's (M, N) timed in the same turns (CUDA-event medians, L2 flushed, the host queued ahead,
``sol.timing.interleaved_medians``). dq, dk, dv come from the attention core's backward, in the
layouts it hands them over (``ops.attention``).

Shapes: the training benchmark's 1b (head_dim 64) and 8b (head_dim 128) attention at 4 x 4096
tokens, 32 / 8 heads, with and without QK-norm, and a ragged 3 x 1111.

    python scripts/bench_rope_backward.py [--rounds 20] [--json out.json]
        [--sweep]    # also the kernel's tuning options (SWEEP) on each shape, launched directly
        [--once]     # no timing: each function launched once per shape, in a printed order (ncu)

``--sweep`` times the kernel itself (``elementwise.rope_backward_kernel``, no op around it) with
each tuning in ``SWEEP`` over the defaults (``RopeBackward.DEFAULTS``), in the same turns, so a
default can be picked from measurements; rows "sweep: option=value".

``--once`` launches each function (the copy first) once per shape after one warm-up launch of
all of them, prints the order and the strides dq / dk / dv arrive in, and times nothing: for a
profiler, e.g. ``ncu --clock-control none --kernel-name regex:RopeBackward --launch-skip K`` with
K the first shape's RopeBackward launches in its warm-up (its functions but the copy, a memcpy).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch
from rich.console import Console
from rich.table import Table

from coda_cute import reference as R
from coda_cute.elementwise import rope_backward_kernel
from coda_cute.ops.attention import attention_backward, attention_forward, qkv_heads
from coda_cute.sol.timing import interleaved_medians

TARGET = 0.85
#: (batch, seq, heads, kv heads, head_dim)
SHAPES = [(4, 4096, 32, 8, 64), (4, 4096, 32, 8, 128), (3, 1111, 32, 8, 128)]
#: (qk_norm, head_dim) -> tunings (over the defaults) that --sweep times: those that build without
#: spills for 32 / 8 heads and differ from the defaults there (at head_dim 128 target_threads 384
#: is the default's 768-thread row). The H200 sweep of 2026-12-05 (4 x 4096 tokens, QK-norm,
#: fraction of copy bandwidth at head_dim 64 / 128) picked the defaults: two rows per thread and
#: stage with 32-row tables 0.860 / 0.900; one row and 64-row tables (the defaults before) 0.849 /
#: 0.894; two vectors per thread 0.854 / 0.899; stage_rows 4 0.839; more warps per SM did worse
#: (two CTAs per SM 0.811, with stage_rows 2 0.824; three 128-thread CTAs with three vectors each
#: 0.804).
SWEEP = {
    (False, 64): [(), (("target_threads", 384),)],
    (False, 128): [()],
    (True, 64): [(), (("chunk_rows", 64), ("stage_rows", 1)), (("stages", 4),), (("min_vpt", 2),),
                 (("stage_rows", 4),), (("chunk_rows", 64),), (("ctas_per_sm", 2),)],
    (True, 128): [(), (("chunk_rows", 64), ("stage_rows", 1)), (("min_vpt", 2), ("target_threads", 384)),
                  (("chunk_rows", 64),)],
}


def rand(*shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def moved_bytes(m: int, n: int) -> int:
    """dq, dk, dv (together m x n) and z (qkv, or with QK-norm the pre-norm values on Q/K and qkv
    on V: one value an element either way) read, g written (bf16); r, positions read and zdz
    written (4 bytes a row each). The same with and without QK-norm."""
    return 2 * m * n * 3 + 12 * m


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--sweep", action="store_true", help="also time the kernel's tuning options (SWEEP)")
    ap.add_argument("--once", action="store_true", help="launch each function once per shape, untimed (for ncu)")
    args = ap.parse_args(argv)
    console = Console(width=140)
    if not torch.cuda.is_available():
        console.print("[red]bench_rope_backward needs a CUDA GPU[/]")
        return 2
    t = Table(title=f"RoPE backward against copy bandwidth (target {TARGET:.0%}; median of {args.rounds})")
    for col in ("B x S, H / Hkv x head_dim", "what", "QK-norm", "ms", "GB moved", "TB/s", "copy TB/s", "/ copy"):
        t.add_column(col, justify="left" if col.startswith("B") else "right")
    records = []
    torch.manual_seed(0)
    for b, s, h, hkv, hd in SHAPES:
        m, n = b * s, (h + 2 * hkv) * hd
        q, k, v = qkv_heads(rand(m, n), b, h, hkv, hd)
        o, lse = attention_forward(q, k, v)
        dq, dk, dv = attention_backward(rand(b, h, s, hd), q, k, v, o, lse)
        qkv, pre = rand(m, n), rand(m, n)
        r = torch.rand(m, device="cuda") + 0.5
        pos = torch.arange(s, device="cuda", dtype=torch.int32).repeat(b)
        inv_freq = R.rope_inv_freq(hd, 500000.0, "cuda")
        qn, kn = 1 + rand(hd, scale=0.1), 1 + rand(hd, scale=0.1)
        src, dst = rand(m, n), torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        fns = {"copy": lambda: dst.copy_(src),
               (False, None): lambda: torch.ops.coda.rope_backward(dq, dk, dv, qkv, r, pos, inv_freq),
               (True, None): lambda: torch.ops.coda.rope_backward(dq, dk, dv, qkv, r, pos, inv_freq, pre, qn, kn,
                                                                  1e-6)}
        if args.sweep:
            for (qk_norm, head_dim), tunings in SWEEP.items():
                for tuning in tunings if head_dim == hd else ():
                    extra = (pre, qn, kn) if qk_norm else (None, None, None)
                    fns[(qk_norm, tuning)] = functools.partial(rope_backward_kernel, dq, dk, dv, qkv, r, pos,
                                                               inv_freq, *extra, 1e-6, tuning)
        if args.once:
            for fn in list(fns.values()) * 2:  # warm-up (compiles), then the profiled launches
                fn()
            torch.cuda.synchronize()
            console.print(f"{b} x {s} x {hd}: dq strides {dq.stride()}, dk {dk.stride()}, dv {dv.stride()}; "
                          f"{len(fns)} launches after {len(fns)} warm-up ones: {', '.join(map(str, fns))}")
            continue
        # the GPU spins ~0.1 ms before each call, so the op's host code (checks, dispatch: longer
        # than its kernel at these sizes) is queued ahead of it, as inside a step
        ms = interleaved_medians(fns, rounds=args.rounds, settle_ms=200, lead_cycles=200_000)
        copy_tbs = 2 * 2 * m * n / ms["copy"] / 1e9
        for key in fns:
            if key == "copy":
                continue
            qk_norm, tuning = key
            gb = moved_bytes(m, n) / 1e9
            tbs = gb / ms[key]
            label = "op" if tuning is None else "sweep: " + (", ".join(f"{k}={v}" for k, v in tuning) or "defaults")
            records.append(dict(batch=b, seq=s, heads=h, kv_heads=hkv, head_dim=hd, qk_norm=qk_norm,
                                what=label, ms=ms[key], gb=gb, tbs=tbs, copy_tbs=copy_tbs, ratio=tbs / copy_tbs))
            t.add_row(f"{b} x {s}, {h} / {hkv} x {hd}", label, "yes" if qk_norm else "no", f"{ms[key]:.3f}",
                      f"{gb:.3f}", f"{tbs:.2f}", f"{copy_tbs:.2f}", f"{tbs / copy_tbs:.3f}")
    console.print(t)
    if args.sweep:  # the fastest tuning per shape and variant, against the defaults of the same turns
        for (b, s, hd, qk_norm) in dict.fromkeys((r["batch"], r["seq"], r["head_dim"], r["qk_norm"]) for r in records):
            rows = [r for r in records if (r["batch"], r["seq"], r["head_dim"], r["qk_norm"]) == (b, s, hd, qk_norm)
                    and r["what"].startswith("sweep")]
            base = next(r for r in rows if r["what"] == "sweep: defaults")
            best = min(rows, key=lambda r: r["ms"])
            console.print(f"{b} x {s} x {hd}, QK-norm {'yes' if qk_norm else 'no'}: fastest {best['what']} "
                          f"{best['ms']:.4f} ms ({best['ratio']:.3f} of copy), defaults {base['ms']:.4f} ms "
                          f"({base['ratio']:.3f})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
