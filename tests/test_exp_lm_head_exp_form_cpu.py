"""CPU test of scripts/exp_lm_head_exp_form.py: the exp form of the cross-entropy gradient operand
(e' with per-tile shifts, the fix-up, the target's term from the others' share) against float64,
next to the bf16 dl' of today's training op (from bf16 logits) and of the recompute path."""

import importlib.util
import json
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_exp_form_is_more_accurate_than_the_bf16_operands(tmp_path):
    spec = importlib.util.spec_from_file_location("exp_lm_head_exp_form", SCRIPTS / "exp_lm_head_exp_form.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "errors.json"
    assert mod.main(["--rows", "64", "--vocab", "700", "--dim", "32", "--json", str(out)]) == 0
    errors = json.loads(out.read_text())["errors"]
    for name, e in errors.items():
        for i in (0, 1):  # G, dW
            assert e["exp"][i] < min(e["training"][i], e["recompute"][i], 2e-3), (name, e)  # bf16's 2^-9 at worst
            assert e["exp_written"][i] < 5e-3, (name, e)  # the target's entry rounded once, never cancelled
    # a confident model's target term needs its own fp32 term: inside e' its rounding dominates
    assert errors["confident"]["exp_target_in_e"][0] > 0.1 > 1e-3 > errors["confident"]["exp"][0]
    # the training op's p_t from bf16 logits: on confident rows its target term is rounding
    assert errors["confident"]["training"][0] > 0.5 > 1e-2 > errors["confident"]["recompute"][0]
    # 1 - p_t below the LSE's fp32 rounding: the recompute path loses the target's term too
    assert errors["certain"]["recompute"][0] > 0.5 and errors["certain"]["exp"][0] < 1e-3
    assert errors["spike"]["exp"][0] < 1e-3  # the rows whose tiles took other shifts (the fix-up)
