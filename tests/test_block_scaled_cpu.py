"""CPU tests of the block-scaled FP8 GEMM (``kernels.sm90.block_scales``, ``coda.gemm_blockwise``):
the kernel's sm_90a builds and the configs it refuses; the op on the reference path against the
float64 product of the dequantized operands, its fake shapes, and its argument rules on the CPU
and fake paths. Each k-tile's partial product is promoted with one FFMA per
accumulator register (``acc += sa[m, kb] * sb[nb, kb] * partial``), its scales come with each
stage by TMA and are read from shared memory (no global loads), and the builds neither spill nor
serialize their WGMMAs."""

import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import coda_cute
from coda_cute import dispatch
from coda_cute import reference as R
from coda_cute.compiler import KernelSpec, compile_gemm, spill_bytes
from coda_cute.kernels.common.config import PROMOTION_GROUP, GemmConfig
from coda_cute.kernels.epilogue.plain import gemm_tree
from helpers import generator, on_path, rel_err

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


def spec(cfg, a=E4M3, b=E4M3, out="bfloat16"):
    return KernelSpec.of(a, b, "k", "k", cfg, gemm_tree("none", "none", out), block_scaled=True)


def expected_tx(ptx: str) -> set:
    """The transaction byte counts the kernel's stage mbarriers expect (``mbarrier.expect_tx``
    of a register set from an immediate)."""
    regs = re.findall(r"expect_tx\.shared\.b64 %rd\d+, \[%r\d+\], (%r\d+);", ptx)
    return {int(v) for r in regs for v in re.findall(rf"mov\.[ubs]32\s+{r},\s*(\d+);", ptx)}


def stage_tx(cfg, b_rows: bool) -> int:
    """What one stage's TMA boxes bring: the FP8 A and B tiles, the tile's rows of A's scales and
    its columns of B's (``b_rows``) or the 16-byte box holding the weight block's scale. A count
    above that never completes the barrier (the kernel hangs), one below lets the consumers read
    a stage still in flight."""
    return (cfg.tile_m + cfg.tile_n) * cfg.tile_k + 4 * cfg.tile_m + (4 * cfg.tile_n if b_rows else 16)


@pytest.mark.parametrize("cfg, a, b", [
    (GemmConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=2), E4M3, E4M3),  # fprop
    (GemmConfig(tile_m=128, tile_n=64, tile_k=128), E5M2, E4M3),  # dgrad with E5M2 gradients
    (GemmConfig(tile_m=64, tile_n=128, tile_k=128, schedule="pingpong"), E4M3, E4M3),
    (GemmConfig(tile_m=256, tile_n=128, tile_k=128, cluster_m=2), E4M3, E4M3),  # promoted in waves
], ids=["coop-128x128-c2x1", "coop-128x64-e5m2", "pingpong-64x128", "coop-256x128-waves"])
def test_block_scaled_kernel_builds(cfg, a, b):
    k = compile_gemm(spec(cfg, a, b), keep_artifacts=True)
    assert spill_bytes(k) == 0 and not k.stats["wgmma_serialized"], k.stats
    ptx = k.ptx
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{cfg.tile_n}k32\.f32\.{a[7:11]}\.{b[7:11]}", ptx)
    # per thread and k-tile: 64 x tile_n / 128 accumulator registers per 64-row atom, one FFMA each
    regs = cfg.tile_m * cfg.tile_n // (128 if cfg.schedule == "pingpong" else 256)
    assert ptx.count("fma.rn.f32") >= regs, ptx.count("fma.rn.f32")
    # a k-tile's row scales and its weight-block scale, from the stage's shared memory
    assert ptx.count("ld.shared") >= 3 and "ld.global" not in ptx
    assert expected_tx(ptx) == {stage_tx(cfg, False)}, expected_tx(ptx)


@pytest.mark.parametrize("cfg", dispatch.block_scaled_config_space(), ids=lambda c: c.name)
def test_every_forward_form_config_polls_without_spills(cfg):
    """The forward form's configs poll their stage barriers (``dispatch.block_scaled_config_space``):
    every one builds with ``mbarrier.try_wait`` polls that carry no suspend-time hint, spill-free
    and with unserialized WGMMAs, so no pick of the heuristic falls back to a spilling build."""
    assert cfg.poll_full
    k = compile_gemm(spec(cfg), keep_artifacts=True)
    assert spill_bytes(k) == 0 and not k.stats["wgmma_serialized"], k.stats
    polls = re.findall(r"mbarrier\.try_wait\.parity\.acquire\.cta\.shared::cta\.b64 [^;]*;", k.ptx)
    assert polls and all(p.count(",") == 2 for p in polls)  # (pred, [bar], phase): no hint


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


@pytest.mark.parametrize("cfg, ok", [
    (GemmConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=2), True),
    (GemmConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=2, cluster_n=2), True),
    (GemmConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=1, cluster_n=2, stages=4, raster_group=2), True),
    (GemmConfig(tile_m=128, tile_n=256, tile_k=128, cluster_m=2, cluster_n=2), False),
    (GemmConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=2, cluster_n=2, fp8_fast_accum=True), False),
])
def test_an_explicit_config_may_set_any_cluster(cfg, ok):
    """The launch's rule for an explicit config (an experiment's): the scales care about the tile
    and the accumulation, not the cluster (each CTA loads its own scales), the stages or the
    raster, so a scalable tile on any cluster passes and an unscalable one is refused, naming
    the config."""
    from coda_cute.epilogue.block_scales import check_block_scaled

    a_q, sa, b_q, sb = quantized(256, 256, 256)
    check = lambda: check_block_scaled(a_q, b_q, (sa, sb), True, False, cfg, "exp")  # noqa: E731
    if ok:
        check()
    else:
        with pytest.raises(ValueError, match=f"config {cfg.name} cannot apply block scales"):
            check()


@pytest.mark.parametrize("k, b_block, match", [
    (640, "128x128", r"tail_carry needs K's k-tiles \(5 of 128 for K = 640\) to be a multiple of the promotion group \(4\)"),
    (512, "1x128", "tail_carry is a block-scaled forward-form mode"),
    (512, None, "tail_carry is a block-scaled forward-form mode"),
], ids=["5 k-tiles", "wgrad form", "row-wise"])
def test_an_explicit_tail_carry_config_is_refused_where_it_cannot_carry(k, b_block, match):
    """An explicit config with ``tail_carry`` (an experiment's) on a launch its rule refuses: K of
    5 k-tiles, the weight-gradient form, row-wise FP8 without block scales. The reference path
    raises what the launch raises, naming the config and the rule, before anything runs."""
    from coda_cute.epilogue import run

    cfg = GemmConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=2, tail_carry=True)
    a_q, sa, b_q, sb = quantized(256, 256, k)
    if b_block == "1x128":
        sb = R.quantize_blocks_ref(b_q.float(), (1, 128))[1]
    kw = {} if b_block is None else dict(block_scales=(sa, sb), b_block=b_block)
    tree = gemm_tree("none", "none", "bfloat16")
    with pytest.raises(ValueError, match=f"config {cfg.name}: " + match), coda_cute.reference_on_cpu():
        run(tree, a_q, b_q.t(), {}, config=cfg, **kw)


def test_tail_carry_config_rules():
    """``tail_carry`` is a cooperative mode without a split tail (the config refuses the others),
    and the kernel's build refuses it off the block-scaled forward form."""
    for bad in (dict(schedule="pingpong", tile_m=128), dict(split_tail=True)):
        with pytest.raises(ValueError, match="tail_carry needs the cooperative schedule without split_tail"):
            GemmConfig(tile_n=128, tile_k=128, tail_carry=True, **bad)
    cfg = GemmConfig(tile_m=128, tile_n=128, tile_k=128, tail_carry=True)
    with pytest.raises(ValueError, match="block-scaled forward-form mode"):
        compile_gemm(KernelSpec.of(E4M3, E4M3, "k", "k", cfg, gemm_tree("none", "none", "bfloat16")))
    with pytest.raises(ValueError, match="three whole accumulators"):
        compile_gemm(spec(cfg.with_(tile_m=256)))


# -- the op: coda.gemm_blockwise --------------------------------------------------------------------
def quantized(m, n, k, a_dtype=torch.float8_e4m3fn, seed=0):
    g = generator(seed)
    a = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-4, 4, (m, 1), generator=g).float())
    b = torch.randn(n, k, generator=g)
    a_q, sa = R.quantize_blocks_ref(a, (1, 128), a_dtype)
    b_q, sb = R.quantize_blocks_ref(b, (128, 128), torch.float8_e4m3fn)
    return a_q, sa, b_q, sb


@pytest.mark.parametrize("a_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("out_dtype", [None, torch.float16, torch.float32])
def test_op_on_the_reference_path_is_the_dequantized_product(a_dtype, out_dtype):
    a_q, sa, b_q, sb = quantized(100, 200, 400, a_dtype)  # ragged: partial last k-block and weight block
    with coda_cute.reference_on_cpu():
        out = torch.ops.coda.gemm_blockwise(a_q, sa.t().contiguous().t(), b_q, sb, out_dtype)  # M-major scales
    want = R.block_scaled_gemm_ref(a_q, sa, (1, 128), b_q, sb, (128, 128), out_dtype=torch.float64)
    assert out.dtype == (out_dtype or torch.bfloat16) and out.shape == (100, 200)
    assert rel_err(out.double(), want) < (1e-6 if out_dtype == torch.float32 else 4e-3)


def test_op_shapes_on_fake_cuda_tensors():
    with FakeTensorMode():
        a = torch.empty(16384, 4096, dtype=torch.float8_e4m3fn, device="cuda")
        b = torch.empty(14336, 4096, dtype=torch.float8_e4m3fn, device="cuda")
        out = torch.ops.coda.gemm_blockwise(a, torch.empty(16384, 32, device="cuda"), b,
                                            torch.empty(112, 32, device="cuda"))
    assert (tuple(out.shape), out.dtype, out.device.type) == ((16384, 14336), torch.bfloat16, "cuda")


def bad_calls():
    a_q, sa, b_q, sb = quantized(64, 256, 256)
    yield "a bf16", (a_q.to(torch.bfloat16), sa, b_q, sb), "2-D float8"
    yield "K mismatch", (a_q, sa, b_q[:, :128], sb[:, :1]), "share a's K"
    yield "a scales grid", (a_q, sa[:, :1], b_q, sb), r"a_scales must be \(64, 2\)"
    yield "b scales per row", (a_q, sa, b_q, torch.ones(256, 2)), r"b_scales must be \(2, 2\)"
    yield "scales dtype", (a_q, sa.double(), b_q, sb), "float32"
    yield "out dtype", (a_q, sa, b_q, sb, torch.int32), "out_dtype"
    # the launch's layout rules, which the fake path checks too
    yield "b column-major", (a_q, sa, b_q.t().contiguous().t(), sb), r"b must be stored \(N, K\) with K contiguous"
    a200, s200, b200, t200 = quantized(64, 256, 200)
    yield "K no multiple of 16", (a200, s200, b200, t200), "a's strides must be multiples of 16 bytes"
    a_n, sa_n, b_n, sb_n = quantized(64, 100, 256)
    yield "bf16 rows of N=100", (a_n, sa_n, b_n, sb_n), "out's strides must be multiples of 16 bytes"
    shifted = torch.zeros(64 * 256 + 8, dtype=torch.float8_e4m3fn)[8:].view(64, 256).copy_(a_q)
    yield "a misaligned", (shifted, sa, b_q, sb), "a's data pointer must be 16-byte aligned"


@pytest.mark.parametrize("case", list(bad_calls()), ids=lambda c: c[0])
@pytest.mark.parametrize("path", ["cpu", "fake"])
def test_bad_input_raises_on_every_path(case, path):
    _, args, match = case
    with pytest.raises(ValueError, match=match), on_path(path):
        torch.ops.coda.gemm_blockwise(*args)


@pytest.mark.parametrize("path", ["cpu", "fake"])
def test_no_columns_give_an_empty_output(path):
    """N = 0: nothing to store, so no rule on the output's row width applies (it raised that
    N must be a multiple of 8 on every path)."""
    a_q, sa, b_q, sb = quantized(64, 0, 256)
    with on_path(path):
        out = torch.ops.coda.gemm_blockwise(a_q, sa, b_q, sb)
    assert tuple(out.shape) == (64, 0) and out.dtype == torch.bfloat16


def test_op_outside_the_reference_path_names_it():
    with pytest.raises(ValueError, match="reference_on_cpu"):
        torch.ops.coda.gemm_blockwise(*quantized(8, 128, 128))


# -- the weight-gradient form: B's scales per row too (b_block="1x128") ------------------------------
@pytest.mark.parametrize("cfg", [
    GemmConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=2),
    GemmConfig(tile_m=128, tile_n=64, tile_k=128),
    GemmConfig(tile_m=64, tile_n=128, tile_k=128, schedule="pingpong"),
    GemmConfig(tile_m=256, tile_n=128, tile_k=128),
], ids=["coop-128x128-c2x1", "coop-128x64", "pingpong-64x128", "coop-256x128-waves"])
def test_wgrad_form_builds_with_an_outer_product_factor(cfg):
    """Per k-tile the factor is the thread's row scales times its column scales: one more fp32
    shared-memory load per column it holds and one multiply per register next to the FFMA,
    without spills."""
    k = compile_gemm(KernelSpec.of(E4M3, E4M3, "k", "k", cfg, gemm_tree("none", "none", "float32"),
                                   block_scaled=True, b_rows=True), keep_artifacts=True)
    assert spill_bytes(k) == 0 and not k.stats["wgmma_serialized"], k.stats
    regs = cfg.tile_m * cfg.tile_n // (128 if cfg.schedule == "pingpong" else 256)
    ptx = k.ptx
    assert ptx.count("fma.rn.f32") >= regs and ptx.count("mul.rn.f32") + ptx.count("mul.f32") >= regs
    # the thread's columns (tile_n / 4 of them) and rows, each k-tile, from the stage
    shared = ptx.count("ld.shared.b32") + 2 * ptx.count("ld.shared.v2.b32") + 4 * ptx.count("ld.shared.v4.b32")
    assert shared >= cfg.tile_n // 4 + 2 and "ld.global" not in ptx, shared
    assert expected_tx(ptx) == {stage_tx(cfg, True)}, expected_tx(ptx)


def test_waves_read_column_scales_once_per_k_tile_before_the_release():
    """In waves (cooperative 256 x 128), the weight-gradient form reads a k-tile's column scales
    once, under its first wave's WGMMAs, and both waves' promotions use them: the thread's 32
    columns as 16 ``ld.shared.v2.b32``, all before the stage's release (the first
    ``mbarrier.arrive`` after the loop's last ``wgmma.wait_group``; a release before a read
    would let the producer refill the scales under it)."""
    k = compile_gemm(KernelSpec.of(E4M3, E4M3, "k", "k", GemmConfig(tile_m=256, tile_n=128, tile_k=128),
                                   gemm_tree("none", "none", "float32"), block_scaled=True, b_rows=True),
                     keep_artifacts=True)
    lines = k.ptx.splitlines()
    last_wait = max(i for i, line in enumerate(lines) if "wgmma.wait_group" in line)
    release = next(i for i, line in enumerate(lines) if i > last_wait and "mbarrier.arrive" in line)
    reads = [i for i, line in enumerate(lines) if "ld.shared.v2.b32" in line]
    assert len(reads) == 16 and max(reads) < release, (len(reads), reads[-3:], release)


def _release_before_promotion(ptx: str) -> list:
    """Per ``wgmma.wait_group 1`` of the k-loop (a k-tile's WGMMAs done, the next one's in
    flight): whether the stage's release (``mbarrier.arrive``) comes before the promotion's first
    FFMA."""
    order = []
    for m in re.finditer(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx):
        rest = ptx[m.end():]
        arrive, fma = rest.find("mbarrier.arrive"), rest.find("fma.rn.f32")
        assert arrive >= 0 and fma >= 0, (arrive, fma)
        order.append(arrive < fma)
    assert order
    return order


def test_stage_is_freed_before_the_promotion_that_reads_nothing_from_it():
    """``mainloop.RELEASE_BEFORE_PROMOTION``: the forward form's promotion factor is in registers
    from its k-tile's issue on, so a finished k-tile's stage goes back to the producer before
    its FFMAs (one promotion sooner); the weight-gradient form reads its column scales from the
    stage at the promotion, so it frees the stage only after it."""
    cfg = GemmConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=2)
    forward = compile_gemm(spec(cfg), keep_artifacts=True)
    assert all(_release_before_promotion(forward.ptx))
    wgrad = compile_gemm(KernelSpec.of(E4M3, E4M3, "k", "k", cfg, gemm_tree("none", "none", "float32"),
                                       block_scaled=True, b_rows=True), keep_artifacts=True)
    assert not any(_release_before_promotion(wgrad.ptx))


@pytest.mark.parametrize("group", [3, 4])
@pytest.mark.parametrize("b_rows", [False, True], ids=["forward", "wgrad"])
def test_larger_promotion_groups_build_without_spills(group, b_rows, monkeypatch):
    """The variants ``scripts/exp_block_scaled.py`` times against pairs: k-tiles promoted in
    groups of 3 or 4 (``config.PROMOTION_GROUP[form]``) build without spills or serialized WGMMAs,
    and the group's loop waits for the tensor cores to drain once (``wait_group 0``), its other
    promotions with the next k-tile in flight (``wait_group 1``, one per k-tile after the first)."""
    waits = {}
    for g in (2, group):
        monkeypatch.setitem(PROMOTION_GROUP, "wgrad" if b_rows else "block", g)
        cfg = GemmConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=1 if b_rows else 2)
        tree = gemm_tree("none", "none", "float32" if b_rows else "bfloat16")
        k = compile_gemm(KernelSpec.of(E4M3, E4M3, "k", "k", cfg, tree, block_scaled=True, b_rows=b_rows),
                         keep_artifacts=True)
        assert spill_bytes(k) == 0 and not k.stats["wgmma_serialized"], (g, k.stats)
        found = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", k.ptx)
        waits[g] = (found.count("0"), found.count("1"))
    assert waits[group] == (waits[2][0], waits[2][1] + group - 2), waits


def test_tail_carry_builds_without_spills():
    """``GemmConfig.tail_carry``: the forward form's pick builds spill-free and unserialized with
    each tile's last group carrying the next tile's first k-tile, which replaces the three single
    promotions and the next tile's own first issue. Counted in k-tile issues (4 WGMMAs each): the
    group loop, the carrying group and the kernel's first issue, against the group loop, the
    singles' loop and the two first issues; and one wait for the tensor cores to drain fewer (the
    singles' loop's)."""
    cfg = next(c for c in dispatch.block_scaled_config_space()
               if c.schedule == "cooperative" and c.tile_m == 128 and c.cluster_m == 2)
    builds = {}
    for carry in (False, True):
        k = compile_gemm(spec(cfg.with_(tail_carry=carry)), keep_artifacts=True)
        assert spill_bytes(k) == 0 and not k.stats["wgmma_serialized"], (carry, k.stats)
        found = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", k.ptx)
        builds[carry] = (k.ptx.count("wgmma.mma_async"), found.count("0"))
    group = PROMOTION_GROUP["block"]
    assert builds[False][0] == 4 * (group + 3) and builds[True][0] == 4 * (2 * group + 1), builds
    assert builds[True][1] == builds[False][1] - 1, builds


@pytest.mark.parametrize("k, b_block, carries", [(4096, "128x128", True), (14336, "128x128", True),
                                                 (512, "128x128", True), (640, "128x128", False),
                                                 (4000, "128x128", True), (3968, "128x128", False),
                                                 (4096, "1x128", False)])
def test_the_heuristic_carries_where_k_allows(k, b_block, carries, monkeypatch):
    """``runner.choose_config`` sets ``tail_carry`` on the block-scaled forward form's picks, under
    ``runner.TAIL_CARRY`` only, where its k-tiles (128 deep, the last one partial where K is
    ragged) make whole promotion groups: 4096, 14336 and 4000 (32, 112 and 32 k-tiles), 512 (one
    group); not 640 or 3968 (5 and 31 k-tiles), nor the weight-gradient form."""
    from coda_cute.epilogue import runner

    tree = gemm_tree("none", "none", "float32" if b_block == "1x128" else "bfloat16")
    for on in (False, True):
        monkeypatch.setattr(runner, "TAIL_CARRY", on)
        pick = runner.choose_config(tree, 16384, 4096, k, 1, True, False, 132, True, b_block == "1x128")
        assert pick.tail_carry == (on and carries), (on, pick.name)


def test_the_carried_build_is_asked_first_and_alone_where_it_does_not_spill(monkeypatch):
    """Each block-scaled build takes seconds to compile, so an op's first call compiles only the
    kernel it launches: ``choose_config`` asks the carried build of a candidate that can carry
    first and takes it where it does not spill, without compiling the build without the carry;
    where it spills, that build is asked next, and where both spill, the next candidate."""
    from coda_cute.epilogue import runner

    monkeypatch.setattr(runner, "TAIL_CARRY", True)
    shape = (gemm_tree("none", "none", "bfloat16"), 16384, 4096, 4096, 1, True, False, 132, True, False)
    ranked = runner.ranked_configs(*shape)
    first, carried = ranked[0], runner._carried(ranked[0], 4096, True, True, False)
    assert carried is not None and carried == first.with_(tail_carry=True)

    def asked_with(spilling):
        asked = []

        def fake_spills(tree, cfg, fp8, sms, block_scaled=False, b_rows=False):
            asked.append(cfg)
            return cfg in spilling
        monkeypatch.setattr(runner, "spills", fake_spills)
        return runner.choose_config(*shape), asked

    assert asked_with(set()) == (carried, [carried])
    assert asked_with({carried}) == (first, [carried, first])
    second = runner._carried(ranked[1], 4096, True, True, False) or ranked[1]
    assert asked_with({carried, first}) == (second, [carried, first, second])


def test_wgrad_form_on_the_reference_path_is_the_dequantized_product():
    g = generator(5)
    dy_t = torch.randn(136, 400, generator=g)  # (N_out, tokens): a gradient transposed
    x_t = torch.randn(200, 400, generator=g) * torch.exp2(torch.randint(-4, 4, (200, 1), generator=g).float())
    a_q, sa = R.quantize_blocks_ref(dy_t, (1, 128))
    b_q, sb = R.quantize_blocks_ref(x_t, (1, 128))
    with coda_cute.reference_on_cpu():
        out = torch.ops.coda.gemm_blockwise(a_q, sa, b_q, sb, torch.float32, "1x128")
    want = R.block_scaled_gemm_ref(a_q, sa, (1, 128), b_q, sb, (1, 128), out_dtype=torch.float64)
    assert out.shape == (136, 200) and rel_err(out.double(), want) < 1e-6
    assert spec(GemmConfig(tile_m=128, tile_n=128, tile_k=128)).name != KernelSpec.of(
        E4M3, E4M3, "k", "k", GemmConfig(tile_m=128, tile_n=128, tile_k=128),
        gemm_tree("none", "none", "bfloat16"), block_scaled=True, b_rows=True).name


@pytest.mark.parametrize("path", ["cpu", "fake"])
def test_wgrad_form_rules(path):
    a_q, sa, b_q, sb = quantized(64, 256, 256)
    with pytest.raises(ValueError, match=r"b_scales must be \(256, 2\) \(one scale per row"), on_path(path):
        torch.ops.coda.gemm_blockwise(a_q, sa, b_q, sb, None, "1x128")
    with pytest.raises(ValueError, match="b_block must be one of"), on_path(path):
        torch.ops.coda.gemm_blockwise(a_q, sa, b_q, sb, None, "128x1")


# test_schema is left out: its mutation check compares each input before and after with
# torch.allclose, which CPU torch does not implement for fp8 ("mul_cpu_reduced_float" not
# implemented for 'Float8_e4m3fn'). The same two checks, bitwise, follow the opcheck below.
BLOCKWISE_OPCHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _blockwise_opcheck_cases():
    a_q, sa, b_q, sb = quantized(100, 200, 400)  # ragged: partial last k-block and weight block
    yield pytest.param((a_q, sa, b_q, sb), {}, id="fprop bf16")
    yield pytest.param((a_q, sa.t().contiguous().t(), b_q, sb), dict(out_dtype=torch.float32), id="M-major scales fp32")
    a5, sa5, _, _ = quantized(100, 200, 400, torch.float8_e5m2, seed=1)
    yield pytest.param((a5, sa5, b_q, sb), dict(out_dtype=torch.float16), id="dgrad e5m2 fp16")
    g = generator(6)
    a_w, sa_w = R.quantize_blocks_ref(torch.randn(136, 400, generator=g), (1, 128))
    b_w, sb_w = R.quantize_blocks_ref(torch.randn(200, 400, generator=g), (1, 128))
    yield pytest.param((a_w, sa_w, b_w, sb_w), dict(out_dtype=torch.float32, b_block="1x128"), id="wgrad 1x128")


@pytest.mark.parametrize("args, kwargs", list(_blockwise_opcheck_cases()))
def test_op_passes_opcheck(args, kwargs):
    before = [t.clone() for t in args]
    with coda_cute.reference_on_cpu():
        result = torch.library.opcheck(torch.ops.coda.gemm_blockwise.default, args, kwargs,
                                       test_utils=BLOCKWISE_OPCHECKS)
        out = torch.ops.coda.gemm_blockwise(*args, **kwargs)
    assert set(result) == set(BLOCKWISE_OPCHECKS) and all(v == "SUCCESS" for v in result.values()), result
    # test_schema's checks: no input changed (bit for bit), and the output aliases none of them
    for t, b in zip(args, before):
        assert t.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8)) and t.stride() == b.stride()
    storage = out.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() != storage for t in args)
    assert out.dtype == kwargs.get("out_dtype", torch.bfloat16) and out.is_contiguous()


def test_scales_reach_the_kernel_in_layouts_its_tma_reads():
    """Our quantizers' layouts pass as they are: 1 x 128 scales M-major with rows padded to 128
    (``precision.block_scales_m_major``), the weight's 128 x 128 contiguous where its k-blocks are
    a multiple of 4. Others are copied into one, values kept: row-major 1 x 128 scales, an odd
    column stride, a misaligned slice, weight scales of 3 k-blocks. The kernel's view has stride 1
    along the contiguous mode and multiples of 4 elsewhere, also for modes of one element."""
    from coda_cute.epilogue.block_scales import scale_view, tma_block_scales
    from coda_cute.precision import block_scales_m_major

    sb = torch.randn(200, 3)
    padded = block_scales_m_major(200, 300, "cpu").copy_(sb)
    assert padded.stride() == (1, 256) and tma_block_scales(padded, True) is padded
    weight = torch.randn(7, 8)
    assert tma_block_scales(weight, False) is weight
    odd = torch.empty_strided((200, 3), (1, 201)).copy_(sb)
    for t, rows in ((sb, True), (odd, True), (padded[1:], True), (torch.randn(7, 3), False),
                    (weight.t().contiguous().t(), False)):
        got = tma_block_scales(t, rows)
        assert got is not t and torch.equal(got, t) and got.data_ptr() % 16 == 0
        view = scale_view(got, rows)
        inner = 0 if rows else 1
        assert view.stride(inner) == 1 and view.stride(1 - inner) % 4 == 0 and view.stride(2) % 4 == 0
        assert torch.equal(view[..., 0], t)
    one = block_scales_m_major(1, 100, "cpu").fill_(2.0)  # one row, one k-block
    view = scale_view(tma_block_scales(one, True), True)
    assert view.stride()[:2] == (1, 4) or view.stride(0) == 1 and view.stride(1) % 4 == 0


def test_stage_ring_ends_where_the_epilogue_buffers_start():
    """The stages' scale arrays sit after A's and B's; the epilogue's first buffer starts at the
    next 1024-byte boundary. Thirteen stages of ping-pong 64 x 64 scales end 128 bytes short of
    one: with a 13344-byte epilogue (the LM head's norm backward with gamma, one store buffer)
    that launch asked for 232480 bytes on the H200, 32 past the limit. The count now leaves
    room for the padding."""
    from coda_cute import dispatch
    from coda_cute.kernels.common.config import (SM90_SMEM_CAPACITY, ab_stage_bytes, block_scale_stage_bytes,
                                                 pipeline_stages, smem_bytes, stage_ring_bytes)

    cfg = GemmConfig(64, 64, 128, "pingpong", 2, 1)
    extra = block_scale_stage_bytes(cfg, False)
    assert (13 * extra) % 1024 == 1024 - 128
    assert pipeline_stages(cfg, 1, 13344, extra) == 12
    assert smem_bytes(cfg, 1, 13344, extra) <= SM90_SMEM_CAPACITY
    for c in dispatch.block_scaled_config_space():
        for b_rows in (False, True):
            e = block_scale_stage_bytes(c, b_rows)
            for st in range(1, 16):
                ring = stage_ring_bytes(c, 1, st, e)
                assert ring % 1024 == 0 and st * (ab_stage_bytes(c, 1) + e) <= ring < st * (ab_stage_bytes(c, 1) + e) + 1024
