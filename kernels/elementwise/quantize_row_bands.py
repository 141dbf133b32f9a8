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
at most ``32 * groups`` of them (``groups``: a build constant, the groups per lane of a row).

1. Load: warp w takes ``rows / 8`` consecutive rows, lane l the groups l + 32 i (i < groups) of each,
   every one a 16-byte ``cp.async`` into the shared slice, all in flight at once (zeros stored
   past the slice or the matrix); after its wait each thread reads its own groups back (no
   barrier) and the warp reduces |x|: each row's maximum over this slice, one float in shared
   memory.
2. Exchange: a cluster barrier (release / acquire: the slices' maxima are visible), then threads
   0 to rows - 1 each take one row's maximum over the cluster's slices (``ld.shared::cluster``),
   its scale and reciprocal; CTA 0 writes the scales and fold factors. A relaxed cluster arrive
   says this CTA has read its peers; it waits for theirs at its end, so no CTA leaves while a
   peer may still read its shared memory.
3. Rows: each warp quantizes its rows from shared memory, 8 values per lane, one 8-byte store.
4. Columns: thread t takes column pairs t + 256 j of the slice: per 16 rows, 16 4-byte loads down
   the band (a warp's lanes on consecutive words of one row: no bank conflicts), each value times
   its row's reciprocal, two 16-byte stores, one per column, into qt's rows.

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
``cp.async`` 1.50-1.69x in another run: the same within the runs' spread. What would overlap them: a persistent CTA loading the next band while it stores this
one, which needs a second slice's shared memory (16-row bands of half the width).
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
    docstring); ``rows``: the band's rows (16 or 32)."""

    def __init__(self, dtype, out_dtype, fp8_max: float, pow2: bool, groups: int, cluster: int, rows: int = BAND):
        self.dtype, self.out_dtype, self.fp8_max, self.pow2 = dtype, out_dtype, fp8_max, pow2
        self.groups, self.cluster, self.rows = groups, cluster, rows
        self.warp_rows = rows // WARPS

    @cute.jit
    def __call__(self, x: cute.Tensor, q: cute.Tensor, qt: cute.Tensor, scales: cute.Tensor, fold: cute.Tensor,
                 stream):
        gx = cute.zipped_divide(x, (1, VEC))  # ((1, 8), (M, K / 8))
        gq = cute.zipped_divide(q, (1, VEC))
        gqt = cute.zipped_divide(qt, (1, QT_ROWS))  # ((1, 16), (K, M / 16))
        rows, _ = gx.shape[1]
        self.kernel(gx, gq, gqt, scales, fold).launch(
            grid=(self.cluster, cute.ceil_div(rows, self.rows), 1),
            block=(THREADS, 1, 1),
            cluster=(self.cluster, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, gx: cute.Tensor, gq: cute.Tensor, gqt: cute.Tensor, scales: cute.Tensor, fold: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        rank, band, _ = cute.arch.block_idx()
        rows, groups = gx.shape[1]
        span = cute.ceil_div(groups, self.cluster)  # this slice's groups: [g0, g0 + span) within the row
        g0 = rank * span
        held = 32 * self.groups
        smem = cutlass.memory.SmemAllocator()
        tile = smem.allocate_tensor(self.dtype, cute.make_layout((self.rows, held * VEC), stride=(held * VEC, 1)), 16)
        part = smem.allocate_tensor(Float32, cute.make_layout(self.rows), 16)
        invs = smem.allocate_tensor(Float32, cute.make_layout(self.rows), 16)
        tile_v = cute.zipped_divide(tile, (1, VEC))  # ((1, 8), (rows, held))
        warp, lane = tidx // 32, tidx % 32
        m0 = band * self.rows

        # 1. load: the slice into shared memory by cp.async, every load of the thread in flight at
        # once; each thread then reads back its own groups (its copies are complete after its wait:
        # no barrier) for its rows' maxima over the slice
        load = cute.make_copy_atom(cpasync.CopyG2SOp(cpasync.LoadCacheMode.GLOBAL), self.dtype, num_bits_per_copy=128)
        for rr in cutlass.range_constexpr(self.warp_rows):
            row = warp * self.warp_rows + rr
            for i in cutlass.range_constexpr(self.groups):
                g = lane + 32 * i
                if g < span and g0 + g < groups and m0 + row < rows:
                    vec = cute.make_layout(((VEC, 1),))  # one 16-byte value, the atom's whole value mode
                    cute.copy(load, cute.make_tensor(gx[(None, (m0 + row, g0 + g))].iterator, vec),
                              cute.make_tensor(tile_v[(None, (row, g))].iterator, vec))
                else:  # past the slice or the matrix: zeros, which add nothing to the amax
                    tile_v[(None, (row, g))].fill(0.0)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        for rr in cutlass.range_constexpr(self.warp_rows):
            row = warp * self.warp_rows + rr
            amax = Float32(0.0)
            for i in cutlass.range_constexpr(self.groups):
                amax = abs_max(amax, tile_v[(None, (row, lane + 32 * i))].load().to(Float32), VEC)
            for off in (16, 8, 4, 2, 1):
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=off), nan=True)
            if lane == 0:
                part[row] = amax

        # 2. exchange: each row's maximum over the cluster's slices, its scale and reciprocal
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if tidx < self.rows:
            amax = part[tidx]
            for peer in cutlass.range_constexpr(1, self.cluster):
                amax = cute.arch.fmax(amax, load_peer_f32(part.iterator + tidx, (rank + peer) % self.cluster), nan=True)
            scale, inv = block_scale(amax, Float32(self.fp8_max), self.pow2)
            invs[tidx] = inv
            if rank == 0 and m0 + tidx < rows:
                scales[(m0 + tidx, 0)] = scale
                fold[m0 + tidx] = fold_factor(amax, scale)
        cute.arch.cluster_arrive_relaxed()
        cute.arch.sync_threads()

        # 3. rows: q
        for rr in cutlass.range_constexpr(self.warp_rows):
            row = warp * self.warp_rows + rr
            inv = invs[row]
            for i in cutlass.range_constexpr(self.groups):
                g = lane + 32 * i
                if g < span and g0 + g < groups and m0 + row < rows:
                    v = tile_v[(None, (row, g))].load().to(Float32)
                    gq[(None, (m0 + row, g0 + g))].store(quantize(v, inv, VEC).to(self.out_dtype))

        # 4. columns: qt, two columns per thread and step, each column's 16-row groups one after another
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
        cute.arch.cluster_wait()
