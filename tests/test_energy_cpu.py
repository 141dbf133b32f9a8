"""CPU tests of ``coda_cute.sol.energy``: no counter without a GPU, and the joules-per-call
arithmetic (the idle board's share taken off the idle spans between the reads) on a simulated
counter: 100 W idle, 700 W while a call runs."""

import types

import pytest
import torch

from coda_cute.sol import energy

IDLE_W, BUSY_W, CALL_S = 100.0, 700.0, 0.02


class SimulatedBoard:
    """An energy counter integrating ``BUSY_W`` while ``busy`` and ``IDLE_W`` otherwise, on a
    simulated clock that only sleeps advance (the module's ``time`` is swapped for it): on a
    real clock a loaded machine's oversleeping moved the per-call figures past their bounds."""

    def __init__(self):
        self.now, self.mj, self.busy = 0.0, 0.0, False
        self.time = types.SimpleNamespace(perf_counter=lambda: self.now, sleep=self._sleep)

    def _sleep(self, s):
        self.mj += (BUSY_W if self.busy else IDLE_W) * s * 1e3
        self.now += s

    def millijoules(self):
        return int(self.mj)

    def call(self):
        self.busy = True
        self._sleep(CALL_S)
        self.busy = False


@pytest.fixture
def board(monkeypatch):
    """The module's counter, clock and settle times on a :class:`SimulatedBoard`."""
    board = SimulatedBoard()
    monkeypatch.setattr(energy.EnergyMeter, "open", staticmethod(lambda device=None: board))
    monkeypatch.setattr(energy, "time", board.time)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(energy, "SETTLE_S", 0.1)
    monkeypatch.setattr(energy, "IDLE_S", 0.1)
    return board


def test_no_counter_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU machine")
    assert energy.EnergyMeter.open() is None
    assert energy.joules_per_call(lambda: None, 3) is None


def test_calls_must_be_positive():
    with pytest.raises(ValueError, match="calls must be >= 1"):
        energy.joules_per_call(lambda: None, 0)


def test_joules_per_call_takes_the_idle_share_off(board):
    out = energy.joules_per_call(board.call, 5)
    assert out["calls"] == 5
    # the counter reads whole millijoules: the figures hold to that
    assert out["idle_watts"] == pytest.approx(IDLE_W, rel=1e-4)
    # the 0.1 s idle span before the last read holds 10 J, 2 J per call, 14 % of a call's 14 J:
    # taken off, a call is its busy joules alone
    assert out["j_per_call"] == pytest.approx(BUSY_W * CALL_S, rel=1e-4)
    assert out["watts"] == pytest.approx(BUSY_W, rel=1e-4)
    assert out["ms_per_call"] == pytest.approx(1e3 * CALL_S, rel=1e-9)


@pytest.mark.parametrize("ms, run_ms, calls", [(20.0, 2500, 125), (0.7, 1000, 1429), (900.0, 2500, 5), (None, 2500, 5),
                                               (0.0, 2500, 5)])
def test_joules_over_run_sizes_the_run_by_the_timing(monkeypatch, ms, run_ms, calls):
    seen = []
    monkeypatch.setattr(energy, "joules_per_call", lambda fn, n, device=None: seen.append((n, device)) or {"n": n})
    assert energy.joules_over_run(lambda: None, ms, "cuda:1", run_ms=run_ms) == {"n": calls}
    assert seen == [(calls, "cuda:1")]


def test_joules_lines_report_each_name_in_order(board):
    fns = {"a": board.call, "b": board.call, "c": board.call}
    lines = energy.joules_lines(fns, {"a": 1e3 * CALL_S, "b": 1e3 * CALL_S, "c": 1.0}, ["b", "a"], run_ms=100)
    # 100 ms of 20 ms calls: 5 each; a call's joules, the busy board's watts
    assert lines == [f"{n}: {BUSY_W * CALL_S:.3f} J per call, {BUSY_W:.0f} W, {1e3 * CALL_S:.3f} ms per call back to back"
                     for n in ("b", "a")]


def test_joules_lines_say_so_without_a_counter(monkeypatch):
    monkeypatch.setattr(energy.EnergyMeter, "open", staticmethod(lambda device=None: None))
    assert energy.joules_lines({"a": lambda: None}, {"a": 1.0}, ["a"]) == ["no energy counter: nothing measured"]
