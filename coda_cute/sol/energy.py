"""The board's energy counter: joules per call of a GPU function, calls run back to back.

Why: under a power cap a GPU's time follows its energy. During a training step on the H200 the
board sits at its 700 W limit with the software power cap as the active clock-event reason, and
the SM clock drops from 1980 to ~1470 MHz; every variant of a step then runs at ~700 W, so a step
that needs fewer joules is the faster one, whatever its idle SMs or its kernels' speed at full
clock. ``scripts/bench_train.py`` reports each variant's joules per step next to its time.

The counter is NVML's ``nvmlDeviceGetTotalEnergyConsumption`` (millijoules since the driver
loaded), read through the driver's own ``libnvidia-ml.so.1`` with ctypes (no Python package).
It updates every 20-100 ms, so :func:`joules_per_call` reads it only after ``SETTLE_S`` of idle
GPU at both ends of the run, and takes the idle board's power, measured over ``IDLE_S`` before
the run, off the idle spans inside the reads:

    J per call = (E_after - E_before - P_idle * (idle time between the reads)) / calls

With no driver (a CPU machine) :meth:`EnergyMeter.open` returns None and so does
:func:`joules_per_call`.
"""

from __future__ import annotations

import ctypes
import math
import time
from typing import Callable, Optional

import torch

#: idle seconds before each read of the counter (it updates every 20-100 ms)
SETTLE_S = 0.25
#: milliseconds of back-to-back calls one measurement runs for (:func:`joules_over_run`)
RUN_MS = 2500
#: seconds over which the idle board's power is measured
IDLE_S = 0.5
_NVML_SUCCESS = 0


class EnergyMeter:
    """One GPU's NVML energy counter."""

    def __init__(self, lib, handle):
        self._lib, self._handle = lib, handle

    @staticmethod
    def open(device=None) -> Optional["EnergyMeter"]:
        """The meter of CUDA ``device`` (default: the current one), or None where NVML or the
        counter is missing."""
        if not torch.cuda.is_available():
            return None
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            return None
        if lib.nvmlInit_v2() != _NVML_SUCCESS:
            return None
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(_nvml_index(device)), ctypes.byref(handle)):
            return None
        meter = EnergyMeter(lib, handle)
        return meter if meter.millijoules() is not None else None

    def millijoules(self) -> Optional[int]:
        """The counter: millijoules since the driver loaded (None if the board has none)."""
        mj = ctypes.c_ulonglong()
        if self._lib.nvmlDeviceGetTotalEnergyConsumption(self._handle, ctypes.byref(mj)) != _NVML_SUCCESS:
            return None
        return int(mj.value)


def _nvml_index(device) -> int:
    """NVML's index of the CUDA device (CUDA_VISIBLE_DEVICES taken into account)."""
    try:
        return torch.cuda._get_nvml_device_index(device)
    except (AttributeError, RuntimeError, ValueError):
        return torch.cuda.current_device() if device is None else torch.device(device).index or 0


def joules_per_call(fn: Callable[[], object], calls: int, device=None) -> Optional[dict]:
    """``fn()`` ``calls`` times back to back (after one call more and an idle settle): joules
    per call with the idle board's share taken off (module docstring), the mean power of the run
    (W) and its milliseconds per call. None without an energy counter."""
    if calls < 1:
        raise ValueError(f"joules_per_call: calls must be >= 1, got {calls}")
    meter = EnergyMeter.open(device)
    if meter is None:
        return None
    fn()
    torch.cuda.synchronize(device)
    idle_w = _idle_watts(meter)
    e0, r0 = meter.millijoules(), time.perf_counter()
    t0 = r0
    for _ in range(calls):
        fn()
    torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    time.sleep(SETTLE_S)
    e1, r1 = meter.millijoules(), time.perf_counter()
    busy_s = t1 - t0
    joules = (e1 - e0) / 1e3 - idle_w * ((r1 - r0) - busy_s)
    return {"j_per_call": joules / calls, "watts": joules / busy_s, "ms_per_call": 1e3 * busy_s / calls,
            "idle_watts": idle_w, "calls": calls}


def _idle_watts(meter: EnergyMeter) -> float:
    """The idle board's power over ``IDLE_S`` (after ``SETTLE_S`` of settling)."""
    time.sleep(SETTLE_S)
    e0, t0 = meter.millijoules(), time.perf_counter()
    time.sleep(IDLE_S)
    return (meter.millijoules() - e0) / 1e3 / (time.perf_counter() - t0)


def joules_over_run(fn: Callable[[], object], ms_per_call: Optional[float], device=None,
                    run_ms: float = RUN_MS) -> Optional[dict]:
    """:func:`joules_per_call` over about ``run_ms`` of back-to-back calls (at least 5), sized by
    ``ms_per_call`` (a timing of ``fn``; None or 0: 5 calls): a run many counter updates long."""
    calls = max(5, math.ceil(run_ms / ms_per_call)) if ms_per_call else 5
    return joules_per_call(fn, calls, device)


def joules_lines(fns: dict, ms_per_call: dict, names, run_ms: float = RUN_MS) -> list:
    """For each of ``names``: ``fns[name]`` back to back for about ``run_ms``
    (:func:`joules_over_run`, sized by its timing ``ms_per_call[name]``) as one line, "name: J per
    call, mean watts, ms per call back to back"; one line saying so without an energy counter."""
    lines = []
    for name in names:
        e = joules_over_run(fns[name], ms_per_call[name], run_ms=run_ms)
        if e is None:
            return ["no energy counter: nothing measured"]
        lines.append(f"{name}: {e['j_per_call']:.3f} J per call, {e['watts']:.0f} W, "
                     f"{e['ms_per_call']:.3f} ms per call back to back")
    return lines
