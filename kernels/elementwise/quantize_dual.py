"""Both 1 x 128 FP8 quantizations of a 16-bit matrix in one pass (``coda_cute.precision``'s recipe):
for x (M, K),

    q, s   = 1 x 128 blocks of x along K     (the dgrad / fprop operand, x as stored)
    qt, st = 1 x 128 blocks of x^T along M   (the weight-gradient operand: x transposed, (K, M))

each exactly ``coda_cute.reference.quantize_blocks_ref`` (``fp8_math``), bit for bit. A 1 x 128
quantized tensor cannot be transposed afterwards (its blocks run the other way), so the weight
gradient needs the second quantization; reading x once for both moves 2 bytes in and 2 out per
element where a bf16 transpose plus two quantizations move 10. ``rows=False`` writes only qt, st
(an operand whose row quantization exists already).

``whole`` (the row-wise recipe, ``Fp8Recipe(scaling="row")``): one scale per whole row of x and
one per whole column, from the given ``row_amax`` (M,) and ``col_amax`` (K,) (each the max of |x|
over its row / column, found beforehand: no tile sees a whole row or column), with the same
scale arithmetic; s is (M, 1) and st (K, 1), written by the CTAs of the first tile column and
row. Exactly ``quantize_blocks_ref`` with blocks (1, K) of x and (1, M) of x^T.

``fold`` (``whole``, the columns alone): qt, st of ``fold[m] * x[m, k]`` (fp32 products, the
column amaxes given of the same products, ``AbsMax(fold=True)``): a weight gradient's activation
operand taking the gradient rows' scales (``fp8_math.fold_factor``). The tile's 128 factors wait
in shared memory for the columns phase.

Roles: no specialization. One CTA of 256 threads per 128 x 128 tile, in three phases and three
barriers. Rows phase: half-warp ``h`` owns the tile's rows ``h + 16 i`` (i < 8), its lane ``j``
the 8 columns ``8 j ..`` (one 16-byte load per row, zeros past the matrix, which add nothing to an
amax); per row a butterfly over the half-warp gives the block's amax, then the 8 quantized values
and (lane 0) the scale; the 16-bit values go to shared memory. Columns phase: thread ``t`` owns
the columns ``2 (t % 64)`` and ``2 (t % 64) + 1`` of rows ``32 (t // 64) ..`` (32 words read down
the column pair, a warp's lanes on consecutive pairs: no bank conflicts), the four quarters'
amaxes meet in shared memory, and each thread stages its 32 quantized values of each of its two
rows of qt's 128 x 128 tile in shared memory. Copy-out phase: the CTA writes that tile, eight
lanes per 128-byte row of qt. K must be a multiple of 8 (16-byte rows of x) and M of 16 (16-byte
rows of qt).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..common.fp8_math import abs_max, block_scale, quantize
from .row_loads import load_row_groups

THREADS = 256
BLOCK = 128
#: columns per thread and row in the rows phase: one 16-byte load of 16-bit values
VEC = 8
#: lanes per row: a half-warp
LANES = BLOCK // VEC
#: rows per thread in the rows phase
ROWS = BLOCK // (THREADS // LANES)
#: column pairs of a tile, one per thread of a quarter of the CTA in the columns phase
PAIRS = BLOCK // 2
#: rows per thread in the columns phase (four quarters of the tile)
QUARTER = BLOCK // (THREADS // PAIRS)
#: FP8 values per store of qt
OUT_VEC = 16
#: 16-value groups per 128-value row of qt's tile
GROUPS = BLOCK // OUT_VEC
#: padding of the staged qt tile's rows (16 bytes, keeping them 16-byte aligned; a warp's lanes
#: write columns two apart, 288 bytes, so its staging stores conflict 2-way, 4 per thread)
QPAD = 16
#: padding of the shared tile's rows (16 bytes), so the rows phase's 16-byte stores of two
#: half-warps do not share banks
PAD = 8


class QuantizeDual:
    """``q, s, qt, st`` of 16-bit ``x`` (M, K) in ``out_dtype`` (E4M3 / E5M2): q (M, K), s
    (M, ceil(K / 128)), qt (K, M), st (K, ceil(M / 128)); scales fp32 of any strides.
    ``rows=False``: q and s are not written (pass them anyway, any tensors of those shapes).
    ``whole``: call :meth:`rowwise` with the amaxes; s (M, 1), st (K, 1); with ``fold`` as well
    (``rows`` False), :meth:`folded` with the factors (M,) and the columns' amaxes."""

    def __init__(self, dtype, out_dtype, fp8_max: float, rows: bool = True, pow2: bool = False,
                 whole: bool = False, fold: bool = False):
        if fold and (rows or not whole):
            raise ValueError("QuantizeDual: fold applies to the row-wise recipe's columns alone")
        self.dtype, self.out_dtype, self.fp8_max, self.rows = dtype, out_dtype, fp8_max, rows
        self.pow2, self.whole, self.fold = pow2, whole, fold

    @cute.jit
    def __call__(self, x: cute.Tensor, q: cute.Tensor, s: cute.Tensor, qt: cute.Tensor, st: cute.Tensor,
                 stream):
        self._launch(x, q, s, qt, st, s, st, stream)  # no amaxes: s, st hold their places unread

    @cute.jit
    def rowwise(self, x: cute.Tensor, q: cute.Tensor, s: cute.Tensor, qt: cute.Tensor, st: cute.Tensor,
                row_amax: cute.Tensor, col_amax: cute.Tensor, stream):
        self._launch(x, q, s, qt, st, row_amax, col_amax, stream)

    @cute.jit
    def folded(self, x: cute.Tensor, q: cute.Tensor, s: cute.Tensor, qt: cute.Tensor, st: cute.Tensor,
               fold: cute.Tensor, col_amax: cute.Tensor, stream):
        self._launch(x, q, s, qt, st, fold, col_amax, stream)  # the rows' slot carries the factors

    @cute.jit
    def _launch(self, x, q, s, qt, st, row_amax, col_amax, stream):
        gx = cute.zipped_divide(x, (1, VEC))  # ((1, VEC), (M, K / VEC))
        gq = cute.zipped_divide(q, (1, VEC))
        gqt = cute.zipped_divide(qt, (1, OUT_VEC))  # ((1, 16), (K, M / 16))
        m, k = x.shape
        self.kernel(gx, gq, s, gqt, st, row_amax, col_amax, m, k).launch(
            grid=(cute.ceil_div(k, BLOCK), cute.ceil_div(m, BLOCK), 1),
            block=(THREADS, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, gx: cute.Tensor, gq: cute.Tensor, s: cute.Tensor, gqt: cute.Tensor, st: cute.Tensor,
               row_amax: cute.Tensor, col_amax: cute.Tensor, m: Int32, k: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        _, groups = gx.shape[1]
        smem = cutlass.memory.SmemAllocator()
        tile = smem.allocate_tensor(self.dtype, cute.make_layout((BLOCK, BLOCK), stride=(BLOCK + PAD, 1)), 16)
        red = smem.allocate_tensor(Float32, cute.make_layout((THREADS // PAIRS, BLOCK)), 16)
        qbuf = smem.allocate_tensor(self.out_dtype, cute.make_layout((BLOCK, BLOCK), stride=(BLOCK + QPAD, 1)), 16)
        factors = smem.allocate_tensor(Float32, cute.make_layout(BLOCK if self.fold else 1), 16)
        fmax = Float32(self.fp8_max)
        if cutlass.const_expr(self.fold):  # row_amax holds the factors; rows past M read the last one's
            if tidx < BLOCK:
                row = by * BLOCK + tidx
                factors[tidx] = row_amax[cutlass.select_(row < m, row, m - 1)]

        # rows phase
        h, j = tidx // LANES, tidx % LANES
        col = Int32(bx * LANES + j)
        p, quarter = tidx % PAIRS, tidx // PAIRS
        ramax, camax = [], []
        if cutlass.const_expr(self.whole):
            # the amaxes first, in flight with x's loads: read between the stores below, each
            # waited out the one before (a load may not pass a store that could alias it; both
            # passes at 16384 x 28672 took 0.87 ms, now 0.74); rows / columns past the matrix
            # read the last one's: never stored
            for i in cutlass.range_constexpr(ROWS if self.rows else 0):
                row = by * BLOCK + h + LANES * i
                ramax.append(row_amax[cutlass.select_(row < m, row, m - 1)])
            for i in cutlass.range_constexpr(2):
                kk = bx * BLOCK + 2 * p + i
                camax.append(col_amax[cutlass.select_(kk < k, kk, k - 1)])
        buf = cute.make_rmem_tensor(cute.make_layout(((1, VEC), ROWS)), self.dtype)
        load_row_groups(gx, buf, by * BLOCK + h, LANES, col, ROWS)
        tile_v = cute.zipped_divide(tile, (1, VEC))
        for i in cutlass.range_constexpr(ROWS):
            tile_v[(None, (h + LANES * i, j))].store(buf[(None, i)].load())
            if cutlass.const_expr(self.rows):
                row = by * BLOCK + h + LANES * i
                v = buf[(None, i)].load().to(Float32)
                if cutlass.const_expr(self.whole):
                    amax = ramax[i]
                else:
                    amax = abs_max(Float32(0.0), v, VEC)
                    for off in (8, 4, 2, 1):  # within the half-warp: lanes differ in their low 4 bits
                        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=off), nan=True)
                scale, inv = block_scale(amax, fmax, self.pow2)
                if row < m and col < groups:
                    gq[(None, (row, col))].store(quantize(v, inv, VEC).to(self.out_dtype))
                    if cutlass.const_expr(self.whole):
                        if j == 0 and bx == 0:
                            s[(row, 0)] = scale
                    elif j == 0:
                        s[(row, bx)] = scale
        cute.arch.sync_threads()

        # columns phase: thread t owns the column pair 2 (t % 64) + {0, 1} of rows 32 (t // 64) ..,
        # read as 32-bit words (a warp's lanes on consecutive pairs of one row: no bank
        # conflicts; one 16-bit column per thread took twice the shared loads)
        tile_p = cute.zipped_divide(tile, (1, 2))  # ((1, 2), (rows, column pairs))
        pair = cute.make_rmem_tensor(cute.make_layout((1, 2)), self.dtype)
        # per column, laid out as the two 16-value stores of qt take them
        cols = [cute.make_rmem_tensor(cute.make_layout(((1, OUT_VEC), QUARTER // OUT_VEC)), Float32)
                for _ in range(2)]
        for e in cutlass.range_constexpr(QUARTER):
            pair.store(tile_p[(None, (quarter * QUARTER + e, p))].load())
            for i in cutlass.range_constexpr(2):
                cols[i][e] = pair[i].to(Float32)
                if cutlass.const_expr(self.fold):
                    cols[i][e] = cols[i][e] * factors[quarter * QUARTER + e]
        if cutlass.const_expr(not self.whole):
            for i in cutlass.range_constexpr(2):
                red[(quarter, 2 * p + i)] = abs_max(Float32(0.0), cols[i].load(), QUARTER)
            cute.arch.sync_threads()
        # the quantized columns go to shared memory as rows of qt's tile (each thread's 32 bytes
        # of a column contiguous): written from there, a warp's 16-byte stores cover whole
        # 128-byte rows of qt, where stored from the registers each lane's 16 bytes were half a
        # sector of a row of their own
        qtile = cute.zipped_divide(qbuf, (1, OUT_VEC))  # ((1, 16), (columns of x, 16-value groups))
        for i in cutlass.range_constexpr(2):
            c = 2 * p + i
            kk = bx * BLOCK + c
            if cutlass.const_expr(self.whole):
                amax = camax[i]
            else:
                amax = red[(0, c)]
                for o in cutlass.range_constexpr(1, THREADS // PAIRS):
                    amax = cute.arch.fmax(amax, red[(o, c)], nan=True)
            scale, inv = block_scale(amax, fmax, self.pow2)
            out = cute.make_rmem_tensor(cute.make_layout(((1, OUT_VEC), QUARTER // OUT_VEC)), self.out_dtype)
            out.store(quantize(cols[i].load(), inv, QUARTER).to(self.out_dtype))
            for u in cutlass.range_constexpr(QUARTER // OUT_VEC):
                qtile[(None, (c, quarter * (QUARTER // OUT_VEC) + u))].store(out[(None, u)].load())
            if cutlass.const_expr(self.whole):
                if quarter == 0 and kk < k and by == 0:
                    st[(kk, 0)] = scale
            elif quarter == 0 and kk < k:
                st[(kk, by)] = scale
        cute.arch.sync_threads()

        # copy-out: thread t writes the 16-value group t % 8 of qt's tile rows t // 8 + 32 i
        g = tidx % GROUPS
        for i in cutlass.range_constexpr(BLOCK * GROUPS // THREADS):
            r = tidx // GROUPS + (THREADS // GROUPS) * i
            kk = bx * BLOCK + r
            m0 = by * BLOCK + g * OUT_VEC
            if kk < k and m0 < m:  # M is a multiple of 16: a 16-value store is wholly in or out
                gqt[(None, (kk, m0 // OUT_VEC))].store(qtile[(None, (r, g))].load())
