"""CPU tests of scripts/bench_step_gemms.py's report (no GPU): the time sums and, with
``--energy``, the joules per launch weighted by how often each ran."""

import importlib.util
from pathlib import Path

import pytest
from rich.console import Console

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_step_gemms.py"


@pytest.fixture(scope="module")
def sg():
    spec = importlib.util.spec_from_file_location("bench_step_gemms", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(energy: bool):
    rows = [dict(config="8b", launch="coda.mlp_block [dz+h+zdz]", count=2, m=16384, n=14336, k=4096, layout="kk",
                 tile="pingpong 128x128", fused_ms=3.0, plain_ms=2.7, cublas_ms=2.9),
            dict(config="8b", launch="coda.lm_head_ce_train [logits+lse+target_logit]", count=4, m=4096, n=128256,
                 k=4096, layout="kk", tile="pingpong 128x128", fused_ms=6.5, plain_ms=6.3, cublas_ms=6.4)]
    if energy:
        for r, (f, p, c) in zip(rows, ((2.2, 1.9, 2.0), (4.6, 4.4, 4.5))):
            r.update(fused_j=f, plain_j=p, cublas_j=c)
    return rows


def test_report_sums_time_and_energy_by_launch_count(sg):
    console = Console(record=True, width=220)
    sg.report(_rows(True), console)
    text = console.export_text()
    assert "sum over the step's launches: fused 32.00 ms, plain 30.60 ms, cuBLAS 31.40 ms" in text
    # 2 x 2.2 + 4 x 4.6 = 22.8 J fused, 21.4 plain, 22.0 cuBLAS
    assert "joules over the step's launches: fused 22.80 J, plain 21.40 J, cuBLAS 22.00 J (fused / cuBLAS " \
           "1.036, plain / cuBLAS 0.973)" in text
    assert "1.100" in text  # the SwiGLU launch's fused / cuBLAS joules


def test_report_without_energy_prints_no_joules(sg):
    console = Console(record=True, width=220)
    sg.report(_rows(False), console)
    text = console.export_text()
    assert "joules" not in text and "fused / cuBLAS 1.019" in text


def test_layout_names_the_training_layouts(sg):
    import torch

    x, w = torch.empty(64, 32), torch.empty(48, 32)
    assert sg.layout_of(x.stride(), w.t().stride()) == "kk"  # x @ W.T
    assert sg.layout_of(torch.empty(64, 48).stride(), w.stride()) == "kn"  # dY @ W
    assert sg.layout_of(torch.empty(64, 48).t().stride(), x.stride()) == "mn"  # dY.T @ X


def test_report_with_cooperative_takes_the_faster_tile_per_launch(sg):
    rows = _rows(False)
    rows[0].update(fused_coop_ms=3.2, plain_tile_ms=2.8)  # slower on the cooperative tile: the pick's 3.0 counts
    rows[1].update(fused_coop_ms=6.0, plain_tile_ms=6.72)  # faster: 4 x 6.0 instead of 4 x 6.5
    console = Console(record=True, width=220)
    sg.report(rows, console)
    text = console.export_text()
    assert "sum over the step's launches: fused 32.00 ms" in text
    # 2 x 3.0 + 4 x 6.0 = 30.0 ms, over cuBLAS's 31.4
    assert "each ping-pong tree on the faster of its tile and the cooperative one: 30.00 ms (/ cuBLAS 0.955)" in text
    assert "cooperative 6.000 (0.938 of cuBLAS); plain on pingpong 128x128 1.050 of cuBLAS" in text


def test_cooperative_plan_only_for_bf16_ping_pong_picks(sg):
    import torch

    class Plan:
        config = sg.COOPERATIVE

    a = torch.empty(256, 128, dtype=torch.bfloat16)
    assert sg.cooperative_plan(Plan(), a, a.t(), {}) is None  # cooperative already
    Plan.config = sg.COOPERATIVE.with_(schedule="pingpong", tile_n=128)
    assert sg.cooperative_plan(Plan(), a.float(), a.t().float(), {}) is None  # not bf16


def test_report_prints_the_per_round_ratios_where_timed(sg):
    """Rows timed by ``time_config`` carry the fused / cuBLAS per-round median and quartiles: the
    time table gains their column, the joules table does not."""
    rows = _rows(True)
    rows[0]["fused_per_round"], rows[1]["fused_per_round"] = [1.034, 1.021, 1.052], [1.016, 1.009, 1.02]
    console = Console(record=True, width=260)
    sg.report(rows, console)
    text = console.export_text()
    assert "fused / cuBLAS per round" in text.split("joules per launch")[0]
    assert "1.034 [1.021, 1.052]" in text and "1.016 [1.009, 1.020]" in text
    assert "per round" not in text.split("joules per launch")[1]
