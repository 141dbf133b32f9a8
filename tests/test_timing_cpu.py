"""CPU test of ``coda_cute.sol.timing.calls_in_range``: every call warmed up outside the NVTX
range, then each once inside it, in order, logged before it runs (the CUDA calls recorded)."""

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
