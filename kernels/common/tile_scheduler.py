"""Static persistent tile scheduler with grouped (L2-friendly) rasterization.

The grid is ``(cluster_m, cluster_n, num_persistent_clusters)``: ``blockIdx.xy`` is the CTA's place
in its cluster and ``blockIdx.z`` the cluster's slot. Work is counted in *cluster tiles*
(``cluster_m x cluster_n`` CTA tiles); slot ``z`` takes cluster tiles ``z, z + Z, z + 2Z, ...``.

Rasterization: cluster tiles are walked in bands of ``group`` cluster rows along M; inside a band
the walk goes down the band's rows first, then steps along N. A wave of concurrently running tiles
therefore touches ``group`` row blocks of A and ``wave / group`` column blocks of B, which keeps
both in L2 for large problems instead of streaming all of A for every column block of B.

Split tail (``split_tail``, cooperative kernels): with ``T`` cluster tiles on ``S`` slots the last
round holds only ``rem = T % S`` tiles and leaves ``S - rem`` slots idle for a whole tile's time
(3 % of a 16384 x 4096 GEMM on 128 x 128 tiles: 2048 cluster tiles on 66 slots). Each of those
``rem`` tiles is then cut along K into ``split = max(1, min(S // rem, MAX_TAIL_SPLIT, k_tiles //
TAIL_SLICE_K_TILES))`` slices, one per slot of the last round (``config.tail_split`` computes the
same on the host):

    work w < T - rem:   tile w, all k-tiles
    work w >= T - rem:  u = w - (T - rem);  tile T - rem + u // split, slice u % split,
                        k-tiles [slice * k_tiles // split, (slice + 1) * k_tiles // split)

The last slice owns the tile: it adds the other slices' fp32 partials (``Sm90Gemm._fixup``) and
runs the epilogue. The caps bound what the owner reads back: each partial is a whole fp32 tile.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from .config import MAX_TAIL_SPLIT, TAIL_SLICE_K_TILES


class TileScheduler:
    """Maps a linear work index to a CTA tile coordinate ``(m_tile, n_tile, batch)``.

    Construct inside a kernel; every method is device code. ``problem_mnl`` is the output tensor's
    ``(M, N, L)`` shape (dynamic), ``tile_mn`` the CTA tile, ``cluster_mn`` the cluster shape,
    ``k_tiles`` the k-tiles of a whole tile. Little is kept in registers across the tile loop: tile
    counts come from the problem shape (kernel parameters) and the CTA's place from the special
    registers at each use, which leaves the consumers' registers to the accumulator and the
    epilogue; a split tail adds its two parameters, computed once per kernel.
    """

    def __init__(self, problem_mnl, tile_mn, cluster_mn, group: int, k_tiles, tail=None):
        self.problem = tuple(problem_mnl)
        self.tile_mn = tile_mn
        self.cluster_mn = cluster_mn
        self.group = group
        self.k_tiles = k_tiles
        self.tail = tail  # split tail: (first tail work item, K slices per tail tile)
        self.split_tail = tail is not None

    @staticmethod
    def create(problem_mnl, tile_mn, cluster_mn, group: int, k_tiles, split_tail: bool = False) -> "TileScheduler":
        sched = TileScheduler(problem_mnl, tile_mn, cluster_mn, group, Int32(k_tiles))
        if const_expr(split_tail):
            # once per kernel: the per-tile path of a non-tail tile then costs one compare
            sched.tail = sched._tail_params()
            sched.split_tail = True
        return sched

    # The DSL carries objects through dynamic loops by their MLIR values.
    def __extract_mlir_values__(self):
        vals = (*self.problem, self.k_tiles) + (tuple(self.tail) if self.split_tail else ())
        return [Int32(v).ir_value() for v in vals]

    def __new_from_mlir_values__(self, values):
        vals = [Int32(v) for v in values]
        return TileScheduler(vals[:3], self.tile_mn, self.cluster_mn, self.group, vals[3],
                             (vals[4], vals[5]) if self.split_tail else None)

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

    def _num_tiles(self) -> Int32:
        cl_m, cl_n = self._clusters_mn()
        return Int32(cl_m * cl_n * self.problem[2])

    def _tail_params(self):
        tiles = self._num_tiles()
        rem = tiles % self.stride
        split = cutlass.min(self.stride // cutlass.max(rem, 1), Int32(MAX_TAIL_SPLIT))
        return tiles - rem, cutlass.max(cutlass.min(split, self.k_tiles // TAIL_SLICE_K_TILES), 1)

    def num_work(self) -> Int32:
        if const_expr(not self.split_tail):
            return self._num_tiles()
        base, split = self.tail
        return base + (self._num_tiles() - base) * split

    def is_valid(self, work: Int32):
        return work < self.num_work()

    @cute.jit
    def tile_index(self, work: Int32) -> Int32:
        tile = work
        if const_expr(self.split_tail):
            base, split = self.tail
            if work >= base:
                tile = base + (work - base) // split
        return tile

    @cute.jit
    def slice(self, work: Int32):
        """``(k_begin, k_count, slice, split, tail_slot)`` of work item ``work``: its k-tiles, its
        K slice of ``split`` (0 of 1 outside the tail) and its tail tile's index (0-based)."""
        k0, kc, sl, sp, slot = Int32(0), self.k_tiles, Int32(0), Int32(1), Int32(0)
        if const_expr(self.split_tail):
            base, split = self.tail
            if work >= base:
                u = work - base
                sl, sp, slot = u % split, split, u // split
                k0 = sl * self.k_tiles // split
                kc = (sl + 1) * self.k_tiles // split - k0
        return k0, kc, sl, sp, slot

    def coord(self, work: Int32):
        """CTA tile coordinate ``(m_tile, n_tile, batch)`` of work item ``work``."""
        cl_m, cl_n = self._clusters_mn()
        per_batch = Int32(cl_m * cl_n)
        tile = self.tile_index(work)
        batch = tile // per_batch
        r = tile - batch * per_batch
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
