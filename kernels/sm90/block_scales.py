"""The block-scaled FP8 GEMM's promotion factors (DeepSeek-V3 / TE ``Float8BlockScaling``):

    D[m, n] = sum_kb  sa[m, kb] * sb[n // 128, kb] * sum_{k in k-block kb} A[m, k] B[n, k]

A (M, K) in FP8 with one fp32 scale per row and 128-column block (1 x 128), B (N, K) with one
per 128 x 128 block. The k-tile is the 128-deep k-block, so the two-level mainloop promotes each
k-tile's partial product with ``acc += sa[m, kb] * sb[nb, kb] * partial`` (``Sm90Mainloop.run``'s
``scale``) instead of ``acc += partial``; an N-tile of at most 128 columns lies in one weight
block, so ``sb`` is one number per k-tile.

Roles: the consumer warpgroups call :meth:`BlockScales.factors` right after issuing a k-tile's
WGMMAs, so its loads (the thread's 2 x MMA_M row scales and the tile's one weight scale, from
L2 after the first tile of a row band) run under the tensor cores' work, and the factors are
ready at the promotion.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

#: the scale block along K and along N of B (the recipe's 128)
BLOCK = 128


class BlockScales:
    """Promotion factors of one output tile. ``sa``: (M, ceil(K / 128), L) fp32, ``sb``:
    (ceil(N / 128), ceil(K / 128), L) fp32, any strides. ``acc_coords``: the global (m, n) of
    every accumulator register of this thread (``thr_mma.partition_C`` of the tile's identity
    tensor); ``n0``: the tile's first column; ``tl``: its batch. Rows past M read row M - 1, and
    a tile past the problem (the producer's extra stage after the last tile) its last block:
    their products are never stored."""

    def __init__(self, sa: cute.Tensor, sb: cute.Tensor, acc_coords: cute.Tensor, problem_mnl, n0, tl):
        self.sa, self.sb = sa, sb
        self.coords = acc_coords
        self.problem = problem_mnl
        self.nb = cutlass.min(n0 // BLOCK, sb.shape[0] - 1)
        self.tl = cutlass.min(tl, problem_mnl[2] - 1)
        (_, _, _), self.mma_m, _ = acc_coords.shape

    @cute.jit
    def factors(self, k):
        """k-tile ``k``'s sa[m, k] * sb[nb, k] per accumulator register (zero strides on the
        column modes: only the thread's rows occupy registers)."""
        out = cute.make_rmem_tensor(cute.make_layout(self.coords.shape, stride=((0, 1, 0), 2, 0)), Float32)
        b = self.sb[(self.nb, k, self.tl)]
        for mm in cutlass.range_constexpr(self.mma_m):
            for half in cutlass.range_constexpr(2):
                crd = ((0, half, 0), mm, 0)
                m = cutlass.min(self.coords[crd][0], self.problem[0] - 1)
                out[crd] = self.sa[(m, k, self.tl)] * b
        return out
