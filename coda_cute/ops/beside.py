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
weight-gradient operands: ``ops.mlp_fp8``).

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

A GEMM launched on a stream of higher priority than the passes' gained more and more steadily on
H100s (2026-12-07, the 8b MLP, in turns: 0.46, 0.43 and 0.36 ms over series in three runs, where
the GEMM on the current stream gained 0.39, 0.13 and -0.22; 0.25 in a fourth run without that
row). It is not taken yet: in ``bench_fp8.py``'s reserved-memory column the sublayer with it
reserved 2530-2658 MiB against 1634. That held with its outputs allocated on the current stream
too (branch ``wip/beside-priority``), while the weights-kept variant with it reserved 1634, and the
column then compared variants among the blocks the earlier ones' gradients held: the bench now
drops those first, and the branch records the reserved MiB by stream pool, neither run yet.
(The 3.73 GiB above ran with it; the bytes allocated are the same.)
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
    # queued first, but both become ready when the launch before them ends: whose CTAs the GPU
    # places first is its choice (a likely cause of the gain's spread between runs)
    out = gemm(sms)
    with torch.cuda.stream(side):
        rest = passes()
    cur.wait_stream(side)
    return out, rest
