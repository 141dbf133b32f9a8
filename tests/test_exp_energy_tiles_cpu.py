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
