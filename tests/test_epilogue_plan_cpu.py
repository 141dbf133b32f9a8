"""CPU tests of the host-side planning around an epilogue tree: which lookups are read a sub-tile
early, how the shared memory is split between the tile-input ring and the A/B stages, and which
config the heuristic picks for trees with tile inputs."""

import pytest

from coda_cute import dispatch
from coda_cute import epilogue as E
from coda_cute.epilogue.runner import (COOP_TILE_INPUT_COST, _epilogue_factor,
                                       choose_config, crowded, epilogue_registers,
                                       row_state, tree_smem_bytes)
from coda_cute.kernels.common.config import GemmConfig, pipeline_stages
from coda_cute.kernels.epilogue.codegen import lookups_ahead
from coda_cute.kernels.sm90.epilogue import MIN_LOAD_STAGES, Sm90TreeEpilogue
from coda_cute.ops.coda_block import norm_rope_qkv_tree, norm_swiglu_tree, residual_norm_stats_tree

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


def test_heuristic_charges_cooperative_configs_for_tile_inputs():
    assert COOP_TILE_INPUT_COST > 0
    plain = E.Epilogue(E.store(E.acc(), "out"))
    assert _epilogue_factor(plain, COOP) == _epilogue_factor(norm_swiglu_tree(), COOP) == 1.0
    assert _epilogue_factor(residual_norm_stats_tree(), COOP) == 1.0 + COOP_TILE_INPUT_COST
    assert _epilogue_factor(residual_norm_stats_tree(), PP) == 1.0
    shape = (16384, 28672, 4096, 1, False, False, 132)
    for tree in (plain, norm_swiglu_tree(), residual_norm_stats_tree()):
        assert choose_config(tree, *shape).schedule == "pingpong"


def test_heuristic_keeps_per_row_state_off_crowded_configs():
    from coda_cute.ops.lm_head_ce import lm_head_ce_tree

    lm = lm_head_ce_tree()  # row sum, targets, lse (2), gather (2)
    assert row_state(lm) == 6 and row_state(E.Epilogue(E.store(E.acc(), "out"))) == 0
    assert epilogue_registers(lm, PP) == 128 + 4 * 6 and crowded(lm, PP)
    assert epilogue_registers(lm, COOP) == 128 + 2 * 6 and not crowded(lm, COOP)
    qk_norm = norm_rope_qkv_tree(1536, 128, True)  # + the per-head sum of squares
    assert row_state(qk_norm) == row_state(norm_rope_qkv_tree(1536, 128, False)) + 1
    shape = (16384, 32768, 4096, 1, False, False, 132)
    for tree in (lm, qk_norm):
        assert not crowded(tree, choose_config(tree, *shape))
    assert choose_config(norm_swiglu_tree(), *shape) == PP  # 1 value per row fits next to 128


def test_crowding_is_a_preference_not_a_rule():
    x = E.acc()
    for i in range(60):  # 60 row vectors: crowded on every config of the space
        x = x * E.row_vec(f"r{i}")
    tree = E.Epilogue(E.store(x, "out"))
    shape = (4096, 4096, 4096, 1, False, False, 132)
    assert all(crowded(tree, c) for c in dispatch.config_space(False))
    assert choose_config(tree, *shape) in dispatch.config_space(False)
