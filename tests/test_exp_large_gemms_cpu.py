"""CPU checks of scripts/exp_large_gemms.py's FP8 mode: its six GEMMs are the FP8 MLP's
(``bench_fp8.mlp_gemms``) and every variant around a pick is another valid FP8 fast-accumulation
config that builds for sm_90a without spills."""

import re

import pytest

from coda_cute import dispatch
from coda_cute.artifacts import scan_ptx
from helpers import load_script


@pytest.fixture(scope="module")
def exp():
    return load_script("exp_large_gemms")


def test_fp8_cases_are_the_mlps_gemms(exp):
    bench = load_script("bench_fp8")
    want = sorted((m, n, k) for m, k, n, _ in bench.mlp_gemms(16384, 4096, 14336))
    assert sorted((m, n, k) for _, m, n, k in exp.FP8_CASES) == want


@pytest.mark.parametrize("label, m, n, k", [("gate_up.fwd", 16384, 28672, 4096), ("down.dgrad", 16384, 14336, 4096)])
def test_fp8_variants_differ_from_the_pick(exp, label, m, n, k):
    pick = dispatch.select_config(m, n, k, 1, True, True, 132)
    variants = exp.fp8_variants(pick)
    assert variants.pop(f"ours {pick.name}") is None
    configs = list(variants.values())
    assert configs and len(set(configs)) == len(configs) and pick not in configs
    assert all(c.fp8_fast_accum for c in configs)
    assert {(c.cluster_m, c.cluster_n) for c in configs} >= {(1, 2), (1, 1), (2, 2)} - {(pick.cluster_m, pick.cluster_n)}


def test_fp8_variants_build_without_spills(exp):
    """Each variant's row-scaled FP8 kernel (the GEMM the experiment times) for sm_90a: E4M3
    WGMMA in the PTX, no spills, no serialized WGMMAs."""
    from coda_cute.compiler import GemmSpec, compile_gemm

    pick = dispatch.select_config(16384, 28672, 4096, 1, True, True, 132)
    for cfg in [pick] + [c for c in exp.fp8_variants(pick).values() if c is not None]:
        k = compile_gemm(GemmSpec("float8_e4m3fn", "float8_e4m3fn", "bfloat16", "k", "k", cfg,
                                  scale_a="row", scale_b="row"), keep_artifacts=True)
        stats = k.stats
        assert stats["spill_stores"] == stats["spill_loads"] == 0 and not stats["wgmma_serialized"], (cfg.name, stats)
        assert "wgmma.mma_async.sync.aligned.m64n" in k.ptx and ".e4m3.e4m3" in k.ptx, cfg.name


def test_wide_ping_pong_sub_tiles_build(monkeypatch):
    """The experiment's 64-column ping-pong sub-tiles (``PINGPONG_WIDE_SUB_TILES``) on the gate/up
    forward's pick: a 64 x 64 sub-tile with the same six A/B stages and two store buffers, half
    the TMA stores of 64 x 32 in the PTX, no spills; and the switch off, the default's 64 x 32."""
    from coda_cute.compiler import GemmSpec, compile_gemm
    from coda_cute.kernels.common.config import pipeline_stages
    from coda_cute.kernels.epilogue.plain import gemm_tree
    from coda_cute.kernels.sm90 import epilogue as EPI

    pick = dispatch.select_config(16384, 28672, 4096, 1, True, True, 132)
    assert pick.schedule == "pingpong"
    tree = gemm_tree("row", "row", "bfloat16")
    spec = GemmSpec("float8_e4m3fn", "float8_e4m3fn", "bfloat16", "k", "k", pick, scale_a="row", scale_b="row")
    stores = {}
    for wide in (False, True):
        monkeypatch.setattr(EPI, "PINGPONG_WIDE_SUB_TILES", wide)
        epi = EPI.Sm90TreeEpilogue(tree, pick, 1)
        assert epi.epi_tile == ((64, 64) if wide else (64, 32)) and epi.stages == 2
        assert pipeline_stages(pick, 1, epi.smem_bytes()) == 6
        k = compile_gemm(spec, keep_artifacts=True)  # compiled afresh: compile_gemm keeps no cache
        assert k.stats["spill_stores"] == k.stats["spill_loads"] == 0 and not k.stats["wgmma_serialized"], k.stats
        stores[wide] = len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", k.ptx))
    assert stores[False] == 2 * stores[True] > 0, stores


def test_two_by_two_cluster_multicasts_both_operands():
    """The 2x2 variant of the gate/up forward's pick: A and B TMA loads both multicast (one
    multicast load each, where 2x1 multicasts B alone), the same six A/B stages, no spills."""
    from coda_cute.compiler import GemmSpec, compile_gemm

    pick = dispatch.select_config(16384, 28672, 4096, 1, True, True, 132)
    loads = {}
    for cm, cn in ((2, 1), (2, 2)):
        cfg = pick.with_(cluster_m=cm, cluster_n=cn)
        k = compile_gemm(GemmSpec("float8_e4m3fn", "float8_e4m3fn", "bfloat16", "k", "k", cfg,
                                  scale_a="row", scale_b="row"), keep_artifacts=True)
        assert k.stats["spill_stores"] == k.stats["spill_loads"] == 0 and not k.stats["wgmma_serialized"], k.stats
        loads[cm, cn] = scan_ptx(k.ptx).multicast_loads
    assert loads == {(2, 1): 1, (2, 2): 2}, loads


def test_resident_clusters_without_a_gpu():
    """Slots of a persistent launch: every SM for 1- and 2-CTA clusters; for 4-CTA clusters the
    driver's count where a GPU answers, else (a CPU compile) a quarter of the SMs."""
    from coda_cute.kernels.sm90.gemm import resident_clusters

    assert [resident_clusters(132, s) for s in (1, 2)] == [132, 66]
    import torch

    if torch.cuda.is_available():  # a GPC holds whole clusters only: some SMs may stay idle
        assert 0 < resident_clusters(torch.cuda.get_device_properties(0).multi_processor_count, 4) <= 33
    else:
        assert resident_clusters(132, 4) == 33
