"""CPU checks of scripts/exp_saved_z_fp8.py: the error z's rounding adds to the MLP's gradients
grows with the format's coarseness, leaves dW_down alone (it does not read z), and adds to the
FP8 operands' error in quadrature (independent roundings)."""

import pytest
import torch

from helpers import load_script


@pytest.fixture(scope="module")
def exp():
    return load_script("exp_saved_z_fp8")


def test_errors_order_and_add_in_quadrature(exp):
    res = exp.errors(256, 256, 384, int(torch.randint(0, 2 ** 31, ())))
    for fp8 in (False, True):
        dz = [res[fp8, name]["dz'"] for name in ("bf16", "e4m3 1x128", "e5m2 1x128")]
        assert dz[0] < dz[1] < dz[2], dz
        assert len({res[fp8, name]["dW_down"] for name in exp.Z_FORMATS}) == 1
    assert res[False, "bf16"]["dW_down"] == 0.0  # exact operands: h is not rounded
    alone, operands, both = res[False, "e4m3 1x128"]["dz'"], res[True, "bf16"]["dz'"], res[True, "e4m3 1x128"]["dz'"]
    assert both == pytest.approx((alone ** 2 + operands ** 2) ** 0.5, rel=0.1)
