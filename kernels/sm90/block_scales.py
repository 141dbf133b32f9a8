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

Its factor is an outer product per k-tile: the thread's row scales times its column scales,
multiplied at the promotion (:class:`OuterFactor`), so only 2 x MMA_M + its columns' values are
live rather than a factor per accumulator register.

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


class OuterFactor:
    """A promotion factor laid out like the accumulator, as the product of a row part and a
    column part (each with zero strides on the other's modes): ``load()`` multiplies them."""

    def __init__(self, rows, cols):
        self.rows, self.cols = rows, cols

    def load(self):
        return self.rows.load() * self.cols.load()


class RowFactor:
    """A promotion factor of one value per accumulator row: ``rows`` laid out like the
    accumulator with zero strides on the column modes."""

    def __init__(self, rows):
        self.rows = rows

    def load(self):
        return self.rows.load()

    def assign(self, other: "RowFactor"):
        """Take ``other``'s values (copying the distinct registers only)."""
        n = cute.cosize(self.rows.layout)
        dst = cute.make_tensor(self.rows.iterator, cute.make_layout(n))
        dst.store(cute.make_tensor(other.rows.iterator, cute.make_layout(n)).load())


class BlockScales:
    """Promotion factors of one output tile. ``sa``: (M, ceil(K / 128), L) fp32, ``sb``:
    (ceil(N / 128), ceil(K / 128), L) fp32 (``b_rows``: (N, ceil(K / 128), L)), any strides.
    ``acc_coords``: the global (m, n) of every accumulator register of this thread
    (``thr_mma.partition_C`` of the tile's identity tensor); ``n0``: the tile's first column;
    ``tl``: its batch. Rows past M read row M - 1 and columns past N column N - 1, and a tile past
    the problem (the producer's extra stage after the last tile) its last block: their products
    are never stored."""

    def __init__(self, sa: cute.Tensor, sb: cute.Tensor, acc_coords: cute.Tensor, problem_mnl, n0, tl,
                 b_rows: bool = False):
        self.sa, self.sb = sa, sb
        self.coords = acc_coords
        self.problem = problem_mnl
        self.b_rows = b_rows
        self.nb = cutlass.min(n0 // BLOCK, sb.shape[0] - 1)
        self.tl = cutlass.min(tl, problem_mnl[2] - 1)
        (self.pairs, _, self.groups), self.mma_m, self.mma_n = acc_coords.shape

    @cute.jit
    def factors(self, k):
        """k-tile ``k``'s sa[m, k] * sb[nb, k] per accumulator register, a :class:`RowFactor`
        (only the thread's rows occupy registers); ``b_rows``: the
        :class:`OuterFactor` of sa[m, k] and sb[n, k]."""
        k = cutlass.min(k, self.sa.shape[1] - 1)  # a prefetch past the last k-block
        rows = cute.make_rmem_tensor(cute.make_layout(self.coords.shape, stride=((0, 1, 0), 2, 0)), Float32)
        b = Float32(1.0) if const_expr(self.b_rows) else self.sb[(self.nb, k, self.tl)]
        for mm in cutlass.range_constexpr(self.mma_m):
            for half in cutlass.range_constexpr(2):
                crd = ((0, half, 0), mm, 0)
                m = cutlass.min(self.coords[crd][0], self.problem[0] - 1)
                rows[crd] = self.sa[(m, k, self.tl)] * b
        if const_expr(not self.b_rows):
            return RowFactor(rows)
        # the thread's columns: (pairs, groups, MMA_N) values, zero strides on the row modes
        p, g = self.pairs, self.groups
        cols = cute.make_rmem_tensor(
            cute.make_layout(self.coords.shape, stride=((1, 0, p), 0, p * g)), Float32)
        for nn in cutlass.range_constexpr(self.mma_n):
            for v in cutlass.range_constexpr(g):
                for c in cutlass.range_constexpr(p):
                    crd = ((c, 0, v), 0, nn)
                    n = cutlass.min(self.coords[crd][1], self.problem[1] - 1)
                    cols[crd] = self.sb[(n, k, self.tl)]
        return OuterFactor(rows, cols)
