"""CPU tests of ``coda.embedding`` and its backward ``coda.embedding_backward``
(``kernels.elementwise.embedding_backward``): the reference path against torch's embedding and
its gradient (fp32 sums, in token order, padding_idx), the fake path, opcheck, the argument
rules on the CPU and fake paths, and the kernel's sm_90a build (16-byte vector loads and stores,
no spills)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import coda_cute
from coda_cute.compiler import compile_elementwise, spill_bytes
from coda_cute.elementwise import EmbeddingBackwardSpec
from coda_cute.reference import embedding_backward_ref
from helpers import generator, on_path


def ids_with_repeats(v, shape, seed):
    """Token ids over a small part of the table, so rows repeat (as frequent tokens do) and many
    rows stay unused."""
    g = generator(seed)
    return torch.randint(0, v // 4, shape, generator=g) * 3 % v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("padding_idx", [-1, 6])
def test_forward_is_torchs_and_the_gradient_the_exact_sum_rounded_once(dtype, padding_idx):
    """The forward is torch's gather; each gradient row is the float64 sum of its tokens' gradient
    rows up to the fp32 additions and one rounding to the table's dtype (torch's own CPU backward
    adds in bf16 and lands a few units in the last place off), the padding row and unused rows
    exactly zero."""
    v, d = 97, 40
    w = torch.randn(v, d, dtype=dtype, requires_grad=True)
    ids = ids_with_repeats(v, (3, 50), seed=1)
    ids[0, :5] = 6  # the padding row, used
    g = torch.randn(3, 50, d, dtype=dtype)
    with coda_cute.reference_on_cpu():
        out = torch.ops.coda.embedding(w, ids, padding_idx)
        out.backward(g)
    assert torch.equal(out, torch.nn.functional.embedding(ids, w.detach()))
    exact = torch.zeros(v, d, dtype=torch.float64).index_add_(0, ids.reshape(-1), g.reshape(-1, d).double())
    if padding_idx >= 0:
        exact[padding_idx] = 0
    mag = torch.zeros(v, d, dtype=torch.float64).index_add_(0, ids.reshape(-1), g.reshape(-1, d).double().abs())
    unit = 2.0 ** -8 if dtype == torch.bfloat16 else 0.0  # the one rounding to bf16
    # plus the fp32 additions' own rounding (2^-24 each, at most a few dozen terms here)
    assert bool(((w.grad.double() - exact).abs() <= unit * exact.abs() + 2.0 ** -18 * mag).all())
    used = torch.zeros(v, dtype=torch.bool).index_fill_(0, ids.reshape(-1), True)
    if padding_idx >= 0:
        used[padding_idx] = False
    assert not w.grad[~used].any() and w.grad[used].any()


def test_backward_reference_sums_in_token_order_in_fp32():
    """Each row is the fp32 sum in token order, rounded once: here 1 + 2^-9 x 4 in bf16 gives
    1 + 2^-7, where bf16 sums rounding after each add would stay at 1."""
    grad = torch.full((5, 8), 2.0 ** -9, dtype=torch.bfloat16)
    grad[0] = 1.0
    ids = torch.tensor([2, 2, 2, 2, 2])
    out = embedding_backward_ref(grad, ids, 4)
    assert out.dtype == torch.bfloat16 and torch.all(out[2] == 1 + 2.0 ** -7) and not out[[0, 1, 3]].any()


def test_opcheck_and_fake():
    w = torch.randn(64, 16, requires_grad=True)
    ids = ids_with_repeats(64, (2, 9), seed=2)
    with coda_cute.reference_on_cpu():
        torch.library.opcheck(torch.ops.coda.embedding.default, (w, ids, 3))
        torch.library.opcheck(torch.ops.coda.embedding_backward.default, (torch.randn(2, 9, 16), ids, 64, -1))
    with FakeTensorMode():
        fw = torch.empty(128256, 4096, dtype=torch.bfloat16, device="cuda")
        fids = torch.empty(4, 4096, dtype=torch.int64, device="cuda")
        out = torch.ops.coda.embedding(fw, fids)
        dw = torch.ops.coda.embedding_backward(torch.empty(4, 4096, 4096, dtype=torch.bfloat16, device="cuda"),
                                               fids, 128256)
    assert out.shape == (4, 4096, 4096) and out.dtype == torch.bfloat16 and dw.shape == (128256, 4096)


def bad_calls():
    w, ids = torch.randn(10, 8), torch.randint(0, 10, (2, 3))
    yield "embedding", (w, ids.float()), "ids must be an int32 / int64"
    yield "embedding", (w[0], ids), "weight must be a 2-D floating-point"
    yield "embedding", (w.long(), ids), "weight must be a 2-D floating-point"
    yield "embedding", (w, ids, 10), "padding_idx must be -1"
    yield "embedding_backward", (torch.randn(2, 4, 8), ids, 10), r"grad must be a floating-point tensor of ids.shape"
    yield "embedding_backward", (torch.randn(2, 3, 8), ids, 0), "at least one row"
    yield "embedding_backward", (torch.randn(2, 3, 8), ids, 10, -2), "padding_idx must be -1"


@pytest.mark.parametrize("path", ["cpu", "fake"])
@pytest.mark.parametrize("op, args, match", list(bad_calls()))
def test_bad_input_is_refused(path, op, args, match):
    with pytest.raises(ValueError, match=match), on_path(path):
        getattr(torch.ops.coda, op)(*args)


def test_ids_outside_the_table_are_refused_on_the_reference_path():
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 10\); found 10"), coda_cute.reference_on_cpu():
        torch.ops.coda.embedding(torch.randn(10, 8), torch.tensor([[1, 10]]))


@pytest.mark.parametrize("bad", [10, -1])
def test_backward_ids_outside_the_table_are_refused_on_the_reference_path(bad):
    """The GPU path reads the same check back (``PendingIndexCheck``): its kernel would drop the row."""
    ids = torch.randint(0, 10, (2, 5))
    ids[1, 3] = bad
    with pytest.raises(ValueError, match=rf"coda.embedding_backward: ids must lie in \[0, 10\); found {bad}"), \
            coda_cute.reference_on_cpu():
        torch.ops.coda.embedding_backward(torch.randn(2, 5, 8), ids, 10)


def test_autograd_backward_does_not_check_the_ids_again(monkeypatch):
    """The forward checked the saved ids; the backward's own check would read back again."""
    from coda_cute.ops import embedding as emb
    made = []
    real = emb.PendingIndexCheck
    monkeypatch.setattr(emb, "PendingIndexCheck", lambda *a, **k: made.append(a[0]) or real(*a, **k))
    w = torch.randn(10, 8, requires_grad=True)
    ids = torch.randint(0, 10, (2, 5))
    with coda_cute.reference_on_cpu():
        torch.ops.coda.embedding(w, ids).sum().backward()
    assert made == [] and w.grad is not None  # the CPU forward checks with check_index_range
    with coda_cute.reference_on_cpu():
        torch.ops.coda.embedding_backward(torch.randn(2, 5, 8), ids, 10)
    assert made == ["coda.embedding_backward"]


def test_cpu_tensors_need_the_reference_mode():
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        torch.ops.coda.embedding(torch.randn(10, 8), torch.tensor([1]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kernel_builds_with_vector_accesses_and_no_spills(dtype):
    """Per row and column group: 16-byte loads of the range's gradient rows (two for fp32,
    unrolled by 4, plus the remainder) and one 16-byte store (two for fp32) of the row."""
    k = compile_elementwise(EmbeddingBackwardSpec(dtype), keep_artifacts=True)
    per = 2 if dtype == "float32" else 1
    assert spill_bytes(k) == 0
    assert k.ptx.count("st.global.v4") == 8 * per  # ROWS rows per CTA, one store each
    assert k.ptx.count("ld.global.v4") >= 8 * 4 * per
