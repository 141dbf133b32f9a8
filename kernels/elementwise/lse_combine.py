"""The log-sum-exp of a row from its per-tile partials, the last step of an ``lse`` row reduction
(``coda_cute.epilogue.finalize_lse`` in one launch instead of torch's eight):

    M_m     = max_t mx[m, t]                     (NaN if any mx[m, t] is NaN)
    lse[m]  = M' + log sum_t se[m, t] exp(mx[m, t] - M'),   M' = M_m, or 0 where M_m is +-inf

where ``mx[m, t]`` is tile t's maximum of row m and ``se[m, t] = sum exp(x - mx[m, t])`` over its
columns. The ``M'`` rule is the reference's: a row of -inf gives log 0 = -inf, a +inf gives inf.
exp and log are the accurate (non-approximate) ones: this is the loss itself, and the kernel
reads 8 bytes per partial, so its time is the launch's.

Roles: no specialization. A 128-thread CTA takes four rows, one per warp. Each lane strides over
its row's partials 32 apart: first their maximum (butterfly max over the warp), then the sum of
``se exp(mx - M')`` over the same elements (back from L1: a row is 8 bytes per tile), then a
butterfly sum, in a fixed order (deterministic); lane 0 writes the row's result.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

THREADS = 128
WARPS = THREADS // 32


class LseCombine:
    """``lse (M,) <- finalize_lse(mx, se)`` for fp32 partials ``mx``, ``se`` (M, T), unit stride
    along T; see the module docstring."""

    @cute.jit
    def __call__(self, mx: cute.Tensor, se: cute.Tensor, lse: cute.Tensor, stream):
        self.kernel(mx, se, lse).launch(
            grid=(cute.ceil_div(mx.shape[0], WARPS), 1, 1),
            block=(THREADS, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mx: cute.Tensor, se: cute.Tensor, lse: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        m, t = mx.shape
        lane = tidx % 32
        row = bid * WARPS + tidx // 32
        if row < m:
            hi = Float32(-math.inf)
            for j in cutlass.range(lane, t, 32, unroll=4):
                hi = cute.arch.fmax(hi, mx[(row, j)], nan=True)
            for off in (16, 8, 4, 2, 1):
                hi = cute.arch.fmax(hi, cute.arch.shuffle_sync_bfly(hi, offset=off), nan=True)
            shift = Float32(cutlass.select_(cute.math.absf(hi) == Float32(math.inf), Float32(0.0), hi))
            acc = Float32(0.0)
            for j in cutlass.range(lane, t, 32, unroll=4):
                acc = cute.math.fma(se[(row, j)], cute.math.exp(mx[(row, j)] - shift), acc)
            for off in (16, 8, 4, 2, 1):
                acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=off)
            if lane == 0:
                lse[row] = shift + cute.math.log(acc)
