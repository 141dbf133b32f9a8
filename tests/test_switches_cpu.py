"""CPU tests of scripts/switches.py: the benchmarks' experiment switches are parsed with a clear
error for bad input, and set only while the switched step runs."""

import pytest

from helpers import load_script


@pytest.fixture(scope="module")
def sw():
    return load_script("switches")


def test_parse_names_module_and_integer_value(sw):
    from coda_cute.ops import attention_fp8, mlp_fp8

    got = sw.parse(["SIDE_SMS_DOWN_WGRAD=16", "attention_fp8.SIDE_SMS_QKV_FORWARD=0", "mlp_fp8.SIDE_SMS_DOWN_DGRAD=-1"])
    assert got == [(mlp_fp8, "SIDE_SMS_DOWN_WGRAD", 16), (attention_fp8, "SIDE_SMS_QKV_FORWARD", 0),
                   (mlp_fp8, "SIDE_SMS_DOWN_DGRAD", -1)]
    assert sw.label(got[:2]) == "mlp_fp8.SIDE_SMS_DOWN_WGRAD=16, attention_fp8.SIDE_SMS_QKV_FORWARD=0"
    assert sw.parse(["SIDE_SMS_QKV_FORWARD=4"], ("attention_fp8",))[0][0] is attention_fp8
    with pytest.raises(ValueError, match="MODULE one of"):  # a caller that sets the MLP's alone
        sw.parse(["attention_fp8.SIDE_SMS_QKV_FORWARD=4"], ("mlp_fp8",))


@pytest.mark.parametrize("item, rule", [
    ("SIDE_SMS_DOWN_WGRAD", "NAME=VALUE"),                 # no value
    ("SIDE_SMS_DOWN_WGRAD=1.5", "VALUE an integer"),
    ("SIDE_SMS_DOWN_WGRAD=", "VALUE an integer"),
    ("SIDE_SMS_DOWN_WGRAD=--5", "VALUE an integer"),
    ("gemm.SIDE_SMS_DOWN_WGRAD=1", "MODULE one of"),       # not an op module with switches
    ("NO_SUCH_SWITCH=1", "not an integer switch"),
    ("FUSED_QUANT=1", "not an integer switch"),            # a bool switch is not an integer one
    ("OP=1", "not an integer switch"),                     # a string attribute
])
def test_parse_rejects_with_the_rule(sw, item, rule):
    with pytest.raises(ValueError, match=rule) as info:
        sw.parse([item])
    assert item in str(info.value)


def test_switched_sets_only_while_the_step_runs(sw):
    from coda_cute.ops import attention_fp8, mlp_fp8

    before = (mlp_fp8.SIDE_SMS_DOWN_WGRAD, attention_fp8.SIDE_SMS_QKV_FORWARD)
    settings = sw.parse([f"SIDE_SMS_DOWN_WGRAD={before[0] + 7}", f"attention_fp8.SIDE_SMS_QKV_FORWARD={before[1] + 3}"])
    seen = []

    def step():
        seen.append((mlp_fp8.SIDE_SMS_DOWN_WGRAD, attention_fp8.SIDE_SMS_QKV_FORWARD))
        return "loss"

    assert sw.switched(step, settings)() == "loss"
    assert seen == [(before[0] + 7, before[1] + 3)]
    assert (mlp_fp8.SIDE_SMS_DOWN_WGRAD, attention_fp8.SIDE_SMS_QKV_FORWARD) == before

    def failing():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        sw.switched(failing, settings)()
    assert (mlp_fp8.SIDE_SMS_DOWN_WGRAD, attention_fp8.SIDE_SMS_QKV_FORWARD) == before
