"""Hopper epilogue plumbing for epilogue trees: registers -> shared memory -> TMA, plus the
tree's inputs (vectors, tiles, scalars) and its reductions.

Roles:
  * consumer warpgroups (after their mainloop): walk the output tile in sub-tiles of
    ``epi_tile`` (one band of WGMMA atoms: 64 rows per warpgroup x 32 columns, up to 128 for
    cooperative element-wise trees). Per sub-tile
    they evaluate the tree (``kernels.epilogue.codegen``) on the fp32 accumulator registers,
    stage each stored output in its shared-memory ring (``stmatrix`` for full-width outputs,
    element stores for half-width ones), fold reductions into registers (row partials) or a
    per-warp shared-memory scratch (column partials) and write gathers straight to global
    memory. One elected warp then issues the TMA stores; bulk-group accounting keeps a ring
    buffer from being rewritten before its store has read it.
  * epilogue-load warp (warp 9, in the producer warpgroup; only when the tree has tile
    inputs): TMA-loads the tile inputs' sub-tiles into their own ring, in the order the
    consumers visit them, guarded by mbarriers (``PipelineTmaAsync``).

Row and column vectors are read once per tile into registers laid out like the accumulator
(``AccVectors``), before the mainloop's last WGMMAs retire (cooperative) or after the mainloop
(ping-pong, whose warpgroups first pull their tile's vector entries into L1 at the tile's start:
``prefetch_vectors``).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Boolean, Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.tensor_utils import LayoutEnum

from ..common.config import GemmConfig, pipeline_stages
from ..common.fastmath import fast_max
from ..epilogue import nodes as N
from ..epilogue.edges import unmasked_max, zero_past_edge
from .acc_vectors import AccVectors
from .epilogue_folds import FP8_TYPES, SinkFolds, _as_float, _lse_fold
from ..epilogue.codegen import (Emitter, assumed_walk, lookups_ahead, read_lookups_ahead, split_value,
                               tile_uniform_split)

DSL_TYPES = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16, "float16": cutlass.Float16,
             "int32": cutlass.Int32}
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4}
#: tile-input sub-tiles in flight: a TMA load takes several sub-tiles' worth of epilogue math,
#: so the load warp runs up to this many sub-tiles ahead of the consumers ...
LOAD_STAGES = 4
#: ... but no fewer than this, and a deeper ring only where it costs no A/B stage.
MIN_LOAD_STAGES = 2
#: fewest A/B stages a wider cooperative epilogue sub-tile may leave (``_sub_tile``).
WIDE_MIN_AB_STAGES = 3
#: most accumulator + staged sub-tile registers per thread a wider sub-tile may need.
WIDE_MAX_REGISTERS = 200
#: sub-tile elements an lse reduction collects before folding them into its running (max, sum
#: of exp): fewer live values against one rescale (an exp) per fold and row
LSE_FOLD = 4
GATHER_SELECT = False
#: the widths a cooperative element-wise tree's sub-tile may take, widest first (``_sub_tile``)
WIDE_SUB_TILES = (128, 64)
#: let ping-pong element-wise trees take them too: a switch for ``scripts/exp_large_gemms.py
#: --fp8``. A ping-pong epilogue runs under the other warpgroup's mainloop, so its per-sub-tile
#: barriers and TMA store rounds cost nothing while they hide there; whether they still hide on
#: the short-K, wide-output FP8 GEMMs of an H100 (where the plain GEMM ran 1.12-1.16x
#: ``_scaled_mm``'s time at K = 4096) is what the experiment asks.
PINGPONG_WIDE_SUB_TILES = False
#: a ping-pong epilogue whose two store buffers per output leave fewer A/B stages than this
#: takes one where that buys a stage (``Sm90TreeEpilogue._store_ring_depth``)
ONE_STORE_BUFFER_BELOW_STAGES = 6
#: store-ring buffers of a sub-tile narrower than its tile, forced for every epilogue (None:
#: :func:`epi_stage_count`'s rule and :meth:`Sm90TreeEpilogue._store_ring_depth`'s); a switch
#: for ``scripts/exp_block_scaled.py --stages`` and ``scripts/exp_swiglu_epilogues.py``.
SUBTILE_BUFFERS = None


def epi_stage_count(tile_mn, epi_tile, buffers: int | None = None) -> int:
    """Store-ring buffers. A sub-tile's buffer is claimed just before it is written (the store
    warp waits for the TMA store that last read it), so a tile stored as one sub-tile needs one
    buffer: its previous store was a whole mainloop ago. That frees 32 KB for a sixth A/B stage
    of a cooperative 128 x 128 FP8 tile. ``buffers``: the epilogue's own choice for a sub-tiled
    tile (:meth:`Sm90TreeEpilogue._store_ring_depth`)."""
    if tuple(epi_tile) == tuple(tile_mn):
        return 1
    if SUBTILE_BUFFERS is not None:
        return SUBTILE_BUFFERS
    if buffers is not None:
        return buffers
    return 2 if tile_mn[1] >= 128 else 4


class Sm90TreeEpilogue(SinkFolds):
    """The epilogue of one (tree, config) kernel: smem rings, TMA atoms and the per-tile loop."""

    def __init__(self, tree: N.Epilogue, cfg: GemmConfig, ab_bytes: int):
        """``ab_bytes``: bytes per A/B element (the shared-memory budget the epilogue shares)."""
        self.tree = tree
        self.tile_mn = tile_mn = (cfg.tile_m, cfg.tile_n)
        self.pingpong = pingpong = cfg.schedule == "pingpong"
        self.epi_warps = 4 if pingpong else 8
        sinks = tree.sinks
        self.full_stores = [s for s in sinks if isinstance(s, N.Store) and not s.half]
        self.half_stores = [s for s in sinks if isinstance(s, N.Store) and s.half]
        self.row_reds = [s for s in sinks if isinstance(s, N.RowReduce)]
        self.col_reds = [s for s in sinks if isinstance(s, N.ColReduce)]
        self.gathers = [s for s in sinks if isinstance(s, N.Gather)]
        self.quants = [s for s in sinks if isinstance(s, N.Quantize) and not s.transposed]
        self.quants_t = [s for s in sinks if isinstance(s, N.Quantize) and s.transposed]
        # Gathers keep their row's hit in registers until the tile's end (a select per element)
        # next to stored outputs, else store it at once (a branch per element): the choice
        # ptxas kept spill-free (logits store + lse + gather on ping-pong 128 x 128: 48 bytes
        # spilled with branches; lse + gather alone: 16 bytes with selects).
        self.gather_select = bool(self.full_stores or self.half_stores)
        self.tile_inputs = [i for i in tree.inputs if i.kind == "tile"]
        self.tensor_inputs = [i for i in tree.inputs if i.kind != "scalar"]
        self.scalar_inputs = [i for i in tree.inputs if i.kind == "scalar"]
        # Output tensor slots: sinks in order; an lse reduction has two (max, sum of exp).
        self.out_slots = {}
        slot = 0
        for s in sinks:
            self.out_slots[s.name] = slot
            slot += 2 if (isinstance(s, N.RowReduce) and s.op == "lse") or isinstance(s, N.Quantize) else 1
        self.lookups_ahead = lookups_ahead(tree)
        # Tile inputs advance the load ring inside the pass: their trees are not split.
        self.split = None if self.tile_inputs else tile_uniform_split(tree, tile_mn[1])
        self.store_buffers = None
        self.epi_tile = epi_tile = self._sub_tile(cfg, ab_bytes)
        self.subtiles = (tile_mn[0] // epi_tile[0]) * (tile_mn[1] // epi_tile[1])
        self.load_stages = self._load_ring_depth(cfg, ab_bytes)
        self._store_ring_depth(cfg, ab_bytes)
        self.stages = epi_stage_count(tile_mn, epi_tile, self.store_buffers)
        # One buffer per sub-tiled output is claimed after the sub-tile's math, which then
        # covers the previous sub-tile's TMA store; only where the math writes no store buffer
        # itself (half-width and quantize sinks stage as they go).
        self.late_claim = (self.stages == 1 and tuple(epi_tile) != tuple(tile_mn)
                           and not (self.half_stores or self.quants or self.quants_t))

    # -- host side (pure Python) -------------------------------------------------------------------
    def _sub_tile(self, cfg: GemmConfig, ab_bytes: int) -> tuple[int, int]:
        """``cfg.epi_tile``, or for a cooperative element-wise tree (full-width stores of
        element-wise math: no tile inputs, reductions, gathers, lookups or half-width stores) the
        widest of 128 / 64 columns that divides the tile, leaves ``WIDE_MIN_AB_STAGES`` and keeps
        the accumulator plus the sub-tile's staged values (fp32 and packed) within
        ``WIDE_MAX_REGISTERS`` (cooperative 256x128 spilled 72 bytes with 128 columns).
        Cooperative warpgroups store with the tensor cores idle, and every sub-tile costs two
        barriers and a TMA store round; on the H200 128-column sub-tiles made cooperative FP8
        128x128 two-level GEMMs 4-7 % faster than 32-column ones (16384 x {6144, 28672} x 4096)."""
        rows, cols = cfg.epi_tile
        if self.quants or self.quants_t:
            # a sub-tile holds whole blocks: one 128-column block of each row (its amax is the
            # row's quad's), all 128 rows of each column (a transposed sink's)
            if cfg.schedule != "cooperative" or cfg.tile_m != 128 or cfg.tile_n % N.QUANT_BLOCK:
                raise ValueError(f"quantize sinks need cooperative 128-row tiles of whole {N.QUANT_BLOCK}-"
                                 f"column blocks, got {cfg.name}")
            if self.quants and self.quants[0].wide:  # 64 columns of column pairs: one 128-value block
                return rows, N.QUANT_BLOCK // 2
            return rows, N.QUANT_BLOCK if self.quants else cols
        elementwise = not (self.tile_inputs or self.row_reds or self.col_reds or self.gathers
                           or self.half_stores or self.lookups_ahead or self.segment_nodes)
        if (self.pingpong and not PINGPONG_WIDE_SUB_TILES) or not elementwise:
            return rows, cols
        for wide in WIDE_SUB_TILES:
            staged = rows * wide // (self.epi_warps * 32)
            if cfg.tile_n % wide or wide <= cols or cfg.acc_registers + staged * 3 // 2 > WIDE_MAX_REGISTERS:
                continue
            try:  # an explicit stage count must still fit next to the wider buffers
                stages = pipeline_stages(cfg, ab_bytes, self.smem_bytes(0, (rows, wide)))
            except ValueError:
                continue
            if stages >= WIDE_MIN_AB_STAGES:
                return rows, wide
        return rows, cols

    def _load_ring_depth(self, cfg: GemmConfig, ab_bytes: int) -> int:
        deepest = min(LOAD_STAGES, self.subtiles)
        if not self.tile_inputs:
            return deepest
        depths = range(deepest, min(MIN_LOAD_STAGES, deepest) - 1, -1)
        if cfg.stages:
            return next((d for d in depths if self._fits(cfg, ab_bytes, d)), depths[-1])
        # A/B stages keep the tensor cores fed in every k-step; the load ring only covers the
        # epilogue's wait for its first sub-tiles: it never takes a stage from the mainloop.
        ab_stages = {d: pipeline_stages(cfg, ab_bytes, self.smem_bytes(d)) for d in depths}
        return next(d for d in depths if ab_stages[d] == ab_stages[depths[-1]])

    def _store_ring_depth(self, cfg: GemmConfig, ab_bytes: int) -> None:
        """One store buffer per output (``store_buffers``, with the load ring re-fitted) where
        a ping-pong epilogue's two would cost the mainloop an A/B stage and leave it fewer than
        ``ONE_STORE_BUFFER_BELOW_STAGES`` (the case measured; deeper rings gain little from one
        more stage). A ping-pong warpgroup's epilogue runs under the other's mainloop, so the
        wait one buffer adds (each sub-tile's staging waits for the previous sub-tile's TMA
        store to have read it; ``late_claim`` puts that wait after the sub-tile's math) mostly
        hides there, while the stage feeds every k-step. Measured on the H200 (2026-12-02, the
        SwiGLU backward's dz' + h + zdz tree on ping-pong 128 x 128, five A/B stages -> six, in
        turns with cuBLAS's plain product, outputs bit-identical): 1.069 -> 1.019 at 16384 x
        8192 x 2048 and 1.039 -> 1.013 at 16384 x 14336 x 4096 (claimed before the math, the
        build spilled 120 bytes and ran at 1.067 / 1.012). A double-width store (dz') takes one
        buffer wherever that costs no stage, deep ring or not: without the h store (the row-wise
        FP8 recipe keeps h from its forward) FP8's ring was six deep with two buffers, and both
        claims of two spilled on ping-pong 128 x 128 where one buffer builds spill-free."""
        if not self.pingpong or cfg.stages or tuple(self.epi_tile) == tuple(self.tile_mn):
            return
        wide = any(s.wide for s in self.full_stores)
        two = pipeline_stages(cfg, ab_bytes, self.smem_bytes())
        if two >= ONE_STORE_BUFFER_BELOW_STAGES and not wide:
            return
        self.store_buffers = 1
        ring = self._load_ring_depth(cfg, ab_bytes)
        one = pipeline_stages(cfg, ab_bytes, self.smem_bytes(ring))
        if one > two or (wide and one == two):
            self.load_stages = ring
        else:
            self.store_buffers = None

    def _fits(self, cfg: GemmConfig, ab_bytes: int, depth: int) -> bool:
        try:
            pipeline_stages(cfg, ab_bytes, self.smem_bytes(depth))
        except ValueError:
            return False
        return True

    def smem_bytes(self, load_stages: int | None = None, epi_tile=None) -> int:
        """Exactly what :meth:`allocate` carves out: 1024-byte aligned buffers in a row, then the
        load ring's mbarriers (the mainloop's struct before them is in ``SMEM_RESERVED``).
        ``load_stages`` and ``epi_tile`` default to this epilogue's."""
        em, en = epi_tile or self.epi_tile
        ring = self.load_stages if load_stages is None else load_stages
        stages = epi_stage_count(self.tile_mn, (em, en), self.store_buffers)
        sizes = [stages * em * en * BYTES[_kdt(s)] for s in self.full_stores]
        sizes += [stages * em * (en // 2) * BYTES[s.dtype] for s in self.half_stores]
        sizes += [stages * em * _quant_words(q, en) * 2 for q in self.quants]  # FP8 pairs as 16-bit words
        sizes += [stages * _t_rows(q, en) * em for q in self.quants_t]  # x^T's FP8 bytes
        sizes += [ring * em * en * BYTES[_kdt(t)] for t in self.tile_inputs]
        sizes += [self.epi_warps * self.tile_mn[1] * 4 for _ in self.col_reds]
        sizes += [(self.epi_warps + 1) * _t_rows(q, en) * 4 for q in self.quants_t]  # column amax partials, 1 / s
        mbarriers = 2 * ring * 8 if self.tile_inputs else 0
        return sum(-(-b // 1024) * 1024 for b in sizes) + mbarriers

    # -- host side (inside the @cute.jit launcher) -------------------------------------------------
    def make_atoms(self, ins: tuple, outs: tuple):
        """TMA atoms (with their coordinate tensors) for stores and tile inputs, and the smem
        layouts, which the kernel receives as arguments."""
        em, en = self.epi_tile
        full_layouts = [
            sm90_utils.make_smem_layout_epi(DSL_TYPES[_kdt(s)], LayoutEnum.ROW_MAJOR, self.epi_tile, self.stages)
            for s in self.full_stores
        ]
        half_layouts = [
            cute.make_layout((em, en // 2, self.stages), stride=(en // 2, 1, em * en // 2))
            for _ in self.half_stores
        ]
        tile_layouts = [
            sm90_utils.make_smem_layout_epi(DSL_TYPES[_kdt(t)], LayoutEnum.ROW_MAJOR, self.epi_tile,
                                            self.load_stages)
            for t in self.tile_inputs
        ]
        quant_layouts = [
            cute.make_layout((em, _quant_words(q, en), self.stages),
                             stride=(_quant_words(q, en), 1, em * _quant_words(q, en)))
            for q in self.quants
        ]
        # x^T's 128-byte rows 128B-swizzled: a byte store of the transposed staging writes, per
        # register, 8 consecutive bytes of 4 rows two apart (one apart half-width, four apart
        # double-width), which unswizzled rows put in the same two banks (a 4-way conflict on
        # every store); swizzled, 4 different 16-byte chunks take them (double-width: 2, rows r
        # and r + 8 sharing their chunk: a 2-way conflict)
        quant_t_layouts = [
            sm90_utils.make_smem_layout_epi(FP8_TYPES[q.dtype], LayoutEnum.ROW_MAJOR, (_t_rows(q, en), em), self.stages)
            for q in self.quants_t
        ]
        store_atoms = []
        for s, lay in zip(self.full_stores, full_layouts):
            store_atoms.append(cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), outs[self.out_slots[s.name]],
                cute.slice_(lay, (None, None, 0)), self.epi_tile))
        for s, lay in zip(self.half_stores + self.quants, half_layouts + quant_layouts):
            store_atoms.append(cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), outs[self.out_slots[s.name]],
                cute.slice_(lay, (None, None, 0)), (em, cute.size(lay, mode=[1]))))
        for s, lay in zip(self.quants_t, quant_t_layouts):  # a sub-tile's columns as rows of x^T
            store_atoms.append(cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), outs[self.out_slots[s.name]],
                cute.slice_(lay, (None, None, 0)), (_t_rows(s, en), em)))
        load_atoms = []
        for t, lay in zip(self.tile_inputs, tile_layouts):
            load_atoms.append(cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), ins[self._in_index(t.name)],
                cute.slice_(lay, (None, None, 0)), self.epi_tile))
        return tuple(store_atoms), tuple(load_atoms), (tuple(full_layouts), tuple(half_layouts), tuple(tile_layouts),
                                                       tuple(quant_layouts), tuple(quant_t_layouts))

    def _in_index(self, name: str) -> int:
        return [i.name for i in self.tensor_inputs].index(name)

    # -- device side: shared memory ----------------------------------------------------------------
    def allocate(self, smem, layouts):
        """Carve the epilogue's buffers out of shared memory (after the mainloop's)."""
        full_layouts, half_layouts, tile_layouts, quant_layouts, quant_t_layouts = layouts
        bufs = []
        for s, lay in zip(self.full_stores, full_layouts):
            bufs.append(smem.allocate_tensor(DSL_TYPES[_kdt(s)], lay.outer, 1024, swizzle=lay.inner))
        for s, lay in zip(self.half_stores, half_layouts):
            bufs.append(smem.allocate_tensor(DSL_TYPES[s.dtype], lay, 1024))
        for lay in quant_layouts:
            bufs.append(smem.allocate_tensor(cutlass.Int16, lay, 1024))
        for s, lay in zip(self.quants_t, quant_t_layouts):
            bufs.append(smem.allocate_tensor(FP8_TYPES[s.dtype], lay.outer, 1024, swizzle=lay.inner))
        tiles = [smem.allocate_tensor(DSL_TYPES[_kdt(t)], lay.outer, 1024, swizzle=lay.inner)
                 for t, lay in zip(self.tile_inputs, tile_layouts)]
        scratch = [smem.allocate_tensor(Float32, cute.make_layout((self.epi_warps, self.tile_mn[1])), 1024)
                   for _ in self.col_reds]
        scratch += [smem.allocate_tensor(Float32, cute.make_layout((self.epi_warps + 1, _t_rows(q, self.epi_tile[1])),
                                                                   stride=(_t_rows(q, self.epi_tile[1]), 1)), 1024)
                    for q in self.quants_t]
        load_pipe = None
        if const_expr(len(self.tile_inputs) > 0):
            mbar = smem.allocate_array(cutlass.Int64, 2 * self.load_stages, byte_alignment=8)
            em, en = self.epi_tile
            tx = sum(em * en * BYTES[_kdt(t)] for t in self.tile_inputs)
            load_pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=mbar, num_stages=self.load_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.epi_warps),
                tx_count=tx, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True,
            )
        return bufs, tiles, scratch, load_pipe

    # -- device side: the epilogue-load warp ----------------------------------------------------
    @cute.jit
    def produce_loads(self, load_atoms, load_tensors, tiles, load_pipe, sched):
        """Load warp: every tile input's sub-tiles, tile after tile, in the consumers' order."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.load_stages)
        work = sched.first
        while sched.is_valid(work):
            tm, tn, tl = sched.coord(work)
            parts = [self._load_partition(atom, t, s, (tm, tn, tl))
                     for atom, t, s in zip(load_atoms, load_tensors, tiles)]
            epi_grid = parts[0][2]
            order = cute.make_layout(epi_grid, stride=(epi_grid[1], 1))
            for e in cutlass.range_constexpr(cute.size(epi_grid)):
                load_pipe.producer_acquire(state)
                bar = load_pipe.producer_get_barrier(state)
                for atom, (bS, bG, _) in zip(load_atoms, parts):
                    cute.copy(atom, bG[(None, order.get_hier_coord(e))], bS[(None, state.index)], tma_bar_ptr=bar)
                load_pipe.producer_commit(state)
                state.advance()
            work += sched.stride
        load_pipe.producer_tail(state)

    def _load_partition(self, atom, tensor, smem, coord):
        g = cute.local_tile(tensor, self.tile_mn, coord)
        g_epi = cute.zipped_divide(g, self.epi_tile)
        bS, bG = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 2), g_epi)
        return bS, bG, g_epi.shape[1]

    # -- device side: per-tile state -------------------------------------------------------------
    @cute.jit
    def begin_tile(self, acc_coords, problem_mnl, batch, ins, scalars):
        """Registers the tree reads for the whole tile: vectors laid out like the accumulator,
        scalars and 1-element scalar tensors."""
        vecs = AccVectors(acc_coords, problem_mnl, batch)
        state = {}
        for spec, t in zip(self.tensor_inputs, ins):
            if const_expr(spec.kind == "row_vec"):
                state[spec.name] = vecs.rows(t, DSL_TYPES[spec.dtype])
            elif const_expr(spec.kind == "col_vec"):
                state[spec.name] = vecs.cols(t, DSL_TYPES[spec.dtype])
            elif const_expr(spec.kind == "scalar_tensor"):
                state[spec.name] = Float32(t[0])
            elif const_expr(spec.kind == "row_sum"):
                state[spec.name] = vecs.row_sums(t)
            elif const_expr(spec.kind == "lookup"):
                state[spec.name] = t
        for spec, v in zip(self.scalar_inputs, scalars):
            state[spec.name] = Float32(v)
        return state

    @cute.jit
    def prefetch_vectors(self, ins, tile_mnl, problem_mnl, tidx):
        """Pull the tile's row- and column-vector entries into L1 at the start of its mainloop
        (one thread per 128-byte line): the epilogue then reads them at L1 latency instead of
        waiting a round trip to L2 (or DRAM) with the tensor cores idle."""
        tm, tn, tl = tile_mnl
        for spec, t in zip(self.tensor_inputs, ins):
            if const_expr(spec.kind in ("row_vec", "col_vec")):
                rows = spec.kind == "row_vec"
                extent = self.tile_mn[0 if rows else 1]
                per_line = 128 // BYTES[spec.dtype]
                if tidx < -(-extent // per_line):
                    i = (tm if rows else tn) * extent + tidx * per_line
                    if const_expr(rows):  # columns arrive padded to whole cluster tiles
                        i = cutlass.min(i, problem_mnl[0] - 1)
                    addr = t.iterator + cute.crd2idx((i, tl), t.layout)
                    cute.arch.prefetch(addr.llvm_ptr, cache_level="L1")

    # -- device side: the sub-tile loop ----------------------------------------------------------
    @cute.jit
    def store_tile(self, acc, state, acc_coords, tile_coords, tiled_mma, tidx, warp_in_epi, bufs,
                   tiles, scratch, store_atoms, store_tensors, outs, load_pipe, load_state,
                   store_pipe, barrier, is_store_warp, buffer_base, problem_mnl, tile_mnl):
        """Evaluate the tree over ``acc`` sub-tile by sub-tile, stage and store its outputs, fold
        its reductions and write their per-tile partials. Returns (sub-tile count, load state).
        With a tile-uniform ``where`` (``self.split``) the pass is compiled once per side of it
        and each tile runs the one its columns pick."""
        args = (acc, state, acc_coords, tile_coords, tiled_mma, tidx, warp_in_epi, bufs, tiles,
                scratch, store_atoms, store_tensors, outs, load_pipe, load_state, store_pipe,
                barrier, is_store_warp, buffer_base, problem_mnl, tile_mnl)
        result = (buffer_base + self.subtiles, load_state)
        if const_expr(self.split is None):
            result = self._tile_pass(*args, {})
        else:
            if split_value(self.split, tile_mnl[1] * self.tile_mn[1]):
                self._tile_pass(*args, {id(self.split): True})
            else:
                self._tile_pass(*args, {id(self.split): False})
        return result

    @cute.jit
    def _tile_pass(self, acc, state, acc_coords, tile_coords, tiled_mma, tidx, warp_in_epi, bufs,
                   tiles, scratch, store_atoms, store_tensors, outs, load_pipe, load_state,
                   store_pipe, barrier, is_store_warp, buffer_base, problem_mnl, tile_mnl,
                   assume: cutlass.Constexpr):
        em, en = self.epi_tile
        tm, tn, tl = tile_mnl
        n_frag = em * en // (self.epi_warps * 32)
        frag = cute.make_rmem_tensor(n_frag, Float32)
        n_epi = (self.tile_mn[0] // em) * (self.tile_mn[1] // en)
        epi_grid = (self.tile_mn[0] // em, self.tile_mn[1] // en)
        order = cute.make_layout(epi_grid, stride=(epi_grid[1], 1))

        full_copies = [self._r2s(tiled_mma, _kdt(s), tidx, buf)
                       for s, buf in zip(self.full_stores, bufs[:len(self.full_stores)])]
        store_parts = []
        n_plain = len(store_atoms) - len(self.quants_t)
        for i, (atom, t, buf) in enumerate(zip(store_atoms, store_tensors, bufs)):
            if const_expr(i < n_plain):
                g = cute.local_tile(t, (self.tile_mn[0], cute.size(buf, mode=[1]) * epi_grid[1]), (tm, tn, tl))
                g_epi = cute.zipped_divide(g, (em, cute.size(buf, mode=[1])))
            else:  # x^T: the tile is (its rows of x^T, tile_m) at (tn, tm), a sub-tile (its rows, em)
                rows = cute.size(buf, mode=[0])
                g = cute.local_tile(t, (rows * epi_grid[1], self.tile_mn[0]), (tn, tm, tl))
                g_epi = cute.zipped_divide(g, (rows, em))
            store_parts.append(cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(buf, 0, 2), g_epi))

        tile_copies = [self._s2r(tiled_mma, _kdt(t), tidx, sm) for t, sm in zip(self.tile_inputs, tiles)]
        segments = self._segment_prepass(acc, frag, state, acc_coords, tile_coords, n_frag, order,
                                         problem_mnl, assume)
        row_acc = [self._row_init(r) for r in self.row_reds]
        found = [[(Boolean(False), Float32(0.0))] * self.row_slots for _ in self.gathers]
        lookups = lookups_ahead(self.tree, assume)
        ahead_args = (frag, state, acc_coords, tile_coords, segments, order, n_frag, n_epi, lookups)
        ahead = self._read_ahead(0, *ahead_args)
        for e in cutlass.range_constexpr(n_epi):
            emc, enc = order.get_hier_coord(e)
            current, ahead = ahead, self._read_ahead(e + 1, *ahead_args)
            for v in cutlass.range_constexpr(n_frag):
                frag[v] = acc[e * n_frag + v]
            tile_vals = []
            if const_expr(len(self.tile_inputs) > 0):
                load_pipe.consumer_wait(load_state)
                for tiled_s2r, tSR_s, vals, tSR_r in tile_copies:
                    cute.copy(tiled_s2r, tSR_s[(None, None, None, load_state.index)], tSR_r)
                    tile_vals.append(vals)
            ctx = _Ctx(self, frag, state, acc_coords, tile_vals, e * n_frag, tile_coords,
                       emc * em, enc * en, segments, current)
            emit = Emitter(ctx, assume=assume)
            buf = (buffer_base + e) % self.stages
            if const_expr(len(store_parts) > 0 and not self.late_claim):
                # Claim the buffer: the TMA store that last read it must be done reading.
                if is_store_warp:
                    store_pipe.producer_acquire()
                barrier.arrive_and_wait()
            staged = self._evaluate(emit, ctx, n_frag, [c[2] for c in full_copies], row_acc, found,
                                    scratch, warp_in_epi, bufs, buf, problem_mnl,
                                    [outs[self.out_slots[g.name]] for g in self.gathers],
                                    [outs[self.out_slots[q.name] + 1] for q in self.quants + self.quants_t], tl,
                                    barrier, tidx, tile_mnl)
            if const_expr(len(store_parts) > 0 and self.late_claim):
                if is_store_warp:
                    store_pipe.producer_acquire()
                barrier.arrive_and_wait()
            for (tiled_r2s, tRS_sD, _), out in zip(full_copies, staged):
                cute.copy(tiled_r2s, out, tRS_sD[(None, None, None, buf)])
            if const_expr(len(self.tile_inputs) > 0):
                load_pipe.consumer_release(load_state)
                load_state.advance()
            if const_expr(len(store_parts) > 0):
                # Register stores are generic-proxy; the TMA engine reads through the async proxy.
                cute.arch.fence_proxy("async.shared", space="cta")
                barrier.arrive_and_wait()
                if is_store_warp:
                    for i, (atom, (bS, bG)) in enumerate(zip(store_atoms, store_parts)):
                        if const_expr(i < n_plain):
                            cute.copy(atom, bS[(None, buf)], bG[(None, (emc, enc))])
                        else:
                            cute.copy(atom, bS[(None, buf)], bG[(None, (enc, emc))])
                    store_pipe.producer_commit()
        for k, r in enumerate(self.row_reds):
            self._row_finish(r, row_acc[k], outs, acc_coords, tn, tl, problem_mnl)
        for g, hits in zip(self.gathers, found):
            self._gather_finish(hits, outs[self.out_slots[g.name]], acc_coords, tl, problem_mnl)
        if const_expr(len(self.col_reds) > 0):
            barrier.arrive_and_wait()
            for k, c in enumerate(self.col_reds):
                self._col_finish(c, scratch[k], outs[self.out_slots[c.name]], tidx, tn, tm, tl, problem_mnl)
            barrier.arrive_and_wait()
        return buffer_base + n_epi, load_state

    def _evaluate(self, emit, ctx, n_frag: int, shapes, row_acc, found, scratch, warp_in_epi, bufs,
                  buf, problem_mnl, outs_g, outs_q, tl, barrier, tidx, tile_mnl):
        """Every sink of the tree over one sub-tile, element after element: each element's
        values are rounded into the store fragments and folded into the row reductions and
        gathers right away, so the intermediates of one element die before the next is computed
        (sink after sink, every element's intermediates would stay live from the first sink to
        the last). Returns the store fragments (a double-width store's as 32-bit words: the pair
        of element i's column in word i, the even value in the low half, as in memory)."""
        frags = [cute.make_rmem_tensor(2 * n_frag if s.wide else shape, DSL_TYPES[s.dtype])
                 for s, shape in zip(self.full_stores, shapes)]
        lse_items = [{} for _ in self.row_reds]
        # a quantize sink's values wait in fp32 until their rows' block amax is known
        # (one register tensor per distinct value: both layouts of one x share it; the row sink
        # zeroes columns past N, the transposed one rows past M, which neither writes)
        quants = self.quants + self.quants_t
        shared = {}
        for q in quants:
            if id(q.x) not in shared:
                shared[id(q.x)] = (q, cute.make_rmem_tensor(2 * n_frag if q.wide else n_frag, Float32))
        quant_vals = [shared[id(q.x)][1] for q in quants]
        col_parts = [self._col_parts(c, n_frag) for c in self.col_reds]
        for v in range(n_frag):
            for q, vals in shared.values():
                if q.half and v % 2:  # a half-width value lives at its pair's even element
                    continue
                for h in (0, 1) if q.wide else (None,):
                    i = v if h is None else 2 * v + h
                    vals[i] = _as_float(emit.value(q.x, i))
            for s, frag in zip(self.full_stores, frags):
                for h in (0, 1) if s.wide else (None,):
                    i = v if h is None else 2 * v + h
                    frag[i] = DSL_TYPES[s.dtype](_as_float(emit.value(s.x, i)))
            if v % 2 == 0:
                for k, s in enumerate(self.half_stores):
                    ml, nl = ctx.local(v)
                    sH = bufs[len(self.full_stores) + k]
                    sH[(ml, nl // 2, buf)] = DSL_TYPES[s.dtype](_as_float(emit.value(s.x, v)))
            for k, r in enumerate(self.row_reds):
                if r.x.domain != N.HALF or v % 2 == 0:
                    row_acc[k] = self._row_step(r, row_acc[k], lse_items[k], emit, ctx, v, problem_mnl)
                if r.op == "lse" and (v + 1) % LSE_FOLD == 0:
                    row_acc[k] = _lse_fold(row_acc[k], lse_items[k])
                    lse_items[k] = {}
            for k, c in enumerate(self.col_reds):
                self._col_step(c, col_parts[k], emit, ctx, v, problem_mnl)
            for k, g in enumerate(self.gathers):
                if self.gather_select:
                    found[k] = self._gather_step(g, found[k], emit, ctx, v, problem_mnl)
                else:
                    self._gather_now(g, emit, ctx, v, outs_g[k], problem_mnl, tl)
        # Column reductions: each column's two row halves fold in the element loop (``_col_step``;
        # evaluating the reduced values after it kept n_frag of them live per reduction, and the
        # SwiGLU backward's three amax columns spilled ping-pong 64 x 128), their shuffles after
        # it (interleaved with the element math they made ptxas spill, e.g. 152 bytes on
        # cooperative 128 x 256 tiles).
        for k, c in enumerate(self.col_reds):
            self._col_fold(c, col_parts[k], scratch[k], n_frag, warp_in_epi, ctx)
        first_quant = len(self.full_stores) + len(self.half_stores)
        for k, q in enumerate(self.quants):
            self._quantize(q, quant_vals[k], ctx, n_frag, bufs[first_quant + k], buf, outs_q[k], problem_mnl, tl)
        for k, q in enumerate(self.quants_t):
            j = len(self.quants) + k
            self._quantize_t(q, quant_vals[j], ctx, n_frag, bufs[first_quant + j], buf,
                             scratch[len(self.col_reds) + k], outs_q[j], warp_in_epi, tidx, barrier,
                             problem_mnl, tile_mnl)
        return [cute.make_tensor(cute.recast_ptr(f.iterator, dtype=Float32), cute.make_layout(shape))
                if s.wide else f for s, f, shape in zip(self.full_stores, frags, shapes)]

    def _read_ahead(self, e: int, frag, state, acc_coords, tile_coords, segments, order, n_frag,
                    n_epi, lookups) -> dict:
        """The lookups of sub-tile ``e``, read while sub-tile ``e - 1`` is evaluated."""
        if e >= n_epi or not lookups:
            return {}
        emc, enc = order.get_hier_coord(e)
        ctx = _Ctx(self, frag, state, acc_coords, None, e * n_frag, tile_coords,
                   emc * self.epi_tile[0], enc * self.epi_tile[1], segments)
        return read_lookups_ahead(ctx, lookups, n_frag)

    def _segment_prepass(self, acc, frag, state, acc_coords, tile_coords, n_frag, order, problem_mnl,
                         assume):
        """Values of the tree's ``segment_reduce`` nodes (those the pass under ``assume`` uses):
        for each row this thread holds and each ``width``-column segment of the tile, the sum (of
        squares) or max over the segment, computed in a first pass over the accumulator (before
        anything is stored) and completed across the 4 threads that share a row. Columns past the
        problem edge are masked out (to 0, or -inf for a max) unless the value is zero there
        anyway (and, for a max, never negative: ``edges.unmasked_max``)."""
        used = {id(n) for n in assumed_walk([s.x for s in self.tree.sinks], assume)}
        nodes = [n for n in self.segment_nodes if id(n) in used]
        if not nodes:
            return {}
        em, en = self.epi_tile
        n_epi = cute.size(order)
        sums = {}
        for e in range(n_epi):
            emc, enc = order.get_hier_coord(e)
            for v in range(n_frag):
                frag[v] = acc[e * n_frag + v]
            ctx = _Ctx(self, frag, state, acc_coords, None, e * n_frag, tile_coords,
                       emc * em, enc * en, {})
            emit = Emitter(ctx, assume=assume)
            for node in nodes:
                is_max = node.op == "max"
                child = node.children[0]
                masked = not (unmasked_max(child) if is_max else zero_past_edge(child))
                for v in range(n_frag):
                    x = _as_float(emit.value(child, v))
                    if node.op == "sumsq":
                        x = x * x
                    if masked:
                        x = Float32(cutlass.select_(ctx.col_index(v) < problem_mnl[1], x,
                                                    Float32(-math.inf if is_max else 0.0)))
                    key = (id(node), ctx.row_slot(v), ctx.segment(node, v))
                    sums[key] = (fast_max(sums[key], x) if is_max else sums[key] + x) if key in sums else x
        ops = {id(n): n.op for n in nodes}
        for key in list(sums):
            x = sums[key]
            for off in (1, 2):
                y = cute.arch.shuffle_sync_bfly(x, offset=off)
                x = fast_max(x, y) if ops[key[0]] == "max" else x + y
            sums[key] = x
        return sums

    @property
    def segment_nodes(self):
        found = {}
        for s in self.tree.sinks:
            for n in N.walk(s.x):
                if isinstance(n, N.SegmentReduce):
                    found[id(n)] = n
        return list(found.values())

    def _s2r(self, tiled_mma, dtype: str, tidx, smem):
        """ldmatrix (16-bit) or plain (fp32) smem->register copy of a tile input, landing in the
        same fragment layout the stores use, so register ``v`` is sub-tile element ``v``."""
        d = DSL_TYPES[dtype]
        tiled_c = cute.make_tiled_copy_C_atom(cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), d), tiled_mma)
        load_atom = (cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), d) if d.width == 16
                     else cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), d))
        tiled_s2r = cute.make_tiled_copy_S(load_atom, tiled_c)
        thr_s2r = tiled_s2r.get_slice(tidx)
        _, _, frag_shape = self._r2s(tiled_mma, dtype, tidx, smem)
        vals = cute.make_rmem_tensor(frag_shape, d)
        return tiled_s2r, thr_s2r.partition_S(smem), vals, thr_s2r.retile(vals)

    def _r2s(self, tiled_mma, dtype: str, tidx, buf):
        """stmatrix (16-bit) or plain (fp32) register->smem copy in the accumulator's layout."""
        d = DSL_TYPES[dtype]
        atom_c = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), d)
        tiled_c = cute.make_tiled_copy_C_atom(atom_c, tiled_mma)
        tiled_r2s = cute.make_tiled_copy_S(sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, d, Float32), tiled_c)
        thr = tiled_r2s.get_slice(tidx)
        return tiled_r2s, thr.partition_D(buf), cute.shape(thr.partition_S(buf))[:3]


class _Ctx:
    """What the tree's leaves read for sub-tile element ``i`` (see ``codegen``)."""

    def __init__(self, epi, frag, state, acc_coords, tiles, offset, tile_coords, sub_m0, sub_n0,
                 segments, ahead=None):
        self.epi = epi
        self.frag = frag
        self.state = state
        self.coords = acc_coords  # global (m, n) per accumulator register
        self.tile_coords = tile_coords  # tile-local (m, n) per accumulator register
        self.tiles = tiles  # per tile input: this sub-tile's values in fragment order
        self.offset = offset
        self.sub0 = (sub_m0, sub_n0)
        self.segments = segments
        self.ahead = ahead or {}  # lookups read a sub-tile early (codegen.lookups_ahead)

    def acc(self, i):
        return self.frag[i]

    def row(self, name, i):
        return self.state[name][self.offset + i]

    def col(self, name, i):
        return self.state[name][self.offset + i]

    def scalar(self, name):
        return self.state[name]

    def lookup(self, name, row, col):
        t = self.state[name]
        r = cutlass.max(cutlass.min(Int32(row), cute.size(t, mode=[0]) - 1), Int32(0))
        c = cutlass.max(cutlass.min(Int32(col), cute.size(t, mode=[1]) - 1), Int32(0))
        return Float32(t[(r, c)])

    def segment(self, node, i):
        """The segment index of element i for ``node`` (static); with ``self.segments`` filled,
        the node's value for element i."""
        idx = self.offset + i
        seg = ((idx // 4) % self.coords.shape[0][2]) * 8 // node.width
        if not self.segments:
            return seg
        return self.segments[(id(node), self.row_slot(i), seg)]

    def tile(self, name, i):
        k = [t.name for t in self.epi.tile_inputs].index(name)
        return Float32(self.tiles[k][i])

    def tile_half(self, name, i, h):
        """Value ``h`` of a wide tile's column pair at element i: the 32-bit word read as two
        16-bit values (the even column in the low half)."""
        k = [t.name for t in self.epi.tile_inputs].index(name)
        spec = self.epi.tile_inputs[k]
        words = self.tiles[k]
        pairs = cute.make_tensor(cute.recast_ptr(words.iterator, dtype=DSL_TYPES[spec.dtype]),
                                 cute.make_layout(2 * cute.size(words)))
        return Float32(pairs[2 * i + h])

    def row_index(self, i):
        return self.coords[self.offset + i][0]

    def col_index(self, i):
        return self.coords[self.offset + i][1]

    def tile_local(self, i):
        return self.tile_coords[self.offset + i]

    def local(self, i):
        """Sub-tile-local (m, n) of element i."""
        m, n = self.tile_coords[self.offset + i]
        return m - self.sub0[0], n - self.sub0[1]

    def row_slot(self, i) -> int:
        """Which of this thread's rows element i is on (static)."""
        idx = self.offset + i
        v_chunks = self.coords.shape[0][2]
        i1 = (idx // 2) % 2
        mm = idx // (4 * v_chunks)
        return i1 + 2 * (mm % (self.epi.row_slots // 2))


def _t_rows(q, en: int) -> int:
    """Rows of x^T a transposed quantize sink's sub-tile of ``en`` output columns gives: one per
    column, per column pair (half-width), two per column (double-width)."""
    return en // 2 if q.half else (2 * en if q.wide else en)


def _quant_words(q, en: int) -> int:
    """16-bit words per row of a quantize sink's sub-tile staging: a column pair's FP8 values
    each (half the columns), or a double-width value's pair per column."""
    return en if q.wide else en // 2


def _kdt(x) -> str:
    """The element type the kernel moves for a store sink or tile input: a double-width column
    pair is one 32-bit word."""
    return "float32" if getattr(x, "wide", False) else x.dtype
