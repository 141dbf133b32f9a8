"""CPU tests of ``coda_cute.sol.timing``: ``calls_in_range`` warms every call up outside the NVTX
range, then runs each once inside it, in order, logged before it runs (the CUDA calls recorded);
``interleaved_times`` on a fake clock, and ``paired_ratios``."""

import pytest
import torch

from coda_cute.sol import timing


def test_calls_in_range_warms_up_outside_and_runs_each_once_inside(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: events.append(f"push {name}"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: events.append("pop"))
    fns = {name: (lambda name=name: events.append(f"call {name}")) for name in ("b", "a", "c")}
    timing.calls_in_range(fns, "step", log=lambda name: events.append(f"log {name}"))
    assert events == ["call b", "call a", "call c", "sync", "push step",
                      "log b", "call b", "log a", "call a", "log c", "call c", "sync", "pop"]


class _FakeEvent:
    """A CUDA event on a fake clock the timed fns advance."""

    clock = [0.0]

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = _FakeEvent.clock[0]

    def elapsed_time(self, other):
        return other.t - self.t


def test_interleaved_times_keeps_every_round_and_medians_match(monkeypatch):
    """Each fn is timed once per round by its own events (its calls' clock advance alone), after
    its warm-up calls; the medians are the per-round times' medians."""
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(timing, "_flush_buffer", lambda: type("F", (), {"zero_": lambda self: None})())
    calls = {"a": 0, "b": 0}
    cost = {"a": lambda n: 1.0 + n % 3, "b": lambda n: 2.0}

    def make(name):
        def fn():
            _FakeEvent.clock[0] += cost[name](calls[name])
            calls[name] += 1
        return fn

    fns = {name: make(name) for name in ("a", "b")}
    times = timing.interleaved_times(fns, rounds=5, warmup=2)
    # a's calls 2..6 (after two warm-up calls) cost 1 + n % 3 each, in call order
    assert times == {"a": [3.0, 1.0, 2.0, 3.0, 1.0], "b": [2.0] * 5}
    calls.update(a=0, b=0)
    assert timing.interleaved_medians(fns, rounds=5, warmup=2) == {"a": 2.0, "b": 2.0}


def test_paired_ratios_take_each_round_against_its_base():
    times = {"base": [1.0, 2.0, 4.0, 1.0], "x": [1.1, 2.2, 4.4, 1.1], "y": [1.0, 1.0, 4.0, 2.0]}
    got = timing.paired_ratios(times, "base")
    assert got["base"] == (1.0, 1.0, 1.0)
    assert all(abs(v - 1.1) < 1e-12 for v in got["x"])
    med, q1, q3 = got["y"]
    assert med == 1.0 and q1 < 1.0 < q3  # rounds 0.5, 1, 1, 2: a wide spread around 1
    with pytest.raises(ValueError, match="base 'z' is not among the timed names"):
        timing.paired_ratios(times, "z")
    with pytest.raises(ValueError, match="'x' has 1 rounds, 'base' 4"):
        timing.paired_ratios({"base": [1.0] * 4, "x": [1.0]}, "base")
    assert timing.ratio_text(got["y"]) == f"1.000 [{q1:.3f}, {q3:.3f}]"
