"""CPU tests of ``coda_cute.sol.energy``: no counter without a GPU, and the joules-per-call
arithmetic (the idle board's share taken off the idle spans between the reads) on a simulated
counter: 100 W idle, 700 W while a call runs."""

import time

import pytest
import torch

from coda_cute.sol import energy

IDLE_W, BUSY_W, CALL_S = 100.0, 700.0, 0.02


class SimulatedBoard:
    """An energy counter integrating ``BUSY_W`` while ``busy`` and ``IDLE_W`` otherwise."""

    def __init__(self):
        self.t, self.mj, self.busy = time.perf_counter(), 0.0, False
        self.busy_s = []  # each call's busy time as slept (a loaded machine oversleeps)

    def _advance(self):
        now = time.perf_counter()
        self.mj += (BUSY_W if self.busy else IDLE_W) * (now - self.t) * 1e3
        self.t = now

    def millijoules(self):
        self._advance()
        return int(self.mj)

    def call(self):
        self._advance()
        start, self.busy = self.t, True
        time.sleep(CALL_S)
        self._advance()
        self.busy = False
        self.busy_s.append(self.t - start)


def test_no_counter_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU machine")
    assert energy.EnergyMeter.open() is None
    assert energy.joules_per_call(lambda: None, 3) is None


def test_calls_must_be_positive():
    with pytest.raises(ValueError, match="calls must be >= 1"):
        energy.joules_per_call(lambda: None, 0)


def test_joules_per_call_takes_the_idle_share_off(monkeypatch):
    board = SimulatedBoard()
    monkeypatch.setattr(energy.EnergyMeter, "open", staticmethod(lambda device=None: board))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(energy, "SETTLE_S", 0.1)
    monkeypatch.setattr(energy, "IDLE_S", 0.1)
    out = energy.joules_per_call(board.call, 5)
    assert out["calls"] == 5
    assert out["idle_watts"] == pytest.approx(IDLE_W, rel=0.05)
    # the 0.1 s idle span before the last read holds 10 J, 2 J per call: 14 % of a call's 14 J
    busy_s = sum(board.busy_s[-5:]) / 5
    assert out["j_per_call"] == pytest.approx(BUSY_W * busy_s, rel=0.03)
    assert out["watts"] == pytest.approx(BUSY_W, rel=0.05)
    assert out["ms_per_call"] == pytest.approx(1e3 * CALL_S, rel=0.2)


@pytest.mark.parametrize("ms, run_ms, calls", [(20.0, 2500, 125), (0.7, 1000, 1429), (900.0, 2500, 5), (None, 2500, 5),
                                               (0.0, 2500, 5)])
def test_joules_over_run_sizes_the_run_by_the_timing(monkeypatch, ms, run_ms, calls):
    seen = []
    monkeypatch.setattr(energy, "joules_per_call", lambda fn, n, device=None: seen.append((n, device)) or {"n": n})
    assert energy.joules_over_run(lambda: None, ms, "cuda:1", run_ms=run_ms) == {"n": calls}
    assert seen == [(calls, "cuda:1")]
