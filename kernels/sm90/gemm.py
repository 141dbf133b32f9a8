"""Warp-specialized persistent GEMM for Hopper (sm_90a): TMA loads, WGMMA, TMA-store epilogue.

    D[m, n, l] = epilogue( sum_k A[m, k, l] * B[n, k, l] )     (fp32 accumulation)

Roles (384 threads = 3 warpgroups; one CTA per SM, persistent over output tiles):
  * warpgroups 0 and 1 - consumers. They issue WGMMA from shared memory into fp32 register
    accumulators and then run the epilogue (``Sm90TmaEpilogue``) on their own accumulators.
    ``cooperative``: both warpgroups work on the same tile, split along M, and share the epilogue.
    ``pingpong``: each warpgroup owns alternate tiles; named barriers order their mainloops and
    their epilogues so one warpgroup's epilogue runs while the other's WGMMAs keep the tensor
    cores busy. Consumers raise their register budget to 240 with ``setmaxnreg``.
  * warpgroup 2 - producer. Its first warp issues the TMA loads of A and B tiles into a
    ``stages``-deep shared-memory ring guarded by mbarriers (``PipelineTmaAsync``); with a 2-CTA
    cluster, A (cluster along N) or B (cluster along M) is multicast to both CTAs. The producer
    drops to 24 registers.

Tiles come from the static persistent scheduler (``kernels.common.tile_scheduler``); producer and
consumers walk the same sequence. Cooperative FP8 two-level kernels keep the tensor cores busy
while both warpgroups store: each warpgroup issues the next tile's first k-tile into a temporary
before its epilogue and takes it as the new accumulator after (the producer loads one extra
stage after the last tile, so every epilogue has a k-tile to overlap); those promoting in waves
(256 x 128, ``GemmConfig.promotion_waves``) have no room for that temporary.

With ``split_tail`` (cooperative) the last round's tiles are cut along K: the consumers of a
slice other than the last publish their fp32 accumulators to a global workspace; the last
slice's consumers wait for them, add them and run the epilogue. The owner being the last slice
puts it on the highest slot of its group: a CTA that waits is never dispatched before the CTAs
it waits for, so a GPU that cannot hold every cluster of the grid at once cannot deadlock.

The k-loop and the FP8 accumulation modes live in ``mainloop.py``, the register -> smem -> TMA
store path in ``epilogue.py``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum

from ..common.config import (MAX_ACC_REGISTERS, PROMOTION_GROUP, GemmConfig, block_scale_stage_bytes,
                             pipeline_stages, promotion_form, tail_carry_rule)
from ..epilogue.nodes import Epilogue
from ..common.tile_scheduler import TileScheduler
from .epilogue import Sm90TreeEpilogue
from .block_scales import BLOCK, BlockScales, ScaleLoads, scale_tx_bytes
from .mainloop import Sm90Mainloop, Stagger, produce

FP8_TYPES = (cutlass.Float8E4M3FN, cutlass.Float8E5M2)
WIDE_TYPES = (cutlass.BFloat16, cutlass.Float16)

# Named barrier ids (0 is __syncthreads).
_BAR_EPI = 1  # + warpgroup index for ping-pong
_BAR_MMA_ORDER = 3  # + warpgroup index
_BAR_EPI_ORDER = 5  # + warpgroup index
_BAR_STAGGER = 7

_THREADS_PER_WG = 128
_PRODUCER_REGS = 24
_CONSUMER_REGS = 240


def resident_clusters(num_sms: int, cluster_size: int) -> int:
    """Persistent cluster slots of a launch. Clusters of one or two CTAs fill every SM of an
    H100 / H200 (66 of two); a 4-CTA cluster must sit in one GPC, and a GPC whose SM count is no
    multiple of four leaves the rest idle, so its count is the driver's occupancy answer where a
    GPU is present. Without one (a
    CPU compile, which never launches) it is ``num_sms // cluster_size``; a grid of more clusters
    than fit would still finish (no slot waits for another), one round later."""
    slots = num_sms // cluster_size
    if cluster_size <= 2:
        return slots
    try:
        from cutlass.utils import HardwareInfo
        return min(slots, HardwareInfo().get_max_active_clusters(cluster_size))
    except (ImportError, RuntimeError, ValueError):
        return slots


class Sm90Gemm:
    """One compiled kernel instance: config x operand dtypes and majors x epilogue tree.

    ``a_major`` is ``"k"`` (A is M x K row-major) or ``"m"``; ``b_major`` is ``"k"`` (B stored
    N x K row-major, i.e. the torch ``K x N`` operand is column-major) or ``"n"``.
    """

    def __init__(self, cfg: GemmConfig, a_dtype, b_dtype, a_major: str, b_major: str,
                 tree: Epilogue, num_sms: int, block_scaled: bool = False, b_rows: bool = False):
        is_fp8 = a_dtype in FP8_TYPES
        if is_fp8 != (b_dtype in FP8_TYPES):
            raise TypeError(f"A and B must both be 16-bit or both be FP8, got {a_dtype} and {b_dtype}")
        if not is_fp8 and (a_dtype not in WIDE_TYPES or a_dtype != b_dtype):
            raise TypeError(f"16-bit A and B must be the same bf16/fp16 type, got {a_dtype} and {b_dtype}")
        if is_fp8 and (a_major != "k" or b_major != "k"):
            raise ValueError("FP8 WGMMA needs K-major A and B")
        if cfg.tile_n % 32:
            raise ValueError(f"tile_n must be a multiple of 32, got {cfg.tile_n}")
        self.cfg = cfg
        self.a_dtype, self.b_dtype = a_dtype, b_dtype
        self.a_layout = LayoutEnum.ROW_MAJOR if a_major == "k" else LayoutEnum.COL_MAJOR
        self.b_layout = LayoutEnum.ROW_MAJOR if b_major == "k" else LayoutEnum.COL_MAJOR
        if cfg.split_tail and any(i.kind == "tile" for i in tree.inputs):
            raise ValueError("split_tail kernels take no tile inputs (their load warp would have to "
                             "skip the tail's K slices)")
        self.split_tail = cfg.split_tail
        self.two_level = is_fp8 and not cfg.fp8_fast_accum
        if block_scaled and not (self.two_level and cfg.tile_k == BLOCK and BLOCK % cfg.tile_n == 0
                                 and not cfg.split_tail):
            raise ValueError("block-scaled FP8 needs two-level accumulation, tile_k = 128 (one k-tile "
                             "per scale block), tile_n dividing 128 (one weight block per N-tile) and "
                             f"no split_tail; got {cfg.name}")
        if b_rows and not block_scaled:
            raise ValueError("b_rows (B's scales per row) is a block-scaled mode")
        self.block_scaled, self.b_rows = block_scaled, b_rows
        cfg.check_registers(self.two_level)
        why = tail_carry_rule(cfg, None, is_fp8, block_scaled, b_rows)
        if why is not None:
            raise ValueError(f"config {cfg.name}: {why}")
        self.pingpong = cfg.schedule == "pingpong"
        waves = cfg.promotion_waves if self.two_level else 1
        # cooperative two-level: each next tile's first k-tile is issued before the epilogue
        # (not in waves: a whole temporary next to the accumulator is what does not fit there)
        self.overlap = self.two_level and not self.pingpong and waves == 1
        self.tile_mnk = (cfg.tile_m, cfg.tile_n, cfg.tile_k)
        self.atom_layout_mnk = (1, 1, 1) if self.pingpong else (2, 1, 1)
        self.cluster_mn = (cfg.cluster_m, cfg.cluster_n)
        self.threads = 3 * _THREADS_PER_WG
        self.producer_warp = 8
        self.load_warp = 9
        # ping-pong: one warpgroup consumes each stage and stores each tile.
        self.consumer_warps = 4 if self.pingpong else 8
        self.epi_threads = _THREADS_PER_WG if self.pingpong else 2 * _THREADS_PER_WG
        self.max_clusters = resident_clusters(num_sms, cfg.cluster_m * cfg.cluster_n)
        self.epilogue = Sm90TreeEpilogue(tree, cfg, a_dtype.width // 8)
        self.scale_bytes = block_scale_stage_bytes(cfg, b_rows) if block_scaled else 0
        self.stages = pipeline_stages(cfg, a_dtype.width // 8, self.epilogue.smem_bytes(), self.scale_bytes)
        self.mainloop = Sm90Mainloop(
            a_dtype, b_dtype, self.a_layout.sm90_mma_major_mode(), self.b_layout.sm90_mma_major_mode(),
            self.atom_layout_mnk, self.tile_mnk, self.two_level,
            # ping-pong's wgrad form spills with a second temporary next to its column scales
            paired=self.two_level and 3 * cfg.acc_registers <= MAX_ACC_REGISTERS and not (b_rows and self.pingpong),
            group=PROMOTION_GROUP[promotion_form(block_scaled, b_rows)],
            waves=waves, poll=cfg.poll_full, carry=cfg.tail_carry,
        )

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, ins: tuple, outs: tuple, scalars: tuple,
                 workspace: tuple, block_scales: tuple, stream):
        """``mA``: (M, K, L), ``mB``: (N, K, L); ``ins`` / ``outs`` / ``scalars``: the tree's
        tensor inputs, outputs and runtime scalars in the epilogue's order (``None`` when
        empty); ``workspace``: ``split_tail`` only (else ``None``), the tail's fp32 partials and
        its per-tile int32 arrival counters (zeroed); ``block_scales``: block-scaled FP8 only
        (else ``None``), A's 1 x 128 and B's 128 x 128 (``b_rows``: 1 x 128) fp32 scales in the
        layouts :meth:`ScaleLoads.make` takes."""
        tiled_mma = self.mainloop.tiled_mma(self.tile_mnk[1])
        a_smem = sm90_utils.make_smem_layout_a(self.a_layout, self.tile_mnk, self.a_dtype, self.stages)
        b_smem = sm90_utils.make_smem_layout_b(self.b_layout, self.tile_mnk, self.b_dtype, self.stages)
        tma_a, tma_mA = self._tma_load(mA, a_smem, (self.tile_mnk[0], self.tile_mnk[2]), self.cluster_mn[1])
        tma_b, tma_mB = self._tma_load(mB, b_smem, (self.tile_mnk[1], self.tile_mnk[2]), self.cluster_mn[0])
        ins = ins if ins is not None else ()
        scalars = scalars if scalars is not None else ()
        store_atoms, load_atoms, epi_layouts = self.epilogue.make_atoms(ins, outs)
        scale_tma, scale_smem = None, (cute.make_layout(1), cute.make_layout(1))
        if const_expr(self.block_scaled):
            scale_smem = ScaleLoads.smem_layouts(self.cfg.tile_m, self.cfg.tile_n, self.b_rows, self.stages)
            scale_tma = ScaleLoads.make(*block_scales, scale_smem,
                                        ScaleLoads.tiles(self.cfg.tile_m, self.cfg.tile_n, self.b_rows))

        @cute.struct
        class SharedStorage:
            ab_mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(b_smem)], 1024]
            # block-scaled FP8: each stage's scales (one float each otherwise, never touched)
            sSA: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(scale_smem[0])], 128]
            sSB: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(scale_smem[1])], 128]

        self.shared_storage = SharedStorage
        problem_mnl = (mA.shape[0], mB.shape[0], mA.shape[2])
        grid = TileScheduler.grid(problem_mnl, self.tile_mnk[:2], self.cluster_mn, self.max_clusters)
        self.kernel(
            tiled_mma, tma_a, tma_mA, tma_b, tma_mB,
            tuple(x[0] for x in store_atoms), tuple(x[1] for x in store_atoms),
            tuple(x[0] for x in load_atoms), tuple(x[1] for x in load_atoms),
            ins, outs, scalars, workspace, scale_tma, problem_mnl, a_smem, b_smem, epi_layouts, scale_smem,
        ).launch(
            grid=grid,
            block=[self.threads, 1, 1],
            cluster=(*self.cluster_mn, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    def _tma_load(self, t, smem_staged, tile, mcast: int):
        op = cpasync.CopyBulkTensorTileG2SOp() if mcast == 1 else cpasync.CopyBulkTensorTileG2SMulticastOp()
        return cpasync.make_tiled_tma_atom(
            op, t, cute.slice_(smem_staged, (None, None, 0)), tile, num_multicast=mcast
        )

    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, mA: cute.Tensor,
               tma_b: cute.CopyAtom, mB: cute.Tensor, store_atoms: tuple, store_tensors: tuple,
               load_atoms: tuple, load_tensors: tuple, ins: tuple, outs: tuple, scalars: tuple,
               workspace: tuple, scale_tma: tuple, problem_mnl, a_smem: cute.ComposedLayout,
               b_smem: cute.ComposedLayout, epi_layouts, scale_smem: tuple):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // _THREADS_PER_WG)

        if warp_idx == self.producer_warp:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            for atom in store_atoms + load_atoms:
                cpasync.prefetch_descriptor(atom)
            if const_expr(self.block_scaled):
                for atom, _ in scale_tma:
                    cpasync.prefetch_descriptor(atom)

        cta_layout_mnk = cute.make_layout((*self.cluster_mn, 1))
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(cta_rank)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sSA = storage.sSA.get_tensor(scale_smem[0])
        sSB = storage.sSB.get_tensor(scale_smem[1])
        epi_bufs, epi_tiles, epi_scratch, load_pipe = self.epilogue.allocate(smem, epi_layouts)

        mcast_size = self.cluster_mn[0] + self.cluster_mn[1] - 1
        stage_bytes = cute.size_in_bytes(self.a_dtype, cute.slice_(a_smem, (None, None, 0))) + \
            cute.size_in_bytes(self.b_dtype, cute.slice_(b_smem, (None, None, 0)))
        if const_expr(self.block_scaled):  # what the scale boxes bring, not the slots they fill
            stage_bytes += scale_tx_bytes(self.cfg.tile_m, self.cfg.tile_n, self.b_rows)
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, mcast_size * self.consumer_warps),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=self.cluster_mn, is_relaxed=True)

        # (bM, bK, RestM, RestK, RestL) and (bN, bK, RestN, RestK, RestL)
        gA = cute.local_tile(mA, cute.slice_(self.tile_mnk, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(self.tile_mnk, (0, None, None)), (None, None, None))
        k_tiles = cute.size(gA, mode=[3])

        pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster_mn)
        sched = TileScheduler.create(problem_mnl, self.tile_mnk[:2], self.cluster_mn, self.cfg.raster_group,
                                     k_tiles, self.split_tail)

        if wg_idx == 2:
            cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
            if warp_idx == self.producer_warp:
                scale_loads = None
                if const_expr(self.block_scaled):
                    scale_loads = ScaleLoads(tuple(x[0] for x in scale_tma), tuple(x[1] for x in scale_tma),
                                             (sSA, sSB), ScaleLoads.tiles(self.cfg.tile_m, self.cfg.tile_n, self.b_rows),
                                             self.cfg.tile_n, self.b_rows)
                produce(tma_a, tma_b, sA, sB, gA, gB, ab_pipe, sched, self.stages,
                        self.cluster_mn, cta_layout_mnk, cluster_coord, self.overlap, scale_loads,
                        self.cfg.poll_full)
            if const_expr(len(load_atoms) > 0):
                if warp_idx == self.load_warp:
                    self.epilogue.produce_loads(load_atoms, load_tensors, epi_tiles, load_pipe, sched)
        else:
            cute.arch.setmaxregister_increase(_CONSUMER_REGS)
            self.consume(tiled_mma, sA, sB, ab_pipe, sched, k_tiles, problem_mnl, tidx, warp_idx,
                         wg_idx, (epi_bufs, epi_tiles, epi_scratch, load_pipe),
                         store_atoms, store_tensors, ins, outs, scalars, workspace, (sSA, sSB))

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def consume(self, tiled_mma, sA, sB, ab_pipe, sched: TileScheduler, k_tiles, problem_mnl, tidx,
                warp_idx, wg_idx, epi_smem, store_atoms, store_tensors, ins, outs, scalars, workspace,
                scale_smem):
        """MMA warpgroups: mainloop into registers, then the epilogue, tile after tile."""
        epi_bufs, epi_tiles, epi_scratch, load_pipe = epi_smem
        mma_tidx = tidx
        warp_in_epi = warp_idx
        if const_expr(self.pingpong):
            mma_tidx = tidx % _THREADS_PER_WG
            warp_in_epi = warp_idx % 4
        thr_mma, frags, acc, acc_tmp = self.mainloop.fragments(tiled_mma, sA, sB, mma_tidx)
        stagger = None
        if const_expr(self.two_level and not self.pingpong):
            stagger = Stagger(_BAR_STAGGER, wg_idx)

        # Global and tile-local (m, n) of every output element, tiled like the output.
        cD = cute.local_tile(cute.make_identity_tensor((problem_mnl[0], problem_mnl[1])),
                             self.tile_mnk[:2], (None, None))
        tCcT = thr_mma.partition_C(cute.make_identity_tensor(self.tile_mnk[:2]))
        scales = None
        if const_expr(self.block_scaled):
            scales = BlockScales(*scale_smem, tCcT, self.b_rows)

        epi_bar_id = _BAR_EPI
        is_store_warp = warp_idx == 0
        if const_expr(self.pingpong):
            epi_bar_id = _BAR_EPI + wg_idx
            is_store_warp = warp_idx % 4 == 0
        epi_barrier = pipeline.NamedBarrier(barrier_id=epi_bar_id, num_threads=self.epi_threads)
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.epilogue.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.epi_threads),
        )
        self.epilogue.init_scratch(epi_scratch, mma_tidx)
        epi_barrier.arrive_and_wait()

        n_epi = self.epilogue.subtiles
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        load_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.epilogue.load_stages)
        work = sched.first
        work_step = sched.stride
        if const_expr(self.pingpong):
            # Warpgroup w takes every other tile; its ring positions start after the other's tile.
            work = work + wg_idx * sched.stride
            work_step = 2 * sched.stride
            if wg_idx == 1:
                read_state.advance(k_tiles)
                load_state.advance(n_epi)
            else:
                self._order_arrive(_BAR_MMA_ORDER, 0)
                self._order_arrive(_BAR_EPI_ORDER, 0)

        if const_expr(self.overlap):
            first, stage, read_state = self.mainloop.issue_first(
                tiled_mma.op, frags, acc, ab_pipe, read_state)
            self.mainloop.take_first(acc, first, ab_pipe, stage, self._first_factor(scales, stage))
        epi_count = Int32(0)
        while sched.is_valid(work):
            tm, tn, tl = sched.coord(work)
            tCcD = thr_mma.partition_C(cD[(None, None, tm, tn)])
            if const_expr(self.pingpong):
                # A ping-pong warpgroup reads its tile's vectors only after its mainloop (see
                # begin_tile below), with the whole round trip exposed; pulled into L1 now, they
                # cost L1 latency there. FP8 fast-accumulation 128x128 ping-pong GEMMs gained
                # 1.5 % at M = 16384. Cooperative kernels read them under their last k-tile's
                # WGMMAs already and measured 0.3 % slower with this prefetch.
                self.epilogue.prefetch_vectors(ins, (tm, tn, tl), problem_mnl, mma_tidx)
                self._order_wait(_BAR_MMA_ORDER, wg_idx)

            def on_last_issue():
                if const_expr(self.pingpong):
                    self._order_arrive(_BAR_MMA_ORDER, 1 - wg_idx)
                    return None
                # Cooperative: per-tile epilogue loads overlap the last k-tile's WGMMAs.
                return self.epilogue.begin_tile(tCcD, problem_mnl, tl, ins, scalars)

            _, k_count, k_slice, split, tail_slot = sched.slice(work)
            if const_expr(self.overlap):
                k_count -= 1  # the first is in acc already
            ran = self.mainloop.run(
                tiled_mma, frags, acc, acc_tmp, ab_pipe, read_state, k_count, on_last_issue, stagger,
                self.overlap, None if const_expr(scales is None) else scales.factors)
            read_state, epi_state = ran[0], ran[1]
            next_factor = None
            if const_expr(self.mainloop.carries(self.overlap)):
                first, stage = ran[2]
                next_factor = self._first_factor(scales, stage)
            elif const_expr(self.overlap):
                # The next tile's first k-tile (after the last tile, the producer's extra stage)
                # runs on the tensor cores during the fixup and the epilogue.
                first, stage, read_state = self.mainloop.issue_first(
                    tiled_mma.op, frags, acc, ab_pipe, read_state)
                next_factor = self._first_factor(scales, stage)
            if const_expr(self.split_tail):
                if split > 1:
                    self._fixup(acc, workspace, k_slice, split, tail_slot, tidx, epi_barrier)
            if const_expr(self.pingpong):
                # Only once the last A/B stage is released: until then the producer cannot refill
                # it and the other warpgroup's mainloop starves after the stages already loaded,
                # so a per-tile read waiting on memory (row sums over T partials) would stall the
                # tensor cores. Here its latency runs under the other warpgroup's mainloop.
                epi_state = self.epilogue.begin_tile(tCcD, problem_mnl, tl, ins, scalars)
                self._order_wait(_BAR_EPI_ORDER, wg_idx)
            if k_slice == split - 1:  # a split tail tile's owner (its last slice), or any other tile
                epi_count, load_state = self.epilogue.store_tile(
                    acc, epi_state, tCcD, tCcT, tiled_mma, mma_tidx, warp_in_epi, epi_bufs, epi_tiles,
                    epi_scratch, store_atoms, store_tensors, outs, load_pipe, load_state, store_pipe,
                    epi_barrier, is_store_warp, epi_count, problem_mnl, (tm, tn, tl),
                )
            if const_expr(self.overlap):
                self.mainloop.take_first(acc, first, ab_pipe, stage, next_factor)
            if const_expr(self.pingpong):
                # The other warpgroup reuses the same smem rings: let our stores drain first.
                if is_store_warp:
                    store_pipe.producer_tail()
                self._order_arrive(_BAR_EPI_ORDER, 1 - wg_idx)
                read_state.advance(k_tiles)
                load_state.advance(n_epi)
            work += work_step

        if const_expr(not self.pingpong):
            if is_store_warp:
                store_pipe.producer_tail()

    @staticmethod
    def _first_factor(scales, stage):
        """A tile's first k-tile's promotion factor from its stage (None unless block-scaled)."""
        return None if const_expr(scales is None) else scales.factors(0, stage.index)

    @cute.jit
    def _fixup(self, acc, workspace, k_slice, split, tail_slot, tidx, barrier):
        """Split tail: slices 0 .. split - 2 publish their fp32 accumulators; slice split - 1
        (the owner) waits for all of them and adds them, in slice order (deterministic), before
        its epilogue.

        A partial is laid out (accumulator register, thread): a warp's 32 threads touch 32
        consecutive floats per register. (16-byte accesses, (register // 4, thread, register %
        4), measured ~1 % slower on every FP8 shape: they change the mainloop's register
        allocation.) A counter per (tail tile, CTA of the cluster) counts published slices: all
        threads store, a barrier, then one thread's gpu-scope fence and increment; the owner's
        one thread spins on acquire loads, then a barrier lets every thread read."""
        parts, counters = workspace
        regs = cute.size(acc)
        threads = self.epi_threads
        cta = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        ctas = self.cluster_mn[0] * self.cluster_mn[1]
        counter = counters.iterator + (tail_slot * ctas + cta)
        if k_slice < split - 1:
            base = ((tail_slot * split + k_slice) * ctas + cta) * regs * threads + tidx
            for v in cutlass.range(regs, unroll_full=True):
                parts[base + v * threads] = acc[v]
            barrier.arrive_and_wait()
            if tidx == 0:
                cute.arch.fence_acq_rel_gpu()
                cute.arch.atomic_add(counter, Int32(1), sem="relaxed", scope="gpu")
        else:
            if tidx == 0:
                seen = cute.arch.atomic_add(counter, Int32(0), sem="acquire", scope="gpu")
                while seen < split - 1:
                    seen = cute.arch.atomic_add(counter, Int32(0), sem="acquire", scope="gpu")
            barrier.arrive_and_wait()
            for j in cutlass.range(split - 1, unroll=1):
                base = ((tail_slot * split + j) * ctas + cta) * regs * threads + tidx
                for v in cutlass.range(regs, unroll_full=True):
                    acc[v] = acc[v] + parts[base + v * threads]

    def _order_wait(self, base: int, wg):
        cute.arch.barrier(barrier_id=base + wg, number_of_threads=2 * _THREADS_PER_WG)

    def _order_arrive(self, base: int, wg):
        cute.arch.barrier_arrive(barrier_id=base + wg, number_of_threads=2 * _THREADS_PER_WG)
