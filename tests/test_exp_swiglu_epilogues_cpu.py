"""CPU checks of scripts/exp_swiglu_epilogues.py's arguments: ``--shape`` takes an MLP shape
(tokens, d, ffn) and refuses anything else by name."""

import argparse

import pytest

from helpers import load_script


@pytest.fixture(scope="module")
def exp():
    return load_script("exp_swiglu_epilogues")


def test_shape_argument(exp):
    assert exp.parse_shape("16384,8192,28672") == ("d8192/f28672/m16384", 16384, 8192, 28672)
    for bad in ("16384,8192", "16384,8192,28672,1", "a,b,c"):
        with pytest.raises(argparse.ArgumentTypeError, match="--shape wants TOKENS,D,FFN"):
            exp.parse_shape(bad)
