"""Static persistent tile scheduler with grouped (L2-friendly) rasterization.

The grid is ``(cluster_m, cluster_n, num_persistent_clusters)``: ``blockIdx.xy`` is the CTA's place
in its cluster and ``blockIdx.z`` the cluster's slot. Work is counted in *cluster tiles*
(``cluster_m x cluster_n`` CTA tiles); slot ``z`` takes cluster tiles ``z, z + Z, z + 2Z, ...``.

Rasterization: cluster tiles are walked in bands of ``group`` cluster rows along M; inside a band
the walk goes down the band's rows first, then steps along N. A wave of concurrently running tiles
therefore touches ``group`` row blocks of A and ``wave / group`` column blocks of B, which keeps
both in L2 for large problems instead of streaming all of A for every column block of B.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


class TileScheduler:
    """Maps a linear work index to a CTA tile coordinate ``(m_tile, n_tile, batch)``.

    Construct inside a kernel; every method is device code. ``problem_mnl`` is the output tensor's
    ``(M, N, L)`` shape (dynamic), ``tile_mn`` the CTA tile, ``cluster_mn`` the cluster shape.
    Nothing is kept in registers across the tile loop: tile counts come from the problem shape
    (kernel parameters) and the CTA's place from the special registers at each use, which leaves
    the consumers' registers to the accumulator and the epilogue.
    """

    def __init__(self, problem_mnl, tile_mn, cluster_mn, group: int):
        self.problem = tuple(problem_mnl)
        self.tile_mn = tile_mn
        self.cluster_mn = cluster_mn
        self.group = group

    @staticmethod
    def create(problem_mnl, tile_mn, cluster_mn, group: int) -> "TileScheduler":
        return TileScheduler(problem_mnl, tile_mn, cluster_mn, group)

    # The DSL carries objects through dynamic loops by their MLIR values.
    def __extract_mlir_values__(self):
        return [Int32(v).ir_value() for v in self.problem]

    def __new_from_mlir_values__(self, values):
        return TileScheduler([Int32(v) for v in values], self.tile_mn, self.cluster_mn, self.group)

    def _clusters_mn(self):
        tiles_m = cute.ceil_div(self.problem[0], self.tile_mn[0])
        tiles_n = cute.ceil_div(self.problem[1], self.tile_mn[1])
        return cute.ceil_div(tiles_m, self.cluster_mn[0]), cute.ceil_div(tiles_n, self.cluster_mn[1])

    @property
    def first(self) -> Int32:
        return Int32(cute.arch.block_idx()[2])

    @property
    def stride(self) -> Int32:
        return Int32(cute.arch.grid_dim()[2])

    def num_work(self) -> Int32:
        cl_m, cl_n = self._clusters_mn()
        return Int32(cl_m * cl_n * self.problem[2])

    def is_valid(self, work: Int32):
        return work < self.num_work()

    def coord(self, work: Int32):
        """CTA tile coordinate ``(m_tile, n_tile, batch)`` of cluster tile number ``work``."""
        cl_m, cl_n = self._clusters_mn()
        per_batch = Int32(cl_m * cl_n)
        batch = work // per_batch
        r = work - batch * per_batch
        band_len = cl_n * self.group
        band = r // band_len
        within = r - band * band_len
        rows = cutlass.min(Int32(self.group), cl_m - band * self.group)
        cm = band * self.group + within % rows
        cn = within // rows
        bidx, bidy, _ = cute.arch.block_idx()
        return (
            cm * self.cluster_mn[0] + bidx,
            cn * self.cluster_mn[1] + bidy,
            batch,
        )

    @staticmethod
    def grid(problem_mnl, tile_mn, cluster_mn, max_clusters: int):
        """Launch grid: one persistent cluster slot per resident cluster, at most one per tile."""
        tiles_m = cute.ceil_div(problem_mnl[0], tile_mn[0])
        tiles_n = cute.ceil_div(problem_mnl[1], tile_mn[1])
        work = (
            cute.ceil_div(tiles_m, cluster_mn[0])
            * cute.ceil_div(tiles_n, cluster_mn[1])
            * problem_mnl[2]
        )
        return (cluster_mn[0], cluster_mn[1], cutlass.min(work, Int32(max_clusters)))
