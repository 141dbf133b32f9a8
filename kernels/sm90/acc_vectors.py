"""Per-row and per-column epilogue inputs in registers laid out like the WGMMA accumulator
(``AccVectors``): row vectors, the row sums of per-tile partials, and column vectors (read lazily
past ``EAGER_COLS`` distinct columns per thread). Used by every consumer warpgroup at the start
of its tile's epilogue (``kernels.sm90.epilogue``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

#: most distinct column values a thread keeps in registers for a whole tile.
EAGER_COLS = 16


class _LazyCols:
    """Column vector read from global memory at the use (L1-resident after the first sub-tile).
    Unclamped, like :meth:`AccVectors.cols`."""

    def __init__(self, vectors: "AccVectors", vec: cute.Tensor, dtype):
        self.vectors = vectors
        self.vec = vec
        self.dtype = dtype

    def __getitem__(self, i):
        n = self.vectors.coords[i][1]
        return _convert(self.vec[(n, self.vectors.batch)], self.dtype)


def _convert(x, dtype):
    return Int32(x) if dtype is cutlass.Int32 else Float32(x)


class AccVectors:
    """Loads per-row / per-column vectors into registers laid out like the accumulator.

    A WGMMA accumulator fragment is ``((col pair, row half, 8-col chunk), MMA_M, MMA_N)``; a row
    vector only varies with (row half, MMA_M) and a column vector with (col pair, chunk, MMA_N).
    The register tensors returned here have the accumulator's shape with zero strides on the other
    modes, so ``vec[i]`` is the value for accumulator register ``i`` while only the distinct
    values occupy registers (2 * MMA_M rows, tile_n / 4 columns per thread). Rows past the problem
    edge read the last valid entry, and column vectors arrive padded to whole clusters of tiles
    (the runner's launch): results past the edge are never stored, and a column read needs no clamp.
    """

    def __init__(self, acc_coords: cute.Tensor, problem_mnl, batch: Int32):
        self.coords = acc_coords
        self.problem = problem_mnl
        self.batch = batch
        self.shape = acc_coords.shape
        (_, _, self.chunks), self.mma_m, self.mma_n = self.shape

    @cute.jit
    def rows(self, vec: cute.Tensor, dtype):
        out = cute.make_rmem_tensor(cute.make_layout(self.shape, stride=((0, 1, 0), 2, 0)), dtype)
        for mm in cutlass.range_constexpr(self.mma_m):
            for half in cutlass.range_constexpr(2):
                crd = ((0, half, 0), mm, 0)
                m = self.coords[crd][0]
                out[crd] = _convert(vec[(cutlass.min(m, self.problem[0] - 1), self.batch)], dtype)
        return out

    @cute.jit
    def row_sums(self, parts: cute.Tensor):
        """Per row: the sum of an (M, T, L) tensor over T (per-tile partials of an earlier
        epilogue, finalized here instead of in a separate kernel).

        The four threads of a quad hold the same rows: each sums every fourth partial, all of
        its rows' loads independent (no load waits on the previous add), and a butterfly over the
        quad completes the sums. A serial walk over T would put T dependent L2 round trips per
        row on the tile's critical path.
        """
        out = cute.make_rmem_tensor(cute.make_layout(self.shape, stride=((0, 1, 0), 2, 0)), Float32)
        rows = []
        for mm in cutlass.range_constexpr(self.mma_m):
            for half in cutlass.range_constexpr(2):
                crd = ((0, half, 0), mm, 0)
                rows.append((crd, cutlass.min(self.coords[crd][0], self.problem[0] - 1)))
                out[crd] = Float32(0.0)
        for t in cutlass.range(cute.arch.lane_idx() % 4, cute.size(parts, mode=[1]), 4, unroll=2):
            for crd, m in rows:
                out[crd] = out[crd] + parts[(m, t, self.batch)]
        for crd, _ in rows:
            x = out[crd]
            for off in (1, 2):
                x = x + cute.arch.shuffle_sync_bfly(x, offset=off)
            out[crd] = x
        return out

    @cute.jit
    def cols(self, vec: cute.Tensor, dtype):
        """Wide tiles (more than ``EAGER_COLS`` distinct columns per thread) would spill next to
        the accumulator; their columns are read lazily, per epilogue sub-tile, instead."""
        if const_expr(2 * self.chunks * self.mma_n > EAGER_COLS):
            return _LazyCols(self, vec, dtype)
        out = cute.make_rmem_tensor(
            cute.make_layout(self.shape, stride=((1, 0, 2), 0, 2 * self.chunks)), dtype)
        for mn in cutlass.range_constexpr(self.mma_n):
            for j in cutlass.range_constexpr(self.chunks):
                for pair in cutlass.range_constexpr(2):
                    crd = ((pair, 0, j), 0, mn)
                    n = self.coords[crd][1]
                    out[crd] = _convert(vec[(n, self.batch)], dtype)
        return out
