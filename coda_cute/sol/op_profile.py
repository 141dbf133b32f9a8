"""Attribute a model step's time to the coda ops it calls.

    with coda_cute.sol.profile() as prof:
        loss = model(batch); loss.backward()
    prof.print()            # per op: calls, total ms, % of the step
    prof.ops["coda::gemm"]  # OpTime(calls=..., total_ms=...)

How: a ``TorchDispatchMode`` sees every ``torch.ops.coda.*`` call below autograd, backward
included (the autograd engine carries the mode into its threads). On CUDA each call is bracketed
by two CUDA events on the current stream and the step by two more; the elapsed times are read once,
at exit, so nothing synchronizes inside the step. An op's time is thus GPU time from the moment
its launch was queued to the end of its last kernel: its kernels, plus any time the GPU sat idle
waiting for the host to launch them. On CPU tensors (``coda_cute.reference_on_cpu()``) wall-clock
time is used instead. The step's other work (attention, elementwise torch ops) is the remainder.

Simplest robust choice: no profiler trace to parse, no kernel-name matching. What it cannot see
is an op's kernels on a stream other than the current one; and the mode adds a Python call to
every torch op of the step, so a host-bound step runs slower inside it: profile to attribute,
time throughput without it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class OpTime:
    calls: int = 0
    total_ms: float = 0.0


class _Clock:
    """Pairs of marks; ``elapsed_ms`` reads them all after the step (one synchronize)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def elapsed_ms(self, start, end) -> float:
        if self.cuda:
            return start.elapsed_time(end)
        return (end - start) * 1e3


class _CodaOpMode(TorchDispatchMode):
    def __init__(self, clock: _Clock, namespaces: tuple[str, ...]):
        super().__init__()
        self.clock = clock
        self.namespaces = namespaces
        self.spans: list[tuple[str, object, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace not in self.namespaces:
            return func(*args, **kwargs)
        start = self.clock.mark()
        out = func(*args, **kwargs)
        self.spans.append((func.name(), start, self.clock.mark()))
        return out


class Profile:
    """Per-op totals of one profiled region: ``ops`` (name -> OpTime), ``step_ms``."""

    def __init__(self, device: Optional[str] = None, namespaces: tuple[str, ...] = ("coda",)):
        cuda = torch.cuda.is_available() if device is None else device == "cuda"
        self._clock = _Clock(cuda)
        self._mode = _CodaOpMode(self._clock, namespaces)
        self.ops: dict[str, OpTime] = {}
        self.step_ms = 0.0

    def __enter__(self) -> "Profile":
        self._start = self._clock.mark()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        end = self._clock.mark()
        if self._clock.cuda:
            torch.cuda.synchronize()
        self.step_ms = self._clock.elapsed_ms(self._start, end)
        for name, s, e in self._mode.spans:
            t = self.ops.setdefault(name, OpTime())
            t.calls += 1
            t.total_ms += self._clock.elapsed_ms(s, e)

    def pct_of_step(self, name: str) -> float:
        return 100 * self.ops[name].total_ms / self.step_ms if self.step_ms else 0.0

    def records(self) -> list[dict]:
        return [{"op": n, "calls": t.calls, "total_ms": t.total_ms, "pct_of_step": self.pct_of_step(n)}
                for n, t in sorted(self.ops.items(), key=lambda kv: -kv[1].total_ms)]

    def print(self, console=None) -> None:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"coda ops in a {self.step_ms:.3f} ms step")
        for col in ("op", "calls", "total ms", "% of step"):
            table.add_column(col, justify="left" if col == "op" else "right")
        for r in self.records():
            table.add_row(r["op"], str(r["calls"]), f"{r['total_ms']:.3f}", f"{r['pct_of_step']:.1f}")
        (console or Console()).print(table)


def profile(device: Optional[str] = None, namespaces: tuple[str, ...] = ("coda",)) -> Profile:
    """Context manager timing every ``torch.ops.coda.*`` call inside it; ``device`` ("cuda" or
    "cpu") picks CUDA events or wall clock (default: CUDA events when a GPU is present)."""
    return Profile(device, namespaces)
