"""CPU tests of scripts/bench_fp8.py's pure-Python pieces: its shadows' GEMM lists are the
training step's GEMMs of the same sublayer (``scripts/train_shadow.step_gemms``), roles included
(the fast-accumulation shadow picks its ``use_fast_accum`` GEMMs by them)."""

import pytest

from helpers import load_script


@pytest.fixture(scope="module")
def mods():
    return load_script("bench_fp8"), load_script("train_shadow")


@pytest.mark.parametrize("heads, kv_heads, head_dim, d, f", [(32, 8, 128, 4096, 14336), (12, 4, 96, 1024, 2816)])
def test_shadow_gemms_are_the_sublayers_training_gemms(mods, heads, kv_heads, head_dim, d, f):
    bench, shadow = mods
    m = 2048
    c = dict(n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, dim=d, ffn_dim=f, n_layers=1,
             vocab_size=1000)
    step = shadow.step_gemms(c, m)
    role = {"fwd": "forward", "dgrad": "dgrad", "wgrad": "wgrad"}
    as_bench = lambda names: sorted((g.m, g.k, g.n, role[g.kind]) for g in step if g.linear in names)  # noqa: E731
    qkv = (heads + 2 * kv_heads) * head_dim
    assert sorted(bench.attention_gemms(m, d, qkv, heads * head_dim)) == as_bench(("qkv", "o"))
    assert sorted(bench.mlp_gemms(m, d, f)) == as_bench(("gate_up", "down"))


def test_quantize_bytes_count_each_recipes_reads_and_writes(mods):
    """Per element: one bf16 read and each layout's FP8 value plus a 4-byte scale per 128 in the
    block recipe; the row-wise recipe reads once more where a column amax is needed (y and dy2
    along the tokens, the weights), not for a tensor needed along K only, and dz''s and h's FP8
    rows once more for their transposes (the scales: one per row, left out); the epilogue writes."""
    bench, _ = mods
    m, d, f = 256, 128, 384
    rows = {r["tensor"]: r for r in bench.quantize_bytes(m, d, f)}
    fp8 = 1 + 4 / 128
    h_k, dz = rows["h (forward, along K)"], rows["dz' (both layouts)"]
    h_t = rows["h (along the tokens)"]
    assert h_k["separate"] == m * f * (2 + fp8) and h_k["row_wise"] == m * f * 3 and h_k["fused"] == m * f * fp8
    assert dz["separate"] == 2 * m * f * (2 + 2 * fp8) and dz["row_wise"] == 2 * m * f * (2 + 1 + 1 + 1)
    assert h_t["row_wise"] == m * f * (1 + 1)
    assert rows["dy2 (both layouts)"]["row_wise"] == m * d * (2 + 1 + 2 + 2 + 1)
    for r in rows.values():
        assert r["fused"] is None or r["fused"] < r["separate"]


def test_kept_weights_variant_is_the_self_quantizing_step(mods):
    """``..., weights kept`` passes the row-wise quantizations ``WeightQuantCache`` would keep, by
    the op's keyword names: the same outputs and gradients as the op quantizing them itself."""
    import torch

    import coda_cute
    from coda_cute.nn.llama import embedding_norm_stats

    bench, _ = mods
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ())))
    m, d, f = 40, 256, 128
    y = torch.randn(m, d, generator=g).bfloat16()
    w_gu = (torch.randn(2 * f, d, generator=g) * d ** -0.5).bfloat16()
    w_down = (torch.randn(d, f, generator=g) * f ** -0.5).bfloat16()
    dy2 = torch.randn(m, d, generator=g).bfloat16()
    runs = []
    with coda_cute.reference_on_cpu():
        ss = embedding_norm_stats(y)
        kept = bench.kept_weights(w_gu, w_down)
        for kw in ({}, kept):
            leaves = [t.clone().requires_grad_() for t in (y, w_gu, w_down)]
            out = torch.ops.coda.mlp_block_fp8(leaves[0], ss, leaves[1], leaves[2], 1e-5, row_scaling=True,
                                               fast_accum="all", **kw)[0]
            out.backward(dy2)
            runs.append([out] + [t.grad for t in leaves])
    assert sorted(kept) == ["down_q", "down_qt", "down_s", "gu_q", "gu_qt", "gu_s"]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert bench.kept_label("all") == "coda fp8 row-wise, fast accum (all), weights kept"


def test_two_by_two_row_sets_the_runner_switch_only_while_it_runs(mods):
    from coda_cute.epilogue import runner

    bench = mods[0]

    seen = []
    step = bench.with_switch(lambda: seen.append(runner.FP8_PINGPONG_2X2), "FP8_PINGPONG_2X2", True, runner)
    step()
    assert seen == [True] and runner.FP8_PINGPONG_2X2 is False
    assert bench.cluster_label("all") == "coda fp8 row-wise, fast accum (all), 2x2 clusters"


def test_memory_is_measured_with_every_other_steps_gradients_dropped(mods):
    """``drop_grads(keep)``: the other CODA steps' leaves lose their gradients, ``keep``'s (and a
    switched copy's, which runs the same leaves) stay."""
    import torch

    from coda_cute.epilogue import runner

    bench = mods[0]
    toy = lambda x, ss, wa, wb: ((x @ wa.t()) @ wb.t(),)  # noqa: E731
    x, wa, wb = torch.randn(5, 4), torch.randn(3, 4), torch.randn(4, 3)
    dy = torch.randn(5, 4)
    one, two = (bench.coda_step(toy, x, None, wa, wb, dy) for _ in range(2))
    switched = bench.with_switch(two, "POLL_FULL", True, runner)
    one(), switched()
    bench.drop_grads(switched)
    assert all(t.grad is None for t in bench._LEAVES[one])
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in bench._LEAVES[two])
    assert bench._LEAVES[switched] is bench._LEAVES[two]
