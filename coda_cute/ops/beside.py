"""Memory-bound passes beside a GEMM, on SMs the GEMM leaves them.

Our GEMMs are persistent: one CTA per SM for the whole launch, with all of its shared memory, so
a pass queued on another stream gets no SM until the GEMM ends. :func:`beside` runs the GEMM on
all SMs but ``side_sms`` and the passes on a second stream: their CTAs take the SMs it left. The
GEMM's slots then walk more rounds of tiles (on an H100 a 16384 x 4096 x 28672 FP8 GEMM took
1.06x its time on 124 SMs, 1.12x on 116); the passes, which move bytes only as fast as the SMs
they get can issue them (about 90 GB/s per SM on an H100, estimated from their time beside it),
come off the critical path (that GEMM with four passes of 0.80 ms: 3.06-3.11 ms on 116 SMs
against 3.40-3.44 in series). It pays where their serial time is more than what the GEMM loses,
and only for passes whose outputs no launch before the join reads (the FP8 MLP backward's
weight-gradient operands: ``ops.mlp_fp8``; the row-wise weights but the first GEMM's rows, beside
that GEMM: ``ops.fp8_gemms.first_projection``).

Streams: the side stream waits for the current one before the passes (they see every earlier
launch), the current one waits for the side stream after (every later launch sees the passes).
Every use forks first, so a block the caching allocator hands out on the side stream was last
used before a fork: no ``record_stream`` is needed. Under CUDA graph capture a fork and a join
are cross-stream event waits, which capture records as the graph's edges (not yet run under
capture on a GPU: ``coda-cute train --cuda-graphs`` falls back to eager steps where a capture
fails). The passes' outputs live from their launch beside the GEMM to their reader, so a caller
orders its launches to keep that short (``ops.mlp_fp8``: with its first order the 8b FP8 step's
peak memory beyond parameters and gradients rose from 4.34 to 4.68 GiB, with its second it is
3.73; H100s, 2026-12-06 and 07).

The GEMM goes on a stream of higher priority than the passes' (``GEMM_PRIORITY``, through
``epilogue.runner.launching_on``; its outputs are still allocated on the current stream). Queued
on the current stream, both become ready when the launch before them ends and whose CTAs the GPU
places first is its choice; on a stream of higher priority the persistent GEMM's are placed first.
On H100s (2026-12-07, the 8b MLP, in turns) it gained 0.25-0.47 ms over series in seven runs
(0.31, 0.47 and 0.42 in the last three) where the GEMM on the current stream gained -0.22 to 0.52
in six (0.10, 0.52 and 0.32), and ran faster than it in five of those six. It allocates
nothing on its stream (``bench_fp8.py``'s reserved MiB by stream: the current stream's pool and
the side stream's alone); the current stream's pool grew 896-2240 MiB from an emptied cache
across variants that allocate the same bytes, in series as much as beside (allocator
fragmentation, not the priority stream).
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch

from .. import dispatch
from ..epilogue.runner import launching_on

G = TypeVar("G")
P = TypeVar("P")
#: the priority of the stream the GEMM is launched on (lower is higher in CUDA; 0: the current
#: stream, the passes' priority)
GEMM_PRIORITY = -1
_streams: dict = {}


def _stream(index: int, priority: int) -> torch.cuda.Stream:
    if (index, priority) not in _streams:
        _streams[index, priority] = torch.cuda.Stream(index, priority=priority)
    return _streams[index, priority]


def stream_pair(device: torch.device) -> tuple[Optional[torch.cuda.Stream], torch.cuda.Stream]:
    """(the GEMM's stream, the passes' side stream) of :func:`beside` on CUDA ``device``: the
    GEMM's is ``None`` (the current stream) where ``GEMM_PRIORITY`` is 0. Each made once per
    device and priority."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (_stream(index, GEMM_PRIORITY) if GEMM_PRIORITY else None), _stream(index, 0)


def beside(gemm: Callable[[Optional[int]], G], passes: Callable[[], P], device: torch.device,
           side_sms: int) -> tuple[G, P]:
    """(gemm(sms), passes()): on CUDA with ``side_sms`` > 0, ``gemm`` is handed the SM count its
    persistent grid may hold (the device's less ``side_sms``) and launched first, on the stream of
    :func:`stream_pair`, then ``passes`` run on the side stream, joined into the current one
    before this returns; elsewhere ``gemm(None)`` (every SM) then ``passes()`` in series."""
    if device.type != "cuda" or side_sms <= 0:
        return gemm(None), passes()
    sms = dispatch.num_sms(device) - side_sms
    cur = torch.cuda.current_stream(device)
    gemm_stream, side = stream_pair(device)
    side.wait_stream(cur)
    with launching_on(gemm_stream):
        out = gemm(sms)
    with torch.cuda.stream(side):
        rest = passes()
    cur.wait_stream(side)
    return out, rest
