"""The transpose of a matrix of 1-byte elements (an FP8 matrix's bytes): for x (M, N) row-major,

    xt[n, m] = x[m, n]      xt (N, M) row-major

bit for bit, whatever the bytes encode. Bandwidth-bound: 1 byte read and 1 written per element
(a 16384 x 28672 FP8 gradient's weight-gradient operand), so every global access is a 16-byte
access, eight consecutive lanes taking a tile row's 128 contiguous bytes; the transpose itself
happens in shared memory.

Roles: no specialization. One CTA of 256 threads per 128 x 128 tile, in three phases and two
barriers. Load phase: thread ``t`` loads the 16-byte group ``t % 8`` of the tile's rows
``t // 8 + 32 i`` (i < 4; eight lanes per 128-byte row, the four loads in flight together) and
stores them to shared memory. Transpose phase: thread ``t`` owns column ``t % 128`` of the tile
and its 16-row groups ``t // 128 + 2 i``: per group 16 byte loads down the column (a warp's lanes
on consecutive columns of one row: no bank conflicts), assembled in registers into 16 bytes of a
row of xt's tile and stored as one 16-byte store into a second shared tile. Copy-out phase: eight
lanes per 128-byte row of xt's tile, one 16-byte store each. M and N must be multiples of 16 (a
16-byte group lies wholly in or out of the matrix; rows of x and xt start 16-byte aligned).

Why byte loads down the columns rather than a register-level byte shuffle: a tile takes about 900
shared-memory wavefronts (512 of them the byte loads, 32 useful bytes each) against about 2000 SM
clocks for its 32 KB of DRAM traffic at ~4.3 TB/s (estimates, not measurements), so shared memory
keeps up. 256 threads and ~36 KB of shared memory per CTA leave six CTAs per SM: up to 96 KB of
x's loads in flight per SM, enough to cover DRAM latency at that bandwidth. Measured on the H200
(2026-12-04, profiled in the FP8 MLP step): 16384 x 28672 in 0.282 ms, 3.3 TB/s of the 4.24 TB/s
a copy reaches (a likely cause, not measured alone: a tile's 128-byte rows lie 28672 and 16384
bytes apart in x and xt, where a copy streams contiguous lines).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Uint8

from .row_loads import load_row_groups

THREADS = 256
BLOCK = 128
#: bytes per global access and per row of a transpose phase's group
VEC = 16
#: 16-byte groups per 128-byte row of a tile: the lanes sharing a row in the load and copy-out phases
GROUPS = BLOCK // VEC
#: rows per thread in the load and copy-out phases
ROWS = BLOCK // (THREADS // GROUPS)
#: 16-row groups per thread in the transpose phase (each thread one column, two threads per column)
COL_GROUPS = GROUPS // (THREADS // BLOCK)
#: padding of the tiles' rows (16 bytes, keeping them 16-byte aligned): the transpose phase's
#: stores put a quarter-warp's eight 16-byte chunks on eight consecutive rows of xt's tile, 144
#: bytes apart, so they fall on distinct bank quads (unpadded, all eight would share four banks);
#: x's tile takes the same layout, where it is harmless: its accesses run along rows
PAD = 16


class TransposeBytes:
    """``xt = x^T`` for ``x`` (M, N) and ``xt`` (N, M) of 1-byte elements (``Uint8``: any 1-byte
    dtype viewed as bytes), M and N multiples of 16, unit column strides."""

    @cute.jit
    def __call__(self, x: cute.Tensor, xt: cute.Tensor, stream):
        gx = cute.zipped_divide(x, (1, VEC))  # ((1, 16), (M, N / 16))
        gxt = cute.zipped_divide(xt, (1, VEC))  # ((1, 16), (N, M / 16))
        m, n = x.shape
        self.kernel(gx, gxt).launch(
            grid=(cute.ceil_div(n, BLOCK), cute.ceil_div(m, BLOCK), 1),
            block=(THREADS, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, gx: cute.Tensor, gxt: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        layout = cute.make_layout((BLOCK, BLOCK), stride=(BLOCK + PAD, 1))
        tile = smem.allocate_tensor(Uint8, layout, 16)
        tile_t = smem.allocate_tensor(Uint8, layout, 16)

        # load phase; groups past the matrix are zeros that the copy-out never writes
        r, g = tidx // GROUPS, tidx % GROUPS
        buf = cute.make_rmem_tensor(cute.make_layout(((1, VEC), ROWS)), Uint8)
        load_row_groups(gx, buf, by * BLOCK + r, THREADS // GROUPS, bx * GROUPS + g, ROWS)
        tile_v = cute.zipped_divide(tile, (1, VEC))  # ((1, 16), (rows, groups))
        for i in cutlass.range_constexpr(ROWS):
            tile_v[(None, (r + (THREADS // GROUPS) * i, g))].store(buf[(None, i)].load())
        cute.arch.sync_threads()

        # transpose phase: column c of x's tile is row c of xt's
        c = tidx % BLOCK
        tile_tv = cute.zipped_divide(tile_t, (1, VEC))
        chunk = cute.make_rmem_tensor(cute.make_layout((1, VEC)), Uint8)
        for i in cutlass.range_constexpr(COL_GROUPS):
            cg = tidx // BLOCK + (THREADS // BLOCK) * i
            for e in cutlass.range_constexpr(VEC):
                chunk[e] = tile[(cg * VEC + e, c)]
            tile_tv[(None, (c, cg))].store(chunk.load())
        cute.arch.sync_threads()

        # copy-out phase: rows of xt past N or groups past M / 16 lie outside xt
        rows, groups = gxt.shape[1]
        for i in cutlass.range_constexpr(ROWS):
            rr = r + (THREADS // GROUPS) * i
            row, col = bx * BLOCK + rr, by * GROUPS + g
            if row < rows and col < groups:
                gxt[(None, (row, col))].store(tile_tv[(None, (rr, g))].load())
