"""CPU tests of ``torch.ops.coda.lm_head_ce_train_fp8`` (the LM head + cross-entropy with its
three GEMMs in block-scaled FP8, the recipe's ``lm_head_fp8``): the reference path's loss and
gradients against float64 math next to the bf16 op's, the FP8 weight gradient on whole 16-token
chunks and the bf16 one on a ragged chunk, its fake implementation, bad input on every path, the
models' switch (``Fp8Recipe(lm_head_fp8=True)``) and evaluation staying bf16."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import coda_cute
from coda_cute import reference as R
from coda_cute.nn.llama import embedding_norm_stats
from coda_cute.ops import lm_head_ce as L
from coda_cute.ops.lm_head_ce_fp8 import cross_entropy_fp8
from helpers import flat_grads, generator, on_path, rel_err

EPS = 1e-5


def _inputs(m, d, v, seed):
    g = generator(seed)
    y = torch.randn(m, d, generator=g).bfloat16()
    w = (torch.randn(v, d, generator=g) * d ** -0.5 * 4).bfloat16()  # peaked softmax: a real gradient
    gamma = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16()
    t = torch.randint(0, v, (m,), generator=g)
    t[3] = -100
    with coda_cute.reference_on_cpu():
        ss = embedding_norm_stats(y)
    return y, w, ss, t, gamma


def _run(op, y, w, ss, t, gamma, **kw):
    leaves = [x.clone().requires_grad_() for x in (y, w, gamma)]
    with coda_cute.reference_on_cpu():
        loss = op(leaves[0], leaves[1], ss, EPS, t, -100, "mean", leaves[2], **kw)[0]
        (2.5 * loss).backward()  # dloss != 1 reaches every gradient
    return [loss.detach()] + [x.grad for x in leaves]


def _exact(y, w, ss, t, gamma):
    """The references' loss and gradients (ss standing for y's statistic, the ops' convention)
    in float64, for dloss = 2.5."""
    y64, w64, ss64, g64 = (x.double() for x in (y, w, ss, gamma))
    loss, _ = R.lm_head_ce_ref(y64, w64, ss64, EPS, t, -100, "mean", g64)
    dy, dw, dg = R.lm_head_ce_grad_ref(y64, w64, ss64, EPS, t, -100, "mean", g64,
                                       torch.tensor(2.5, dtype=torch.float64))
    return [loss, dy, dw, dg]


@pytest.mark.parametrize("m", [256, 200], ids=["fp8-wgrad", "ragged-bf16-wgrad"])
@pytest.mark.parametrize("e5m2", [False, True])
def test_loss_and_gradients_against_float64_next_to_the_bf16_op(m, e5m2):
    """FP8 rounds each GEMM operand (2^-4 relative for E4M3, 2^-3 for E5M2 gradients): errors
    several times the bf16 op's, bounded. With 200 tokens (no multiple of 16) the weight
    gradient's GEMM is the bf16 one (its dl' still comes from the FP8 logits)."""
    y, w, ss, t, gamma = _inputs(m, 128, 256, 1)
    exact = _exact(y, w, ss, t, gamma)
    fp8 = _run(torch.ops.coda.lm_head_ce_train_fp8, y, w, ss, t, gamma, e5m2_grads=e5m2)
    bf16 = _run(torch.ops.coda.lm_head_ce_train, y, w, ss, t, gamma)
    assert abs(float(fp8[0]) - float(exact[0])) < 1e-2 * float(exact[0])
    errors = {}
    for i, name in enumerate(("dy", "dw", "dgamma"), start=1):
        e8, e16 = rel_err(fp8[i].double(), exact[i]), rel_err(bf16[i].double(), exact[i])
        errors[name] = (e8, e16)
        assert e8 < 0.15, errors
    for name in errors:  # every GEMM's operands were quantized
        assert errors[name][0] > 2 * errors[name][1], errors


def test_chunks_add_up_to_the_whole(monkeypatch):
    """Several row chunks (the logits buffer's budget forced small): the reference's per-chunk
    weight gradient, whole 128-token blocks in each, is the one-chunk result."""
    y, w, ss, t, gamma = _inputs(384, 128, 256, 2)
    whole = _run(torch.ops.coda.lm_head_ce_train_fp8, y, w, ss, t, gamma)
    monkeypatch.setattr(L, "CHUNK_BYTES", 128 * 2 * 256)  # one 128-row chunk of logits
    assert L.plan_chunks(384, 256, 128)[0] == 128
    chunked = _run(torch.ops.coda.lm_head_ce_train_fp8, y, w, ss, t, gamma)
    for a, b in zip(whole, chunked):  # fp32 sums in another order, then one bf16 rounding
        assert rel_err(b.double(), a.double()) < 2e-3


def test_fake_outputs_are_the_cpu_outputs():
    y, w, ss, t, gamma = _inputs(64, 128, 256, 3)
    with coda_cute.reference_on_cpu():
        real = torch.ops.coda.lm_head_ce_train_fp8(y, w, ss, EPS, t, -100, "sum", gamma)
    with FakeTensorMode() as mode:
        fake = torch.ops.coda.lm_head_ce_train_fp8(*(mode.from_tensor(x) for x in (y, w, ss)), EPS,
                                                   mode.from_tensor(t), -100, "sum", mode.from_tensor(gamma))
    for r, f in zip(real, fake):
        assert r.shape == f.shape and r.dtype == f.dtype


@pytest.mark.parametrize("path", ["cpu", "fake"])
@pytest.mark.parametrize("case, match", [
    ("vocab", "vocabulary size V .* multiple of 16"),
    ("width", "model width d .* multiple of 16"),
    ("reduction", "reduction must be one of"),
])
def test_bad_input_raises_on_every_path(case, match, path):
    d, v = (136, 256) if case == "width" else (128, 250 if case == "vocab" else 256)
    y, w, ss, t, gamma = _inputs(32, d, v, 4)
    reduction = "none" if case == "reduction" else "mean"
    with on_path(path), pytest.raises(ValueError, match=match):
        torch.ops.coda.lm_head_ce_train_fp8(y, w, ss, EPS, t, -100, reduction, gamma)


@pytest.mark.parametrize("path", ["cpu", "fake"])
@pytest.mark.parametrize("op", ["lm_head_ce_train_fp8", "lm_head_ce"])
def test_no_tokens_are_refused_on_every_path(path, op):
    """The FP8 and bf16 ops alike (a raw division by zero and a zero range step before)."""
    y, w, ss, t, gamma = _inputs(32, 128, 256, 4)
    with on_path(path), pytest.raises(ValueError, match="y has no rows: the loss needs at least one token"):
        getattr(torch.ops.coda, op)(y[:0], w, ss[:0], EPS, t[:0], -100, "mean", gamma)


@pytest.mark.parametrize("path", ["cpu", "fake"])
def test_errors_name_the_weight_w_lm(path):
    y, w, ss, t, gamma = _inputs(32, 128, 256, 4)
    with on_path(path), pytest.raises(TypeError, match=r"coda\.lm_head_ce_train_fp8: w_lm must be torch\.bfloat16"):
        torch.ops.coda.lm_head_ce_train_fp8(y, w.float(), ss, EPS, t, -100, "mean", gamma)


def test_evaluation_takes_the_bf16_op():
    """Without a gradient the loss is ``coda.lm_head_ce``'s (bf16), bit for bit."""
    y, w, ss, t, gamma = _inputs(64, 128, 256, 5)
    with coda_cute.reference_on_cpu(), torch.no_grad():
        got = cross_entropy_fp8(y, w, ss, EPS, t, -100, "mean", gamma)
        want = torch.ops.coda.lm_head_ce(y, w, ss, EPS, t, -100, "mean", gamma)[0]
    assert torch.equal(got, want)


def test_models_put_the_lm_head_in_fp8_with_the_switch():
    """``apply_coda(model, Fp8Recipe(lm_head_fp8=True))`` on a tiny Llama (vocab 112): loss and
    gradients against the fp32 model, bounded; next to the FP8 decoder with the bf16 LM head,
    the same decoder, so where the two differ the head's own quantization shows: the LM head's
    gradient moves by several percent."""
    import test_hf_cpu as H
    from coda_cute.precision import Fp8Recipe

    # 64 tokens: whole 16-token blocks, the FP8 weight gradient
    want_loss, want, (loss8, got8, _), (loss88, got88, head8) = H.two_patches(
        "fp8", Fp8Recipe(lm_head_fp8=True), vocab=112, seq=32)
    assert head8._coda.cfg.precision.lm_head_fp8
    assert abs(loss88 - want_loss) < 2e-2 * abs(want_loss)
    e8 = rel_err(flat_grads(got8, want), flat_grads(want, want))
    e88 = rel_err(flat_grads(got88, want), flat_grads(want, want))
    assert e88 < 0.15, (e88, e8)
    head = "lm_head.weight"
    assert rel_err(got88[head], got8[head]) > 1e-2


def test_op_passes_opcheck():
    """Schema, autograd registration, fake tensors and AOT dispatch (the loss alone is
    differentiable; the gradient outputs are marked non-differentiable)."""
    y, w, ss, t, gamma = _inputs(64, 128, 256, 6)
    args = (y.requires_grad_(), w.requires_grad_(), ss, EPS, t, -100, "mean", gamma.requires_grad_())
    with coda_cute.reference_on_cpu():
        torch.library.opcheck(torch.ops.coda.lm_head_ce_train_fp8.default, args,
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
