"""1 x 128 block quantization of a 16-bit matrix to FP8 (``coda_cute.precision``'s recipe) for the
operands no GEMM epilogue produces (attention output, embedding output). For x (M, K) and block
b = columns [128 b, 128 b + 128) of a row (the last one partial when K is no multiple of 128):

    amax = max |x| over the block   (NaN if the block holds a NaN, inf if it holds an inf)
    s    = amax / FP8_MAX, 1 where amax = 0, NaN where amax is not finite
    q    = fp8(clamp(x * (1 / s), -FP8_MAX, FP8_MAX))   (1 / s rounded to fp32 once per block)

as ``coda_cute.reference.quantize_blocks_ref`` defines it, bit for bit. Bandwidth-bound: 2 bytes
read and 1 written per element, 4 per 128 for the scale.

Roles: no specialization. A CTA of 128 threads is 8 half-warps; half-warp ``h`` owns column block
``8 * blockIdx.x + h`` of ``ROWS`` consecutive rows, its lane ``j`` the 8 columns
``[128 b + 8 j, 128 b + 8 j + 8)`` (one 16-byte load, one 8-byte store per row). A thread issues
the loads of all its rows first (zero-filled where a row or its columns lie past the matrix, so
they add nothing to the amax), then per row: its 8-value amax, a butterfly over the half-warp's 16
lanes (every lane shuffles, in or out of range: ``shfl.sync`` wants the whole warp), the scale,
the 8 quantized values; lane 0 of the half-warp writes the scale. Rows must start 16-byte aligned
(K a multiple of 8).

``whole`` (the row-wise recipe, ``Fp8Recipe(scaling="row")``): one scale per whole row, from the
given ``row_amax`` (M,) (max |x| over the row, found beforehand), scales (M, 1) written by the
first column block's half-warps; exactly ``quantize_blocks_ref`` with blocks (1, K).

:class:`QuantizeWholeRows`: the same whole-row scales with each row's amax found in the kernel, so
x is read once (the forward's activations, which need no column scales: a separate amax pass read
them a second time). Roles: no specialization. One CTA of ``WHOLE_THREADS`` threads per row;
thread ``t`` loads the row's 16-byte groups ``t + WHOLE_THREADS i`` (i < ``groups``, a build
constant: the row lives in registers), then a butterfly per warp and the warps' maxima through
shared memory give every thread the row's amax; each thread scales and stores its own groups.
With ``fold`` (a gradient's rows, whose weight gradient folds their scales into the other
operand) it also writes each row's fold factor (``fp8_math.fold_factor``: the scale, 0 for a
zero row).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..common.fp8_math import abs_max, block_scale, fold_factor, quantize
from .row_loads import load_row_groups

THREADS = 128
#: columns per scale block (the recipe's 1 x 128)
BLOCK = 128
#: elements per access (16 bytes of a 16-bit type)
VEC = 8
#: lanes per block: a half-warp
LANES = BLOCK // VEC
#: rows per thread: independent 16-byte loads in flight
ROWS = 4


class QuantizeRows:
    """``q, scales = quantize 1 x 128`` for 16-bit ``x`` (M, K) to ``out_dtype`` (E4M3 / E5M2),
    scales (M, ceil(K / 128)) fp32 of any strides."""

    def __init__(self, dtype, out_dtype, fp8_max: float, pow2: bool = False, whole: bool = False):
        self.dtype, self.out_dtype, self.fp8_max, self.pow2 = dtype, out_dtype, fp8_max, pow2
        self.whole = whole

    @cute.jit
    def __call__(self, x: cute.Tensor, q: cute.Tensor, scales: cute.Tensor, stream):
        self._launch(x, q, scales, scales, stream)  # no amaxes: scales holds their place unread

    @cute.jit
    def rowwise(self, x: cute.Tensor, q: cute.Tensor, scales: cute.Tensor, row_amax: cute.Tensor, stream):
        self._launch(x, q, scales, row_amax, stream)

    @cute.jit
    def _launch(self, x, q, scales, row_amax, stream):
        gx = cute.zipped_divide(x, (1, VEC))  # ((1, VEC), (M, K / VEC))
        gq = cute.zipped_divide(q, (1, VEC))
        rows, groups = gx.shape[1]
        blocks = cute.ceil_div(groups, LANES)
        self.kernel(gx, gq, scales, row_amax).launch(
            grid=(cute.ceil_div(blocks, THREADS // LANES), cute.ceil_div(rows, ROWS), 1),
            block=(THREADS, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, gx: cute.Tensor, gq: cute.Tensor, scales: cute.Tensor, row_amax: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        rows, groups = gx.shape[1]
        block = Int32(bx * (THREADS // LANES) + tidx // LANES)
        lane = tidx % LANES
        col = Int32(block * LANES + lane)
        row0 = Int32(by * ROWS)
        buf = cute.make_rmem_tensor(cute.make_layout(((1, VEC), ROWS)), self.dtype)
        load_row_groups(gx, buf, row0, 1, col, ROWS)
        fmax = Float32(self.fp8_max)
        for r in cutlass.range_constexpr(ROWS):
            v = buf[(None, r)].load().to(Float32)
            if cutlass.const_expr(self.whole):  # rows past M read the last row's: never stored
                amax = row_amax[cutlass.select_(row0 + r < rows, row0 + r, rows - 1)]
            else:
                amax = abs_max(Float32(0.0), v, VEC)
                for off in (8, 4, 2, 1):  # within the half-warp: lanes differ in their low 4 bits
                    amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=off), nan=True)
            scale, inv = block_scale(amax, fmax, self.pow2)
            if row0 + r < rows and col < groups:
                gq[(None, (row0 + r, col))].store(quantize(v, inv, VEC).to(self.out_dtype))
                if cutlass.const_expr(self.whole):
                    if lane == 0 and block == 0:
                        scales[(row0 + r, 0)] = scale
                elif lane == 0:
                    scales[(row0 + r, block)] = scale


#: threads of a :class:`QuantizeWholeRows` CTA (one row)
WHOLE_THREADS = 256
WHOLE_WARPS = WHOLE_THREADS // 32


class QuantizeWholeRows:
    """``q, scales = quantize`` with one scale per whole row of 16-bit ``x`` (M, K), the amax found
    here; K at most ``groups * VEC * WHOLE_THREADS``; scales (M, 1) fp32 of any strides. ``fold``:
    call :meth:`with_fold`, which also writes the rows' fold factors (M,)."""

    def __init__(self, dtype, out_dtype, fp8_max: float, pow2: bool, groups: int, fold: bool = False):
        self.dtype, self.out_dtype, self.fp8_max, self.pow2 = dtype, out_dtype, fp8_max, pow2
        self.groups, self.fold = groups, fold

    @cute.jit
    def __call__(self, x: cute.Tensor, q: cute.Tensor, scales: cute.Tensor, stream):
        self._launch(x, q, scales, scales, stream)  # no fold factors: scales hold their place unwritten

    @cute.jit
    def with_fold(self, x: cute.Tensor, q: cute.Tensor, scales: cute.Tensor, fold: cute.Tensor, stream):
        self._launch(x, q, scales, fold, stream)

    @cute.jit
    def _launch(self, x, q, scales, fold, stream):
        gx = cute.zipped_divide(x, (1, VEC))  # ((1, VEC), (M, K / VEC))
        gq = cute.zipped_divide(q, (1, VEC))
        rows, _ = gx.shape[1]
        self.kernel(gx, gq, scales, fold).launch(grid=(rows, 1, 1), block=(WHOLE_THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, gx: cute.Tensor, gq: cute.Tensor, scales: cute.Tensor, fold: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        _, groups = gx.shape[1]
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout(WHOLE_WARPS), 16)
        buf = cute.make_rmem_tensor(cute.make_layout(((1, VEC), self.groups)), self.dtype)
        buf.fill(0.0)  # groups past K: zeros, which add nothing to the amax
        for i in cutlass.range_constexpr(self.groups):
            col = tidx + WHOLE_THREADS * i
            if col < groups:
                buf[(None, i)].store(gx[(None, (row, col))].load())
        amax = Float32(0.0)
        for i in cutlass.range_constexpr(self.groups):
            amax = abs_max(amax, buf[(None, i)].load().to(Float32), VEC)
        for off in (16, 8, 4, 2, 1):
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=off), nan=True)
        if tidx % 32 == 0:
            red[tidx // 32] = amax
        cute.arch.sync_threads()
        amax = red[0]
        for w in cutlass.range_constexpr(1, WHOLE_WARPS):
            amax = cute.arch.fmax(amax, red[w], nan=True)
        scale, inv = block_scale(amax, Float32(self.fp8_max), self.pow2)
        for i in cutlass.range_constexpr(self.groups):
            col = tidx + WHOLE_THREADS * i
            if col < groups:
                gq[(None, (row, col))].store(quantize(buf[(None, i)].load().to(Float32), inv, VEC).to(self.out_dtype))
        if tidx == 0:
            scales[(row, 0)] = scale
            if cutlass.const_expr(self.fold):
                fold[row] = fold_factor(amax, scale)
