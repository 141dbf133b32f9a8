"""The block-scaled FP8 GEMM's promotion factors (DeepSeek-V3 / TE ``Float8BlockScaling``):

    D[m, n] = sum_kb  sa[m, kb] * sb[n // 128, kb] * sum_{k in k-block kb} A[m, k] B[n, k]

A (M, K) in FP8 with one fp32 scale per row and 128-column block (1 x 128), B (N, K) with one
per 128 x 128 block. The k-tile is the 128-deep k-block, so the two-level mainloop promotes each
k-tile's partial product with ``acc += sa[m, kb] * sb[nb, kb] * partial`` (``Sm90Mainloop.run``'s
``scale``) instead of ``acc += partial``; an N-tile of at most 128 columns lies in one weight
block, so ``sb`` is one number per k-tile.

The weight-gradient form (``b_rows``): dW = dY^T X contracts over the tokens, and both operands
are quantized in 1 x 128 blocks along them, so B too has one scale per row and k-block:

    D[m, n] = sum_kb  sa[m, kb] * sb[n, kb] * sum_{k in kb} A[m, k] B[n, k]

Its factor is an outer product per k-tile: the thread's row scales times its column scales
(:class:`OuterFactor`), so only 2 x MMA_M + its columns' values are live rather than a factor
per accumulator register. The partial is multiplied by the two parts in turn, never by their
product: the product depends on the loads alone, and ptxas hoisted it to right after them, into
the block that issues the k-tile's WGMMAs, where the warp then waited for the loads' L2 round trip
every k-tile (SASS). ``partial * row`` depends on the WGMMAs' result and stays after their wait.

Roles: the consumer warpgroups call :meth:`BlockScales.factors` right after issuing a k-tile's
WGMMAs, so its loads (the thread's 2 x MMA_M row scales and the tile's one weight scale, or its
columns' scales, from L2 after the first tile of a row band) run under the tensor cores' work,
and the factors are ready at the promotion.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

#: the scale block along K and along N of B (the recipe's 128)
BLOCK = 128
#: the weight-gradient form's B scales (N, ceil(K / 128)) are N-major with each k-block's column
#: readable up to N rounded up to this (``coda_cute.epilogue.runner`` pads them where needed)
COLUMN_PAD = 128


class OuterFactor:
    """A promotion factor laid out like the accumulator, as the product of a row part and a
    column part (each with zero strides on the other's modes)."""

    def __init__(self, rows, cols):
        self.rows, self.cols = rows, cols

    def scaled(self, t):
        """``t * rows * cols`` (one FMUL and, in ``acc + scaled``, one FFMA per register), in
        that order: see the module docstring."""
        return t.load() * self.rows.load() * self.cols.load()


class RowFactor:
    """A promotion factor of one value per accumulator row, kept as its two loaded parts: ``rows``
    (sa of the thread's rows, laid out like the accumulator with zero strides on the column
    modes) and ``b`` (one-element tensor: the weight block's scale). :meth:`load` multiplies them,
    at the promotion: a product formed right after the loads would make the warp wait for their
    L2 round trip before it can issue the next k-tile (ptxas keeps it in the issuing block)."""

    def __init__(self, rows, b):
        self.rows, self.b = rows, b

    def _flat(self, t):
        return cute.make_tensor(t.iterator, cute.make_layout(cute.cosize(self.rows.layout)))

    def load(self):
        out = cute.make_rmem_tensor(self.rows.layout, Float32)
        self._flat(out).store(self._flat(self.rows).load() * self.b[0])  # the distinct values only
        return out.load()

    def scaled(self, t):
        """``t * factor``."""
        return t.load() * self.load()

    def assign(self, other: "RowFactor"):
        """Take ``other``'s values (copying the distinct registers only)."""
        self._flat(self.rows).store(self._flat(other.rows).load())
        self.b[0] = other.b[0]


class BlockScales:
    """Promotion factors of one output tile. ``sa``: (M, ceil(K / 128), L) fp32, any strides;
    ``sb``: (ceil(N / 128), ceil(K / 128), L) fp32, any strides (``b_rows``: (N, ceil(K / 128), L),
    N-major and padded: stride 1 along N, and each k-block's column of scales readable up to N
    rounded up to 128, see :data:`COLUMN_PAD`). ``acc_coords``: the global (m, n) of every
    accumulator register of this thread (``thr_mma.partition_C`` of the tile's identity tensor);
    ``tl``: its batch; ``tile_n``: the tile's width. Rows past M read row M - 1, columns past N
    (``b_rows``) the padding, and a tile past the problem (the producer's extra stage after the
    last tile) its last block: their products are never stored."""

    def __init__(self, sa: cute.Tensor, sb: cute.Tensor, acc_coords: cute.Tensor, problem_mnl, tl,
                 tile_n: int, b_rows: bool = False):
        self.sa, self.sb = sa, sb
        self.coords = acc_coords
        self.problem = problem_mnl
        self.b_rows = b_rows
        self.tl = cutlass.min(tl, problem_mnl[2] - 1)
        (self.pairs, _, self.groups), self.mma_m, self.mma_n = acc_coords.shape
        # the thread's rows of sa and the tile's row of sb as tensors along k, sliced once per
        # tile: a k-tile's load is then one offset from its row's start, not a 3-D index
        self.sa_rows = []
        for mm in range(self.mma_m):
            for half in range(2):
                m = cutlass.min(acc_coords[((0, half, 0), mm, 0)][0], problem_mnl[0] - 1)
                self.sa_rows.append(sa[(m, None, self.tl)])
        self.sb_row = None
        if const_expr(b_rows):
            # The thread's columns as one base plus offsets known at compile time (no clamp to
            # N - 1, whose per-column address arithmetic ptxas spread between a k-tile's WGMMAs:
            # SASS), into the padding past N; a tile past the problem reads the last tile's.
            self.col0 = acc_coords[((0, 0, 0), 0, 0)][1]
            last = cute.ceil_div(problem_mnl[1], COLUMN_PAD) * COLUMN_PAD - tile_n
            self.col_base = cutlass.min(self.col0, last + self.col0 % tile_n)
        else:
            # The tile's weight block, found from this thread's first column rather than the tile's:
            # the same block for every thread (a tile of at most 128 columns lies in one), but
            # ptxas cannot prove the load uniform, so it keeps the value in a vector register
            # instead of moving it into a uniform one right after the load (which waits for it).
            n = cutlass.min(acc_coords[((0, 0, 0), 0, 0)][1], problem_mnl[1] - 1)
            self.sb_row = sb[(cutlass.min(n // BLOCK, sb.shape[0] - 1), None, self.tl)]

    @cute.jit
    def factors(self, k):
        """k-tile ``k``'s sa[m, k] * sb[nb, k] per accumulator register, a :class:`RowFactor`
        (only the thread's rows and one value occupy registers); ``b_rows``: the
        :class:`OuterFactor` of sa[m, k] and sb[n, k]."""
        k = cutlass.min(k, self.sa.shape[1] - 1)  # a prefetch past the last k-block
        rows = cute.make_rmem_tensor(cute.make_layout(self.coords.shape, stride=((0, 1, 0), 2, 0)), Float32)
        for mm in cutlass.range_constexpr(self.mma_m):
            for half in cutlass.range_constexpr(2):
                rows[((0, half, 0), mm, 0)] = self.sa_rows[2 * mm + half][k]
        if const_expr(not self.b_rows):
            b = cute.make_rmem_tensor(cute.make_layout(1), Float32)
            b[0] = self.sb_row[k]
            return RowFactor(rows, b)
        # the thread's columns: (pairs, groups, MMA_N) values, zero strides on the row modes
        p, g = self.pairs, self.groups
        cols = cute.make_rmem_tensor(
            cute.make_layout(self.coords.shape, stride=((1, 0, p), 0, p * g)), Float32)
        for nn in cutlass.range_constexpr(self.mma_n):
            for v in cutlass.range_constexpr(g):
                for c in cutlass.range_constexpr(p):
                    crd = ((c, 0, v), 0, nn)
                    cols[crd] = self.sb[(self.col_base + (self.coords[crd][1] - self.col0), k, self.tl)]
        return OuterFactor(rows, cols)
