"""Per-architecture kernel selection: which kernel family runs on a device, and which config.

``arch_of(device)`` maps a CUDA device to the compile target (``sm_90a`` for Hopper). The config
heuristic is a fixed, fast function of the problem shape and dtype; it never times anything on the
call path. ``config_space()`` lists every config the report compiles and the tuner may try.
"""

from __future__ import annotations

import functools

from .kernels.common.config import MAX_ACC_REGISTERS, GemmConfig

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
            "Move them with .cuda() (or use coda_cute.reference for a CPU result)."
        )
    cap, _, name = _device_props(device.index if device.index is not None else _current_device())
    if cap == (9, 0):
        return "sm_90a"
    if cap[0] == 10:
        raise NotImplementedError(f"{name} (sm_{cap[0]}{cap[1]}): {_BLACKWELL_MSG}")
    raise NotImplementedError(
        f"{name} is sm_{cap[0]}{cap[1]}; coda_cute GEMMs need a Hopper GPU (sm_90)."
    )


def num_sms(device) -> int:
    return _device_props(device.index if device.index is not None else _current_device())[1]


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
    (128, 128, "cooperative", 1, 1),
    (128, 128, "pingpong", 1, 1),
    (128, 128, "pingpong", 2, 1),
    (128, 192, "pingpong", 1, 2),  # 16-bit only: FP8 scale math spills next to 192 acc regs
    (64, 128, "pingpong", 1, 1),
    (64, 192, "pingpong", 1, 1),
    (64, 256, "pingpong", 1, 1),
)


def config_space(fp8: bool) -> list[GemmConfig]:
    """Every config the kernels are built and checked with (report, CI compile tests, tuner).

    FP8 configs use 128-element k-tiles. Each FP8 tile comes with two-level accumulation where
    the doubled accumulator fits the registers, and with fast accumulation always.
    """
    out = []
    for tm, tn, sched, cm, cn in _BASE_CONFIGS:
        cfg = GemmConfig(tm, tn, 128 if fp8 else 64, sched, cm, cn)
        if not fp8:
            out.append(cfg)
            continue
        if cfg.acc_registers > 128:
            continue
        if 2 * cfg.acc_registers <= MAX_ACC_REGISTERS:
            out.append(cfg)
        out.append(cfg.with_(fp8_fast_accum=True))
    return out


def select_config(m: int, n: int, k: int, batch: int, fp8: bool, fast_accum: bool, sms: int) -> GemmConfig:
    """Pick a config from the problem shape alone (no timing on the call path).

    Large problems take the biggest tile that keeps every SM busy, clustered for TMA multicast;
    small-M problems (decode-like, M <= 256) take 64-row ping-pong tiles so more CTAs share the
    weight read; when the tile count cannot fill the GPU, smaller tiles trade reuse for SMs.
    """
    kt = 128 if fp8 else 64
    two_level = fp8 and not fast_accum
    tiles = lambda tm, tn: -(-m // tm) * -(-n // tn) * batch  # noqa: E731
    if m <= 64:
        return GemmConfig(64, 128, kt, "pingpong", 1, 1, fp8_fast_accum=fast_accum)
    if two_level:
        if tiles(128, 192) >= sms:
            return GemmConfig(128, 192, kt, "cooperative", 2, 1)
        return GemmConfig(64, 192, kt, "pingpong", 1, 1)
    if tiles(128, 256) >= 2 * sms:
        return GemmConfig(128, 256, kt, "cooperative", 2, 1, fp8_fast_accum=fast_accum)
    if tiles(128, 128) >= sms:
        return GemmConfig(128, 128, kt, "pingpong", 1, 1, fp8_fast_accum=fast_accum)
    return GemmConfig(64, 128, kt, "pingpong", 1, 1, fp8_fast_accum=fast_accum)
