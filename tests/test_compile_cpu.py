"""CPU (CI) compile tests: every kernel config builds for sm_90a with the intended instructions.

Every spec of ``coda-cute report`` (bf16 K-major over ``config_space(False)``, fp8 e4m3 with
row-wise scales over ``config_space(True)``, the bf16 training layouts) is compiled once per
process through ``report.inspect_kernel`` (cached), then checked: PTX target, WGMMA shape and
types, TMA loads and stores, multicast exactly when the cluster has 2 CTAs, the matching SASS
opcodes (when nvdisasm is installed), and no register spills. Plus the config rules and the errors
for configs or archs the kernels do not support.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from coda_cute import cli, dispatch, report, report_elementwise
from coda_cute.artifacts import find_nvdisasm, scan_ptx, scan_sass
from coda_cute.compiler import GemmSpec, KernelSpec, compile_gemm, parse_ptxas_remarks
from coda_cute.epilogue.runner import tree_smem_bytes
from coda_cute.kernels.epilogue.plain import gemm_tree
from coda_cute.kernels.common.config import (
    SM90_SMEM_CAPACITY, GemmConfig, pipeline_stages, smem_bytes,
)

SPECS = report.kernel_specs("all")
IDS = [f"{fam}-{s.a_major}{s.b_major}-{s.config.name}" if fam != "coda" else s.label for fam, s in SPECS]
needs_nvdisasm = pytest.mark.skipif(find_nvdisasm() is None, reason="nvdisasm not installed")

_PTX_TYPE = {"bfloat16": "bf16", "float8_e4m3fn": "e4m3"}


def mma_shape(spec):
    """(N, K, fp8) of the WGMMA each spec must issue: one instruction spans the tile's N; K spans
    32 bytes."""
    fp8 = spec.a_dtype.startswith("float8")
    return spec.config.tile_n, 32 if fp8 else 16, fp8


def built(spec):
    return report.inspect_kernel(spec)


def test_spec_list_covers_the_config_spaces():
    fams = [f for f, _ in SPECS]
    assert fams.count("bf16") == len(dispatch.config_space(False))
    assert fams.count("fp8") == len(dispatch.config_space(True))
    assert sorted(s.a_major + s.b_major for f, s in SPECS if f == "training") == ["kn", "mk", "mn"]
    assert all(s.scale_a == s.scale_b == "row" for f, s in SPECS if f == "fp8")
    assert all(s.arch == "sm_90a" for _, s in SPECS)
    assert [s.label for f, s in SPECS if f == "coda"] == [
        "residual_gemm_norm_stats", "norm_swiglu", "norm_rope_qkv", "norm_rope_qkv_qk_norm",
        "norm_proj", "lm_head_ce", "lm_head_ce_train.logits", "lm_head_ce_backward.dlogits",
        "swiglu_backward", "norm_backward.gate_up", "norm_backward.qkv", "norm_backward.lm_head",
        "lm_head_ce_train.dgrad", "lm_head_ce_train.dw"]
    # the backward GEMMs run in the layouts their operands arrive in: dgrad B n-major, wgrad A m-major
    # the picks an H100 makes differently (dispatch.card_of): the computing trees at K = d on
    # cooperative 128 x 256 and the exp form's logits on cooperative 128 x 128 (its fixed tile
    # width), each with the same tree and majors as its H200 build
    coda = {s.label: s for f, s in SPECS if f == "coda"}
    h100 = {s.label: s for f, s in SPECS if f == "coda_h100"}
    assert {"norm_swiglu", "norm_rope_qkv", "norm_backward.qkv", "lm_head_ce_train.logits"} <= set(h100) <= set(coda)
    assert h100["lm_head_ce_train.logits"].config.tile_n == coda["lm_head_ce_train.logits"].config.tile_n
    assert all(s.config != coda[lb].config and s.config.schedule == "cooperative" and s.tree is coda[lb].tree
               and s.a_major + s.b_major == coda[lb].a_major + coda[lb].b_major for lb, s in h100.items())
    majors = {s.label: s.a_major + s.b_major for f, s in SPECS if f == "coda"}
    assert majors["swiglu_backward"] == majors["norm_backward.qkv"] == "kn"
    assert majors["lm_head_ce_train.dw"] == "mn"
    fp8 = {s.label: s for f, s in SPECS if f == "coda_fp8"}
    assert all(s.block_scaled and s.a_major + s.b_major == "kk" and s.a_dtype == "float8_e4m3fn"
               for s in fp8.values())
    assert [label for label, s in fp8.items() if s.b_rows] == ["fp8.wgrad.gate_up", "fp8.lm_head.dw"]
    row = {s.label: s for f, s in SPECS if f == "coda_fp8_row"}
    assert list(row) == ["fp8_row.norm_swiglu", "fp8_row.residual.down", "fp8_row.norm_rope_qkv", "fp8_row.residual.o",
                         "fp8_row.swiglu_backward", "fp8_row.norm_backward.gate_up", "fp8_row.dgrad.o"]
    assert all(not s.block_scaled and s.a_major + s.b_major == "kk" and s.a_dtype == "float8_e4m3fn"
               and {"scale_a", "scale_b"} <= set(s.tree.input_order()) and not s.config.fp8_fast_accum
               for s in row.values())
    fast = {s.label: s for f, s in SPECS if f == "coda_fp8_row_fast"}
    assert list(fast) == [label.replace("fp8_row.", "fp8_row_fast.") for label in row]
    assert all(s.config.fp8_fast_accum and s.tree is row[label.replace("_fast", "")].tree for label, s in fast.items())


def stores(spec) -> bool:
    """Whether the kernel writes an output tile (every plain GEMM; a fused op unless it only reduces)."""
    tree = spec.kernel_spec.tree if isinstance(spec, GemmSpec) else spec.tree
    return any(o.kind == "store" for o in tree.outputs)


@pytest.mark.parametrize("fam,spec", SPECS, ids=IDS)
def test_ptx_instructions(fam, spec):
    kernel, _, _ = built(spec)
    ptx = kernel.ptx
    assert ".target sm_90a" in ptx
    n, k, _ = mma_shape(spec)
    t = _PTX_TYPE[spec.a_dtype]
    want = f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{t}.{t}"
    assert want in ptx
    assert ptx.count("wgmma.mma_async") == ptx.count(want), "WGMMAs of another shape or type"
    census = scan_ptx(ptx)
    assert census.tma_loads >= 2, "A and B TMA loads (cp.async.bulk.tensor ... .global)"
    # TMA store of D (cp.async.bulk.tensor.*.global.shared::cta) exactly when a tile is stored
    assert (census.tma_stores >= 1) == stores(spec)


@pytest.mark.parametrize("fam,spec", SPECS, ids=IDS)
def test_multicast_iff_cluster(fam, spec):
    kernel, _, sass = built(spec)
    clustered = spec.config.cluster_m * spec.config.cluster_n > 1
    assert (".multicast::cluster" in kernel.ptx) == clustered
    if sass is not None:
        assert (sass.multicast_loads > 0) == clustered


@needs_nvdisasm
@pytest.mark.parametrize("fam,spec", SPECS, ids=IDS)
def test_sass_instructions(fam, spec):
    _, _, sass = built(spec)
    n, k, fp8 = mma_shape(spec)
    want = f"QGMMA.64x{n}x{k}.F32.E4M3.E4M3" if fp8 else f"HGMMA.64x{n}x{k}.F32.BF16"
    assert sass.gmma == (want,)
    assert sass.tma_loads >= 2
    assert (sass.tma_stores >= 1) == stores(spec)
    assert sass.vector_descriptors == 0


@pytest.mark.parametrize("fam,spec", SPECS, ids=IDS)
def test_no_spills(fam, spec):
    kernel, _, _ = built(spec)
    stats = kernel.stats
    assert stats["registers"] <= 255
    assert stats["spill_stores"] == 0 and stats["spill_loads"] == 0, stats
    assert not stats["wgmma_serialized"], stats


def test_serialized_wgmma_warning_is_recognized():
    text = ("ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are "
            "serialized due to non wgmma instructions reading accumulator registers\n"
            "ptxas info    : Used 168 registers, used 8 barriers\n"
            "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
    assert parse_ptxas_remarks(text) == {"registers": 168, "spill_stores": 0, "spill_loads": 0,
                                         "stack_frame": 0, "wgmma_serialized": True}
    assert not parse_ptxas_remarks(text.split("\n", 1)[1])["wgmma_serialized"]


def test_compiles_collect_ptxas_stats_without_tracking_source_locations():
    """ptxas statistics need remarks, which would also turn on the DSL's per-op source locations
    (a Python stack walk per traced op, ~40 % of a compile); the compiler keeps them off."""
    from cutlass._mlir_helpers import op as dsl_op

    from coda_cute.elementwise import ScaleColumnsSpec, compile_elementwise

    kernel = compile_elementwise(ScaleColumnsSpec("bfloat16"))
    assert "registers" in kernel.stats  # the remarks arrived
    assert dsl_op._ENABLE_FRAME_FILTERING is False  # left as the last compile set it


def test_default_configs_have_the_documented_instructions():
    """The spellings CI relies on, written out for the two default large-problem kernels."""
    bf16 = report.default_config(False)
    # 8192^3 on 132 SMs: 128 x 192 tiles fill the last wave better than 128 x 256 ones
    assert (bf16.tile_m, bf16.tile_n, bf16.schedule) == (128, 192, "cooperative")
    spec = GemmSpec("bfloat16", "bfloat16", "bfloat16", "k", "k", bf16)
    kernel, _, sass = built(spec)
    assert "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16" in kernel.ptx
    fast = GemmConfig(128, 256, 128, "cooperative", 2, 1, fp8_fast_accum=True)
    spec8 = GemmSpec("float8_e4m3fn", "float8_e4m3fn", "bfloat16", "k", "k", fast, "row", "row")
    kernel8, _, sass8 = built(spec8)
    assert "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3" in kernel8.ptx
    if sass is not None:
        assert sass.gmma == ("HGMMA.64x192x16.F32.BF16",)
        assert sass8.gmma == ("QGMMA.64x256x32.F32.E4M3.E4M3",)


# -- the plain GEMMs of the training step's backward, on the configs the heuristic picks there ----
#: The configs ``choose_config`` picks for the step's plain bf16 GEMMs (132 SMs; llama3-1b and -8b
#: at 16384 tokens): cooperative 128x256 (every wgrad of 8b and most of 1b, the o-proj dgrad of
#: 8b), cooperative 128x192 (1b's QKV wgrad) and ping-pong 128x128 (1b's o-proj dgrad).
STEP_CONFIGS = [GemmConfig(128, 256, 64, "cooperative", 2, 1), GemmConfig(128, 192, 64, "cooperative", 2, 1),
                GemmConfig(128, 128, 64, "pingpong", 2, 1)]
#: dgrad dY @ W (B n-major) and wgrad dY^T @ X (A m-major)
STEP_LAYOUTS = {"dgrad": ("k", "n"), "wgrad": ("m", "n")}


def step_plain_gemms(model: str, tokens: int):
    """(layout, (M, N, K)) of every plain GEMM of one block's backward (``ops.attention``,
    ``ops.mlp``, ``ops.qkv``: the fused trees' GEMMs aside): the o-proj dgrad and the four wgrads."""
    from coda_cute.sol.shapes import LLAMA3

    c = LLAMA3[model]
    n_qkv, hd = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.n_heads * c.head_dim
    return [("kn", (tokens, hd, c.d)), ("mn", (n_qkv, c.d, tokens)), ("mn", (c.d, hd, tokens)),
            ("mn", (2 * c.ffn, c.d, tokens)), ("mn", (c.d, c.ffn, tokens))]


def test_step_configs_are_the_ones_the_training_step_picks():
    """Every (layout, config) the heuristic picks for the step's plain GEMMs is compiled below; a
    retuned heuristic that picks another one fails here until it is added to STEP_CONFIGS."""
    from coda_cute.epilogue.runner import choose_config
    from coda_cute.sol.shapes import DEFAULT_TOKENS

    tree = gemm_tree("none", "none", "bfloat16")
    picked = {(layout, choose_config(tree, *mnk, 1, False, False, 132))
              for model in ("llama3-1b", "llama3-8b") for layout, mnk in step_plain_gemms(model, DEFAULT_TOKENS)}
    compiled = {("".join(lay), cfg) for lay in STEP_LAYOUTS.values() for cfg in STEP_CONFIGS}
    assert picked <= compiled, sorted((lay, c.name) for lay, c in picked - compiled)


@pytest.mark.parametrize("cfg", STEP_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("layout", list(STEP_LAYOUTS))
def test_step_plain_gemm_builds(layout, cfg):
    """The plain bf16 dgrad / wgrad GEMM on a step config: sm_90a, WGMMA of the tile's width
    reading A and B in the layout's majors (PTX imm-trans-a / imm-trans-b: 1 for an M-major A /
    N-major B), TMA loads multicast across the 2x1 cluster, a TMA store of D, no spills and no
    serialized WGMMAs."""
    a_major, b_major = STEP_LAYOUTS[layout]
    spec = GemmSpec("bfloat16", "bfloat16", "bfloat16", a_major, b_major, cfg)
    kernel, census, sass = built(spec)
    ptx = kernel.ptx
    assert census.target == "sm_90a"
    want = f"wgmma.mma_async.sync.aligned.m64n{cfg.tile_n}k16.f32.bf16.bf16"
    assert census.wgmma == (f"m64n{cfg.tile_n}k16.f32.bf16.bf16",) and want in ptx
    trans = set(re.findall(r"wgmma\.mma_async\.[^;]*,\s*(\d),\s*(\d);", ptx))
    assert trans == {(str(int(a_major == "m")), str(int(b_major == "n")))}, trans
    assert census.tma_loads >= 2 and census.tma_stores >= 1 and census.multicast_loads >= 1, census
    stats = kernel.stats
    assert stats["registers"] <= 255 and stats["spill_stores"] == stats["spill_loads"] == 0, stats
    assert not stats["wgmma_serialized"], stats
    if sass is not None:
        assert sass.gmma == (f"HGMMA.64x{cfg.tile_n}x16.F32.BF16",)
        assert sass.tma_loads >= 2 and sass.tma_stores >= 1 and sass.multicast_loads >= 1, sass


# -- census regexes on hand-written lines -------------------------------------------------------
def test_scan_ptx_directions():
    ptx = """
    .target sm_90a
    wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, p, 1, 1, 0, 1;
    cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster.L2::cache_hint [%r1], [%rd3, {%r2, %r3, %r4}], [%r5], %rs1, %rd4;
    cp.async.bulk.tensor.3d.shared::cta.global.tile.mbarrier::complete_tx::bytes [%r1], [%rd3, {%r2, %r3, %r4}], [%r5];
    cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%rd5, {%r6, %r7, %r8}], [%r9];
    """
    c = scan_ptx(ptx)
    assert c.target == "sm_90a"
    assert c.wgmma == ("m64n128k16.f32.bf16.bf16",)
    assert (c.tma_loads, c.tma_stores, c.multicast_loads) == (2, 1, 1)


def test_scan_sass_opcodes():
    sass = """
    /*1110*/  UTMALDG.3D.MULTICAST [UR8], [UR20], UR18, desc[URZ] ;
    /*1150*/  UTMALDG.3D [UR8], [UR22], desc[URZ] ;
    /*2000*/  QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], RZ, !UPT, gsb0 ;
    /*3230*/  UTMASTG.3D [UR16], [UR20], desc[URZ] ;
    """
    c = scan_sass(sass)
    assert c.gmma == ("QGMMA.64x128x32.F32.E4M3.E4M3",)
    assert (c.tma_loads, c.tma_stores, c.multicast_loads) == (2, 1, 1)
    assert c.vector_descriptors == 0
    # WGMMAs fed from vector registers: those whose gdesc[URn .. URn+3] an R2UR wrote last
    sass = """
    /*3370*/  R2UR UR16, R18 ;
    /*3380*/  WARPGROUP.ARRIVE ;
    /*3390*/  R2UR UR17, R19 ;
    /*33a0*/  R2UR UR22, R152 ;
    /*3490*/  QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR16], R88, UP0 ;
    /*3520*/  QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR20], R24, UP0 ;
    /*3530*/  UIADD3 UR16, UR10, 0x200, URZ ;
    /*3540*/  @!UP0 UMOV UR17, 0x40000040 ;
    /*3550*/  R2UR UR4, R16 ;
    /*3555*/  S2UR UR4, SR_CgaCtaId ;
    /*3558*/  QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR4], R88 ;
    /*3560*/  QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR16], R88, gsb0 ;
    /*3770*/  WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
    """
    assert scan_sass(sass).vector_descriptors == 2


# -- config rules and unsupported requests -------------------------------------------------------
@pytest.mark.parametrize("fp8", [False, True])
def test_config_space_fits_shared_memory(fp8):
    ab = 1 if fp8 else 2
    for cfg in dispatch.config_space(fp8):
        for d in ("bfloat16", "float32"):
            epi = tree_smem_bytes(gemm_tree("none", "none", d), cfg, ab)
            assert pipeline_stages(cfg, ab, epi) >= 2, cfg.name
            assert smem_bytes(cfg, ab, epi) <= SM90_SMEM_CAPACITY, cfg.name


def test_smem_bytes_formula():
    cfg = GemmConfig(128, 256, 64, "cooperative")
    epi = tree_smem_bytes(gemm_tree("none", "none", "bfloat16"), cfg)
    # 2 epilogue buffers of 128 x 64 bf16 (a 1 KiB multiple: no alignment padding): an
    # element-wise tree on a cooperative tile gets sub-tiles wider than 32 columns where its
    # registers allow (128 accumulator + 48 staged per thread)
    assert epi == 2 * 128 * 64 * 2
    # 4 stages of (128 + 256) x 64 bf16 + the epilogue + 1 KiB reserved
    assert smem_bytes(cfg, 2, epi) == 4 * 384 * 64 * 2 + epi + 1024


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("mnkl", [(1, 4096, 4096, 1), (64, 28672, 4096, 1), (1024, 4096, 4096, 1),
                                  (16384, 6144, 4096, 1), (8192, 8192, 8192, 1), (300, 264, 520, 3)])
def test_heuristic_picks_from_the_config_space(fp8, fast, mnkl):
    if fast and not fp8:
        pytest.skip("fast accumulation is FP8-only")
    cfg = dispatch.select_config(*mnkl, fp8, fast, 132)
    assert cfg in dispatch.config_space(fp8)


@pytest.mark.parametrize("kw,match", [
    (dict(tile_m=96), "tile_m"),
    (dict(tile_m=256, schedule="pingpong"), "tile_m for pingpong"),
    (dict(schedule="stream-k"), "schedule"),
    (dict(cluster_m=4, cluster_n=1), "cluster shape"),
    (dict(cluster_m=2, cluster_n=2, split_tail=True), "split_tail needs a cluster"),
    (dict(tile_n=136 + 1), "tile_n"),
    (dict(tile_k=32), "tile_k"),
    (dict(stages=1), "stages"),
])
def test_invalid_config_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        GemmConfig(**kw)


@pytest.mark.parametrize("poll", [False, True])
def test_poll_full_builds_unhinted_consumer_waits(poll):
    """``GemmConfig.poll_full`` (the block-scaled forward form's): the consumers' full-stage waits and the producer's
    free-stage waits become ``mbarrier.try_wait`` polls without the pipeline's 10 ms suspend hint,
    in the fast ping-pong
    kernel, in the block-scaled one's two-level loop and under the row-wise FP8 SwiGLU backward
    tree (the heaviest of the FP8 MLP's), spill-free; without it, no such poll. (Polling the
    epilogue's tile-input ring as well spilled 216 bytes in that tree: its waits are unrolled per
    sub-tile.)"""
    swiglu = next(s for f, s in SPECS if f == "coda_fp8_row_fast" and s.label == "fp8_row_fast.swiglu_backward")
    specs = [dataclasses.replace(swiglu, config=swiglu.config.with_(poll_full=poll)),
             GemmSpec("float8_e4m3fn", "float8_e4m3fn", "bfloat16", "k", "k",
                      GemmConfig(128, 128, 128, "pingpong", 2, 1, fp8_fast_accum=True, poll_full=poll),
                      scale_a="row", scale_b="row"),
             KernelSpec.of("float8_e4m3fn", "float8_e4m3fn", "k", "k",
                           GemmConfig(128, 128, 128, "cooperative", 2, 1, poll_full=poll),
                           gemm_tree("none", "none", "bfloat16"), "sm_90a", 132, block_scaled=True)]
    for spec in specs:
        k = compile_gemm(spec, keep_artifacts=True)
        polls = re.findall(r"mbarrier\.try_wait\.parity\.acquire\.cta\.shared::cta\.b64 [^;]*;", k.ptx)
        assert bool(polls) == poll, spec.config.name
        assert all(p.count(",") == 2 for p in polls)  # (pred, [bar], phase): no suspend-time hint
        assert k.stats["spill_stores"] == k.stats["spill_loads"] == 0
    assert specs[1].config.name.endswith("_poll") == poll


def test_fp8_two_level_register_budget_rejected():
    import cutlass

    from coda_cute.kernels.sm90.gemm import Sm90Gemm
    from coda_cute.kernels.epilogue.plain import gemm_tree

    cfg = GemmConfig(128, 256, 128, "cooperative")  # two 128-register accumulators per thread
    with pytest.raises(ValueError, match="registers per thread"):
        Sm90Gemm(cfg, cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, "k", "k",
                 gemm_tree("row", "row", "bfloat16"), 132)
    assert cfg not in dispatch.config_space(True)


@pytest.mark.parametrize("cfg, waves", [
    (GemmConfig(128, 128, 128, "cooperative"), 1),  # 64 + 64 registers: a whole temporary
    (GemmConfig(128, 192, 128, "cooperative"), 1),  # 96 + 96
    (GemmConfig(256, 128, 128, "cooperative"), 2),  # 128 + one 64-row wave's 64
    (GemmConfig(128, 128, 128, "pingpong"), 0),  # waves would idle the tensor cores at each promotion
    (GemmConfig(128, 256, 128, "cooperative"), 0),  # one 64-row atom per warpgroup: nothing to split
    (GemmConfig(256, 192, 128, "cooperative"), 0),  # 192 + 96
])
def test_promotion_waves(cfg, waves):
    assert cfg.promotion_waves == waves


def test_config_space_has_two_level_in_waves():
    waves = [c for c in dispatch.config_space(True) if not c.fp8_fast_accum and c.promotion_waves > 1]
    assert waves == [GemmConfig(256, 128, 128, "cooperative", 2, 1, split_tail=True)]
    assert GemmConfig(256, 128, 128, "cooperative", 2, 1) in dispatch.block_scaled_config_space(wgrad_form=True)
    # the forward form polls its stage barriers (dispatch.block_scaled_config_space)
    assert GemmConfig(256, 128, 128, "cooperative", 2, 1, poll_full=True) in dispatch.block_scaled_config_space()


def test_two_level_in_waves_builds():
    """Cooperative 256 x 128 two-level: each warpgroup's k-tile is two 64-row waves of four
    m64n128k32 WGMMAs, each into a temporary one wave tall that is drained (``wait_group 0``) and
    added to its rows of the accumulator (64 FADDs per wave and thread) before the next wave; no
    k-tile is issued ahead of the epilogue; no spills, no serialized WGMMAs."""
    cfg = GemmConfig(256, 128, 128, "cooperative", 2, 1)
    k = compile_gemm(GemmSpec("float8_e4m3fn", "float8_e4m3fn", "bfloat16", "k", "k", cfg,
                              scale_a="row", scale_b="row"), keep_artifacts=True)
    stats = k.stats
    assert stats["spill_stores"] == stats["spill_loads"] == 0 and not stats["wgmma_serialized"], stats
    ptx = k.ptx
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3", ptx)) == 8
    assert re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx) == ["0", "0"]
    assert ptx.count("add.f32") + ptx.count("add.rn.f32") >= 128


def test_fp8_needs_k_major_in_the_kernel():
    import cutlass

    from coda_cute.kernels.sm90.gemm import Sm90Gemm
    from coda_cute.kernels.epilogue.plain import gemm_tree

    with pytest.raises(ValueError, match="K-major"):
        Sm90Gemm(GemmConfig(128, 128, 128, "cooperative"), cutlass.Float8E4M3FN, cutlass.Float8E4M3FN,
                 "m", "k", gemm_tree("row", "row", "bfloat16"), 132)


def test_unsupported_arch_raises_not_implemented():
    spec = GemmSpec("bfloat16", "bfloat16", "bfloat16", "k", "k", GemmConfig(), arch="sm_100a")
    with pytest.raises(NotImplementedError, match="sm_100a"):
        compile_gemm(spec)


# -- the report itself (reuses the kernels compiled above) ----------------------------------------
def test_report_json(tmp_path, capsys):
    path = tmp_path / "report.json"
    rc = cli.main(["report", "--configs", "default", "--compile-only", "--json", str(path)])
    assert rc == 0
    records = json.loads(path.read_text())
    elementwise = [r for r in records if r["kind"] == "elementwise"]
    records = [r for r in records if r["kind"] != "elementwise"]
    assert len(records) == len(report.kernel_specs("default")) == 51
    assert len(elementwise) == len(report_elementwise.kernels()) == 23
    for r in elementwise:  # every bandwidth-bound kernel of the step: its intended instructions, no spills
        assert r["ok"] and r["spills"] == 0 and r["problems"] == [] and all(r["instructions"].values()), r
    names = {r["name"] for r in elementwise}
    assert {"transpose_bytes_sm_90a", "quantize_rowwise_rows_amax_g14_fold_sm_90a_bf16_e4m3",
            "quantize_rowwise_cols_fold_sm_90a_bf16_e4m3", "rope_backward_sm_90a_h32x8_d128_qknorm"} <= names
    for r in records:
        assert r["kind"] == "kernel" and r["arch"] == "sm_90a" and r["ok"], r
        for key in ("name", "config", "registers", "spills", "smem_bytes", "has_wgmma", "has_tma",
                    "has_tma_store", "has_multicast", "compile_seconds"):
            assert key in r
        assert r["spills"] == {"stores": 0, "loads": 0}
        assert r["has_wgmma"] and r["has_tma"] and r["has_tma_store"] == (r.get("op") != "lm_head_ce")
        assert r["has_multicast"] == (r["config"]["cluster_m"] * r["config"]["cluster_n"] > 1)
        assert 0 < r["smem_bytes"] <= SM90_SMEM_CAPACITY
    out = capsys.readouterr().out
    assert "pp_128x128x64_c2x1_g8" in out and "51 as intended" in out and "norm_rope_qkv_qk_norm" in out
    assert "fp8.wgrad.gate_up" in out and "fp8.lm_head.dw" in out and "fp8_row.swiglu_backward" in out
    assert "fp8_row_fast.swiglu_backward" in out and "fastacc" in out
    assert "23 element-wise kernels for sm_90a; 23 as intended, 0 not" in out


def test_elementwise_report_finds_a_missing_instruction():
    """A kernel without one of its intended instructions, or with spills, is not ok: the census
    counts opcodes at the start of an instruction (predicated too), not substrings
    (``shared.global`` holds ``red.global``)."""
    ptx = "\tcp.async.cg.shared.global [%r1], [%rd1], 16;\n\t@%p1 ld.global.v4.u32 {%r1, %r2, %r3, %r4}, [%rd2];\n"
    assert report_elementwise.count(ptx, "red.global") == 0 and report_elementwise.count(ptx, "ld.global.v4") == 1
    label, spec, intended = report_elementwise.kernels()[0]
    r = report_elementwise.ElementwiseReport(label, spec, intended, {"spill_stores": 8, "spill_loads": 0},
                                             {op: 0 for op in intended}, 0.1)
    assert r.problems() == [f"no {op}" for op in intended] + ["spills 8 B"] and not r.record()["ok"]


def test_report_without_nvdisasm_shows_unknown(monkeypatch):
    from rich.console import Console

    import coda_cute.artifacts as artifacts

    monkeypatch.setattr(artifacts, "find_nvdisasm", lambda: None)
    assert artifacts.disassemble(b"not a cubin") is None
    fam, spec = report.kernel_specs("default")[0]
    kernel, ptx, _ = built(spec)
    rep = report.KernelReport(fam, spec, kernel, ptx, None)
    rec = rep.record()
    assert rec["ok"] and not rec["sass_checked"] and rec["sass"] is None and rec["has_wgmma"]
    console = Console(record=True, width=200)
    console.print(report.family_table(fam, [rep]))
    text = console.export_text()
    assert "✓/?" in text and "(SASS ?)" in text


def test_run_table_renders_results_and_failures():
    from rich.console import Console

    ok = {"rel_err": 2.1e-3, "ms": 0.25, "tflops": 549.8}
    rows = [
        dict(kind="run", op="bf16 x @ W.T", m=4096, n=4096, k=4096, config="coop_128x256x64_c2x1_g8",
             torch_op="torch.mm", coda=ok, torch=dict(ok, ms=0.5, tflops=274.9), ok=True),
        dict(kind="run", op="fp8 e4m3 row-wise scales", m=4096, n=4096, k=4096, config="x",
             torch_op="torch._scaled_mm", coda={"error": "RuntimeError: launch failed"}, torch=ok, ok=False),
    ]
    console = Console(record=True, width=220)
    console.print(report.run_table(rows, "H200"))
    text = console.export_text()
    assert "2.00" in text and "2.10e-03" in text and "RuntimeError: launch failed" in text


_DISK_CACHE_PROBE = """
import os, sys
import coda_cute.compiler as C
C._gpu_matches = lambda arch: True  # as on a Hopper machine
from coda_cute.kernels.common.config import GemmConfig
k = C.get_gemm(C.GemmSpec("bfloat16", "bfloat16", "bfloat16", "k", "k", GemmConfig(128, 128, 64, "pingpong")))
print("loaded" if k.compile_seconds == 0.0 else "compiled", len(os.listdir(os.environ["CODA_CUTE_CACHE_DIR"])))
"""


def test_disk_cache_round_trip(tmp_path):
    """A kernel compiled in one process is loaded, not recompiled, by the next (the exported
    object keeps the launcher's signature; its ptxas statistics lie next to it)."""
    env = dict(os.environ, CODA_CUTE_CACHE_DIR=str(tmp_path), CUTE_DSL_ARCH="sm_90a")
    runs = [subprocess.run([sys.executable, "-c", _DISK_CACHE_PROBE], env=env, capture_output=True,
                           text=True, timeout=300) for _ in range(2)]
    assert [r.stdout.split() for r in runs] == [["compiled", "2"], ["loaded", "2"]], runs[0].stderr[-2000:]


def test_pingpong_kernels_prefetch_their_tile_vectors_into_l1():
    """A ping-pong warpgroup reads its tile's row / column vectors (here the FP8 scales) only
    after its mainloop, so it pulls them into L1 at the tile's start: one prefetch per vector.
    Cooperative kernels read them under their last WGMMAs and do not prefetch."""
    pp = GemmConfig(128, 128, 128, "pingpong", 2, 1, fp8_fast_accum=True)
    coop = GemmConfig(128, 128, 128, "cooperative", 2, 1, split_tail=True)
    for cfg, prefetches in ((pp, 2), (coop, 0)):
        spec = GemmSpec("float8_e4m3fn", "float8_e4m3fn", "bfloat16", "k", "k", cfg, "row", "row")
        assert built(spec)[0].ptx.count("prefetch.global.L1") == prefetches, cfg.name


def test_disk_key_tells_every_kernel_apart():
    """The on-disk name of a binary follows every field the spec's equality compares: the plain
    FP8 GEMM, its block-scaled form and the weight-gradient form of one tree and config are three
    kernels and three files (one key once omitted the block scales, and a block-scaled GEMM loaded
    the wgrad form's binary from an earlier process)."""
    from coda_cute.compiler import KernelSpec, disk_key

    cfg = GemmConfig(128, 128, 128, "cooperative", 2, 1)
    tree = gemm_tree("none", "none", "bfloat16")
    specs = [KernelSpec.of("float8_e4m3fn", "float8_e4m3fn", "k", "k", cfg, tree, **kw)
             for kw in ({}, {"block_scaled": True}, {"block_scaled": True, "b_rows": True},
                        {"block_scaled": True, "num_sms": 78}, {"block_scaled": True, "arch": "sm_100a"})]
    assert len({disk_key(s) for s in specs}) == len(specs)
    # the label is not part of the kernel: the same binary under another name
    relabelled = KernelSpec.of("float8_e4m3fn", "float8_e4m3fn", "k", "k", cfg, tree, label="other")
    assert disk_key(relabelled) == disk_key(specs[0])
    # element-wise specs of different kernels may carry the same field values
    from coda_cute.elementwise_fp8 import QuantizeWeightSpec

    @dataclasses.dataclass(frozen=True)
    class Twin:
        dtype: str
        gamma_dtype: str | None = None
        out_dtype: str = "float8_e4m3fn"
        arch: str = "sm_90a"
    assert disk_key(Twin("bfloat16")) != disk_key(QuantizeWeightSpec("bfloat16"))


def test_binary_digest_covers_the_modules_that_shape_a_kernel():
    """The on-disk cache's build digest reads every kernel source and the modules that build the
    kernels' compile arguments (an element-wise kernel's signature is its spec's fake arguments
    in ``coda_cute.elementwise*``: a change there alone must not load an old binary)."""
    from pathlib import Path

    from coda_cute import compiler, elementwise, elementwise_fp8, elementwise_lm_head
    from coda_cute.kernels.elementwise import rope_backward

    sources = {Path(p).resolve() for p in compiler.digest_sources()}
    for mod in (compiler, elementwise, elementwise_fp8, elementwise_lm_head, rope_backward):
        assert Path(mod.__file__).resolve() in sources, mod.__name__
    assert set(Path(compiler.__file__).resolve().parent.glob("elementwise*.py")) <= sources
    kernel_root = Path(rope_backward.__file__).resolve().parents[1]
    assert {p for p in kernel_root.rglob("*.py")} <= sources
