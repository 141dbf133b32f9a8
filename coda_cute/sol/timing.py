"""GPU timing: median CUDA-event time of a launch, after warm-up, with L2 flushed between runs.

:func:`interleaved_medians` times several launches round-robin, for ratios between them
(:func:`interleaved_times` keeps every round's times, and :func:`paired_ratios` turns them into
per-round ratios with their spread); :func:`calls_in_range` runs each once where a profiler's
NVTX filter takes them alone.

Uses ``triton.testing.do_bench`` when Triton is installed (as ``scripts/bench_gemm.py`` does);
otherwise the same procedure with ``torch.cuda.Event``: estimate one call, warm up for
``warmup_ms``, then time each of ``rep_ms`` worth of calls between two events, zeroing a buffer
larger than any L2 before each so that no run finds its inputs cached by the previous one.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Callable

import torch

WARMUP_MS = 25
REP_MS = 100
_FLUSH_BYTES = 256 << 20


def bench_ms(fn: Callable[[], object], warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS) -> float:
    """Median milliseconds of one ``fn()`` on the current CUDA device."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return event_median_ms(fn, warmup_ms, rep_ms)
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def event_median_ms(fn: Callable[[], object], warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS,
                    max_reps: int = 1000) -> float:
    """``bench_ms`` without Triton: CUDA events around each call, median over the calls."""
    flush = _flush_buffer()
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    per_call = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / per_call))):
        fn()
    reps = min(max_reps, max(5, int(rep_ms / per_call)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def interleaved_medians(fns: dict, rounds: int = 30, warmup: int = 3, settle_ms: float = 0.0,
                        lead_cycles: int = 0) -> dict:
    """Median milliseconds of each ``fns[name]()``, timed round-robin (:func:`interleaved_times`)."""
    times = interleaved_times(fns, rounds, warmup, settle_ms, lead_cycles)
    return {name: statistics.median(t) for name, t in times.items()}


def interleaved_times(fns: dict, rounds: int = 30, warmup: int = 3, settle_ms: float = 0.0,
                      lead_cycles: int = 0) -> dict:
    """Milliseconds of each ``fns[name]()`` in every round, in round order, timed round-robin:
    every round runs each fn once (L2 flushed before each, CUDA events around it). An H200 under
    sustained load drifts by several percent in clock speed; fns timed one after another would
    carry that drift into their ratio, fns timed in turns share it. Each round runs the fns in a
    fresh (seeded) random order: the clock also depends on what ran just before (a GEMM right
    after a memory-bound launch starts cooler than one right after another GEMM), and in any
    fixed cyclic order, rotated or not, every fn keeps the same predecessor. ``settle_ms``: keep
    running the fns in turns for that long first, so that timing starts at the clocks the
    sequence settles at (a GPU coming from idle starts several percent faster). ``lead_cycles``:
    before each timed call the GPU first spins that many clock cycles (``torch.cuda._sleep``,
    outside the events), so that the host has queued the call before the GPU reaches it: the
    events then hold the call's GPU time alone, as in a step whose host runs ahead, not the
    host's time for an op whose kernel is shorter than its Python."""
    flush = _flush_buffer()
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < settle_ms:
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
    runs = []
    order = list(fns.items())
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for name, fn in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            flush.zero_()
            if lead_cycles:
                torch.cuda._sleep(lead_cycles)
            start.record()
            fn()
            end.record()
            runs.append((name, start, end))
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for name, start, end in runs:
        times[name].append(start.elapsed_time(end))
    return times


def paired_ratios(times: dict, base: str) -> dict:
    """``{name: (median, lower quartile, upper quartile)}`` of each round's ``times[name][r] /
    times[base][r]`` (``times`` from :func:`interleaved_times`). A ratio taken inside one round
    shares that round's clock; the quartiles say how far one run's ratio can be trusted: two
    variants whose quartile ranges overlap are not told apart by it."""
    if base not in times:
        raise ValueError(f"paired_ratios: base {base!r} is not among the timed names {sorted(times)}")
    out = {}
    for name, t in times.items():
        if len(t) != len(times[base]):
            raise ValueError(f"paired_ratios: {name!r} has {len(t)} rounds, {base!r} {len(times[base])}")
        ratios = sorted(x / y for x, y in zip(t, times[base]))
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        out[name] = (statistics.median(ratios), q1, q3)
    return out


def ratio_text(ratio) -> str:
    """One :func:`paired_ratios` entry as text: ``median [lower quartile, upper quartile]``."""
    med, q1, q3 = ratio
    return f"{med:.3f} [{q1:.3f}, {q3:.3f}]"


def _flush_buffer() -> torch.Tensor:
    """A buffer larger than any L2, zeroed before each timed call."""
    return torch.empty(_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")


def calls_in_range(fns: dict, nvtx_range: str = "gemms", log: Callable[[str], object] | None = None) -> None:
    """Each of ``fns`` once to compile and warm up, then each once more inside the push/pop NVTX
    range ``nvtx_range`` (ncu: ``--nvtx --nvtx-include <range>/``), in order, ``log(name)`` before
    each: the profiler's kernels in the order they were named. A push/pop range holds the
    pushing thread's launches alone, so the calls launch no kernel from another thread (autograd
    runs a backward on one of its own)."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(nvtx_range)
    for name, fn in fns.items():
        if log is not None:
            log(name)
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
