"""GEMM kernel configurations and their shared-memory budget (pure Python, no DSL import).

A config names everything about a kernel instance that is not a tensor property: the CTA tile,
the schedule, the cluster and the pipeline depth. Dtypes and operand majors come from the call.

Schedules (Hopper):
  * ``cooperative`` - two consumer warpgroups split one ``tile_m x tile_n`` output tile along M.
  * ``pingpong``    - each consumer warpgroup owns a whole ``tile_m x tile_n`` tile; the two
    alternate, so one warpgroup's epilogue runs under the other's mainloop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

SCHEDULES = ("cooperative", "pingpong")
#: cluster shapes (M x N CTAs). A 2x2 cluster multicasts both operands (each CTA's share of a
#: k-tile's L2 reads: a half of A and a half of B, against a half of one of them in 2x1 or 1x2);
#: its four CTAs must sit in one GPC, so fewer SMs may work (``kernels.sm90.gemm.resident_clusters``).
CLUSTERS = ((1, 1), (2, 1), (1, 2), (2, 2))

#: bytes of dynamic shared memory one Hopper CTA may use (227 KiB).
SM90_SMEM_CAPACITY = 232448
#: reserved for mbarriers and alignment padding.
SMEM_RESERVED = 1024
#: accumulator registers a consumer thread can hold next to the epilogue's working set
#: (consumer warpgroups run with 232-240 registers per thread).
MAX_ACC_REGISTERS = 192
#: k-tiles per software-pipelined promotion group (two-level FP8 where three accumulators fit), by
#: form: "row" (row-wise or no scales), "block" (block-scaled, 128 x 128 weight blocks) and "wgrad"
#: (block-scaled, both operands 1 x 128 along K). Pairs, measured on the H200 with cooperative
#: 128x128 tiles, 2x1 cluster, against torch._scaled_mm in the same runs: 0.992 / 0.967 / 1.001 of
#: its throughput at M = 16384 and (N, K) = (4096, 4096) / (4096, 14336) / (6144, 4096), where
#: groups of 8 gave 0.967 / 0.944 / 0.975 and one promotion per k-tile 0.906 / 0.886 / 0.910
#: (groups of 3-16 spilled then). In today's block-scaled kernel groups of 3 and 4 build
#: spill-free. Its forward form at M = 16384, (N, K) = (6144, 4096) / (28672, 4096) /
#: (4096, 14336), in turns (2026-12-03, ``scripts/exp_block_scaled.py``): pairs 1100 / 1100 / 1070
#: TFLOP/s, groups of 3 1106 / 1108 / 1046, groups of 4 1125 / 1143 / 1121 (1.000 / 1.007 / 0.998
#: of torch's block-wise kernel); a second run: pairs 1124 / 1094 / 1092, groups of 4 1167 / 1158 /
#: 1149. Its weight-gradient form (six Llama wgrad shapes, same run): groups of 3 and 4 within
#: -0.8 % .. +1.8 % of pairs, so it keeps pairs. The row-wise kernel keeps pairs: its groups of 4
#: spill 3.5 KB and serialize the WGMMAs (455-515 TFLOP/s against 1227-1309 in pairs).
PROMOTION_GROUP = {"row": 2, "block": 4, "wgrad": 2}
#: rows of one WGMMA atom (``m64nNk``): a warpgroup's accumulator is a stack of such waves
WAVE_ROWS = 64


@dataclass(frozen=True)
class GemmConfig:
    """One point of the kernel config space.

    ``tile_k`` is in elements (64 for 16-bit inputs and 128 for 8-bit inputs are both 128 B rows,
    the widest TMA swizzle). ``stages = 0`` means "as many A/B stages as shared memory allows".
    ``raster_group`` is how many cluster rows (along M) one L2 band holds before the scheduler
    moves along N. ``fp8_fast_accum`` keeps FP8 products in the tensor core's accumulator for
    the whole K loop; otherwise each k-tile's partial sum is promoted into a separate fp32
    accumulator (two-level accumulation, the accurate default). ``split_tail`` (cooperative only)
    cuts the tiles of a nearly empty last round along K over the idle slots
    (``kernels.common.tile_scheduler``). ``poll_full``: the consumers wait for a full A/B stage,
    and the producer for a free one, by polling ``mbarrier.try_wait`` without a suspend-time hint
    (``kernels.sm90.mainloop``); on in the block-scaled forward form's configs
    (``dispatch.block_scaled_config_space``), off in every other config the heuristic picks.
    ``tail_carry`` (cooperative two-level FP8 in groups, :func:`tail_carry_rule`): each tile's
    last promotion group takes its last ``group - 1`` k-tiles and the next tile's first, which it
    issues and leaves in flight through the epilogue, instead of promoting those k-tiles one at a
    time and then issuing the next tile's first alone; the heuristic sets it on the block-scaled
    forward form's picks where K allows under ``coda_cute.epilogue.runner.TAIL_CARRY``.
    """

    tile_m: int = 128
    tile_n: int = 256
    tile_k: int = 64
    schedule: str = "cooperative"
    cluster_m: int = 1
    cluster_n: int = 1
    stages: int = 0
    raster_group: int = 8
    fp8_fast_accum: bool = False
    split_tail: bool = False
    poll_full: bool = False
    tail_carry: bool = False

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if (self.cluster_m, self.cluster_n) not in CLUSTERS:
            raise ValueError(
                f"cluster shape must be 1x1, 2x1, 1x2 or 2x2, got {self.cluster_m}x{self.cluster_n}"
            )
        if self.split_tail and self.cluster_m * self.cluster_n > 2:
            raise ValueError("split_tail needs a cluster of at most 2 CTAs (its slot count assumes "
                             "every SM holds one; how many 4-CTA clusters fit is the driver's answer)")
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 16 in [16, 256], got {self.tile_n}")
        valid_m = (128, 256) if self.schedule == "cooperative" else (64, 128)
        if self.tile_m not in valid_m:
            raise ValueError(f"tile_m for {self.schedule} must be one of {valid_m}, got {self.tile_m}")
        if self.tile_k not in (64, 128):
            raise ValueError(f"tile_k must be 64 or 128, got {self.tile_k}")
        if self.tail_carry and (self.schedule != "cooperative" or self.split_tail):
            raise ValueError("tail_carry needs the cooperative schedule without split_tail (the next "
                             "tile's first k-tile is issued before this one's epilogue)")
        if self.split_tail and self.schedule != "cooperative":
            raise ValueError("split_tail needs the cooperative schedule (a ping-pong warpgroup "
                             "would wait for a partial with the other warpgroup's tile pending)")
        if self.raster_group < 1:
            raise ValueError("raster_group must be >= 1")
        if self.stages == 1 or self.stages < 0:
            # consumers keep one k-tile's stage (two-level: two) while they wait for the next
            raise ValueError(f"stages must be 0 (as many as fit) or at least 2, got {self.stages}")

    # -- derived quantities ------------------------------------------------------------------
    @property
    def wg_tile_m(self) -> int:
        """Rows of the output tile one consumer warpgroup accumulates."""
        return self.tile_m // 2 if self.schedule == "cooperative" else self.tile_m

    @property
    def acc_registers(self) -> int:
        """fp32 accumulator registers per consumer thread."""
        return self.wg_tile_m * self.tile_n // 128

    def cluster_tiles(self, m: int, n: int, batch: int) -> int:
        """Cluster tiles of an (M, N) x batch output: the scheduler's unit of work."""
        clusters_m = _ceil_div(_ceil_div(m, self.tile_m), self.cluster_m)
        clusters_n = _ceil_div(_ceil_div(n, self.tile_n), self.cluster_n)
        return clusters_m * clusters_n * batch

    def slots(self, m: int, n: int, batch: int, sms: int) -> int:
        """Persistent cluster slots of a launch on ``sms`` SMs (the grid's z extent)."""
        return min(self.cluster_tiles(m, n, batch), sms // (self.cluster_m * self.cluster_n))

    def tail(self, m: int, n: int, k: int, batch: int, sms: int) -> tuple[int, int]:
        """:func:`tail_split` of this config's launch: (tail tiles, K slices per tail tile)."""
        if not self.split_tail:
            return 0, 1
        return tail_split(self.cluster_tiles(m, n, batch), self.slots(m, n, batch, sms), _ceil_div(k, self.tile_k))

    @property
    def promotion_waves(self) -> int:
        """How FP8 two-level accumulation's temporary covers a warpgroup's accumulator: 1 where a
        whole second accumulator fits next to it in ``MAX_ACC_REGISTERS``; else, on a cooperative
        tile with several 64-row WGMMA atoms per warpgroup, that number of waves, each k-tile's
        atoms issued one wave at a time into a temporary one atom tall and promoted before the
        next wave (256 x 128: 128 + 64 registers, DeepGEMM's scheme; ping-pong would leave the
        tensor cores idle through each promotion, its other warpgroup being in its epilogue);
        0 where neither fits."""
        acc = self.acc_registers
        if 2 * acc <= MAX_ACC_REGISTERS:
            return 1
        waves = self.wg_tile_m // WAVE_ROWS
        if self.schedule == "cooperative" and waves > 1 and acc + acc // waves <= MAX_ACC_REGISTERS:
            return waves
        return 0

    def check_registers(self, two_level_accumulation: bool) -> None:
        """Reject tiles whose accumulators cannot live in a consumer thread's registers."""
        if two_level_accumulation and not self.promotion_waves:
            raise ValueError(
                f"config {self.name}: FP8 two-level accumulation needs the fp32 accumulator "
                f"({self.acc_registers} registers per thread) and a temporary for a whole one or for "
                f"one {WAVE_ROWS}-row wave of a cooperative tile within the {MAX_ACC_REGISTERS} a "
                f"consumer warpgroup can spare"
            )
        if self.acc_registers > MAX_ACC_REGISTERS:
            raise ValueError(
                f"config {self.name}: the fp32 accumulator needs {self.acc_registers} registers per "
                f"thread, more than the {MAX_ACC_REGISTERS} a consumer warpgroup can spare"
            )

    @property
    def epi_tile(self) -> tuple[int, int]:
        """Epilogue sub-tile (M, N): one row band of WGMMA atoms (64 rows per warpgroup in M)."""
        rows = 128 if self.schedule == "cooperative" else 64
        return (rows, min(32, self.tile_n))

    @property
    def name(self) -> str:
        s = "coop" if self.schedule == "cooperative" else "pp"
        acc = "_fastacc" if self.fp8_fast_accum else ""
        st = f"_s{self.stages}" if self.stages else ""
        tail = "_splittail" if self.split_tail else ""
        poll = "_poll" if self.poll_full else ""
        carry = "_carry" if self.tail_carry else ""
        return (
            f"{s}_{self.tile_m}x{self.tile_n}x{self.tile_k}_c{self.cluster_m}x{self.cluster_n}"
            f"_g{self.raster_group}{st}{acc}{tail}{poll}{carry}"
        )

    def with_(self, **kw) -> "GemmConfig":
        return replace(self, **kw)


def promotion_form(block_scaled: bool, b_rows: bool) -> str:
    """:data:`PROMOTION_GROUP`'s key of a kernel: "wgrad" (block-scaled, B's scales per row),
    "block" (block-scaled) or "row"."""
    return "wgrad" if b_rows else "block" if block_scaled else "row"


def tail_carry_rule(cfg: GemmConfig, k: int | None, fp8: bool, block_scaled: bool, b_rows: bool) -> str | None:
    """Why ``cfg.tail_carry`` cannot run this kernel (``k``: a launch's K, or None at build time),
    or None where it can. It carries in software-pipelined groups only: two-level FP8 (no fast
    accumulation) with three whole accumulators in the registers (a temporary per k-tile in
    flight, one wave), and the block-scaled forward form (the one measured: the weight-gradient
    and row-wise forms are left as they are). The carrying group is the tile's last, so every
    tile's k-tile count must be a multiple of the form's group: K of a whole number of groups of
    ``tile_k``-deep k-tiles."""
    if not cfg.tail_carry:
        return None
    if not (fp8 and not cfg.fp8_fast_accum and block_scaled and not b_rows):
        return "tail_carry is a block-scaled forward-form mode (two-level FP8, 128 x 128 weight blocks)"
    if cfg.promotion_waves != 1 or 3 * cfg.acc_registers > MAX_ACC_REGISTERS:
        return (f"tail_carry needs three whole accumulators of {cfg.name} ({cfg.acc_registers} "
                f"registers each) within the {MAX_ACC_REGISTERS} a consumer thread can spare")
    group = PROMOTION_GROUP[promotion_form(block_scaled, b_rows)]
    if k is not None and _ceil_div(k, cfg.tile_k) % group:
        return (f"tail_carry needs K's k-tiles ({_ceil_div(k, cfg.tile_k)} of {cfg.tile_k} for K = {k}) "
                f"to be a multiple of the promotion group ({group})")
    return None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


#: most K slices a tail tile is cut into
MAX_TAIL_SPLIT = 8
#: what reading one other slice's fp32 tile back costs the owner, in k-tiles of its mainloop:
#: about 3.5 for a 128 x 128 FP8 tile on the H200 (a 16384 x 4096 x 4096 GEMM gained nothing from
#: 8 slices of 4 k-tiles; at K = 14336, 8 slices of 14 gained 2.8 %)
TAIL_PARTIAL_K_TILES = 3.5
#: k-tiles per slice at least: the owner's k_tiles / s + 3.5 (s - 1) is least near
#: s = sqrt(k_tiles / 3.5), about k_tiles / 10 at these K
TAIL_SLICE_K_TILES = 10


def tail_split(cluster_tiles: int, slots: int, k_tiles: int) -> tuple[int, int]:
    """(tail tiles, K slices per tail tile) of a ``split_tail`` launch: the ``cluster_tiles %
    slots`` tiles of the last round, each cut into as many slices as the round has slots for
    (at most ``MAX_TAIL_SPLIT`` and one per ``TAIL_SLICE_K_TILES`` k-tiles); (0, 1) when the
    last round is full. The device scheduler computes the same."""
    rem = cluster_tiles % slots if slots else 0
    if rem == 0:
        return 0, 1
    return rem, max(1, min(slots // rem, MAX_TAIL_SPLIT, k_tiles // TAIL_SLICE_K_TILES))


#: shared-memory bytes of one stage's weight-scale box in the block-scaled FP8 GEMM (16 bytes of
#: scales in a slot that keeps TMA destinations 128-byte aligned)
BLOCK_SCALE_B_SLOT = 128


def block_scale_stage_bytes(cfg: GemmConfig, b_rows: bool) -> int:
    """What one stage of the block-scaled FP8 GEMM holds for its scales
    (``kernels.sm90.block_scales``): the tile's rows of A's, and its columns of B's (``b_rows``)
    or one weight-scale slot."""
    return 4 * cfg.tile_m + (4 * cfg.tile_n if b_rows else BLOCK_SCALE_B_SLOT)


def ab_stage_bytes(cfg: GemmConfig, ab_bytes: int) -> int:
    return (cfg.tile_m + cfg.tile_n) * cfg.tile_k * ab_bytes


def stage_ring_bytes(cfg: GemmConfig, ab_bytes: int, stages: int, stage_extra: int = 0) -> int:
    """The A/B stages' shared memory with their ``stage_extra`` bytes each (block-scaled FP8:
    the scales, held in arrays after A's and B's), up to the next 1024-byte boundary, where the
    epilogue's first buffer starts: an FP8 ping-pong 64 x 64 CTA's 13 stages of scales end 128
    bytes short of one, which once took a launch 32 bytes past the 227 KB limit."""
    return stages * ab_stage_bytes(cfg, ab_bytes) + -(-stages * stage_extra // 1024) * 1024


def smem_bytes(cfg: GemmConfig, ab_bytes: int, epi_bytes: int, stage_extra: int = 0) -> int:
    """Shared memory one CTA allocates for ``cfg`` next to ``epi_bytes`` of epilogue buffers:
    :func:`stage_ring_bytes` of the stages :func:`pipeline_stages` picks, plus ``epi_bytes``,
    plus ``SMEM_RESERVED`` (the mainloop's mbarriers, padded to A's 1024-byte alignment)."""
    stages = pipeline_stages(cfg, ab_bytes, epi_bytes, stage_extra)
    return stage_ring_bytes(cfg, ab_bytes, stages, stage_extra) + epi_bytes + SMEM_RESERVED


def pipeline_stages(cfg: GemmConfig, ab_bytes: int, epi_bytes: int, stage_extra: int = 0) -> int:
    """A/B stages (each with ``stage_extra`` bytes besides) that fit next to ``epi_bytes`` of
    epilogue shared memory."""
    free = SM90_SMEM_CAPACITY - SMEM_RESERVED - epi_bytes
    fit = free // (ab_stage_bytes(cfg, ab_bytes) + stage_extra)
    while fit > 0 and stage_ring_bytes(cfg, ab_bytes, fit, stage_extra) > free:
        fit -= 1
    if cfg.stages:
        if stage_ring_bytes(cfg, ab_bytes, cfg.stages, stage_extra) > free:
            raise ValueError(
                f"config {cfg.name}: {cfg.stages} stages need "
                f"{stage_ring_bytes(cfg, ab_bytes, cfg.stages, stage_extra) + epi_bytes} B of shared memory, "
                f"only {SM90_SMEM_CAPACITY - SMEM_RESERVED} B exist"
            )
        return cfg.stages
    return fit
