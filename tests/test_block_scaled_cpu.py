"""CPU tests of the block-scaled FP8 GEMM kernel (``kernels.sm90.block_scales``): its sm_90a builds
and the configs it refuses. Each k-tile's partial product is promoted with one FFMA per
accumulator register (``acc += sa[m, kb] * sb[nb, kb] * partial``), its scale loads are fp32
global loads issued under the WGMMAs, and the builds neither spill nor serialize their WGMMAs."""

import re

import pytest

from coda_cute.compiler import KernelSpec, compile_gemm, spill_bytes
from coda_cute.kernels.common.config import GemmConfig
from coda_cute.kernels.epilogue.plain import gemm_tree

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


def spec(cfg, a=E4M3, b=E4M3, out="bfloat16"):
    return KernelSpec.of(a, b, "k", "k", cfg, gemm_tree("none", "none", out), block_scaled=True)


@pytest.mark.parametrize("cfg, a, b", [
    (GemmConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=2), E4M3, E4M3),  # fprop
    (GemmConfig(tile_m=128, tile_n=64, tile_k=128), E5M2, E4M3),  # dgrad with E5M2 gradients
    (GemmConfig(tile_m=64, tile_n=128, tile_k=128, schedule="pingpong"), E4M3, E4M3),
], ids=["coop-128x128-c2x1", "coop-128x64-e5m2", "pingpong-64x128"])
def test_block_scaled_kernel_builds(cfg, a, b):
    k = compile_gemm(spec(cfg, a, b), keep_artifacts=True)
    assert spill_bytes(k) == 0 and not k.stats["wgmma_serialized"], k.stats
    ptx = k.ptx
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{cfg.tile_n}k32\.f32\.{a[7:11]}\.{b[7:11]}", ptx)
    # per thread and k-tile: 64 x tile_n / 128 accumulator registers per 64-row atom, one FFMA each
    regs = cfg.tile_m * cfg.tile_n // (128 if cfg.schedule == "pingpong" else 256)
    assert ptx.count("fma.rn.f32") >= regs, ptx.count("fma.rn.f32")
    assert ptx.count("ld.global.b32") >= 3  # a k-tile's row scales and its weight-block scale


def test_block_scaled_name_differs_from_row_scaled():
    cfg = GemmConfig(tile_m=128, tile_n=128, tile_k=128)
    plain = KernelSpec.of(E4M3, E4M3, "k", "k", cfg, gemm_tree("none", "none", "bfloat16"))
    assert spec(cfg) != plain and "blockscaled" in spec(cfg).name and "blockscaled" not in plain.name


@pytest.mark.parametrize("cfg, why", [
    (GemmConfig(tile_m=128, tile_n=128, tile_k=64), "tile_k = 128"),
    (GemmConfig(tile_m=128, tile_n=256, tile_k=128), "tile_n dividing 128"),
    (GemmConfig(tile_m=128, tile_n=128, tile_k=128, fp8_fast_accum=True), "two-level"),
    (GemmConfig(tile_m=128, tile_n=128, tile_k=128, split_tail=True), "split_tail"),
])
def test_block_scaled_refuses_configs_it_cannot_scale(cfg, why):
    with pytest.raises(ValueError, match=why):
        compile_gemm(spec(cfg))
