"""A weight's RMSNorm fold and 128 x 128 FP8 quantization in one pass (the FP8 recipe's weights,
``coda_cute.precision``): for W (N, K), the norm weight gamma (K,) that the consumer's input
carries (``coda-math`` section 2, ``W' = W diag(gamma)``; none for weights without a norm before
them) and block b = rows [128 bi, 128 bi + 128) x columns [128 bj, 128 bj + 128):

    W'   = W * gamma  (fp32 product, not rounded to 16 bits first)
    amax = max |W'| over the block;  s, q as ``coda_cute.reference.quantize_blocks_ref``

so q * s ~= W', bit for bit the reference on ``W.float() * gamma.float()``. Bandwidth-bound: the
weight read once (4 or 2 bytes per element), 1 byte written; run once per optimizer step.
``transposed`` also writes qt = q^T (K, N): the dgrad's K-major operand, whose 128 x 128 blocks
are q's transposed with the same scales (a square block's amax does not care which way it is
read), so the backward needs no transpose pass over the FP8 weight.

Roles: no specialization. One CTA of 256 threads per 128 x 128 block: thread t owns the ``VEC``
columns ``8 (t % 16) ..`` (fp32 W: two 16-byte loads of 4, else one of 8) of the block's rows
``t // 16 + 16 i``, i < 8. A thread loads gamma's 8 values and its 8 row vectors (zeros past the
matrix, which add nothing to the amax), keeps the fp32 products in registers, reduces its amax
over the warp with butterflies and over the 8 warps through shared memory, then every thread
quantizes and stores its values and thread 0 the block's scale. ``transposed``: the FP8 values
also go to a shared 128 x 128 tile; after a barrier thread t reads column ``t % 128`` of rows
``64 (t // 128) ..`` (a warp's lanes on consecutive bytes of a row: no bank conflicts) and
writes them as row ``t % 128`` of qt's block, four 16-byte stores (N a multiple of 16).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..common.fp8_math import abs_max, block_scale, quantize

THREADS = 256
WARPS = THREADS // 32
BLOCK = 128
#: columns per thread and row: one 8-byte store of FP8 values
VEC = 8
#: rows per thread: 128 rows / (256 threads / 16 column groups)
ROWS = BLOCK // (THREADS // (BLOCK // VEC))
#: qt: rows of the block per thread (two halves), FP8 values per 16-byte store
HALF = BLOCK // 2
OUT_VEC = 16
#: padding of the shared tile's rows (16 bytes)
PAD = 16


class QuantizeWeight:
    """``q, scales`` of ``w * gamma`` (``gamma`` None: of ``w``) for ``w`` (N, K) fp32 / bf16 /
    fp16, gamma (K,) of any of those, rows 16-byte aligned; q (N, K) FP8, scales
    (ceil(N / 128), ceil(K / 128)) fp32 of any strides; ``transposed``: qt (K, N) FP8 too."""

    def __init__(self, dtype, gamma_dtype, out_dtype, fp8_max: float, transposed: bool = False, pow2: bool = False):
        self.dtype, self.gamma_dtype, self.out_dtype, self.fp8_max = dtype, gamma_dtype, out_dtype, fp8_max
        self.pow2 = pow2
        self.transposed = transposed

    @cute.jit
    def __call__(self, w: cute.Tensor, gamma: cute.Tensor, q: cute.Tensor, scales: cute.Tensor, qt, stream):
        gw = cute.zipped_divide(w, (1, VEC))  # ((1, VEC), (N, K / VEC))
        gq = cute.zipped_divide(q, (1, VEC))
        gqt = None
        if cutlass.const_expr(self.transposed):
            gqt = cute.zipped_divide(qt, (1, OUT_VEC))  # ((1, 16), (K, N / 16))
        gg = None
        if cutlass.const_expr(gamma is not None):
            gg = cute.zipped_divide(
                cute.make_tensor(gamma.iterator, cute.make_layout((1, gamma.shape[0]), stride=(0, 1))), (1, VEC))
        rows, groups = gw.shape[1]
        self.kernel(gw, gg, gq, scales, gqt).launch(
            grid=(cute.ceil_div(groups, BLOCK // VEC), cute.ceil_div(rows, BLOCK), 1),
            block=(THREADS, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, gw: cute.Tensor, gg, gq: cute.Tensor, scales: cute.Tensor, gqt):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        rows, groups = gw.shape[1]
        col = Int32(bx * (BLOCK // VEC) + tidx % (BLOCK // VEC))
        row0 = Int32(by * BLOCK + tidx // (BLOCK // VEC))
        step = THREADS // (BLOCK // VEC)
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout((WARPS + 1,)), 16)
        tile = None
        if cutlass.const_expr(self.transposed):
            tile = smem.allocate_tensor(self.out_dtype, cute.make_layout((BLOCK, BLOCK), stride=(BLOCK + PAD, 1)), 16)

        buf = cute.make_rmem_tensor(cute.make_layout(((1, VEC), ROWS)), self.dtype)
        buf.fill(0.0)
        for r in cutlass.range_constexpr(ROWS):
            if row0 + r * step < rows and col < groups:
                buf[(None, r)].store(gw[(None, (row0 + r * step, col))].load())
        g = None
        if cutlass.const_expr(gg is not None):  # a column past K reads the last group (its products are 0)
            g = gg[(None, (0, cutlass.min(col, groups - 1)))].load().to(Float32)
        vals = cute.make_rmem_tensor(cute.make_layout(((1, VEC), ROWS)), Float32)
        amax = Float32(0.0)
        for r in cutlass.range_constexpr(ROWS):
            v = buf[(None, r)].load().to(Float32)
            slot = vals[(None, r)]
            for e in cutlass.range_constexpr(VEC):
                slot[e] = v[e] * g[e] if cutlass.const_expr(g is not None) else v[e]
            amax = abs_max(amax, slot.load(), VEC)

        warp, lane = tidx // 32, tidx % 32
        for off in (16, 8, 4, 2, 1):
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=off), nan=True)
        if lane == 0:
            red[warp] = amax
        cute.arch.sync_threads()
        if tidx == 0:
            total = red[0]
            for w in cutlass.range_constexpr(1, WARPS):
                total = cute.arch.fmax(total, red[w], nan=True)
            red[WARPS] = total
        cute.arch.sync_threads()
        fmax = Float32(self.fp8_max)
        scale, inv = block_scale(red[WARPS], fmax, self.pow2)
        tile_v = None if cutlass.const_expr(tile is None) else cute.zipped_divide(tile, (1, VEC))
        for r in cutlass.range_constexpr(ROWS):
            qv = quantize(vals[(None, r)].load(), inv, VEC).to(self.out_dtype)
            # the shared copy first: its unconditional store must come before the guarded one
            # (the guard's region would otherwise own the conversion both stores use)
            if cutlass.const_expr(tile_v is not None):  # past the matrix: zeros, never stored
                tile_v[(None, (tidx // (BLOCK // VEC) + r * step, tidx % (BLOCK // VEC)))].store(qv)
            if row0 + r * step < rows and col < groups:
                gq[(None, (row0 + r * step, col))].store(qv)
        if tidx == 0:
            scales[(by, bx)] = scale
        if cutlass.const_expr(gqt is not None):
            cute.arch.sync_threads()
            self._store_transposed(tile, gqt, bx, by, tidx, rows, groups * VEC)

    @cute.jit
    def _store_transposed(self, tile, gqt, bx, by, tidx, n, k):
        """Row ``t % 128`` of qt's block (column t % 128 of the shared tile), half t // 128."""
        c, half = tidx % BLOCK, tidx // BLOCK
        out = cute.make_rmem_tensor(cute.make_layout(((1, OUT_VEC), HALF // OUT_VEC)), self.out_dtype)
        for e in cutlass.range_constexpr(HALF):
            out[e] = tile[(half * HALF + e, c)]
        kk = bx * BLOCK + c
        if kk < k:
            for u in cutlass.range_constexpr(HALF // OUT_VEC):
                n0 = by * BLOCK + half * HALF + u * OUT_VEC
                if n0 < n:  # N is a multiple of 16: a 16-value store is wholly in or out
                    gqt[(None, (kk, n0 // OUT_VEC))].store(out[(None, u)].load())
