"""CPU tests of scripts/bench_compile.py's report (no compile): medians, maxima, the count over the
target and the first calls' builds and time come from the rounds as given."""

import importlib.util
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def bc():
    spec = importlib.util.spec_from_file_location("bench_compile", SCRIPTS / "bench_compile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_report_medians_maxima_and_first_calls(bc):
    def rnd(a, a_call, b, b_call):
        return {"k.a": {"kernel": a, "first_call": a_call, "builds": 2, "config": "c1"},
                "k.b": {"kernel": b, "first_call": b_call, "builds": 0, "config": "c1"}}

    rounds = [rnd(3.0, 5.0, 1.0, 0.1), rnd(2.4, 4.0, 1.5, 0.3), rnd(2.6, 4.4, 1.2, 0.2)]
    _, rows = bc.table(rounds)
    by = {r["kernel"]: r for r in rows}
    assert by["k.a"]["seconds"] == pytest.approx(2.6) and by["k.a"]["max"] == pytest.approx(3.0)
    assert by["k.a"]["first_call"] == pytest.approx(4.4) and by["k.a"]["builds"] == 2
    assert by["k.b"]["seconds"] == pytest.approx(1.2) and by["k.b"]["rounds"] == [1.0, 1.5, 1.2]
    assert bc.summary(rows) == ("2 kernels: median 1.90 s, max 2.60 s, 1 over 2 s; "
                                "2 builds for their first calls, 4.6 s in all")


def test_rounds_must_be_positive(bc, capsys):
    with pytest.raises(SystemExit):
        bc.main(["--rounds", "0"])
    assert "--rounds must be >= 1" in capsys.readouterr().err
