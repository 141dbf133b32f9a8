"""Memory-bound passes beside a GEMM, on SMs the GEMM leaves them.

Our GEMMs are persistent: one CTA per SM for the whole launch, with all of its shared memory, so
a pass queued on another stream gets no SM until the GEMM ends. :func:`beside` runs the GEMM on
all SMs but ``side_sms`` and the passes on a second stream: their CTAs take the SMs it left. The
GEMM's slots then walk more rounds of tiles (16 SMs of 132 made a 16384 x 4096 x 28672 FP8 GEMM
1.12x slower on an H100; 4 cost it nothing, its last round being half empty anyway); the passes,
which move bytes only as fast as the SMs they get can issue them (about 90 GB/s per SM on an
H100), come off the critical path. It pays where their serial time is more than what the GEMM
loses, and only for passes whose outputs no launch before the join reads (the FP8 MLP backward's
weight-gradient operands: ``ops.mlp_fp8``).

Streams: the side stream waits for the current one before the passes (they see every earlier
launch), the current one waits for the side stream after (every later launch sees the passes).
Every use forks first, so a block the caching allocator hands out on the side stream was last
used before a fork: no ``record_stream`` is needed, and CUDA graph capture takes the fork and the
join as events.
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch

from .. import dispatch

G = TypeVar("G")
P = TypeVar("P")
_streams: dict = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _streams:
        _streams[index] = torch.cuda.Stream(index)
    return _streams[index]


def beside(gemm: Callable[[Optional[int]], G], passes: Callable[[], P], device: torch.device,
           side_sms: int) -> tuple[G, P]:
    """(gemm(sms), passes()): on CUDA with ``side_sms`` > 0, ``gemm`` is handed the SM count its
    persistent grid may hold (the device's less ``side_sms``) and launched first, then ``passes``
    run on the side stream, joined into the current one before this returns; elsewhere
    ``gemm(None)`` (every SM) then ``passes()`` in series."""
    if device.type != "cuda" or side_sms <= 0:
        return gemm(None), passes()
    sms = dispatch.num_sms(device) - side_sms
    cur = torch.cuda.current_stream(device)
    side = _side_stream(device)
    side.wait_stream(cur)
    out = gemm(sms)  # queued first: its CTAs hold their SMs before the passes' CTAs are placed
    with torch.cuda.stream(side):
        rest = passes()
    cur.wait_stream(side)
    return out, rest
