"""Hopper epilogue plumbing: accumulator registers -> shared memory -> TMA store.

Roles: runs on the consumer (MMA) warpgroups right after their mainloop. Every consumer thread
walks the output tile in sub-tiles of ``epi_tile`` (one band of WGMMA atoms: 64 rows per
warpgroup, 32 columns), hands the sub-tile's fp32 values and their global coordinates to the
*visitor* (the epilogue math), converts to the output dtype, and writes the sub-tile into a ring of
``stages`` shared-memory buffers with ``stmatrix``. One elected warp per participating warpgroup
set then issues the TMA store of that buffer; bulk-group accounting (``PipelineTmaStore``) keeps a
buffer from being overwritten before its store has read it.

The class is arch-specific plumbing only; what is computed lives in the visitor
(``coda_cute.kernels.epilogue``), so the mainloop, the plumbing and the math stay separable.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.tensor_utils import LayoutEnum


class Sm90TmaEpilogue:
    """Epilogue stage of the Hopper GEMM: owns the D smem ring, the TMA store atom and the loop."""

    def __init__(self, d_dtype, acc_dtype, epi_tile, stages: int, visitor):
        self.d_dtype = d_dtype
        self.acc_dtype = acc_dtype
        self.epi_tile = epi_tile
        self.stages = stages
        self.visitor = visitor
        self.d_layout = LayoutEnum.ROW_MAJOR

    # -- host side (inside the @cute.jit launcher) --------------------------------------------
    def smem_layout(self):
        return sm90_utils.make_smem_layout_epi(self.d_dtype, self.d_layout, self.epi_tile, self.stages)

    def make_tma_store(self, mD: cute.Tensor):
        smem_one = cute.slice_(self.smem_layout(), (None, None, 0))
        return cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mD, smem_one, self.epi_tile
        )

    # -- device side -------------------------------------------------------------------------
    def r2s_copy(self, tiled_mma: cute.TiledMma):
        """stmatrix-based register->smem copy shaped by the MMA's accumulator layout."""
        atom_c = cute.make_copy_atom(
            warp.StMatrix8x8x16bOp(self.d_layout.is_m_major_c(), 4), self.d_dtype
        )
        tiled_c = cute.make_tiled_copy_C_atom(atom_c, tiled_mma)
        atom_r2s = sm90_utils.get_smem_store_op(self.d_layout, self.d_dtype, self.acc_dtype)
        return cute.make_tiled_copy_S(atom_r2s, tiled_c)

    @cute.jit
    def begin_tile(self, acc_coords: cute.Tensor, problem_mnl, batch: Int32, visitor_args: tuple):
        """Per-tile visitor state (row/column vectors in registers), loaded once per tile."""
        return self.visitor.begin_tile(AccVectors(acc_coords, problem_mnl, batch), *visitor_args)

    @cute.jit
    def store_tile(
        self,
        acc: cute.Tensor,
        visitor_state,
        tiled_mma: cute.TiledMma,
        tidx: Int32,
        sD: cute.Tensor,
        tma_atom_d: cute.CopyAtom,
        gD_tile: cute.Tensor,
        store_pipeline,
        barrier: pipeline.NamedBarrier,
        is_store_warp,
        buffer_base: Int32,
    ):
        """Run the visitor over ``acc`` sub-tile by sub-tile and store the tile ``gD_tile``.

        ``visitor_state`` comes from :meth:`begin_tile`. ``buffer_base`` is the running sub-tile
        count, which picks the smem buffer.
        """
        tiled_r2s = self.r2s_copy(tiled_mma)
        thr_r2s = tiled_r2s.get_slice(tidx)
        tRS_sD = thr_r2s.partition_D(sD)
        frag_shape = cute.shape(thr_r2s.partition_S(sD))[:3]
        frag = cute.make_rmem_tensor(frag_shape, self.acc_dtype)
        frag_out = cute.make_rmem_tensor(frag_shape, self.d_dtype)
        n_frag = cute.size(frag)

        gD_epi = cute.zipped_divide(gD_tile, self.epi_tile)
        bSG_sD, bSG_gD = cpasync.tma_partition(
            tma_atom_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), gD_epi
        )
        epi_grid = gD_epi.shape[1]
        epi_count = cute.size(epi_grid)
        # Sub-tiles are visited N-fastest: the register fragment holds a row band of WGMMA atoms
        # contiguously, column block after column block.
        epi_order = cute.make_layout(epi_grid, stride=(epi_grid[1], 1))

        for e in cutlass.range_constexpr(epi_count):
            for v in cutlass.range_constexpr(n_frag):
                frag[v] = acc[e * n_frag + v]
            self.visitor.visit(frag, visitor_state, e * n_frag)
            frag_out.store(frag.load().to(self.d_dtype))
            buf = (buffer_base + e) % self.stages
            cute.copy(tiled_r2s, frag_out, tRS_sD[(None, None, None, buf)])
            # stmatrix writes are generic-proxy; the TMA engine reads through the async proxy.
            cute.arch.fence_proxy("async.shared", space="cta")
            barrier.arrive_and_wait()
            if is_store_warp:
                cute.copy(tma_atom_d, bSG_sD[(None, buf)], bSG_gD[(None, epi_order.get_hier_coord(e))])
                store_pipeline.producer_commit()
                store_pipeline.producer_acquire()
            barrier.arrive_and_wait()
        return buffer_base + epi_count


#: most distinct column values a thread keeps in registers for a whole tile.
EAGER_COLS = 48


class _LazyCols:
    """Column vector read from global memory at the use (L1-resident after the first sub-tile)."""

    def __init__(self, vectors: "AccVectors", vec: cute.Tensor):
        self.vectors = vectors
        self.vec = vec

    def __getitem__(self, i):
        n = self.vectors.coords[i][1]
        return self.vec[(cutlass.min(n, self.vectors.problem[1] - 1), self.vectors.batch)]


class AccVectors:
    """Loads per-row / per-column vectors into registers laid out like the accumulator.

    A WGMMA accumulator fragment is ``((col pair, row half, 8-col chunk), MMA_M, MMA_N)``; a row
    vector only varies with (row half, MMA_M) and a column vector with (col pair, chunk, MMA_N).
    The register tensors returned here have the accumulator's shape with zero strides on the other
    modes, so ``vec[i]`` is the value for accumulator register ``i`` while only the distinct
    values occupy registers (2 * MMA_M rows, tile_n / 4 columns per thread).
    """

    def __init__(self, acc_coords: cute.Tensor, problem_mnl, batch: Int32):
        self.coords = acc_coords
        self.problem = problem_mnl
        self.batch = batch
        self.shape = acc_coords.shape
        (_, _, self.chunks), self.mma_m, self.mma_n = self.shape

    @cute.jit
    def rows(self, vec: cute.Tensor):
        """``vec[(m, batch)]`` for each register's row m (rows past M read row M-1: never stored)."""
        out = cute.make_rmem_tensor(
            cute.make_layout(self.shape, stride=((0, 1, 0), 2, 0)), cutlass.Float32)
        for mm in cutlass.range_constexpr(self.mma_m):
            for half in cutlass.range_constexpr(2):
                crd = ((0, half, 0), mm, 0)
                m = self.coords[crd][0]
                out[crd] = vec[(cutlass.min(m, self.problem[0] - 1), self.batch)]
        return out

    @cute.jit
    def cols(self, vec: cute.Tensor):
        """``vec[(n, batch)]`` for each register's column n (clamped like :meth:`rows`).

        Wide tiles (more than ``EAGER_COLS`` distinct columns per thread) would spill next to the
        accumulator; their columns are read lazily, per epilogue sub-tile, instead.
        """
        if cutlass.const_expr(2 * self.chunks * self.mma_n > EAGER_COLS):
            return _LazyCols(self, vec)
        out = cute.make_rmem_tensor(
            cute.make_layout(self.shape, stride=((1, 0, 2), 0, 2 * self.chunks)), cutlass.Float32)
        for mn in cutlass.range_constexpr(self.mma_n):
            for j in cutlass.range_constexpr(self.chunks):
                for pair in cutlass.range_constexpr(2):
                    crd = ((pair, 0, j), 0, mn)
                    n = self.coords[crd][1]
                    out[crd] = vec[(cutlass.min(n, self.problem[1] - 1), self.batch)]
        return out
