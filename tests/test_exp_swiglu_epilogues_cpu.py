"""CPU checks of scripts/exp_swiglu_epilogues.py: ``--shape`` takes an MLP shape (tokens, d, ffn)
and refuses anything else by name; ``--split`` runs the tree on consecutive row bands of every
tensor with A's rows, into one set of outputs."""

import argparse
import types

import pytest
import torch

from helpers import load_script


@pytest.fixture(scope="module")
def exp():
    return load_script("exp_swiglu_epilogues")


def test_shape_argument(exp):
    assert exp.parse_shape("16384,8192,28672") == ("d8192/f28672/m16384", 16384, 8192, 28672)
    for bad in ("16384,8192", "16384,8192,28672,1", "a,b,c"):
        with pytest.raises(argparse.ArgumentTypeError, match="--shape wants TOKENS,D,FFN"):
            exp.parse_shape(bad)


def _spec(name, kind):
    return types.SimpleNamespace(name=name, kind=kind)


def test_split_launches_cover_every_row_once(exp, monkeypatch):
    """Each launch gets one band of A and the same band of the tree's row-bound inputs (tile,
    row vector, row sum) and of every output; the bands tile M with no gap and no overlap; a
    column vector as long as M, B and scalars pass whole; the call returns the outputs it wrote."""
    m, n = 10, 3
    tree = types.SimpleNamespace(
        inputs=[_spec("z", "tile"), _spec("ss", "row_sum"), _spec("scale_a", "row_vec"),
                _spec("scale_b", "col_vec"), _spec("eps", "scalar")],
        outputs=[_spec("dz", "store"), _spec("zdz", "row_reduce")])
    seen = []

    def fake_run(tree, a, b, inputs, config=None, use_fast_accum=False, outputs=None):
        if outputs is None:  # the whole-M call that allocates the outputs
            return {"dz": torch.full((m, 2 * n), -1.0), "zdz": torch.full((m, 1), -1.0)}
        rows = a.shape[0]
        assert all(inputs[k].shape[0] == rows for k in ("z", "ss", "scale_a"))
        assert inputs["scale_b"].shape == (m,) and inputs["eps"] == 1e-5 and b.shape == (4, n)
        assert outputs["dz"].shape[0] == rows and outputs["zdz"].shape[0] == rows
        outputs["dz"].copy_(a[:, :1].expand(rows, 2 * n))
        outputs["zdz"].fill_(len(seen))
        seen.append(rows)

    monkeypatch.setattr(exp.E, "run", fake_run)
    a = torch.arange(m, dtype=torch.float32)[:, None].expand(m, 4).contiguous()
    inputs = {"z": torch.zeros(m, 2 * n), "ss": torch.zeros(m, 4), "scale_a": torch.ones(m),
              "scale_b": torch.ones(m), "eps": 1e-5}
    out = exp.split_launches(tree, None, a, torch.zeros(4, n), inputs, 3, False)()
    assert seen == [3, 3, 4]
    assert torch.equal(out["dz"][:, 0], torch.arange(m, dtype=torch.float32))
    assert out["zdz"].flatten().tolist() == [0] * 3 + [1] * 3 + [2] * 4


def test_split_launches_refuse_outputs_without_a_rows(exp):
    tree = types.SimpleNamespace(inputs=[], outputs=[_spec("dz", "store"), _spec("dgamma", "col_reduce")])
    with pytest.raises(SystemExit, match=r"--split: outputs \['dgamma'\] do not have A's rows"):
        exp.split_launches(tree, None, torch.zeros(4, 4), torch.zeros(4, 4), {}, 2, False)
