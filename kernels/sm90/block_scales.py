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
(:class:`OuterFactor`). The partial is multiplied by the two parts in turn, never by their
product, which depends on the loads alone: ptxas hoists such a product to right after its
loads, into the block that issues the k-tile's WGMMAs (SASS).

Roles: the producer warp's TMA brings each k-tile's scales into its shared-memory stage next to
the A and B tiles, under the same mbarrier (:class:`ScaleLoads`): the tile's rows of ``sa`` and
(weight-gradient form) its columns of ``sb``, both one contiguous run in their M- / N-major
layouts, or the 16 bytes of ``sb``'s row holding the k-block's weight scale. The consumer
warpgroups read them with shared-memory loads right after issuing the k-tile's WGMMAs
(:meth:`BlockScales.factors`). Read from global memory instead, each k-tile's scales were an
L2 round trip that the promotion waited for (ncu, H200: the weight-gradient form's top stall,
its 34 loads per thread and k-tile also throttling the load queue). TMA fills rows and columns
past the problem with zeros: their products are never stored.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import cpasync

from ..common.config import BLOCK_SCALE_B_SLOT

#: the scale block along K and along N of B (the recipe's 128)
BLOCK = 128
#: fp32 scales per TMA box of the weight's 128 x 128 scales: the 16 bytes of its K-major row
#: that hold the k-block's scale (TMA boxes are whole 16-byte units)
SB_BOX = 4


def scale_tx_bytes(tile_m: int, tile_n: int, b_rows: bool) -> int:
    """Bytes one stage's scale boxes bring (the stage mbarrier's transaction count): less than
    the slots they fill (``config.block_scale_stage_bytes``), whose weight-scale slot is padded
    for alignment. A count above what arrives never completes the barrier."""
    return 4 * tile_m + 4 * (tile_n if b_rows else SB_BOX)


class ScaleLoads:
    """The producer's side: TMA atoms and per-stage shared-memory tiles of the scales. The atoms
    are built in the host function (:meth:`make`); the constructor, in the kernel, partitions
    them over the staged shared-memory tiles."""

    @staticmethod
    def smem_layouts(tile_m: int, tile_n: int, b_rows: bool, stages: int):
        """(sa's, sb's) staged shared-memory layouts."""
        sa = cute.make_layout((tile_m, 1, stages))
        if b_rows:
            return sa, cute.make_layout((tile_n, 1, stages))
        return sa, cute.make_layout((1, SB_BOX, stages), stride=(SB_BOX, 1, BLOCK_SCALE_B_SLOT // 4))

    @staticmethod
    def tiles(tile_m: int, tile_n: int, b_rows: bool):
        return (tile_m, 1), ((tile_n, 1) if b_rows else (1, SB_BOX))

    @staticmethod
    def make(sa: cute.Tensor, sb: cute.Tensor, layouts, tiles):
        """TMA atoms of ``sa`` (M, KB, L), M-major, and ``sb``: (NB, KB, L) K-major or (``b_rows``)
        (N, KB, L) N-major; every other stride a multiple of 16 bytes (the launch copies other
        layouts). Returns ((atom, TMA tensor) of sa, of sb)."""
        op = cpasync.CopyBulkTensorTileG2SOp()
        return tuple(cpasync.make_tiled_tma_atom(op, t, cute.slice_(lay, (None, None, 0)), tile)
                     for t, lay, tile in zip((sa, sb), layouts, tiles))

    def __init__(self, atoms, tensors, smem, tiles, tile_n: int, b_rows: bool):
        self.atoms = atoms
        self.b_rows = b_rows
        self.tile_n = tile_n
        self.parts = []
        for atom, t, s, tile in zip(atoms, tensors, smem, tiles):
            g = cute.local_tile(t, tile, (None, None, None))
            self.parts.append(cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                                                    cute.group_modes(g, 0, 2)))

    def load(self, coord, stage, bar):
        """Tile ``coord`` = (tm, tn, tl, k)'s k-tile scales into stage ``stage``, counted on
        ``bar`` (the A/B stage's mbarrier)."""
        tm, tn, tl, k = coord
        (sa_s, sa_g), (sb_s, sb_g) = self.parts
        cute.copy(self.atoms[0], sa_g[(None, tm, k, tl)], sa_s[(None, stage)], tma_bar_ptr=bar)
        if const_expr(self.b_rows):
            cute.copy(self.atoms[1], sb_g[(None, tn, k, tl)], sb_s[(None, stage)], tma_bar_ptr=bar)
        else:
            nb = tn * self.tile_n // BLOCK
            cute.copy(self.atoms[1], sb_g[(None, nb, k // SB_BOX, tl)], sb_s[(None, stage)], tma_bar_ptr=bar)


class OuterFactor:
    """A promotion factor laid out like the accumulator, as the product of a row part (loaded)
    and a column part (zero strides on the row modes). Whole-accumulator forms pass ``columns``
    as a function that reads the column part from shared memory at the promotion: its values
    held from the k-tile's issue on (a temporary's worth of registers per thread next to two
    temporaries in flight) made the paired 128 x 128 build spill. Promotion in waves passes the
    loaded column part, read once per k-tile under its first wave's WGMMAs and shared by its
    waves (spill-free there)."""

    def __init__(self, rows, columns):
        self.rows, self.columns = rows, columns
        # a function reads the stage's column scales at the promotion: the stage is not free before
        self.reads_stage = callable(columns)

    def scaled(self, t):
        """``t * rows * cols`` (one FMUL and, in ``acc + scaled``, one FFMA per register), in
        that order: see the module docstring."""
        scaled = t.load() * self.rows.load()  # before the columns are read: see the class docstring
        return scaled * (self.columns() if callable(self.columns) else self.columns).load()


class RowFactor:
    """A promotion factor of one value per accumulator row, kept as its two loaded parts: ``rows``
    (sa of the thread's rows, laid out like the accumulator with zero strides on the column
    modes) and ``b`` (one-element tensor: the weight block's scale), multiplied at the
    promotion."""

    #: both parts are in registers from the k-tile's issue on
    reads_stage = False

    def __init__(self, rows, b, in_turn: bool = False):
        self.rows, self.b = rows, b
        self.in_turn = in_turn

    def _flat(self, t):
        return cute.make_tensor(t.iterator, cute.make_layout(cute.cosize(self.rows.layout)))

    def load(self):
        out = cute.make_rmem_tensor(self.rows.layout, Float32)
        self._flat(out).store(self._flat(self.rows).load() * self.b[0])  # the distinct values only
        return out.load()

    def scaled(self, t):
        """``t * factor``; ``in_turn``: ``t * rows * b`` (an FMUL more per register), which
        the 256 x 128 build promoting in waves needs: ``t * factor`` spilled 600 bytes there."""
        if const_expr(self.in_turn):
            return t.load() * self.rows.load() * self.b[0]
        return t.load() * self.load()


class BlockScales:
    """The consumers' side: promotion factors from a stage's scales. ``sSA`` / ``sSB``: the
    staged shared-memory scales (:meth:`ScaleLoads.smem_layouts`); ``tile_coords``: the
    tile-local (m, n) of every accumulator register of this thread (``thr_mma.partition_C`` of
    the tile's identity tensor), the same for every tile."""

    def __init__(self, sSA: cute.Tensor, sSB: cute.Tensor, tile_coords: cute.Tensor, b_rows: bool = False):
        self.sSA, self.sSB = sSA, sSB
        self.coords = tile_coords
        self.b_rows = b_rows
        (self.pairs, _, self.groups), self.mma_m, self.mma_n = tile_coords.shape

    @cute.jit
    def factors(self, k, stage, wave=None, prev=None):
        """k-tile ``k``'s sa[m, k] * sb[nb, k] per accumulator register from stage ``stage``, a
        :class:`RowFactor` (only the thread's rows and one value occupy registers); ``b_rows``:
        the :class:`OuterFactor` of sa[m, k] and sb[n, k]. ``wave``: laid out like the
        accumulator's 64-row atom ``wave`` alone (promotion in waves; slicing the whole
        factor instead spilled the 256 x 128 build); ``prev``: the same k-tile's factor of an
        earlier wave, whose B part (the same for every wave) is taken instead of read again."""
        if const_expr(wave is None):
            rows = cute.make_rmem_tensor(cute.make_layout(self.coords.shape, stride=((0, 1, 0), 2, 0)), Float32)
            for mm in cutlass.range_constexpr(self.mma_m):
                for half in cutlass.range_constexpr(2):
                    crd = ((0, half, 0), mm, 0)
                    rows[crd] = self.sSA[(self.coords[crd][0], 0, stage)]
        else:
            # the wave's two rows; every atom's coordinates name them (zero strides), so the
            # slice is laid out like the accumulator's slice
            rows = cute.make_rmem_tensor(cute.make_layout(self.coords.shape, stride=((0, 1, 0), 0, 0)), Float32)
            for half in cutlass.range_constexpr(2):
                rows[((0, half, 0), 0, 0)] = self.sSA[(self.coords[((0, half, 0), wave, 0)][0], 0, stage)]
            rows = rows[(None, 0, 0)]
        if const_expr(not self.b_rows):
            if const_expr(prev is not None):
                return RowFactor(rows, prev.b, in_turn=True)
            b = cute.make_rmem_tensor(cute.make_layout(1), Float32)
            b[0] = self.sSB[(0, k % SB_BOX, stage)]
            return RowFactor(rows, b, in_turn=wave is not None)
        if const_expr(wave is None):
            return OuterFactor(rows, lambda: self._columns(stage))
        return OuterFactor(rows, self._columns(stage, wave) if const_expr(prev is None) else prev.columns)

    @cute.jit
    def _columns(self, stage, wave=None):
        """The thread's columns of sb: (pairs, groups, MMA_N) values, zero strides on the row
        modes (``wave``: laid out like one 64-row atom, whose N is the tile's)."""
        p, g = self.pairs, self.groups
        if const_expr(wave is None):
            cols = cute.make_rmem_tensor(cute.make_layout(self.coords.shape, stride=((1, 0, p), 0, p * g)), Float32)
            for nn in cutlass.range_constexpr(self.mma_n):
                for v in cutlass.range_constexpr(g):
                    for c in cutlass.range_constexpr(p):
                        crd = ((c, 0, v), 0, nn)
                        cols[crd] = self.sSB[(self.coords[crd][1], 0, stage)]
        else:
            cols = cute.make_rmem_tensor(cute.make_layout(self.coords.shape, stride=((1, 0, p), 0, 0)), Float32)
            for v in cutlass.range_constexpr(g):
                for c in cutlass.range_constexpr(p):
                    cols[((c, 0, v), 0, 0)] = self.sSB[(self.coords[((c, 0, v), wave, 0)][1], 0, stage)]
            cols = cols[(None, 0, 0)]
        return cols
