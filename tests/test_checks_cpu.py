"""ops.checks.deferred_checks: the read-back of device-data checks postponed to a forward's end.

On the CPU a PendingCheck raises at once, so these tests build checks whose "device copy" is a
host flag and whose event records how often it was waited on."""

import pytest
import torch

from coda_cute.ops import checks


class _Event:
    def __init__(self):
        self.waits = 0

    def synchronize(self):
        self.waits += 1


def _queued(bad: bool, what: str = "x") -> checks.PendingCheck:
    c = checks.PendingCheck.__new__(checks.PendingCheck)
    c.error = lambda: ValueError(f"bad {what}")
    c.flag = torch.tensor(bad)
    c.done = _Event()
    return c


def test_wait_outside_a_context_reads_back_at_once():
    c = _queued(True)
    with pytest.raises(ValueError, match="bad x"):
        c.wait()
    assert c.done.waits == 1


def test_waits_inside_are_postponed_to_the_exit_in_order():
    first, second = _queued(False), _queued(True, "y")
    with pytest.raises(ValueError, match="bad y"):
        with checks.deferred_checks():
            first.wait()
            second.wait()
            assert first.done.waits == second.done.waits == 0
    assert first.done.waits == second.done.waits == 1


def test_a_good_context_waits_once_per_check_and_returns():
    cs = [_queued(False) for _ in range(3)]
    with checks.deferred_checks():
        for c in cs:
            c.wait()
    assert [c.done.waits for c in cs] == [1, 1, 1]
    assert getattr(checks._DEFERRED, "checks", None) is None


def test_nested_contexts_join_the_outermost():
    c = _queued(True)
    with pytest.raises(ValueError):
        with checks.deferred_checks():
            with checks.deferred_checks():
                c.wait()
            assert c.done.waits == 0  # the inner exit did not read it back
    assert c.done.waits == 1


def test_an_exception_inside_drops_the_pending_checks():
    c = _queued(True)
    with pytest.raises(RuntimeError, match="first"):
        with checks.deferred_checks():
            c.wait()
            raise RuntimeError("first")
    assert c.done.waits == 0
    assert getattr(checks._DEFERRED, "checks", None) is None
    with pytest.raises(ValueError):  # the next context starts clean and still checks
        with checks.deferred_checks():
            _queued(True).wait()


def test_with_deferred_checks_wraps_and_bypasses_when_compiling(monkeypatch):
    seen = []

    @checks.with_deferred_checks
    def forward(c):
        """doc"""
        c.wait()
        seen.append(c.done.waits)
        return 7

    c = _queued(False)
    assert forward(c) == 7 and seen == [0] and c.done.waits == 1
    assert forward.__doc__ == "doc"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    c = _queued(False)
    assert forward(c) == 7 and seen[-1] == 1  # waited inside the op, as without the context


def test_cpu_checks_still_raise_at_once_inside_a_context():
    with checks.deferred_checks():
        with pytest.raises(ValueError, match="bad cpu"):
            checks.PendingCheck(torch.tensor(True), lambda: ValueError("bad cpu"))
