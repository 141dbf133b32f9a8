"""CPU tests of scripts/exp_energy_tiles.py's report (no GPU): joules and cool times summed over a
step by launch count, a config that could not run a shape counted at the usual pick's numbers,
and the least-joule tile per shape."""

import importlib.util
import sys
from pathlib import Path

import pytest
from rich.console import Console

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def et():
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location("exp_energy_tiles", SCRIPTS / "exp_energy_tiles.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(SCRIPTS))
    return mod


def _v(j, cool):
    return dict(cool_ms=cool, j=j, cap_ms=cool * 1.05, watts=700.0)


def test_report_sums_by_count_and_fills_skipped_configs(et):
    labels = list(et.CANDIDATES)
    a = {lb: _v(1.0 + 0.1 * i, 2.0) for i, lb in enumerate(labels)}
    a["cuBLAS"] = _v(1.05, 2.1)
    b = {lb: _v(2.0, 3.0) for lb in labels if lb != "coop128x256 2x1"}  # it could not run this one
    b["pp128x128 2x1"] = _v(2.5, 2.9)
    b["cuBLAS"] = _v(2.2, 3.1)
    rows = [dict(config="8b", m=16384, n=4096, k=4096, count=2, layout="kk", variants=a),
            dict(config="8b", m=4096, n=4096, k=128256, count=1, layout="kn", variants=b)]
    console = Console(record=True, width=400)
    et.report(rows, console)
    text = console.export_text()
    # cuBLAS 2 x 1.05 + 2.2; coop 128x256 2x1 (skipped on b: ping-pong's 2.5 J, 2.9 ms) 2 x 1.1 + 2.5
    assert "cuBLAS 4.30 J / 7.30 ms" in text
    assert "coop128x256 2x1 4.70 J / 6.90 ms" in text
    # least joules per shape: 1.0 (ping-pong) on a, 2.0 on b
    assert "least-joule tile per shape 4.00 J" in text
    assert "0.952 (0.952)" in text  # ping-pong on a: 1.0 / 1.05 J, 2.0 / 2.1 ms


def test_report_names_the_fp8_baseline(et):
    v = {lb: _v(1.0, 1.0) for lb in et.CANDIDATES_FP8}
    v["_scaled_mm fast"] = _v(0.9, 1.1)
    console = Console(record=True, width=400)
    et.report([dict(config="8b", fp8=True, m=16384, n=4096, k=4096, count=3, layout="kk", variants=v)], console)
    text = console.export_text()
    assert "8b FP8: joules per call at the cap, / _scaled_mm fast's" in text
    assert "_scaled_mm fast 2.70 J / 3.30 ms" in text and "coop128x128 2x1 3.00 J / 3.00 ms" in text


def test_fp8_shapes_leave_out_the_lm_head_and_go_k_major(et, monkeypatch):
    """The FP8 recipes keep the LM head in bf16; their GEMMs take both operands K-major, so the
    step's dgrad and wgrad layouts of one (M, N, K) count as one FP8 shape."""
    import torch

    vocab = et.TM.SPECS["8b"].vocab_size
    bf = torch.bfloat16
    fwd = (None, torch.empty(64, 32, dtype=bf), torch.empty(48, 32, dtype=bf).t(), {}, {}, None, 2)
    same_mnk_mn = (None, torch.empty(32, 64, dtype=bf).t(), torch.empty(32, 48, dtype=bf), {}, {}, None, 1)
    lm_head = (None, torch.empty(64, 32, dtype=bf), torch.empty(vocab, 32, dtype=bf).t(), {}, {}, None, 4)
    fp8_launch = (None, torch.empty(64, 32, dtype=torch.float8_e4m3fn), torch.empty(48, 32, dtype=bf).t(),
                  {}, {}, ("sa", "sb"), 1)
    monkeypatch.setattr(et, "step_launches", lambda name, layers: [fwd, same_mnk_mn, lm_head, fp8_launch])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    assert et.shapes_of("8b", 2, True) == [(((64, 32), (32, 1), (32, 48), (1, 32)), 3)]
    bf16 = dict(et.shapes_of("8b", 2, False))
    assert len(bf16) == 3 and sum(bf16.values()) == 7  # both layouts and the LM head, FP8 launch left out


def _model_rows(et, name, shapes, truth, depth, tile_depth=0, tree_depth=0):
    """Rows whose back-to-back times are the model's own for (rates, depths); ``shapes``: (M, N,
    K), (M, N, K, tile inputs) or (M, N, K, tile inputs, computes)."""
    out = []
    for shape in shapes:
        m, n, k, tiles, computes = (*shape, 0, False)[:5]
        row = dict(config=name, m=m, n=n, k=k, count=1, layout="kk", tile_inputs=tiles, computes=computes,
                   variants={})
        for lb, cfg in et.CANDIDATES.items():
            rate = truth[lb] * 1e12 / 2 / 1e3  # per ms, as fit() reads it
            row["variants"][lb] = _v(1.0, 1.0)
            row["variants"][lb]["cap_ms"] = et._predicted_ms(cfg, row, rate, depth, tile_depth, 132, tree_depth)
        out.append(row)
    return out


TRUTH = {"pp128x128 2x1": 680.0, "coop128x256 2x1": 740.0, "coop128x256 1x2": 720.0,
         "coop256x128 2x1": 725.0, "coop128x192 2x1": 730.0, "coop128x128 2x1": 640.0}


def test_fit_recovers_the_rates_and_epilogue_depth_it_was_made_from(et):
    """Rows made from the model with known rates and cooperative depth give those back, and the
    picks of a model fitted on one set land on the best configs of the other."""
    a = _model_rows(et, "8b", [(16384, 4096, 4096), (16384, 28672, 4096), (4096, 4096, 128256),
                               (28672, 4096, 16384)], TRUTH, 225)
    b = _model_rows(et, "1b", [(16384, 2048, 2048), (16384, 3072, 2048), (3072, 2048, 16384),
                               (16384, 2048, 8192)], TRUTH, 225)
    f = et.fit(a + b)
    assert (f.depth, f.tile_depth, f.tree_depth) == (225, 0, 0) and f.rms < 1e-9
    assert f.rates == pytest.approx(TRUTH, rel=1e-9)
    picked, best = et.picks_against_best(b, et.fit(a))
    assert picked == pytest.approx(best, rel=1e-9)


def test_fit_reports_the_cards_ping_pong_scale(et):
    """A 16-bit run's fit gives the card's ping-pong scale against the H200's table: rows made
    with ping-pong at 0.8 of its table ratio to cooperative 128 x 256 2x1 give back 0.80."""
    table = {lb: et.dispatch._rate(cfg, False) for lb, cfg in et.CANDIDATES.items()}
    truth = {**table, "pp128x128 2x1": 0.8 * table["pp128x128 2x1"]}
    rows = _model_rows(et, "8b", [(16384, 4096, 4096), (16384, 28672, 4096), (28672, 4096, 16384)], truth, 175)
    console = Console(record=True, width=300)
    et.report_fit(rows, console)
    assert "dispatch.PINGPONG_16_SCALE would be 0.80" in console.export_text()


def test_fit_separates_the_tile_inputs_depth(et):
    """Fused rows (``--fused``) with 0, 1 and 2 tile inputs at several K give back the depth each
    tile input adds to a cooperative tile, apart from the epilogue's own."""
    rows = _model_rows(et, "8b", [(16384, 4096, 4096, 0), (16384, 4096, 4096, 1), (16384, 4096, 14336, 1),
                                  (4096, 4096, 128256, 1), (16384, 28672, 4096, 0), (16384, 4096, 28672, 2)],
                       TRUTH, 150, 325)
    f = et.fit(rows)
    assert (f.depth, f.tile_depth, f.tree_depth) == (150, 325, 0) and f.rms < 1e-9
    assert f.rates == pytest.approx(TRUTH, rel=1e-9)


def test_fit_separates_the_computing_trees_depth(et):
    """Fused rows whose trees compute (more than a scaled store) give back the depth such a tree
    adds, apart from the plain epilogue's and the tile inputs'; with it, the picks put the
    computing trees at K = 4096 on ping-pong (as measured at the cap) and the plain GEMMs on the
    cooperative tile, which a fit without the tree depth gets wrong."""
    rows = _model_rows(et, "8b", [(16384, 4096, 4096, 0, False), (16384, 4096, 4096, 0, True),
                                  (16384, 4096, 14336, 1, True), (4096, 128256, 4096, 0, True),
                                  (16384, 28672, 4096, 0, False), (16384, 28672, 4096, 0, True),
                                  (16384, 4096, 28672, 2, True), (4096, 4096, 128256, 1, True)],
                       TRUTH, 175, 200, 300)
    f = et.fit(rows)
    assert (f.depth, f.tile_depth, f.tree_depth) == (175, 200, 300) and f.rms < 1e-9
    picked, best = et.picks_against_best(rows, f)
    assert picked == pytest.approx(best, rel=1e-9)
    fastest = {(r["k"], r["computes"]): min(r["variants"], key=lambda lb: r["variants"][lb]["cap_ms"])
               for r in rows}
    assert fastest[(4096, True)] == "pp128x128 2x1" and fastest[(4096, False)] == "coop128x256 2x1"
    blind = f._replace(tree_depth=0)
    assert et.picks_against_best(rows, blind)[0] > best * 1.001


def test_timed_row_takes_cool_times_in_turns_and_joules_back_to_back(et, monkeypatch):
    calls = []
    monkeypatch.setattr(et, "interleaved_medians",
                        lambda fns, rounds, settle_ms: {k: 2.0 + i for i, k in enumerate(fns)})
    monkeypatch.setattr(et, "joules_over_run", lambda fn, ms, run_ms: calls.append((ms, run_ms)) or dict(
        j_per_call=ms / 2, ms_per_call=ms * 1.1, watts=700.0))
    row = et.timed_row({"cuBLAS": None, "pp128x128 2x1": None}, dict(config="1b", m=1, n=2, k=3, count=2, layout="kn"),
                       600, 5, Console(record=True))
    assert calls == [(2.0, 600), (3.0, 600)]  # each run sized by its own cool time
    assert row["variants"]["pp128x128 2x1"] == dict(cool_ms=3.0, j=1.5, cap_ms=pytest.approx(3.3), watts=700.0)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_fused_rows_take_the_launches_of_their_precision(et, monkeypatch, fp8):
    """``--fused`` times the bf16 launches against torch.mm; ``--fused --fp8`` builds the step in
    the row-wise FP8 recipe with fast accumulation and times its FP8 launches (row-scaled, no
    block scales) against ``_scaled_mm`` on the FP8 candidates; a candidate whose run raises is
    left out."""
    import types

    import torch
    from coda_cute.kernels.epilogue.plain import gemm_tree

    plan = types.SimpleNamespace(op="coda.gemm", tree=gemm_tree("row", "row", "bfloat16"))
    f8 = torch.float8_e4m3fn
    bf16_launch = (plan, torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(48, 32, dtype=torch.bfloat16).t(),
                   {}, {}, None, 2)
    fp8_launch = (plan, torch.empty(64, 32, dtype=f8), torch.empty(48, 32, dtype=f8).t(), {}, {}, None, 3)
    blocked = (plan, torch.empty(64, 32, dtype=f8), torch.empty(48, 32, dtype=f8).t(), {}, {}, ("sa", "sb"), 1)
    precisions = []
    monkeypatch.setattr(et, "step_launches", lambda name, layers, precision=None: precisions.append(precision)
                        or [bf16_launch, fp8_launch, blocked])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(et.runner, "fits", lambda tree, cfg, ab: True)
    monkeypatch.setattr(et.runner, "spills", lambda tree, cfg, fp8, sms: False)
    calls = []

    def run(tree, a, b, i, config, use_fast_accum, op):
        calls.append((config.schedule, use_fast_accum))
        if config.tile_n == 192:
            raise ValueError("no")

    monkeypatch.setattr(et.runner, "run", run)
    monkeypatch.setattr(et, "timed_row", lambda fns, row, run_ms, rounds, console: (list(fns), row))
    (labels, row), = list(et.measure_fused("8b", 2, 600, 5, Console(record=True), fp8))
    assert row["fp8"] is fp8 and row["count"] == (3 if fp8 else 2) and (row["m"], row["n"], row["k"]) == (64, 48, 32)
    assert row["computes"] is False and row["tile_inputs"] == 0
    assert labels[0] == et.BASE[fp8]
    assert labels[1:] == [lb for lb in (et.CANDIDATES_FP8 if fp8 else et.CANDIDATES) if "128x192" not in lb]
    assert {fast for _, fast in calls} == {fp8}
    assert (precisions[0] is None) is (not fp8)
    if fp8:
        assert (precisions[0].scaling, precisions[0].fast_accum) == ("row", "all")
