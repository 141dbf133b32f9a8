"""CPU tests of the host-side planning around an epilogue tree: which lookups are read a sub-tile
early, which ``where`` splits a tile into two compiled passes, how the shared memory is split between the tile-input ring and the A/B stages, and which
config the heuristic picks for trees with tile inputs."""

import pytest

from coda_cute import dispatch
from coda_cute import epilogue as E
from coda_cute.epilogue import runner
from coda_cute.epilogue.runner import (COOP_TILE_INPUT_COST, COOP_TILE_INPUT_K, COOP_TREE_K,
                                       COOP_WIDE_TILE_INPUT_COST_FP8, _epilogue_factor, choose_config,
                                       computes, ranked_configs, spills, tree_smem_bytes)
from coda_cute.kernels.common.config import GemmConfig, pipeline_stages
from coda_cute.kernels.epilogue.codegen import assumed_walk, lookups_ahead, tile_uniform_split
from coda_cute.kernels.epilogue.edges import unmasked_max, zero_past_edge, zero_past_rows
from coda_cute.kernels.epilogue.rewrites import nonnegative
from coda_cute.kernels.sm90.epilogue import MIN_LOAD_STAGES, Sm90TreeEpilogue
from coda_cute.ops.lm_head_ce import logits_tree
from coda_cute.ops.qkv import norm_rope_qkv_tree
from coda_cute.ops.residual import residual_norm_stats_tree
from coda_cute.ops.swiglu import norm_swiglu_tree

COOP = GemmConfig(128, 256, 64, "cooperative", 2, 1)
PP = GemmConfig(128, 128, 64, "pingpong", 2, 1)


def test_lookups_ahead_with_their_read_stride():
    k = E.col_index() % 64 // 2
    per_element = E.lookup("f", E.const(0, "int32"), k)
    per_pair = E.lookup("g", E.row_vec("pos", "int32"), k)
    both = E.lookup("h", E.row_index(), k)
    rot = E.pairwise(lambda a, b: (a * per_pair + both, b * per_pair), E.acc())
    tree = E.Epilogue(E.store(rot + per_element, "out"), E.store(E.acc() * both, "aux"))
    assert {n.name: step for n, step in lookups_ahead(tree)} == {"f": 1, "g": 2, "h": 1}


def test_lookup_indices_cannot_depend_on_the_accumulator():
    # what makes every lookup safe to read a sub-tile early: no int32 value comes from acc
    with pytest.raises(E.EpilogueError, match="int32"):
        E.lookup("t", E.row_index(), E.cast(E.acc(), "float32"))
    with pytest.raises(E.EpilogueError):
        E.lookup("t", E.row_index(), E.col_index() + E.acc())


def test_qkv_tree_reads_inv_freq_ahead_once_per_pair():
    (node, step), = lookups_ahead(norm_rope_qkv_tree(5120, 128, False))
    assert node.name == "inv_freq" and step == 2


@pytest.mark.parametrize("cond, tile_n, split", [
    (E.col_index() < 256, 128, True), (E.col_index() < 256, 256, True), (E.col_index() >= 384, 128, True),
    (E.col_index() <= 255, 128, True), (E.col_index() > 127, 128, True), (E.col_index() < 192, 128, False),
    (E.col_index() <= 256, 128, False), (E.col_index() < 384, 256, False),
    (E.row_index() < 256, 128, False), (E.col_index() % 128 < 64, 128, False),
    (E.col_index() < E.row_index(), 128, False), (E.col_index() < 2.0 ** 31, 128, False)])
def test_tile_uniform_split_needs_a_column_threshold_on_a_tile_boundary(cond, tile_n, split):
    tree = E.Epilogue(E.store(E.where(cond, E.acc() * 2.0, E.acc()), "out"))
    assert (tile_uniform_split(tree, tile_n) is cond) is split


def test_qkv_tree_splits_q_k_tiles_from_v_tiles_and_prunes_each_side():
    tree = norm_rope_qkv_tree(5120, 128, True)
    cond = tile_uniform_split(tree, 128)
    assert cond is not None and tile_uniform_split(norm_rope_qkv_tree(5184, 128, True), 128) is None
    roots = [s.x for s in tree.sinks]
    kinds = {v: {type(n).__name__ for n in assumed_walk(roots, {id(cond): v})} for v in (True, False)}
    # V tiles: r * acc only, no RoPE angles, no QK-norm segment pass or weight reads
    assert {"Pairwise", "Lookup", "SegmentReduce", "ColVec"} <= kinds[True]
    assert not {"Pairwise", "Lookup", "SegmentReduce", "ColVec"} & kinds[False]
    assert lookups_ahead(tree, {id(cond): False}) == [] and len(lookups_ahead(tree, {id(cond): True})) == 1
    # a tile-input tree keeps one pass (its load ring advances inside the pass)
    tiled = E.Epilogue(E.store(E.where(E.col_index() < 256, E.acc(), E.tile("res")), "out"))
    assert Sm90TreeEpilogue(tiled, PP, 2).split is None
    assert Sm90TreeEpilogue(tree, PP, 2).split is cond


@pytest.mark.parametrize("x, zero", [
    (E.acc(), True), (E.row_vec("r") * E.acc() - E.acc(), True), (E.acc() * E.rsqrt(E.row_sum("s")), True),
    (E.square(-E.acc()), True), (E.exp(E.acc()), False),
    # tile inputs are zero-filled past N by their TMA loads
    (E.tile("t"), True), (E.cast(E.acc() + E.tile("t"), "bfloat16"), True),
    # column vectors are zero-padded past N: rsqrt(0) * 0 would be NaN there
    (E.acc() * E.col_vec("w"), False), (E.acc() + E.col_vec("b"), False), (E.acc() * E.rsqrt(E.col_vec("v")), False),
    # f(0) worked out: sigmoid(0) = 0.5, silu(0) = 0, 1 / 0 * 0 = NaN
    (E.sigmoid(E.acc()), False), (E.silu(E.acc()), True), (E.acc() * E.sigmoid(E.acc()) * (1 - E.acc()), True),
    (E.recip(E.acc()) * E.acc(), False), (E.acc() * E.exp(E.row_vec("lse")), True),
    (E.acc() / E.row_vec("r"), False), (E.where(E.col_index() < 64, E.acc(), 1.0), False),
    (E.pairwise(lambda g, u: E.silu(g) * u, E.acc()), True), (E.pairwise(lambda g, u: g + 1, E.acc()), False),
    # with N odd, column N pairs with column N - 1 (inside the problem)
    (E.pairwise(lambda a, b: (b, a), E.acc()), False),
    # a column-dependent expression of a row's number is no row number: 0 * (1 / (0 + r)) is NaN at r = 0
    (E.acc() * E.recip(E.acc() + E.row_vec("r")), False), (E.acc() * E.exp(E.row_vec("r") - E.acc()), False),
    # numbers are trusted for exact zeros and finiteness only (the kernel: fp32, fast approximations)
    (E.cast(E.acc() + 0.1, "bfloat16") - 0.1, False), (E.acc() * E.exp(E.acc() + 100.0), False),
    (E.cos(E.acc()) - 1.0, False), (E.acc() * E.exp(E.acc() + 10.0), True)])
def test_zero_past_edge(x, zero):
    # row and segment sums skip the bounds mask exactly for these summands
    assert zero_past_edge(x) is zero


@pytest.mark.parametrize("x, zero", [
    (E.acc(), True), (E.tile("t"), True), (E.exp(E.acc()), False), (E.silu(E.acc()) * E.tile("u"), True),
    # row vectors read row M - 1 past M, column vectors the columns' own: numbers from inside
    (E.acc() * E.row_vec("s") * E.col_vec("w"), True), (E.acc() * E.rsqrt(E.col_vec("v")), True),
    (E.acc() + E.col_vec("b"), False), (E.acc() + E.row_vec("r"), False),
    # pairs are columns of one row: no pair crosses M
    (E.pairwise(lambda a, b: (b, a), E.acc()), True),
    (E.where(E.row_index() < 64, E.acc(), 1.0), False), (E.where(E.col_index() < 64, E.acc(), 0.0), True)])
def test_zero_past_rows(x, zero):
    # column sums skip the row mask exactly for these summands
    assert zero_past_rows(x) is zero


def test_maxima_of_values_zero_past_the_edge_and_never_negative_go_unmasked():
    a, b = E.silu(E.acc()) * E.tile("u"), E.acc() * E.col_vec("w")
    assert nonnegative(E.absolute(a)) and nonnegative(E.maximum(E.absolute(a), b)) and nonnegative(E.square(b))
    assert not nonnegative(a) and not nonnegative(E.absolute(a) - 1.0) and not nonnegative(E.minimum(E.absolute(a), b))
    for axis in ("col", "row"):
        assert unmasked_max(E.absolute(a), axis)
        assert unmasked_max(E.maximum(E.absolute(a), E.absolute(E.acc() * E.row_vec("s"))), axis)
        assert not unmasked_max(a, axis)  # max over negative values: a zero past the edge could win
        assert not unmasked_max(E.exp(E.acc()), axis)  # >= 0, but 1 past the edge
    # a column vector is unknown past N, a number from inside past M
    assert unmasked_max(E.absolute(E.acc() * E.col_vec("w")), "row")
    assert not unmasked_max(E.absolute(E.acc() * E.col_vec("w")), "col")


def test_row_sums_of_values_zero_past_n_build_without_the_column_mask():
    """The residual stream's sum of squares and the SwiGLU backward's zdz add the columns past N
    unmasked (no select left in their builds); the LM head's dlogits statistic, whose softmax
    factor exp(logits - lse) is a column-dependent expression of a row's number, keeps its mask
    (a select per element)."""
    from coda_cute.compiler import KernelSpec, compile_gemm
    from coda_cute.ops.lm_head_ce import dlogits_tree
    from coda_cute.ops.swiglu import swiglu_backward_tree

    sums = [s.x for t in (residual_norm_stats_tree(), swiglu_backward_tree()) for s in t.sinks
            if s.kind == "row_reduce"]
    assert all(zero_past_edge(x) for x in sums)
    assert not zero_past_edge(next(s.x for s in dlogits_tree().sinks if s.kind == "row_reduce"))
    for tree, selects in ((residual_norm_stats_tree(), 0), (swiglu_backward_tree(), 0), (dlogits_tree(), 256)):
        k = compile_gemm(KernelSpec.of("bfloat16", "bfloat16", "k", "k", PP, tree, "sm_90a", 132), keep_artifacts=True)
        # dlogits: the target's where and the mask, per element of the tile (128 per thread)
        assert k.ptx.count("selp.f32") == selects


def test_residual_tree_keeps_four_ab_stages_on_128x256():
    epi = Sm90TreeEpilogue(residual_norm_stats_tree(), COOP, 2)
    assert epi.load_stages == MIN_LOAD_STAGES
    assert pipeline_stages(COOP, 2, epi.smem_bytes()) == 4


@pytest.mark.parametrize("cfg", [COOP, PP, GemmConfig(128, 192, 64, "pingpong", 1, 2)], ids=lambda c: c.name)
@pytest.mark.parametrize("tree", ["residual", "two tiles"])
def test_load_ring_never_costs_an_ab_stage(cfg, tree):
    t = (residual_norm_stats_tree() if tree == "residual" else
         E.Epilogue(E.store(E.acc() + E.tile("a") + E.tile("b"), "out")))
    epi = Sm90TreeEpilogue(t, cfg, 2)
    shallowest = pipeline_stages(cfg, 2, epi.smem_bytes(MIN_LOAD_STAGES))
    assert pipeline_stages(cfg, 2, epi.smem_bytes()) == shallowest
    assert epi.load_stages >= MIN_LOAD_STAGES
    deeper = epi.load_stages + 1
    if deeper <= min(4, epi.subtiles):  # a deeper ring would have cost a stage
        assert pipeline_stages(cfg, 2, epi.smem_bytes(deeper)) < shallowest


def test_smem_bytes_are_the_buffers_without_padding():
    # residual tree on COOP: y store ring 2 x 128x32 bf16, tile ring 2 x 128x32 bf16, 4 mbarriers
    assert tree_smem_bytes(residual_norm_stats_tree(), COOP) == 2 * 8192 + 2 * 8192 + 2 * 2 * 8


def test_heuristic_charges_cooperative_configs_for_tree_work_and_tile_inputs():
    """A bf16 tree deepens a cooperative tile's exposed epilogue by COOP_TREE_K elements of K when
    it computes more than a scaled store, and by COOP_TILE_INPUT_K per tile input: shares that
    shrink as the k-loop grows. Measured at the cap (8b step, exp_energy_tiles --fused): the
    computing trees without tile inputs (norm + SwiGLU, the LM head's logits) and those with one
    at K = 4096 run on ping-pong, the plain GEMM and the long loops (the residual at K = 14336,
    the LM head's dgrad chunks at K = the vocabulary) on cooperative 128 x 256."""
    assert COOP_TREE_K > 0 and COOP_TILE_INPUT_K > 0
    plain = E.Epilogue(E.store(E.acc(), "out"))
    depth = 4096 + dispatch.COOP_EPILOGUE_K
    assert _epilogue_factor(plain, COOP, 4096) == 1.0
    assert _epilogue_factor(norm_swiglu_tree(), COOP, 4096) == pytest.approx(1.0 + COOP_TREE_K / depth)
    res = residual_norm_stats_tree()
    assert _epilogue_factor(res, COOP, 4096) == pytest.approx(1.0 + (COOP_TREE_K + COOP_TILE_INPUT_K) / depth)
    assert _epilogue_factor(res, COOP, 128256) < _epilogue_factor(res, COOP, 4096)
    assert _epilogue_factor(res, PP, 4096) == _epilogue_factor(norm_swiglu_tree(), PP, 4096) == 1.0
    for tree in (plain, norm_swiglu_tree(), res, logits_tree()):
        assert ranked_configs(tree, 16384, 2048, 2048, 1, False, False, 132)[0] == PP
    assert ranked_configs(plain, 16384, 28672, 4096, 1, False, False, 132)[0] == COOP
    for tree in (norm_swiglu_tree(), res):
        assert ranked_configs(tree, 16384, 28672, 4096, 1, False, False, 132)[0] == PP
    assert ranked_configs(logits_tree(), 4096, 128256, 4096, 1, False, False, 132)[0] == PP
    assert ranked_configs(res, 16384, 4096, 14336, 1, False, False, 132)[0] == COOP
    assert ranked_configs(res, 4096, 4096, 128256, 1, False, False, 132)[0] == COOP


def test_h100_picks_cooperative_for_every_bf16_tree_but_the_wide_tile_input():
    """On an H100's card (``dispatch.card_of``) 16-bit ping-pong tiles run at PINGPONG_16_SCALE of
    their H200 rate: at the 8b step's shapes the trees the H200 keeps on ping-pong (norm + SwiGLU,
    norm + RoPE + QKV, the residual at K = 4096, the norm backward at K = 6144, the LM head's
    weight-gradient chunks) go cooperative 128 x 256, where they ran 3-25 % faster at the H100's
    cap; the SwiGLU backward's double-width z keeps it on ping-pong at the 1b, 3b and 8b steps'
    shapes (``runner.COOP_WIDE_TILE_INPUT_K_16``); FP8 picks do not change."""
    from coda_cute.ops.lm_head_ce import accumulate_tree, finish_dw_tree
    from coda_cute.ops.rmsnorm import norm_backward_tree
    from coda_cute.ops.swiglu import swiglu_backward_tree

    assert 0 < dispatch.PINGPONG_16_SCALE["h100"] < 1
    moved = [(norm_swiglu_tree(), 16384, 28672, 4096), (norm_rope_qkv_tree(4096, 128, False), 16384, 6144, 4096),
             (residual_norm_stats_tree(), 16384, 4096, 4096), (norm_backward_tree(True), 16384, 4096, 6144),
             (accumulate_tree("bfloat16"), 128256, 4096, 4096), (finish_dw_tree("bfloat16"), 128256, 4096, 4096)]
    for tree, m, n, k in moved:
        assert ranked_configs(tree, m, n, k, 1, False, False, 132)[0] == PP
        assert ranked_configs(tree, m, n, k, 1, False, False, 132, card="h100")[0] == COOP
    swiglu = swiglu_backward_tree()
    for card in ("h200", "h100"):
        for f, d in ((8192, 2048), (8192, 3072), (14336, 4096)):
            assert ranked_configs(swiglu, 16384, f, d, 1, False, False, 132, card=card)[0] == PP
    fp8 = [ranked_configs(t, m, n, k, 1, True, True, 132, card=card)[0] for t, m, n, k in moved[:3]
           for card in ("h200", "h100")]
    assert fp8[0::2] == fp8[1::2]


def test_card_of_reads_the_device_name(monkeypatch):
    """H100 and H800 names take the H100's card; an H200, another name, a CPU device and a CUDA
    device whose properties cannot be read (fake tensors without a GPU) the default."""
    import torch

    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H200", 2: "NVIDIA H800", 3: "NVIDIA H100 PCIe"}

    def props(index):
        if index not in names:
            raise RuntimeError("no such device")
        return (9, 0), 132, names[index]
    monkeypatch.setattr(dispatch, "_device_props", props)
    assert [dispatch.card_of(torch.device("cuda", i)) for i in range(5)] == ["h100", "h200", "h100", "h100", "h200"]
    assert dispatch.card_of(torch.device("cpu")) == dispatch.card_of("cpu") == dispatch.DEFAULT_CARD == "h200"


def test_fake_path_sizes_partials_by_the_card(monkeypatch):
    """The tile width the fake implementations size per-tile partials by (``rmsnorm.tile_n_of``)
    follows the device's card, as the launch's config does: the residual tree's norm-statistics
    partials at 16384 x 4096 x 4096 are 128 columns on the H200 (ping-pong) and 256 on an H100."""
    import torch

    from coda_cute.ops import rmsnorm

    monkeypatch.setattr(runner, "spills", lambda *a, **k: False)  # no build asked on the CPU
    rmsnorm._tile_n_on.cache_clear()
    cuda = torch.device("cuda", 0)
    widths = {}
    for card in ("h200", "h100"):
        monkeypatch.setattr(dispatch, "card_of", lambda device, card=card: card)
        widths[card] = rmsnorm.tile_n_of(residual_norm_stats_tree(), 16384, 4096, 4096, cuda)
    rmsnorm._tile_n_on.cache_clear()
    assert widths == {"h200": 128, "h100": 256}


def test_computes_tells_a_scaled_store_from_a_tree_that_computes():
    """The plain GEMM's trees (any scale modes and output dtype) and a store scaled by an
    RMSNorm's r (row-uniform, however it is computed) do not compute; a sum with a tile or a
    column vector, a second sink, a reduction or a per-element nonlinearity does."""
    from coda_cute.kernels.epilogue.plain import gemm_tree
    from coda_cute.ops.lm_head_ce import accumulate_tree
    from coda_cute.ops.proj import norm_proj_tree

    for modes in (("none", "none"), ("row", "row"), ("tensor", "tensor")):
        assert not computes(gemm_tree(*modes, "float32"))
    assert not computes(norm_proj_tree())
    assert not computes(E.Epilogue(E.store(E.acc() * E.col_vec("c") * 2.0, "out")))
    assert computes(E.Epilogue(E.store(E.acc() + E.col_vec("bias"), "out")))
    assert computes(accumulate_tree("float32"))
    assert computes(norm_swiglu_tree())
    assert computes(logits_tree())
    assert computes(E.Epilogue(E.store(E.exp(E.acc()), "out")))
    assert computes(E.Epilogue(E.row_reduce(E.acc(), "sum", "s")))


@pytest.mark.parametrize("block_scaled", [True, False], ids=["block-scaled", "row-wise"])
@pytest.mark.parametrize("m, d, f", [(16384, 2048, 8192), (16384, 4096, 14336), (8192, 8192, 28672)])
def test_fp8_heuristic_puts_only_the_wide_tile_input_on_ping_pong(m, d, f, block_scaled):
    """On the FP8 kernels (block-scaled, and the plain one the row-wise recipe's trees run on) a
    double-width tile input (the SwiGLU backward's z) costs a cooperative config its measured
    extra and moves the tree to ping-pong 64 x 128; the trees with plain tile inputs (the
    residual, the norm backward) stay cooperative, where they ran faster; the bf16 factors take
    it as a depth, a plain tile input's on the H200's card and its own on an H100's."""
    from coda_cute.ops.fp8_gemms import row_scaled
    from coda_cute.ops.rmsnorm import norm_backward_tree
    from coda_cute.ops.swiglu import swiglu_backward_tree

    coop = GemmConfig(128, 128, 128, "cooperative", 2, 1)
    swiglu = swiglu_backward_tree()
    assert _epilogue_factor(swiglu, coop, d, True) == 1.0 + COOP_WIDE_TILE_INPUT_COST_FP8
    assert _epilogue_factor(swiglu, coop, d) == pytest.approx(
        1.0 + (COOP_TREE_K + COOP_TILE_INPUT_K) / (d + dispatch.COOP_EPILOGUE_K))
    assert _epilogue_factor(swiglu, coop, d, card="h100") == pytest.approx(
        1.0 + (COOP_TREE_K + runner.COOP_WIDE_TILE_INPUT_K_16["h100"]) / (d + dispatch.COOP_EPILOGUE_K))
    assert _epilogue_factor(norm_backward_tree(True), coop, 2 * f, True) == 1.0 + 2 * COOP_TILE_INPUT_COST
    trees = (("swiglu", swiglu, (m, f, d)), ("norm", norm_backward_tree(True), (m, d, 2 * f)),
             ("residual", residual_norm_stats_tree(), (m, d, f)))
    picks = {name: choose_config(tree if block_scaled else row_scaled(tree), *shape, 1, True, False, 132, block_scaled)
             for name, tree, shape in trees}
    assert (picks["swiglu"].schedule, picks["swiglu"].tile_m) == ("pingpong", 64)
    assert picks["norm"].schedule == picks["residual"].schedule == "cooperative"


def test_fast_fp8_trees_take_the_16_bit_depths_and_the_wide_tile_its_factor():
    """The FP8 fast-accumulation kernels (the row-wise recipe) charge a cooperative tile the
    16-bit depths over their own plain depth, and a double-width tile input its FP8 factor on
    top. Measured at the cap (8b step, exp_energy_tiles --fused --fp8): the norm backward at
    K = 28672 and the residual at K = 14336 ran on cooperative 128 x 256 (0.95x / 1.05x
    _scaled_mm's joules, against 1.05x / 1.08x on ping-pong), the trees at K = 4096 and the norm
    backward at K = 6144 on ping-pong, the SwiGLU backward on ping-pong (1.36x against 1.58-1.65x)."""
    from coda_cute.ops.fp8_gemms import row_scaled
    from coda_cute.ops.rmsnorm import norm_backward_tree
    from coda_cute.ops.swiglu import swiglu_backward_tree

    fast = GemmConfig(128, 256, 128, "cooperative", 2, 1, fp8_fast_accum=True)
    depth = 28672 + dispatch.COOP_EPILOGUE_K_FP8_FAST
    norm = row_scaled(norm_backward_tree(True))
    assert _epilogue_factor(norm, fast, 28672, True) == pytest.approx(1.0 + (COOP_TREE_K + 2 * COOP_TILE_INPUT_K) / depth)
    swiglu = row_scaled(swiglu_backward_tree())
    assert _epilogue_factor(swiglu, fast, 4096, True) == pytest.approx(
        1.0 + COOP_TREE_K / (4096 + dispatch.COOP_EPILOGUE_K_FP8_FAST) + COOP_WIDE_TILE_INPUT_COST_FP8)
    assert _epilogue_factor(norm, fast.with_(schedule="pingpong", tile_n=128), 28672, True) == 1.0

    def pick(tree, m, n, k):
        c = choose_config(row_scaled(tree), m, n, k, 1, True, True, 132)
        return c.schedule, c.tile_m, c.tile_n

    assert pick(norm_backward_tree(True), 16384, 4096, 28672) == ("cooperative", 128, 256)
    assert pick(residual_norm_stats_tree(), 16384, 4096, 14336) == ("cooperative", 128, 256)
    for tree, shape in ((norm_backward_tree(True), (16384, 4096, 6144)), (residual_norm_stats_tree(), (16384, 4096, 4096)),
                        (norm_swiglu_tree(), (16384, 28672, 4096)), (swiglu_backward_tree(), (16384, 14336, 4096))):
        assert pick(tree, *shape) == ("pingpong", 128, 128)


def test_choose_config_takes_the_first_candidate_that_does_not_spill(monkeypatch):
    tree = norm_swiglu_tree()
    shape = (16384, 28672, 4096, 1, False, False, 132)
    ranked = ranked_configs(tree, *shape)
    asked = []

    def fake_spills(t, cfg, fp8, sms, block_scaled=False, b_rows=False):
        asked.append(cfg)
        return cfg in ranked[:2]

    monkeypatch.setattr(runner, "spills", fake_spills)
    assert choose_config(tree, *shape) == ranked[2] and asked == ranked[:3]
    monkeypatch.setattr(runner, "spills", lambda *a: True)  # spills everywhere: still a config
    assert choose_config(tree, *shape) == ranked[0]


def test_lm_head_and_qk_norm_picks_build_without_spills():
    """The two trees with the most per-row state, on the Llama shapes' configs (real sm_90a
    builds; these spilled on ping-pong 128x128 before the scheduler stopped holding registers)."""
    from coda_cute.ops.lm_head_ce import lm_head_ce_tree

    for tree, shape in ((lm_head_ce_tree(), (16384, 32768, 4096)),
                        (norm_rope_qkv_tree(6144, 128, True), (16384, 6144, 4096))):
        cfg = choose_config(tree, *shape, 1, False, False, 132)
        assert not spills(tree, cfg, False, 132)
        assert cfg in ranked_configs(tree, *shape, 1, False, False, 132)[:runner.SPILL_CHECKS]


def test_pingpong_takes_one_store_buffer_where_two_cost_an_ab_stage():
    """The SwiGLU backward (dz' twice the output's width, h, zdz) on ping-pong 128 x 128: two
    store buffers per output leave five A/B stages, one leaves six, so it takes one, claimed
    after each sub-tile's math, and its build stays spill-free. Where the second buffer costs
    no stage (the residual tree), or on cooperative configs, nothing changes."""
    from coda_cute.compiler import KernelSpec, compile_gemm, spill_bytes
    from coda_cute.kernels.sm90 import epilogue as EPI
    from coda_cute.ops.swiglu import swiglu_backward_tree

    tree = swiglu_backward_tree()
    epi = Sm90TreeEpilogue(tree, PP, 2)
    assert (epi.stages, epi.late_claim) == (1, True) and pipeline_stages(PP, 2, epi.smem_bytes()) == 6
    EPI.SUBTILE_BUFFERS = 2
    try:
        assert pipeline_stages(PP, 2, Sm90TreeEpilogue(tree, PP, 2).smem_bytes()) == 5
    finally:
        EPI.SUBTILE_BUFFERS = None
    assert spill_bytes(compile_gemm(KernelSpec.of("bfloat16", "bfloat16", "k", "k", PP, tree, "sm_90a", 132))) == 0
    assert Sm90TreeEpilogue(residual_norm_stats_tree(), PP, 2).stages == 2
    assert Sm90TreeEpilogue(tree, COOP, 2).stages == 2


def test_segment_max_shift_builds_without_spills():
    """exp(x - max over the 128-column segment) stored, x = acc * r (the shifted exponentials of
    a softmax over each segment, r taken out of the max): real sm_90a builds, spill-free, on
    ping-pong 128 x 128 with the LM head's (max, sum exp) partials beside it, and alone on
    cooperative 128 x 256 (with the partials as well, that build spills 176 bytes)."""
    from coda_cute.compiler import KernelSpec, compile_gemm, spill_bytes
    from coda_cute.ops.rmsnorm import rstd_node

    x = E.acc() * rstd_node()
    shifted = E.store(E.exp(x - E.segment_reduce(x, "max", 128)), "e", "bfloat16")
    # |acc| is zero past N and never negative: its segment max takes those columns unmasked
    amax = E.store(E.acc() / (E.segment_reduce(E.absolute(E.acc()), "max", 128) + 1.0), "a", "bfloat16")
    assert unmasked_max(E.absolute(E.acc())) and not unmasked_max(E.acc())
    for cfg, tree in ((PP, E.Epilogue(shifted, E.row_reduce(x, "lse", "lse"))), (COOP, E.Epilogue(shifted)),
                      (PP, E.Epilogue(amax))):
        assert spill_bytes(compile_gemm(KernelSpec.of("bfloat16", "bfloat16", "k", "k", cfg, tree, "sm_90a", 132))) == 0


def test_cooperative_elementwise_trees_get_wider_sub_tiles():
    from coda_cute.kernels.epilogue.plain import gemm_tree

    plain = gemm_tree("row", "row", "bfloat16")
    fp8_coop = GemmConfig(128, 128, 128, "cooperative", 2, 1)
    assert Sm90TreeEpilogue(plain, fp8_coop, 1).epi_tile == (128, 128)
    assert Sm90TreeEpilogue(plain, COOP, 2).epi_tile == (128, 64)  # 128 accumulator registers
    assert Sm90TreeEpilogue(plain, GemmConfig(128, 192, 128, "cooperative", 2, 1), 1).epi_tile == (128, 64)
    assert Sm90TreeEpilogue(plain, PP, 2).epi_tile == (64, 32)  # ping-pong hides its epilogue
    # a tile stored as one sub-tile needs one store buffer (claimed just before it is written):
    # 32 KB of epilogue smem leave six 32 KB A/B stages
    wide = Sm90TreeEpilogue(plain, fp8_coop, 1)
    assert wide.stages == 1 and wide.smem_bytes() == 128 * 128 * 2
    assert pipeline_stages(fp8_coop, 1, wide.smem_bytes()) == 6
    # more than one sub-tile per tile: a second buffer lets one sub-tile's store run under the
    # next one's math
    assert Sm90TreeEpilogue(plain, COOP, 2).stages == 2
    # an explicit stage count is kept: the sub-tile narrows until it fits next to 5 stages
    five_cfg = GemmConfig(128, 192, 128, "cooperative", 2, 1, stages=5)
    five = Sm90TreeEpilogue(plain, five_cfg, 1)
    assert five.epi_tile == (128, 32)
    assert pipeline_stages(five_cfg, 1, five.smem_bytes()) == 5
    # trees with tile inputs or reductions keep the narrow sub-tiles their rings are sized for
    assert Sm90TreeEpilogue(residual_norm_stats_tree(), fp8_coop, 1).epi_tile == (128, 32)


def test_two_by_two_switch_widens_only_fp8_fast_ping_pong_picks(monkeypatch):
    """``runner.FP8_PINGPONG_2X2`` (an experiment switch): an FP8 fast-accumulation ping-pong pick
    on 2x1 takes 2x2 unless that build spills; every other pick stands, and so does every pick
    with the switch off."""
    from coda_cute.ops.fp8_gemms import row_scaled

    tree = row_scaled(norm_swiglu_tree())
    fast = (16384, 28672, 4096, 1, True, True, 132)
    others = [(16384, 28672, 4096, 1, True, False, 132),  # two-level FP8
              (16384, 28672, 4096, 1, False, False, 132),  # bf16
              (16384, 4096, 28672, 1, True, True, 132)]  # long K: a cooperative pick
    spilling = set()
    monkeypatch.setattr(runner, "spills", lambda t, cfg, *a, **kw: cfg in spilling)
    pick = choose_config(tree, *fast)
    assert pick.schedule == "pingpong" and (pick.cluster_m, pick.cluster_n) == (2, 1)
    off = [choose_config(tree, *shape) for shape in others]
    assert off[2].schedule == "cooperative"
    monkeypatch.setattr(runner, "FP8_PINGPONG_2X2", True)
    assert choose_config(tree, *fast) == pick.with_(cluster_n=2)
    assert [choose_config(tree, *shape) for shape in others] == off
    spilling.add(pick.with_(cluster_n=2))
    assert choose_config(tree, *fast) == pick
