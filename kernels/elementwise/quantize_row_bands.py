"""A gradient's row-wise FP8 quantization in both layouts from one read: for x (M, K) 16-bit,

    amax_m = max |x[m, :]|,  s_m = block_scale(amax_m),  q[m, k] = fp8(x[m, k] / s_m)
    qt = q^T (K, M),  fold_m = fold_factor(amax_m, s_m)

exactly ``QuantizeWholeRows(fold=True)`` followed by ``TransposeBytes`` (``coda_cute.reference``'s
``quantize_blocks_ref`` with blocks (1, K)), bit for bit, without their second read of q: 2 bytes
read and 2 written per element where the two passes moved 5. A row's scale needs its whole row,
and the transposed layout needs 16 rows at once (qt's 16-byte groups), so a band of ``BAND`` rows
of the whole width is in flight together; no CTA holds that (a 32 x 28672 bf16 band is 1.8 MB),
so a cluster of CTAs shares it: each CTA holds its slice of the band's columns in shared memory
and the row maxima of the slices meet through distributed shared memory.

Roles: no specialization. A cluster of ``cluster`` CTAs of 256 threads per band of ``rows`` rows
(32: each column's 32 bytes of qt, a whole sector, come from one thread; 16 for experiments); CTA r
of the cluster takes the band's 16-byte column groups [r S, r S + S), S = ceil(K / 8 / cluster),
at most ``32 * groups`` of them (``groups``: a build constant, the groups per lane of a row). A
cluster takes the bands y, y + Y, ... (y its index in a grid of Y clusters: one band each with one
stage, the clusters that fit at once with two), each in four phases:

1. Load: warp w takes ``rows / 8`` consecutive rows, lane l the groups l + 32 i (i < groups) of
   each, every one a 16-byte ``cp.async`` into the shared slice, all in flight at once (zeros
   stored past the slice or the matrix). With two stages the next band's copies are issued into
   the other slice before this band's phases 2-4, so they fly while this one is stored.
2. Exchange: after its wait each thread reads its own groups back (no barrier) and the warp
   reduces |x|, each row's maximum over this slice into shared memory (two bands' worth: a peer
   may still read the last band's); a cluster barrier (release / acquire: the maxima are
   visible), then threads 0 to rows - 1 each take one row's maximum over the cluster's slices
   (``ld.shared::cluster``), its scale and reciprocal; CTA 0 writes the scales and fold factors.
3. Rows: each warp quantizes its rows from shared memory, 8 values per lane, one 8-byte store.
4. Columns: thread t takes column pairs t + 256 j of the slice: per 16 rows, 16 4-byte loads down
   the band (a warp's lanes on consecutive words of one row: no bank conflicts), each value times
   its row's reciprocal, two 16-byte stores, one per column, into qt's rows. A CTA barrier then
   frees the slice for the copies that reuse it.

At its end a cluster barrier keeps each CTA until its peers have read its maxima.

M and K must be multiples of 16 (qt's rows start 16-byte aligned, a pair never straddles the
matrix's edge; a band past M by 16 rows writes its first half); K at most ``8 * 32 * groups *
cluster`` (the launcher picks both).

Measured on an H100 80GB HBM3 (2026-12-06, ``bench_quantize.py --plans``, 16384 rows, in turns):
slower than the two passes it replaces, 1.343 ms against 0.818 at K = 28672 and 1.58-1.61x at K
4096, 6144 and 14336. It moves the bytes it should (ncu at K = 28672: 0.99 GB read, 0.96 GB
written, no read-for-write of qt's sectors) but keeps DRAM 43 % busy: two CTAs of 8 warps per SM
(the slice's 112 KB of shared memory), each band's phases in series across its cluster (every
CTA's loads, then the barrier, then its stores), so an SM's loads stop while it stores. 16-row
bands (half-sector qt writes) ran 1.64-2.09x, and loading through registers rather than by
``cp.async`` 1.50-1.69x in another run: the same within the runs' spread. The two stages (a
persistent grid, 16-row bands of half the slice) are what would overlap them; they build but
have not run on a GPU yet, nor has the band loop, added after those measurements
(``bench_quantize.py --plans`` and the GPU tests time and check both).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.nvgpu import cpasync

from ..common.cluster_smem import load_peer_f32
from ..common.fp8_math import abs_max, block_scale, fold_factor, quantize

THREADS = 256
WARPS = THREADS // 32
#: rows of a band: two of qt's 16-byte groups, so each 32-byte sector of qt is written whole by one
#: thread (half-sector writes leave the L2 to merge them with the next band's)
BAND = 32
#: rows of a qt group
QT_ROWS = 16
#: elements per 16-byte access of the 16-bit input
VEC = 8
#: most 16-byte groups a CTA's slice holds per row and lane, times the band's rows: 224 (a 32 x
#: 1792 bf16 slice, 112 KB) leaves room for two CTAs per SM
MAX_HELD = 224
CLUSTERS = (1, 2, 4, 8, 16)


def band_plan(k: int, rows: int = BAND, held: int = MAX_HELD):
    """(cluster, groups) for rows of ``k`` values in bands of ``rows``: the smallest cluster
    (16: H100's non-portable largest) whose slices fit ``held`` groups per lane and row, and the
    groups per lane the slices need; None past 16 slices (K > 28672: the two-pass path)."""
    groups8 = -(-k // VEC)
    for cluster in CLUSTERS:
        per_lane = -(-(-(-groups8 // cluster)) // 32)
        if per_lane * rows <= held:
            return cluster, max(per_lane, 1)
    return None


class QuantizeRowBands:
    """``q, scales (M, 1), qt, fold (M,)`` of 16-bit ``x`` (M, K) to ``out_dtype`` (module
    docstring); ``rows``: the band's rows (16 or 32); ``stages``: slices in shared memory, 2 for a
    persistent cluster loading its next band while it stores this one (the launcher's grid then
    holds no more clusters than fit at once)."""

    def __init__(self, dtype, out_dtype, fp8_max: float, pow2: bool, groups: int, cluster: int, rows: int = BAND,
                 stages: int = 1):
        self.dtype, self.out_dtype, self.fp8_max, self.pow2 = dtype, out_dtype, fp8_max, pow2
        self.groups, self.cluster, self.rows, self.stages = groups, cluster, rows, stages
        self.warp_rows = rows // WARPS

    @cute.jit
    def __call__(self, x: cute.Tensor, q: cute.Tensor, qt: cute.Tensor, scales: cute.Tensor, fold: cute.Tensor,
                 clusters: cutlass.Int32, stream):
        gx = cute.zipped_divide(x, (1, VEC))  # ((1, 8), (M, K / 8))
        gq = cute.zipped_divide(q, (1, VEC))
        gqt = cute.zipped_divide(qt, (1, QT_ROWS))  # ((1, 16), (K, M / 16))
        self.kernel(gx, gq, gqt, scales, fold).launch(
            grid=(self.cluster, clusters, 1),
            block=(THREADS, 1, 1),
            cluster=(self.cluster, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, gx: cute.Tensor, gq: cute.Tensor, gqt: cute.Tensor, scales: cute.Tensor, fold: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        rank, first, _ = cute.arch.block_idx()
        _, stride, _ = cute.arch.grid_dim()
        rows, groups = gx.shape[1]
        bands = cute.ceil_div(rows, self.rows)
        span = cute.ceil_div(groups, self.cluster)  # this slice's groups: [g0, g0 + span) within the row
        g0 = rank * span
        held = 32 * self.groups
        smem = cutlass.memory.SmemAllocator()
        tiles = smem.allocate_tensor(
            self.dtype, cute.make_layout((self.stages, self.rows, held * VEC),
                                         stride=(self.rows * held * VEC, held * VEC, 1)), 16)
        # the slices' maxima, two bands' worth: a peer may still read band k's while this CTA writes
        # band k + 1's; it has read them before this CTA passes band k + 1's cluster barrier
        part = smem.allocate_tensor(Float32, cute.make_layout((2, self.rows), stride=(self.rows, 1)), 16)
        invs = smem.allocate_tensor(Float32, cute.make_layout(self.rows), 16)
        warp, lane = tidx // 32, tidx % 32
        slice_ = (g0, span, groups, rows, warp, lane)

        self._load(gx, tiles[(0, None, None)], first * self.rows, slice_)
        cute.arch.cp_async_commit_group()
        k = cutlass.Int32(0)
        for band in cutlass.range(first, bands, stride):
            stage = k % self.stages
            m0 = band * self.rows
            if cutlass.const_expr(self.stages == 2):
                if band + stride < bands:  # the next band's loads fly while this one's are used
                    self._load(gx, tiles[(1 - stage, None, None)], m0 + stride * self.rows, slice_)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(1)
            else:
                cute.arch.cp_async_wait_group(0)
            tile = tiles[(stage, None, None)]
            self._exchange(tile, part[(k % 2, None)], invs, scales, fold, m0, rank, slice_)
            self._store(tile, invs, gq, gqt, m0, band, tidx, slice_)
            cute.arch.sync_threads()  # this stage's slice read: free for the loads that reuse it
            if cutlass.const_expr(self.stages == 1):
                if band + stride < bands:
                    self._load(gx, tile, m0 + stride * self.rows, slice_)
                cute.arch.cp_async_commit_group()
            k = k + 1
        cute.arch.cluster_arrive_relaxed()  # no CTA leaves while a peer may still read its maxima
        cute.arch.cluster_wait()

    @cute.jit
    def _load(self, gx: cute.Tensor, tile: cute.Tensor, m0, slice_):
        """1. The slice of the band at row ``m0`` into ``tile`` by ``cp.async``, every load of the
        thread in flight at once (zeros past the slice or the matrix); the caller commits them."""
        g0, span, groups, rows, warp, lane = slice_
        tile_v = cute.zipped_divide(tile, (1, VEC))  # ((1, 8), (rows, held))
        load = cute.make_copy_atom(cpasync.CopyG2SOp(cpasync.LoadCacheMode.GLOBAL), self.dtype, num_bits_per_copy=128)
        vec = cute.make_layout(((VEC, 1),))  # one 16-byte value, the atom's whole value mode
        # runtime loops: unrolled, each copy's addresses would stay live across the band loop
        for rr in cutlass.range(self.warp_rows, unroll=1):
            row = warp * self.warp_rows + rr
            for i in cutlass.range(self.groups, unroll=1):
                g = lane + 32 * i
                if g < span and g0 + g < groups and m0 + row < rows:
                    cute.copy(load, cute.make_tensor(gx[(None, (m0 + row, g0 + g))].iterator, vec),
                              cute.make_tensor(tile_v[(None, (row, g))].iterator, vec))
                else:
                    tile_v[(None, (row, g))].fill(0.0)

    @cute.jit
    def _exchange(self, tile: cute.Tensor, part: cute.Tensor, invs: cute.Tensor, scales: cute.Tensor,
                  fold: cute.Tensor, m0, rank, slice_):
        """2. Each row's maximum over this slice (each thread its own groups, complete after its
        wait: no barrier), then over the cluster's slices through a cluster barrier, its scale and
        reciprocal; CTA 0 writes the scales and fold factors."""
        _, _, _, rows, warp, lane = slice_
        tile_v = cute.zipped_divide(tile, (1, VEC))
        for rr in cutlass.range_constexpr(self.warp_rows):
            row = warp * self.warp_rows + rr
            amax = Float32(0.0)
            for i in cutlass.range_constexpr(self.groups):
                amax = abs_max(amax, tile_v[(None, (row, lane + 32 * i))].load().to(Float32), VEC)
            for off in (16, 8, 4, 2, 1):
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=off), nan=True)
            if lane == 0:
                part[row] = amax
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        t = warp * 32 + lane
        if t < self.rows:
            amax = part[t]
            for peer in cutlass.range_constexpr(1, self.cluster):
                amax = cute.arch.fmax(amax, load_peer_f32(part.iterator + t, (rank + peer) % self.cluster), nan=True)
            scale, inv = block_scale(amax, Float32(self.fp8_max), self.pow2)
            invs[t] = inv
            if rank == 0 and m0 + t < rows:
                scales[(m0 + t, 0)] = scale
                fold[m0 + t] = fold_factor(amax, scale)
        cute.arch.sync_threads()

    @cute.jit
    def _store(self, tile: cute.Tensor, invs: cute.Tensor, gq: cute.Tensor, gqt: cute.Tensor, m0, band, tidx,
               slice_):
        """3. q: each warp's rows, 8 values per lane, one 8-byte store. 4. qt: two columns per
        thread and step, each column's 16-row groups one after another."""
        g0, span, groups, rows, warp, lane = slice_
        tile_v = cute.zipped_divide(tile, (1, VEC))
        held = 32 * self.groups
        for rr in cutlass.range_constexpr(self.warp_rows):
            row = warp * self.warp_rows + rr
            inv = invs[row]
            for i in cutlass.range_constexpr(self.groups):
                g = lane + 32 * i
                if g < span and g0 + g < groups and m0 + row < rows:
                    v = tile_v[(None, (row, g))].load().to(Float32)
                    gq[(None, (m0 + row, g0 + g))].store(quantize(v, inv, VEC).to(self.out_dtype))
        inv_r = cute.make_rmem_tensor(cute.make_layout(self.rows), Float32)
        for r in cutlass.range_constexpr(self.rows):
            inv_r[r] = invs[r]
        tile_p = cute.zipped_divide(tile, (1, 2))  # ((1, 2), (rows, held * 4))
        lo = cute.make_rmem_tensor(cute.make_layout(QT_ROWS), Float32)
        hi = cute.make_rmem_tensor(cute.make_layout(QT_ROWS), Float32)
        for j in cutlass.range_constexpr(-(-held * VEC // 2 // THREADS)):
            p = tidx + THREADS * j
            c = g0 * VEC + 2 * p
            if p < span * (VEC // 2) and c < groups * VEC:
                for h in cutlass.range_constexpr(self.rows // QT_ROWS):
                    if m0 + h * QT_ROWS < rows:
                        for r in cutlass.range_constexpr(QT_ROWS):
                            pair = tile_p[(None, (h * QT_ROWS + r, p))].load().to(Float32)
                            lo[r] = pair[0] * inv_r[h * QT_ROWS + r]
                            hi[r] = pair[1] * inv_r[h * QT_ROWS + r]
                        qg = band * (self.rows // QT_ROWS) + h
                        gqt[(None, (c, qg))].store(lo.load().to(self.out_dtype))
                        gqt[(None, (c + 1, qg))].store(hi.load().to(self.out_dtype))
