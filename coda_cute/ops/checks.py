"""Argument rules shared by the CODA ops: one function per rule.

Every op runs the same checks on its CUDA path, its fake (tracing) path and its CPU reference
path, so a call the GPU would reject is rejected while tracing and on the CPU too, before any
launch. Each failure names the op, the argument and the rule.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import Optional

import torch

from ..operands import check_pointer_aligned

BF16 = torch.bfloat16
F32 = torch.float32
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(op: str, name: str, t, dims: int, dtypes: tuple, aligned: bool = False):
    """A ``dims``-D contiguous tensor of one of ``dtypes``; ``aligned``: its data pointer on a
    16-byte boundary (tensors TMA reads or writes)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: {name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{op}: {name} must be {dims}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous, got strides {tuple(t.stride())}")
    if aligned:
        check_pointer_aligned(t, name, op)


def check_shape(op: str, name: str, t, shape: tuple, what: str = ""):
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must be {what}{tuple(shape)}, got {tuple(t.shape)}")


def check_aligned(op: str, what: str, n: int):
    if n % 8:
        raise ValueError(f"{op}: {what} = {n} must be a multiple of 8 (rows of bf16 values must "
                         "start on 16-byte boundaries for TMA)")


def check_norm_width(op: str, what: str, d: int):
    """An RMS norm's width: its mean of squares over no values is undefined."""
    if d < 1:
        raise ValueError(f"{op}: the RMS norm's width d ({what}) must be >= 1, got {d}")


def check_same_device(op: str, **tensors):
    devs = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devs.values())) > 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {devs}")


def check_eps(op: str, name: str, eps: float):
    if not (eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"{op}: {name} must be a finite number >= 0, got {eps}")


def check_linear(op: str, x_name: str, x, w, w_name: str = "w"):
    """x (M, K) @ w.T with w stored like nn.Linear (N, K), both bf16, contiguous and 16-byte
    aligned, K a multiple of 8. Returns (M, N, K)."""
    check_tensor(op, x_name, x, 2, (BF16,), aligned=True)
    check_tensor(op, w_name, w, 2, (BF16,), aligned=True)
    m, k = x.shape
    n, kw = w.shape
    if kw != k:
        raise ValueError(f"{op}: {w_name} is {tuple(w.shape)} but {x_name} has {k} columns ({w_name} is "
                         "stored like nn.Linear: out_features x in_features)")
    check_aligned(op, f"the inner dimension (columns of {x_name})", k)
    check_same_device(op, **{x_name: x, w_name: w})
    return m, n, k


def check_dgrad(op: str, g_name: str, g, w_name: str, w, what: str):
    """g (M, N) @ w (N, K), w a weight as stored (nn.Linear: out_features x in_features), both
    bf16, contiguous and 16-byte aligned, N a multiple of 8. Returns (M, N, K). ``what`` names
    N for the message."""
    check_tensor(op, g_name, g, 2, (BF16,), aligned=True)
    check_tensor(op, w_name, w, 2, (BF16,), aligned=True)
    m, n = g.shape
    if w.shape[0] != n:
        raise ValueError(f"{op}: {w_name} is {tuple(w.shape)} but {g_name} has {n} columns ({w_name} is "
                         f"the weight as stored, out_features x in_features, with out_features = {what})")
    check_aligned(op, f"{what} (columns of {g_name})", n)
    return m, n, w.shape[1]


def check_stats(op: str, name: str, ss, m: int):
    """Per-row partial sums (M, T) fp32, T >= 1 (norm statistics, gradient statistics)."""
    check_tensor(op, name, ss, 2, (F32,))
    if ss.shape[0] != m or ss.shape[1] < 1:
        raise ValueError(f"{op}: {name} must be (M, T) per-row partials with M = {m}, got shape "
                         f"{tuple(ss.shape)}")


def check_norm_input(op: str, y, w, ss, eps: float, store_cols: bool = True, w_name: str = "w",
                     y_name: str = "y"):
    """Rules shared by the ops that consume y with its norm statistics (``w_name``, ``y_name``:
    what the op calls its weight and its input). Returns (M, N, d)."""
    m, n, d = check_linear(op, y_name, y, w, w_name)
    check_norm_width(op, f"columns of {y_name}", d)
    check_stats(op, "ss", ss, m)
    if store_cols:
        check_aligned(op, f"the output width (rows of {w_name})", n)
    check_eps(op, "eps", eps)
    check_same_device(op, **{y_name: y, w_name: w, "ss": ss})
    return m, n, d


def _out_of_range(t: torch.Tensor, hi: int, ignore: Optional[int],
                  clamped: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Where t lies outside [0, hi) (and is not ``ignore``): t against its clamp (two launches
    where lt, ge and or took three; one where the caller gathers with the clamped values and
    passes them)."""
    if hi < 1:
        bad = torch.ones_like(t, dtype=torch.bool)
    else:
        top = min(hi - 1, torch.iinfo(t.dtype).max)  # an int32 t with hi past its range
        bad = (t.clamp(0, top) if clamped is None else clamped) != t
    if ignore is not None:
        bad &= t != ignore
    return bad


def _range_error(op: str, name: str, t, hi: int, ignore: Optional[int]) -> ValueError:
    first = int(t[_out_of_range(t, hi, ignore)][0])
    extra = "" if ignore is None else f" (or {ignore}, the ignore_index)"
    return ValueError(f"{op}: {name} must lie in [0, {hi}){extra}; found {first}")


def check_index_range(op: str, name: str, t: torch.Tensor, hi: int, ignore: Optional[int] = None):
    """Values of ``t`` must lie in [0, hi) (or equal ``ignore``). Costs one reduction and a host
    sync; a device-side assert instead would poison the CUDA context."""
    if bool(_out_of_range(t, hi, ignore).any()):
        raise _range_error(op, name, t, hi, ignore)


class PendingCheck:
    """A condition on device data read back without stalling the GPU: ``bad`` (a 0-dim bool
    tensor, queued now) is copied to pinned host memory, and :meth:`wait` blocks only until that
    copy has landed (the work queued after it keeps the GPU busy meanwhile), then raises
    ``error()`` if it was true. A synchronous check would leave the GPU idle between the sync and
    the next launch. On CPU tensors the condition is read at once. Inside a CUDA graph capture,
    where nothing can be read back, it becomes a device-side assert of the captured work (a
    failing replay stops with a CUDA error instead of a Python one, never a silent result)."""

    def __init__(self, bad: torch.Tensor, error):
        self.error = error
        self.done = None
        if bad.device.type != "cuda":
            if bool(bad):
                raise error()
            return
        if torch.cuda.is_current_stream_capturing():
            torch._assert_async(~bad, "coda_cute: an argument check failed in a CUDA graph replay "
                                      "(run the step eagerly for the Python error)")
            return
        self.flag = torch.empty((), dtype=torch.bool, pin_memory=True)
        self.flag.copy_(bad, non_blocking=True)
        self.done = torch.cuda.Event()
        # the stream of bad's device named: current_stream() without one first asks which
        # device is current, a tenth of a millisecond of host time per check
        self.done.record(torch.cuda.current_stream(bad.device))

    def wait(self):
        if self.done is None:
            return
        deferred = getattr(_DEFERRED, "checks", None)
        if deferred is not None:
            deferred.append(self)
            return
        self.done.synchronize()
        if bool(self.flag):
            raise self.error()


class PendingIndexCheck(PendingCheck):
    """:func:`check_index_range` as a :class:`PendingCheck`; ``clamped``: ``t.clamp(0, hi - 1)``
    where the caller has it."""

    def __init__(self, op: str, name: str, t: torch.Tensor, hi: int, ignore: Optional[int] = None,
                 clamped: Optional[torch.Tensor] = None):
        super().__init__(_out_of_range(t, hi, ignore, clamped).any(),
                         lambda: _range_error(op, name, t, hi, ignore))


#: the checks whose read-back a :func:`deferred_checks` context of this thread postponed
_DEFERRED = threading.local()


@contextlib.contextmanager
def deferred_checks():
    """Postpone every :meth:`PendingCheck.wait` inside the context to its exit, where each is
    read back in order and the first failing one raises: a model's forward then syncs with the
    host once, at its end, instead of at each op that checks device data (the embedding's ids at
    the step's very start left the GPU idle until the host had caught up). Safe because every
    op that queues a check already tolerates the bad values until its wait (clamped gathers,
    targets the loss kernels never index with). Errors still raise before the forward returns.
    Nested contexts join the outermost; an exception inside drops the pending checks."""
    if getattr(_DEFERRED, "checks", None) is not None:
        yield
        return
    _DEFERRED.checks = []
    try:
        yield
    finally:
        pending, _DEFERRED.checks = _DEFERRED.checks, None
    for check in pending:
        check.wait()


def with_deferred_checks(forward):
    """``forward`` run inside :func:`deferred_checks`; traced unchanged by ``torch.compile``
    (the compiled graph's ops wait for their own checks)."""
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if torch.compiler.is_compiling():
            return forward(*args, **kwargs)
        with deferred_checks():
            return forward(*args, **kwargs)
    return run
