"""Per-architecture kernel selection: which implementation runs on a device, and which config.

``arch_of(device)`` maps a CUDA device to the compile target (``sm_90a`` for Hopper); CPU tensors
run the torch references only inside :func:`reference_on_cpu` (``reference_on_cpu_enabled``,
``require_reference``). The config heuristic is a fixed, fast function of the problem shape,
dtype and card (``card_of(device)``: whose measured rates apply, the H200's unless the device is
an H100); it never times anything on the call path. ``config_space()`` lists every config the
report compiles and the tuner may try.
"""

from __future__ import annotations

import contextlib
import functools

from .kernels.common.config import TAIL_PARTIAL_K_TILES, GemmConfig

_BLACKWELL_MSG = (
    "coda_cute has no Blackwell (sm_100) GEMM yet; the tcgen05 kernels arrive in a later release. "
    "Run on a Hopper GPU (sm_90) for now."
)


@functools.lru_cache(maxsize=None)
def _device_props(index: int):
    import torch

    p = torch.cuda.get_device_properties(index)
    return (p.major, p.minor), p.multi_processor_count, p.name


def arch_of(device) -> str:
    """Compile target for a tensor's device; raises for devices without a coda_cute GEMM."""
    if device.type != "cuda":
        raise ValueError(
            f"coda_cute GEMMs run on CUDA tensors; got tensors on {device.type!r}. "
            "Move them with .cuda(), or run the call inside coda_cute.reference_on_cpu() for "
            "the torch reference on CPU tensors."
        )
    cap, _, name = _device_props(device.index if device.index is not None else _current_device())
    if cap == (9, 0):
        return "sm_90a"
    if cap[0] == 10:
        raise NotImplementedError(f"{name} (sm_{cap[0]}{cap[1]}): {_BLACKWELL_MSG}")
    raise NotImplementedError(
        f"{name} is sm_{cap[0]}{cap[1]}; coda_cute GEMMs need a Hopper GPU (sm_90)."
    )


_reference_on_cpu = [False]


def reference_on_cpu_enabled() -> bool:
    """Whether coda ops given CPU tensors compute their torch reference (else they raise)."""
    return _reference_on_cpu[0]


@contextlib.contextmanager
def reference_on_cpu():
    """Within this block, coda ops given CPU tensors compute their fp32 torch reference instead
    of raising (for tests, opcheck and debugging without a GPU)."""
    prev = _reference_on_cpu[0]
    _reference_on_cpu[0] = True
    try:
        yield
    finally:
        _reference_on_cpu[0] = prev


def require_reference(op: str) -> None:
    """The CPU implementation's gate: CPU tensors outside :func:`reference_on_cpu` raise."""
    if not reference_on_cpu_enabled():
        raise ValueError(f"{op} runs on CUDA tensors (Hopper, sm_90); got CPU tensors. Move them "
                         "with .cuda(), or wrap the call in coda_cute.reference_on_cpu() to use the "
                         "torch reference.")


def num_sms(device) -> int:
    return _device_props(device.index if device.index is not None else _current_device())[1]


def num_sms_or_default(device, default: int = 132) -> int:
    """SM count of ``device``; ``default`` (an H100/H200's) for fake CUDA tensors on a machine
    without a GPU, where shapes must still be derived (fake implementations, tracing)."""
    try:
        return num_sms(device)
    except (AssertionError, RuntimeError):
        return default


#: The card every rates table below was measured on, and the one a device whose name names no
#: other card (or whose properties cannot be read: fake tensors without a GPU) takes.
DEFAULT_CARD = "h200"
#: Card names as ``card_of`` gives them, by the marks in the device's name that select them: the
#: H100 and H800 (GH100 with HBM3, 3.35 TB/s against the H200's 4.8 TB/s).
_CARD_MARKS = {"h100": ("H100", "H800")}


def card_of(device) -> str:
    """Which card's measurements the config heuristic uses for ``device`` (``PINGPONG_16_SCALE``):
    "h100" where the device's name marks an H100 or H800, else :data:`DEFAULT_CARD`, also for CPU
    and for fake CUDA tensors on a machine without a GPU (where no launch follows: tracing on a
    GPU machine reads that GPU's name, as the launch will)."""
    if getattr(device, "type", device) != "cuda":
        return DEFAULT_CARD
    try:
        name = _device_props(device.index if getattr(device, "index", None) is not None else _current_device())[2]
    except (AssertionError, RuntimeError):
        return DEFAULT_CARD
    return next((card for card, marks in _CARD_MARKS.items() if any(m in name for m in marks)), DEFAULT_CARD)


def _current_device() -> int:
    import torch

    return torch.cuda.current_device()


# -- config space ------------------------------------------------------------------------------
_BASE_CONFIGS = (
    # (tile_m, tile_n, schedule, cluster_m, cluster_n)
    (128, 256, "cooperative", 1, 1),
    (128, 256, "cooperative", 2, 1),
    (128, 256, "cooperative", 1, 2),
    (256, 128, "cooperative", 2, 1),
    (128, 192, "cooperative", 2, 1),
    (128, 160, "cooperative", 2, 1),
    (128, 128, "cooperative", 1, 1),
    (128, 128, "cooperative", 2, 1),
    (128, 128, "pingpong", 1, 1),
    (128, 128, "pingpong", 2, 1),
    (128, 192, "pingpong", 1, 2),  # 16-bit only: FP8 scale math spills next to 192 acc regs
    (64, 64, "pingpong", 1, 1),
    (64, 64, "pingpong", 2, 1),  # small M: the two M tiles share B through multicast
    (64, 128, "pingpong", 1, 1),
    (64, 128, "pingpong", 2, 1),
    (64, 192, "pingpong", 1, 1),
    (64, 256, "pingpong", 1, 1),
)


def config_space(fp8: bool) -> list[GemmConfig]:
    """Every config the kernels are built and checked with (report, CI compile tests, tuner).

    FP8 configs use 128-element k-tiles. Each FP8 tile comes with two-level accumulation where
    its temporary fits the registers next to the accumulator (``GemmConfig.promotion_waves``: a
    whole second accumulator, or one 64-row wave of cooperative 256 x 128), and with fast
    accumulation always. Cooperative
    two-level configs split a nearly empty last round's tiles along K (``split_tail``): their
    long k-loops gain most from it (16384 x 4096 x 14336: 0.968 -> 0.996 of _scaled_mm).
    """
    out = []
    for tm, tn, sched, cm, cn in _BASE_CONFIGS:
        cfg = GemmConfig(tm, tn, 128 if fp8 else 64, sched, cm, cn)
        if not fp8:
            out.append(cfg)
            continue
        if cfg.acc_registers > 128:
            continue
        if cfg.promotion_waves:
            out.append(cfg.with_(split_tail=sched == "cooperative"))
        out.append(cfg.with_(fp8_fast_accum=True))
    return out


def block_scaled_config_space(wgrad_form: bool = False) -> list[GemmConfig]:
    """The FP8 configs the block-scaled kernel can scale (``kernels.sm90.block_scales``): two-level
    accumulation, one 128-deep k-tile per scale block, N-tiles inside one 128-column weight block,
    no split tail (whose K slices the promotion does not index).

    The forward form (not ``wgrad_form``) polls its stage barriers (``GemmConfig.poll_full``): the
    pipeline's own wait sleeps between polls, where ncu put 9 % of this kernel's stall samples
    (H100, 2026-12-06). Polling, at the 8B shapes 16384 x 6144 / 28672 / 4096 x 4096 / 4096 /
    14336, in turns on three H100s: +3.5 / +0.9 / +2.5 %, +2.7 / +0.9 / +3.3 % and +3.7 / +1.1 /
    +2.5 % (``exp_block_scaled.py --poll``), the output bit for bit the same. The weight-gradient
    form measured -2.4 to +4.3 % over six shapes (``--wgrad --poll``), so it sleeps."""
    return [c.with_(split_tail=False, poll_full=not wgrad_form) for c in config_space(True)
            if not c.fp8_fast_accum and 128 % c.tile_n == 0]


def _at_cap(fitted: dict, cool: dict, pp_cool: float) -> dict:
    """A rates table: the configs fitted at the cap, and the others' cool rates scaled by
    ping-pong 128 x 128 2x1's ratio, its fitted rate over its cool one (``pp_cool``)."""
    ratio = fitted[("pingpong", 128, 128, 2, 1)] / pp_cool
    return {**{key: rate * ratio for key, rate in cool.items()}, **fitted}


# 16-bit rates are sustained throughput at the H200's 700 W power cap, where a training step
# runs (``coda_cute.sol.energy``): TFLOP/s of each config's mainloop when it runs back to back,
# fitted over every distinct GEMM of the 1b and 8b training steps (``scripts/exp_energy_tiles.py``,
# 2026-12-04; 15 + 15 shapes, both model widths, all three layouts) together with
# ``COOP_EPILOGUE_K`` (``exp_energy_tiles.py --fit``). The fit's error is 2.4 % rms; fitted on
# either step alone, it picks the other step's configs within 0.2 % of the best measured one's
# sum. At the cap a config's speed
# follows its joules per FLOP: cooperative 128 x 256 2x1 reads the fewest shared-memory and L2
# bytes per FLOP and is 8 % faster there than ping-pong 128 x 128 2x1, which is 2-5 % faster
# from a cool GPU (its two warpgroups overlap the epilogue and draw more power while there is
# headroom). Configs the fit did not cover keep their cool sweep rate (bench_gemm.py --sweep,
# 2026-11-30) times ping-pong 128 x 128 2x1's ratio, cap over cool (683 / 712).
# Key: (schedule, tile_m, tile_n, cluster_m, cluster_n).
_RATES_16 = _at_cap({
    ("cooperative", 128, 256, 2, 1): 736, ("cooperative", 128, 192, 2, 1): 729,
    ("cooperative", 256, 128, 2, 1): 722, ("cooperative", 128, 256, 1, 2): 721,
    ("pingpong", 128, 128, 2, 1): 683,
}, {
    ("cooperative", 128, 256, 1, 1): 650, ("cooperative", 128, 160, 2, 1): 630,
    ("cooperative", 128, 128, 2, 1): 640, ("cooperative", 128, 128, 1, 1): 530,
    ("pingpong", 128, 128, 1, 1): 520, ("pingpong", 128, 192, 1, 2): 655,
    ("pingpong", 64, 256, 1, 1): 360, ("pingpong", 64, 192, 1, 1): 340,
    ("pingpong", 64, 128, 1, 1): 330, ("pingpong", 64, 64, 1, 1): 315,
    # M = 128 sweep: 1.15x (64x128) and 1.02-1.03x (64x64) their 1x1 cluster's time
    ("pingpong", 64, 128, 2, 1): 378, ("pingpong", 64, 64, 2, 1): 322,
}, pp_cool=712)
#: The k-loop length (elements of K) a cooperative 16-bit tile's epilogue costs: its warpgroups
#: store the tile after their mainloop with the tensor cores idle, where ping-pong's other
#: warpgroup covers it. Fitted with ``_RATES_16``: it is why ping-pong still wins at K = 2048
#: (the 1b step's forward GEMMs) while cooperative 128 x 256 wins from K = 4096 on.
COOP_EPILOGUE_K = 175
# FP8 (128-element k-tiles): medians over the same six large shapes, bench_gemm.py --dtype fp8
# --sweep --shapes large, 2026-11-30 (two-level: k-tiles promoted in software-pipelined pairs
# where three accumulators fit; cooperative WGMMA descriptors in uniform registers).
_RATES_FP8 = {
    ("cooperative", 128, 128, 2, 1): 1204, ("cooperative", 128, 192, 2, 1): 1160,
    ("cooperative", 128, 128, 1, 1): 1093, ("cooperative", 128, 160, 2, 1): 1077,
    ("pingpong", 64, 128, 2, 1): 817, ("pingpong", 64, 128, 1, 1): 765,
    ("pingpong", 64, 192, 1, 1): 686, ("pingpong", 64, 64, 2, 1): 611,
    ("pingpong", 64, 64, 1, 1): 587,
    # two-level in 64-row waves (``GemmConfig.promotion_waves``): 0.912 of the picks (median over
    # the FP8 MLP's six GEMMs, row-wise and block-scaled, in turns; scripts/exp_wave_promotion.py,
    # 2026-12-05): a wave's promotion waits on its own WGMMAs, so it is never picked here
    ("cooperative", 256, 128, 2, 1): 1097,
}
# The block-scaled kernel's weight-gradient form (both operands 1 x 128 blocks along the tokens,
# fp32 out): medians over six Llama wgrad shapes (6144, 28672, 4096 x 4096 / 14336 and the 1B-like
# 3072, 16384, 2048 x 2048 / 8192, over 16384 tokens), scripts/exp_block_scaled.py --wgrad,
# 2026-12-02, in turns: the 1x1 cluster beat the 2x1 on every shape (by 1.2-1.9 %), unlike the
# forward form. Configs not timed in this form take their forward rate times the measured
# cooperative 128 x 128 2x1 ratio (845 / 1204).
_RATES_FP8_WGRAD = {
    ("cooperative", 128, 128, 1, 1): 860, ("cooperative", 128, 128, 2, 1): 845,
    ("pingpong", 64, 128, 2, 1): 610, ("pingpong", 64, 128, 1, 1): 589,
    # in 64-row waves: 1.030-1.033 of the 1x1 pick on the 8B MLP's two weight gradients
    # (exp_wave_promotion.py, 2026-12-05; the block MLP forward + backward 0.971 of its time).
    # Checked on the six shapes above (exp_block_scaled.py --wgrad): with this rate the pick is
    # the fastest config on each, in waves on five (1.006-1.029 of the 1x1), not on 3072 x 2048
    ("cooperative", 256, 128, 2, 1): 887,
}
_WGRAD_UNTIMED_SCALE = 845 / 1204
# FP8 with fast accumulation (the row-wise recipe's GEMMs): sustained throughput at the power cap,
# fitted like ``_RATES_16`` over the 1b and 8b steps' 21 distinct FP8 GEMMs outside the LM head
# (``scripts/exp_energy_tiles.py --fp8``, 2026-12-04, against ``_scaled_mm(use_fast_accum=True)``)
# with ``COOP_EPILOGUE_K_FP8_FAST``: 2.1 % rms; fitted on either step alone, it picks the other's
# configs within 0.03 % (8b -> 1b) and 1.3 % (1b -> 8b) of the best measured sum. As at 16 bits,
# cooperative 128 x 256 2x1 leads at the cap (ping-pong 128 x 128 2x1 led from cool, 1317 against
# 1245). Cooperative 128 x 192 2x1, measured in a second run (2026-12-04, the same 21 shapes, the
# six configs fitted together: 1382 against cooperative 128 x 256 2x1's 1417), takes that ratio
# to the first run's 1432; its cool rate had put it 13 % below that. It moves no pick of the 8b
# step; at 1b the QKV weight gradient (3072 x 2048 x 16384: two whole rounds of 128 x 192 tiles)
# leaves ping-pong for it, which costs that launch 0.8 % (measured 1.019x ``_scaled_mm``'s joules
# against ping-pong's 1.011x: within the model's 2.5 % rms, not tuned away per shape), as do the
# untimed weight gradients of a d 3072 model (5120 x 3072, from cooperative 128 x 256). Over both
# steps the picks spend 0.8 % more than the least-joule config per shape. Configs no fit covered
# keep their cool rate (bench_gemm.py --dtype fp8 --sweep
# --fast-accum, 2026-12-03) times ping-pong 128 x 128 2x1's ratio, cap over cool (1327 / 1317).
_RATES_FP8_FAST = _at_cap({
    ("cooperative", 128, 256, 2, 1): 1432, ("cooperative", 256, 128, 2, 1): 1405,
    ("cooperative", 128, 256, 1, 2): 1404, ("cooperative", 128, 192, 2, 1): 1397,
    ("cooperative", 128, 128, 2, 1): 1348, ("pingpong", 128, 128, 2, 1): 1327,
}, {
    ("cooperative", 128, 256, 1, 1): 1241,
    ("pingpong", 128, 128, 1, 1): 1194, ("cooperative", 128, 160, 2, 1): 1155,
    ("cooperative", 128, 128, 1, 1): 1154, ("pingpong", 64, 128, 2, 1): 1071,
    ("pingpong", 64, 256, 1, 1): 869, ("pingpong", 64, 192, 1, 1): 800,
    ("pingpong", 64, 128, 1, 1): 731, ("pingpong", 64, 64, 2, 1): 706,
    ("pingpong", 64, 64, 1, 1): 583,
}, pp_cool=1317)
#: ``COOP_EPILOGUE_K`` of the FP8 fast-accumulation kernels, fitted with ``_RATES_FP8_FAST``: about
#: twice the 16-bit depth, the epilogue taking as long while the k-loop runs twice as fast. It puts
#: the K = 4096 GEMMs on ping-pong and the weight gradients and long dgrads on cooperative 128 x 256.
COOP_EPILOGUE_K_FP8_FAST = 375


#: A card's 16-bit ping-pong rates relative to the H200's, cooperative rates held (``card_of``).
#: On an H100 at the power cap, ping-pong 128 x 128 2x1 falls further behind cooperative 128 x 256
#: 2x1 than on the H200 (``scripts/exp_energy_tiles.py --fused``, 2026-12-06, the 8b step's 19
#: bf16 launches with their trees on three tiles, back to back): fitted rates 585 against 762
#: TFLOP/s (H200 683 / 736), so 0.77 of it against 0.93: 0.83. It loses most where K or the
#: output is large (plain 28672 x 4096 x 16384: 1.53x cooperative's time; 16384 x 6144 x 4096
#: from cool it is 0.92x, at the cap 1.03-1.05x). With it, the picks of the 8b step came within
#: 0.12 % of the least time measured per launch among the three tiles (the H200's rates: 5.2 %
#: over); on the 1b and 3b steps, not fitted on, within 0.31 % and 0.87 % (4.6 % and 5.8 %). The
#: FP8 fast-accumulation picks already came within 0.43 % on the H100 (the 8b step's 14 FP8
#: launches): they keep their rates. Every 16-bit ping-pong config takes the factor; only 128 x
#: 128 2x1 was measured (the small ones serve small M, where the cooperative tiles leave SMs idle).
PINGPONG_16_SCALE = {"h100": 0.83}


def _rate(cfg: GemmConfig, fp8: bool, wgrad_form: bool = False, card: str = DEFAULT_CARD) -> float:
    key = (cfg.schedule, cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n)
    if fp8 and wgrad_form:
        return _RATES_FP8_WGRAD.get(key, _RATES_FP8.get(key, 0.0) * _WGRAD_UNTIMED_SCALE)
    if fp8:
        return (_RATES_FP8_FAST if cfg.fp8_fast_accum else _RATES_FP8).get(key, 0.0)
    scale = PINGPONG_16_SCALE.get(card, 1.0) if cfg.schedule == "pingpong" else 1.0
    return _RATES_16.get(key, 0.0) * scale


#: 16-bit operands (A + B, bytes) past which a config's rate scales with its L2 intensity
#: (:func:`l2_intensity`). Measured on an H200, 2026-12-02 (``scripts/exp_large_gemms.py``, in
#: turns with cuBLAS): on gate/up dgrad 32768 x 8192 x 57344 and wgrad 57344 x 8192 x 32768 (4.3-4.7
#: GB of operands) ping-pong 128 x 128 2x1 ran at 0.74-0.77 of cuBLAS, cooperative 128 x 256 2x1
#: at 1.04-1.08 and ping-pong 128 x 128 1x1 at 0.55; at the same (M, N) with K = 8192 (under 2 GB)
#: the three ran at 1.00-1.05, 1.02-1.04 and 0.57 of cuBLAS (the 1x1 rate is in the table).
LARGE_OPERAND_BYTES = 2 << 30


def l2_intensity(cfg: GemmConfig) -> float:
    """Output elements per operand element a CTA loads per k-step, multicast counted once per
    cluster: tile_m tile_n / (tile_m / cluster_n + tile_n / cluster_m)."""
    return cfg.tile_m * cfg.tile_n / (cfg.tile_m / cfg.cluster_n + cfg.tile_n / cfg.cluster_m)


def _large_operands(m: int, n: int, k: int, batch: int, fp8: bool) -> bool:
    """Problems whose rate follows the tiles' L2 intensity: 16-bit (the FP8 tables were not
    measured there), both M and N past one wave of big tiles (thin problems stream one operand
    once whatever the tile)."""
    return not fp8 and min(m, n) >= 1024 and 2 * batch * k * (m + n) > LARGE_OPERAND_BYTES


def predicted_time(cfg: GemmConfig, m: int, n: int, k: int, batch: int, sms: int, fp8: bool,
                   wgrad_form: bool = False, card: str = DEFAULT_CARD) -> float:
    """Wave-quantization model of a config's run time (arbitrary units); ``wgrad_form``: the
    block-scaled kernel's weight-gradient form (its own rates); ``card``: whose rates
    (:func:`card_of`).

    Every CTA runs its tiles back to back at the config's measured full-GPU rate, so the time is
    the busiest CTA's tile count x the tile's work / the per-SM rate; a cooperative tile's work is
    K + :func:`coop_epilogue_k` deep (its exposed epilogue). Partial tiles at the edges
    cost as much as full ones; a cluster slot processes a whole cluster tile. On operands past
    ``LARGE_OPERAND_BYTES`` the rate is scaled by the config's L2 intensity over the densest
    config's (the measured ratios there follow it).
    """
    rate = _rate(cfg, fp8, wgrad_form, card)
    if _large_operands(m, n, k, batch, fp8):
        rate *= l2_intensity(cfg) / max(l2_intensity(c) for c in config_space(False))
    tiles_m, tiles_n = -(-m // cfg.tile_m), -(-n // cfg.tile_n)
    if rate <= 0 or tiles_m < cfg.cluster_m or tiles_n < cfg.cluster_n:
        # A cluster wider than the problem leaves its extra CTAs on out-of-bounds tiles.
        return float("inf")
    per_cta = -(-cfg.cluster_tiles(m, n, batch) // cfg.slots(m, n, batch, sms))
    _, split = cfg.tail(m, n, k, batch, sms)
    if split > 1:  # the last round: one slice and the owner's read-back of the others
        per_cta += 1 / split + TAIL_PARTIAL_K_TILES * (split - 1) / -(-k // cfg.tile_k) - 1
    return per_cta * cfg.tile_m * cfg.tile_n * (k + coop_epilogue_k(cfg, fp8)) * sms / rate


def coop_epilogue_k(cfg: GemmConfig, fp8: bool) -> int:
    """The k-loop length a tile's exposed epilogue costs: ``COOP_EPILOGUE_K`` (16-bit) or
    ``COOP_EPILOGUE_K_FP8_FAST`` on cooperative configs; 0 on ping-pong (the other warpgroup's
    mainloop covers it) and on the promoted FP8 kernels (their rates were measured from cool,
    one GEMM at a time, the epilogue inside them)."""
    if cfg.schedule != "cooperative":
        return 0
    if not fp8:
        return COOP_EPILOGUE_K
    return COOP_EPILOGUE_K_FP8_FAST if cfg.fp8_fast_accum else 0


def select_config(m: int, n: int, k: int, batch: int, fp8: bool, fast_accum: bool, sms: int,
                  card: str = DEFAULT_CARD) -> GemmConfig:
    """The config with the least predicted time (:func:`predicted_time`); no timing on the call
    path. Large problems land on the fastest big tiles; small or oddly sized ones trade tile
    efficiency for fewer idle SMs in the last wave."""
    candidates = [c for c in config_space(fp8) if not fp8 or c.fp8_fast_accum == fast_accum]
    return min(candidates, key=lambda c: predicted_time(c, m, n, k, batch, sms, fp8, card=card))
