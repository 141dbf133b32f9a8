"""The row and column absolute maxima of a 16-bit matrix in one read, for the row-wise FP8 recipe's
quantization (``coda_cute.precision.Fp8Recipe(scaling="row")``): for x (M, K),

    row_amax[m] = max_k |x[m, k]|,   col_amax[k] = max_m |x[m, k]|   (NaN where a NaN is among them)

into fp32 vectors the caller zeroes first. No tile sees a whole row or column, so each CTA folds
its tile's maxima into the vectors with atomic max on the values' bits (``atomic_fmax``: |x| has
its sign bit clear, so the bits order like the values, NaN above inf). A max is exact and its
order does not matter: the result is deterministic, the reference's bit for bit.

Roles: no specialization. One CTA of 256 threads per strip of ``STRIP`` 128 x 128 tiles along a
row block, taken in turn. Half-warp ``h`` owns the strip's rows ``h + 16 i`` (i < 8), its lane
``j`` the 8 columns ``8 j ..`` of each tile (one 16-byte load per row, zeros past the matrix,
which add nothing to an amax). Rows: a thread keeps its 8 rows' maxima over the whole strip, then
per row a butterfly over the half-warp and lane 0 folds the row's maximum in: one atomic per row
per strip, not per tile (a wide matrix's row atomics otherwise queue on the same addresses: at
K = 28672 the one-tile CTAs ran at 1.9 TB/s). Columns: per tile each thread's 8 column maxima over
its 8 rows go to shared memory (two buffers, so one barrier per tile), and each of 128 threads
takes one column's 16 and folds it in. K must be a multiple of 8 (16-byte rows).

``fold`` (the columns alone): the column maxima of ``fold[m] * x[m, k]`` (fp32 products), the
operand of a weight gradient that takes the gradient rows' scales (``fp8_math.fold_factor``); a
thread reads its 8 rows' factors once.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..common.fp8_math import abs_max
from .row_loads import load_row_groups

THREADS = 256
BLOCK = 128
#: columns per thread and row: one 16-byte load of 16-bit values
VEC = 8
#: lanes per row: a half-warp
LANES = BLOCK // VEC
#: rows per thread
ROWS = BLOCK // (THREADS // LANES)
#: half-warps: the partial column maxima of a tile per column
HALVES = THREADS // LANES
#: 128 x 128 tiles per CTA, along the row block
STRIP = 4


class AbsMax:
    """``row_amax``, ``col_amax`` (zeroed fp32 (M,), (K,)) of 16-bit ``x`` (M, K); ``rows`` /
    ``cols`` False: that vector is not touched (pass any fp32 vector). ``fold`` (columns only):
    call :meth:`with_fold` with the rows' factors (M,)."""

    def __init__(self, dtype, rows: bool = True, cols: bool = True, fold: bool = False):
        if fold and (rows or not cols):
            raise ValueError("AbsMax: fold scales the column maxima alone")
        self.dtype, self.rows, self.cols, self.fold = dtype, rows, cols, fold

    @cute.jit
    def __call__(self, x: cute.Tensor, row_amax: cute.Tensor, col_amax: cute.Tensor, stream):
        self._launch(x, row_amax, col_amax, col_amax, stream)  # no factors: col_amax holds their place unread

    @cute.jit
    def with_fold(self, x: cute.Tensor, row_amax: cute.Tensor, col_amax: cute.Tensor, fold: cute.Tensor, stream):
        self._launch(x, row_amax, col_amax, fold, stream)

    @cute.jit
    def _launch(self, x, row_amax, col_amax, fold, stream):
        gx = cute.zipped_divide(x, (1, VEC))  # ((1, VEC), (M, K / VEC))
        m, k = x.shape
        self.kernel(gx, row_amax, col_amax, fold, m, k).launch(
            grid=(cute.ceil_div(k, BLOCK * STRIP), cute.ceil_div(m, BLOCK), 1),
            block=(THREADS, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, gx: cute.Tensor, row_amax: cute.Tensor, col_amax: cute.Tensor, fold: cute.Tensor, m: Int32,
               k: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        # row-major: the column reads below are conflict-free, the writes 4-way (8 per thread)
        red = smem.allocate_tensor(Float32, cute.make_layout((2, HALVES, BLOCK), stride=(HALVES * BLOCK, BLOCK, 1)),
                                   16)
        h, j = tidx // LANES, tidx % LANES
        rmax = [Float32(0.0)] * ROWS
        factors = []
        for i in cutlass.range_constexpr(ROWS if self.fold else 0):  # rows past M: zeros, any factor
            row = by * BLOCK + h + LANES * i
            factors.append(fold[cutlass.select_(row < m, row, m - 1)])
        for t in cutlass.range_constexpr(STRIP):
            tile = bx * STRIP + t
            buf = cute.make_rmem_tensor(cute.make_layout(((1, VEC), ROWS)), self.dtype)
            load_row_groups(gx, buf, by * BLOCK + h, LANES, Int32(tile * LANES + j), ROWS)
            if cutlass.const_expr(self.rows):
                for i in cutlass.range_constexpr(ROWS):
                    rmax[i] = abs_max(rmax[i], buf[(None, i)].load().to(Float32), VEC)
            if cutlass.const_expr(self.cols):
                v = cute.make_rmem_tensor(cute.make_layout(ROWS), Float32)
                for e in cutlass.range_constexpr(VEC):
                    for i in cutlass.range_constexpr(ROWS):
                        v[i] = buf[(e, i)].to(Float32)
                        if cutlass.const_expr(self.fold):
                            v[i] = v[i] * factors[i]
                    red[(t % 2, h, VEC * j + e)] = abs_max(Float32(0.0), v.load(), ROWS)
                # one barrier per tile: a buffer is rewritten two tiles later, after every thread
                # has passed the next tile's barrier, so after its reads of this one
                cute.arch.sync_threads()
                if tidx < BLOCK:
                    cmax = red[(t % 2, 0, tidx)]
                    for o in cutlass.range_constexpr(1, HALVES):
                        cmax = cute.arch.fmax(cmax, red[(t % 2, o, tidx)], nan=True)
                    kk = tile * BLOCK + tidx
                    if kk < k:
                        cute.arch.atomic_fmax(col_amax.iterator + kk, cmax, sign_bit=False)
        if cutlass.const_expr(self.rows):
            for i in cutlass.range_constexpr(ROWS):
                amax = rmax[i]
                for off in (8, 4, 2, 1):  # within the half-warp: lanes differ in their low 4 bits
                    amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=off), nan=True)
                row = by * BLOCK + h + LANES * i
                if j == 0 and row < m:
                    cute.arch.atomic_fmax(row_amax.iterator + row, amax, sign_bit=False)
