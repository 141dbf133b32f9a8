"""Hopper mainloop: the TMA producer warp and the consumers' WGMMA k-loop.

Roles:
  * ``produce`` runs on one producer warp: for every tile the scheduler hands this CTA it streams
    the A/B k-tiles into the shared-memory ring (``PipelineTmaAsync``), multicasting A along the
    cluster's N extent and B along its M extent.
  * ``Sm90Mainloop.run`` runs on a consumer warpgroup: it waits for each stage, issues the k-tile's
    WGMMAs into fp32 registers and releases stages as the tensor cores finish with them.

Accumulation modes:
  * single-level (16-bit inputs, FP8 ``fp8_fast_accum``): WGMMAs accumulate in place for the whole
    K loop; one k-tile of WGMMAs stays in flight while the next is issued.
  * two-level (FP8 default): every k-tile's products go to a temporary that is then added into
    the fp32 accumulator (the tensor core's FP8 accumulation keeps too few mantissa bits for long
    K). Where three accumulators fit the registers (``paired``), k-tiles go in groups of
    ``kernels.common.config.PROMOTION_GROUP[form]``: each is issued into its own temporary before
    the previous one is promoted, so only the group's last promotion waits for the tensor cores.
    Otherwise each promotion waits for its k-tile. A finished k-tile's stage goes back to the
    producer before its promotion wherever that reads nothing more from it (:func:`_retire`).
    The temporaries are created inside the loop body: a WGMMA result carried across loop
    iterations becomes a register copy that ptxas answers by serializing every WGMMA of the
    kernel. The cooperative schedule staggers its two warpgroups by half a k-tile so one's
    WGMMAs cover the other's promotion, and issues each tile's first k-tile before the previous
    tile's epilogue (``issue_first`` / ``take_first``; with ``GemmConfig.tail_carry``, as the
    last k-tile of the previous tile's last group).
    Rolling the two temporaries across loop iterations instead of pairing k-tiles (never
    draining a warpgroup's WGMMAs) compiles without serialization when nothing is in flight at
    loop entry, but measured 0.3 % slower than pairs on the H200.
  * two-level in waves (cooperative 256 x 128, ``waves`` > 1): a second whole accumulator does
    not fit next to the 128-register one, so each k-tile is issued one 64-row wave (WGMMA atom)
    at a time into a temporary one wave tall, which is promoted into its rows of the accumulator
    before the next wave is issued. A warpgroup's tensor-core work then stops at every
    promotion; the other warpgroup's wave runs meanwhile (the stagger offsets them by a wave).
    Nothing is in flight across the epilogue (no ``issue_first``: its temporary would not fit).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup


#: free a two-level k-tile's stage before its promotion where that reads nothing from the stage
#: (:func:`_retire`): the producer refills it one promotion sooner. Off (an experiment's switch:
#: ``scripts/exp_block_scaled.py --around late-release``), after it, as until 2026-12-07, when the
#: block-scaled forward form measured +1.7 / +0.9 / +0.2 % with it at 16384 x 6144 / 28672 / 4096 x
#: 4096 / 4096 / 14336 (an H100, in turns: 1191 / 1175 / 1152 TFLOP/s against torch's block-wise
#: kernel's 1179 / 1173 / 1131; starting both warpgroups together instead of :class:`Stagger`'s
#: half a k-tile apart measured -2.0 / -0.8 / +0.3 % in the same run, not kept).
RELEASE_BEFORE_PROMOTION = True


@cute.jit
def _poll(bar, phase):
    """Poll ``mbarrier.try_wait`` on ``bar`` until ``phase`` completes, without a suspend-time hint."""
    done = cute.arch.mbarrier_try_wait(bar, phase)
    while not done:
        done = cute.arch.mbarrier_try_wait(bar, phase)


@cute.jit
def wait_full(ab_pipe, state, poll: cutlass.Constexpr = False):
    """Wait until the A/B stage ``state`` is full. The pipeline's wait passes ``mbarrier.try_wait``
    a 10 ms suspend-time hint, which ptxas lowers to a sleep (``NANOSLEEP.SYNCS``) between polls;
    ncu (H100, 2026-12-06) put 9 % of the block-scaled GEMM's stall samples on those sleeps in its
    consumers (and 4 % in its producer's wait for a free stage), where torch's kernel showed none
    in its k-loop. ``poll`` (``GemmConfig.poll_full``, the block-scaled forward form's): poll instead."""
    if const_expr(poll):
        _poll(ab_pipe.producer_get_barrier(state), state.phase)  # the stage's full barrier
    else:
        ab_pipe.consumer_wait(state)


@cute.jit
def acquire_empty(ab_pipe, state, poll: cutlass.Constexpr = False):
    """The producer's ``producer_acquire`` of stage ``state``: wait until it is free (``poll``: by
    polling, :func:`wait_full`), then arm its full barrier with the stage's transaction bytes."""
    if const_expr(poll):
        _poll(ab_pipe.consumer_get_barrier(state), state.phase)  # the stage's empty barrier
        ab_pipe.producer_acquire(state, cutlass.Boolean(True))  # waited already: arm only
    else:
        ab_pipe.producer_acquire(state)


@cute.jit
def produce(tma_a, tma_b, sA, sB, gA, gB, ab_pipe, sched, stages: cutlass.Constexpr,
            cluster_mn: cutlass.Constexpr, cta_layout_mnk, cluster_coord, extra_stage: cutlass.Constexpr,
            scale_loads=None, poll: cutlass.Constexpr = False):
    """TMA warp: stream the A/B k-tiles of every scheduled tile into the smem ring.
    ``extra_stage``: after the last tile, load its first k-tile once more, for consumers that
    issue each next tile's first k-tile before their epilogue (``Sm90Mainloop.issue_first``).
    ``scale_loads`` (block-scaled FP8): each stage's scales too (``block_scales.ScaleLoads``).
    ``poll``: wait for free stages by polling (``GemmConfig.poll_full``, :func:`acquire_empty`)."""
    a_mask = None
    b_mask = None
    if const_expr(cluster_mn[1] > 1):
        a_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=1)
    if const_expr(cluster_mn[0] > 1):
        b_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)
    tAsA, tAgA = cpasync.tma_partition(
        tma_a, cluster_coord[1], cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape),
        cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2),
    )
    tBsB, tBgB = cpasync.tma_partition(
        tma_b, cluster_coord[0], cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape),
        cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2),
    )
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    work = sched.first
    while sched.is_valid(work):
        tm, tn, tl = sched.coord(work)
        k0, k_count, _, _, _ = sched.slice(work)  # a K slice of a split tail tile, or all of K
        for k in cutlass.range(k0, k0 + k_count, unroll=1):
            _load_stage(tma_a, tma_b, tAsA, tAgA, tBsB, tBgB, ab_pipe, state, (tm, tn, tl, k), a_mask, b_mask,
                        scale_loads, poll)
            state.advance()
        work += sched.stride
    if const_expr(extra_stage):
        # every slot has at least one work item (the grid has at most one per tile)
        last = work - sched.stride
        tm, tn, tl = sched.coord(last)
        k0, _, _, _, _ = sched.slice(last)
        _load_stage(tma_a, tma_b, tAsA, tAgA, tBsB, tBgB, ab_pipe, state, (tm, tn, tl, k0), a_mask, b_mask,
                    scale_loads, poll)
        state.advance()
    ab_pipe.producer_tail(state)


@cute.jit
def _load_stage(tma_a, tma_b, tAsA, tAgA, tBsB, tBgB, ab_pipe, state, coord, a_mask, b_mask, scale_loads=None,
                poll: cutlass.Constexpr = False):
    """One k-tile of A and B (and its scales) into the ring stage ``state`` (after it is free)."""
    tm, tn, tl, k = coord
    acquire_empty(ab_pipe, state, poll)
    bar = ab_pipe.producer_get_barrier(state)
    cute.copy(tma_a, tAgA[(None, tm, k, tl)], tAsA[(None, state.index)], tma_bar_ptr=bar, mcast_mask=a_mask)
    cute.copy(tma_b, tBgB[(None, tn, k, tl)], tBsB[(None, state.index)], tma_bar_ptr=bar, mcast_mask=b_mask)
    if const_expr(scale_loads is not None):
        scale_loads.load(coord, state.index, bar)
    ab_pipe.producer_commit(state)


class Sm90Mainloop:
    """Consumer side of the mainloop for one warpgroup (or one warpgroup's share of a tile)."""

    def __init__(self, a_dtype, b_dtype, a_major_mode, b_major_mode, atom_layout_mnk, tile_mnk,
                 two_level: bool, paired: bool = False, group: int = 2, waves: int = 1, poll: bool = False,
                 carry: bool = False):
        self.a_dtype, self.b_dtype = a_dtype, b_dtype
        self.a_major_mode, self.b_major_mode = a_major_mode, b_major_mode
        self.atom_layout_mnk = atom_layout_mnk
        self.tile_mnk = tile_mnk
        self.two_level = two_level
        self.paired = paired
        self.group = group
        self.waves = waves
        self.poll = poll  # GemmConfig.poll_full
        self.carry = carry  # GemmConfig.tail_carry (its rule: config.tail_carry_rule)

    def tiled_mma(self, tile_n: int):
        return sm90_utils.make_trivial_tiled_mma(
            self.a_dtype, self.b_dtype, self.a_major_mode, self.b_major_mode, cutlass.Float32,
            self.atom_layout_mnk, tiler_mn=(64, tile_n),
        )

    @cute.jit
    def fragments(self, tiled_mma, sA, sB, tidx):
        """(thr_mma, (A, B) operand fragments, accumulator, two-level temporary or None; in
        waves, a temporary one atom (64 rows) tall, whose layout :meth:`run` copies)."""
        thr_mma = tiled_mma.get_slice(tidx)
        acc_shape = thr_mma.partition_shape_C(self.tile_mnk[:2])
        acc = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
        tmp = None
        if const_expr(self.two_level):
            tmp = cute.make_rmem_tensor(acc_shape if const_expr(self.waves == 1) else (acc_shape[0], 1, 1),
                                        cutlass.Float32)
        # The smem operand descriptors depend on the thread only through its warpgroup: sliced by
        # a warp-uniform index they live in uniform registers, computed on the uniform datapath,
        # instead of being rebuilt from the thread index in vector registers every k-tile.
        thr_ab = tiled_mma.get_slice(cute.arch.make_warp_uniform(tidx // 128 * 128))
        frags = (tiled_mma.make_fragment_A(thr_ab.partition_A(sA)),
                 tiled_mma.make_fragment_B(thr_ab.partition_B(sB)))
        return thr_mma, frags, acc, tmp

    @cute.jit
    def _issue(self, op, target, frags, stage, accumulate, wave=None):
        """One k-tile of WGMMAs from smem stage ``stage`` into ``target`` as one commit group;
        ``wave``: only that 64-row atom of the warpgroup's rows (``target`` one atom tall; an
        atom spans the tile's N, so B's fragment has one)."""
        tCrA, tCrB = frags
        # A fresh atom per issue: its ACCUMULATE flag is per-k-tile state.
        atom = cute.make_mma_atom(op)
        atom.set(warpgroup.Field.ACCUMULATE, accumulate)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            if const_expr(wave is None):
                cute.gemm(atom, target, tCrA[(None, None, kb, stage)], tCrB[(None, None, kb, stage)], target)
            else:
                # (V, 1) x (V, 1) => (V, 1, 1): the wave's atom as an M mode of one
                cute.gemm(atom, target, cute.append_ones(tCrA[(None, wave, kb, stage)], up_to_rank=2),
                          tCrB[(None, None, kb, stage)], target)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def run(self, tiled_mma, frags, acc, tmp, ab_pipe, read_state, k_tiles, on_last_issue, stagger,
            preloaded: cutlass.Constexpr = False, scale=None):
        """``k_tiles`` k-tiles of one output tile. ``on_last_issue()`` runs once the last WGMMAs
        are issued, before waiting for them (ping-pong cues the other warpgroup there; the
        epilogue starts its per-tile loads). ``stagger`` (two-level cooperative only) offsets the
        two warpgroups. ``preloaded`` (two-level): ``acc`` already holds the tile's first k-tile
        (:meth:`issue_first`, :meth:`take_first`) and ``k_tiles`` are the ones after it.
        ``scale`` (two-level, block-scaled FP8): ``scale(k, stage)`` gives k-tile k's promotion
        factors, laid out like the accumulator, from its smem stage (``kernels.sm90.block_scales``):
        acc += factor * tmp. Returns (advanced read state, on_last_issue's result), and where it
        :meth:`carries`, the next tile's first k-tile in flight as a third value."""
        extra = None
        if const_expr(not self.two_level):
            release_state = read_state.clone()
            for k in cutlass.range(k_tiles, unroll=1):
                wait_full(ab_pipe, read_state, self.poll)
                self._issue(tiled_mma.op, acc, frags, read_state.index, k > 0)
                # Keep this k-tile in flight; the previous k-tile's stage is now free.
                warpgroup.wait_group(1)
                if k > 0:
                    ab_pipe.consumer_release(release_state)
                    release_state.advance()
                read_state.advance()
            extra = on_last_issue()
            warpgroup.wait_group(0)
            ab_pipe.consumer_release(release_state)
        else:
            if const_expr(not preloaded):
                acc.fill(0.0)
            if const_expr(stagger is not None):
                stagger.wait_turn()
            if const_expr(self.waves > 1):
                read_state = self._in_waves(tiled_mma.op, frags, acc, tmp, ab_pipe, read_state, k_tiles,
                                            stagger, scale)
            elif const_expr(self.carries(preloaded)):
                read_state, carried = self._whole(tiled_mma.op, frags, acc, tmp, ab_pipe, read_state, k_tiles,
                                                  stagger, scale, preloaded)
            else:
                read_state = self._whole(tiled_mma.op, frags, acc, tmp, ab_pipe, read_state, k_tiles,
                                         stagger, scale, preloaded)
            if const_expr(stagger is not None and (preloaded or self.waves > 1)):
                if k_tiles == 0:  # nothing issued: the other warpgroup must not wait for it
                    stagger.pass_turn()
            if const_expr(self.carries(preloaded)):
                return read_state, on_last_issue(), carried
            extra = on_last_issue()
        return read_state, extra

    def carries(self, preloaded) -> bool:
        """Whether :meth:`run` issues the next tile's first k-tile itself (``GemmConfig.tail_carry``)
        and returns it as a third value, (the temporary, its stage's state) for :meth:`take_first`."""
        return bool(self.carry and preloaded and self.paired and self.two_level and self.waves == 1)

    @cute.jit
    def _whole(self, op, frags, acc, tmp, ab_pipe, read_state, k_tiles, stagger, scale,
               preloaded: cutlass.Constexpr):
        """``k_tiles`` k-tiles, each into a temporary as large as ``acc``: in software-pipelined
        groups (``paired``), then one promotion per k-tile. Returns the advanced read state.

        The k-tiles past the last whole group (3 at every 8B shape of the block-scaled forward
        form: 31 or 111 follow the one issued before the epilogue) are promoted one at a time:
        a group of their own, as a second group site before or after the loop, under a branch
        or in a loop of 0 or 1 trips, spilled 2.2-3.0 KB in every build with a 64-register
        accumulator (cooperative 128 x 128, ping-pong 64 x 128; 2026-12-07); as the last trip of
        the one group body, its issues and promotions guarded at run time, it made ptxas
        serialize every WGMMA (and spill 5.4 KB). What does build (``GemmConfig.tail_carry``,
        :meth:`carries`; K of whole groups): the last group takes the last ``group - 1`` k-tiles
        and the next tile's first, issued and left in flight, so one group site serves every
        group and no promotion waits alone. Returns (read state, (that k-tile's temporary, its
        stage's state)) then."""
        release_state = read_state.clone()
        singles = k_tiles
        first_k = Int32(1 if preloaded else 0)  # the tile's k-tile index of run's first one
        if const_expr(self.carries(preloaded)):
            groups = (k_tiles - (self.group - 1)) // self.group
            for j in cutlass.range(groups, unroll=1):
                read_state, release_state = self._group(
                    op, frags, acc, tmp, ab_pipe, read_state, release_state,
                    self.group, j * self.group, stagger, scale, first_k)
            read_state, release_state, carried = self._group(
                op, frags, acc, tmp, ab_pipe, read_state, release_state,
                self.group, groups * self.group, stagger, scale, first_k, carry=True)
            return read_state, carried
        if const_expr(self.paired):
            groups = k_tiles // self.group
            for j in cutlass.range(groups, unroll=1):
                read_state, release_state = self._group(
                    op, frags, acc, tmp, ab_pipe, read_state, release_state,
                    self.group, j * self.group, stagger, scale, first_k)
            singles = k_tiles - groups * self.group
            first_k = first_k + groups * self.group
        for k in cutlass.range(singles, unroll=1):
            wait_full(ab_pipe, read_state, self.poll)
            self._issue(op, tmp, frags, read_state.index, False)
            factor = None
            if const_expr(scale is not None):
                factor = scale(first_k + k, read_state.index)  # read under the WGMMAs
            read_state.advance()
            if const_expr(stagger is not None):
                # once per tile, after its first issue (a grouped loop has passed it already)
                if k == 0 and (k_tiles < self.group or not self.paired):
                    stagger.pass_turn()
            warpgroup.wait_group(0)
            _retire(acc, tmp, factor, ab_pipe, release_state)
            release_state.advance()
        return read_state

    @cute.jit
    def _in_waves(self, op, frags, acc, tmp, ab_pipe, read_state, k_tiles, stagger, scale):
        """``k_tiles`` k-tiles, each issued one wave at a time into a temporary shaped like
        ``tmp`` (created here, in the loop body: see the module docstring) and promoted into the
        wave's rows of ``acc`` before the next wave; the stage is released after the last
        wave's promotion. Returns the advanced read state."""
        for k in cutlass.range(k_tiles, unroll=1):
            wait_full(ab_pipe, read_state, self.poll)
            factor = None
            for w in cutlass.range_constexpr(self.waves):
                part = cute.make_rmem_tensor(tmp.layout, cutlass.Float32)
                self._issue(op, part, frags, read_state.index, False, w)
                if const_expr(scale is not None):
                    # read under the wave's WGMMAs; the B part once per k-tile, shared by its waves
                    factor = scale(k, read_state.index, w, factor)
                if const_expr(w == 0):
                    if const_expr(stagger is not None):
                        if k == 0:  # once per tile: the other warpgroup's first wave may start
                            stagger.pass_turn()
                warpgroup.wait_group(0)
                rows = acc[(None, w, 0)]
                _promote(rows, cute.make_tensor(part.iterator, rows.layout), factor)  # part seen as those rows
            # after the last promotion, whatever a factor may still read from the stage (a
            # release before it once let the producer refill column scales under their reads)
            ab_pipe.consumer_release(read_state)
            read_state.advance()
        return read_state

    @cute.jit
    def issue_first(self, op, frags, acc, ab_pipe, read_state):
        """Issue one k-tile (a tile's first) into a fresh temporary, without waiting for it:
        the cooperative two-level schedule issues the next tile's first k-tile before its
        epilogue, so the tensor cores have work while both warpgroups store. Returns (the
        temporary, the stage's state for :meth:`take_first`, the advanced read state). Two
        k-tiles issued so (more of the epilogue covered) spilled 1.6 KB across the whole k-loop
        of cooperative 128 x 128: two temporaries live across the epilogue (2026-12-07)."""
        first = cute.make_rmem_tensor(acc.layout, cutlass.Float32)
        stage = read_state.clone()
        wait_full(ab_pipe, read_state, self.poll)
        self._issue(op, first, frags, read_state.index, False)
        read_state.advance()
        return first, stage, read_state

    @cute.jit
    def take_first(self, acc, first, ab_pipe, stage, factor=None):
        """``acc = first`` (block-scaled: ``factor * first``) once its WGMMAs are done; frees
        its stage (before the copy where :func:`_retire` would)."""
        warpgroup.wait_group(0)
        early = _frees_early(factor)
        if const_expr(early):
            ab_pipe.consumer_release(stage)
        if const_expr(factor is None):
            acc.store(first.load())
        else:
            acc.store(factor.scaled(first))
        if const_expr(not early):
            ab_pipe.consumer_release(stage)

    @cute.jit
    def _group(self, op, frags, acc, tmp, ab_pipe, read_state, release_state, n: cutlass.Constexpr,
               k0, stagger, scale=None, first_k=None, carry: cutlass.Constexpr = False):
        """k-tiles k0 .. k0 + n - 1, software-pipelined: k-tile i + 1 is issued into its own
        temporary before k-tile i is promoted, so only the last promotion waits for the tensor
        cores to drain. Two temporaries are live at a time; all are created here, in the loop
        body (see the module docstring). Returns the advanced (read, release) states; with
        ``carry`` the last k-tile is the next tile's first, issued and neither waited for nor
        promoted, and (its temporary, its stage's state) comes third."""
        temps, factors = [], []
        carried_stage = None
        for i in cutlass.range_constexpr(n):
            temps.append(cute.make_rmem_tensor(tmp.layout, cutlass.Float32))
            if const_expr(carry and i == n - 1):
                carried_stage = read_state.clone()
            wait_full(ab_pipe, read_state, self.poll)
            self._issue(op, temps[i], frags, read_state.index, False)
            factors.append(scale(first_k + k0 + i, read_state.index)
                           if const_expr(scale is not None and not (carry and i == n - 1)) else None)
            read_state.advance()
            if const_expr(stagger is not None and i == 0):
                if k0 == 0:
                    stagger.pass_turn()
            if const_expr(i > 0):
                warpgroup.wait_group(1)
                _retire(acc, temps[i - 1], factors[i - 1], ab_pipe, release_state)
                release_state.advance()
        if const_expr(carry):
            # the next tile's first k-tile: in flight through the epilogue, taken by take_first
            return read_state, release_state, (temps[n - 1], carried_stage)
        warpgroup.wait_group(0)
        _retire(acc, temps[n - 1], factors[n - 1], ab_pipe, release_state)
        release_state.advance()
        return read_state, release_state


def _frees_early(factor) -> bool:
    """Whether a finished k-tile's stage is freed before its promotion (:func:`_retire`)."""
    return RELEASE_BEFORE_PROMOTION and not (factor is not None and factor.reads_stage)


@cute.jit
def _retire(acc, tmp, factor, ab_pipe, release_state):
    """Promote a k-tile whose WGMMAs are done and free its stage: the stage first where the
    promotion reads nothing from it (no factor, or one already in registers), so the producer
    refills it one promotion sooner; after the promotion where the factor still reads the stage
    (the weight-gradient form's column scales, ``block_scales.OuterFactor``)."""
    if const_expr(_frees_early(factor)):
        ab_pipe.consumer_release(release_state)
        _promote(acc, tmp, factor)
    else:
        _promote(acc, tmp, factor)
        ab_pipe.consumer_release(release_state)


@cute.jit
def _promote(acc, tmp, factor):
    """acc += tmp (block-scaled FP8: acc += factor * tmp, one FFMA per register)."""
    if const_expr(factor is None):
        acc.store(acc.load() + tmp.load())
    else:
        acc.store(acc.load() + factor.scaled(tmp))


class Stagger:
    """Starts warpgroup 1's tile half a k-tile after warpgroup 0's (named barrier handshake)."""

    def __init__(self, barrier_id: int, wg_idx):
        self.barrier_id = barrier_id
        self.wg_idx = cutlass.Int32(wg_idx)

    # Carried through dynamic loops by its MLIR value.
    def __extract_mlir_values__(self):
        return [self.wg_idx.ir_value()]

    def __new_from_mlir_values__(self, values):
        return Stagger(self.barrier_id, values[0])

    @cute.jit
    def wait_turn(self):
        if self.wg_idx == 1:
            cute.arch.barrier(barrier_id=self.barrier_id, number_of_threads=256)

    @cute.jit
    def pass_turn(self):
        if self.wg_idx == 0:
            cute.arch.barrier_arrive(barrier_id=self.barrier_id, number_of_threads=256)
