"""GPU tests of ``coda.embedding``'s backward kernel (``kernels.elementwise.embedding_backward``):
every row of the table written (into a NaN-poisoned output), equal to the
float64 sum of its tokens' gradient rows up to fp32 additions and one rounding, unused rows and
the padding row exactly zero, two runs bit for bit the same, next to torch's embedding backward;
ragged widths and table sizes, bf16 and fp32; bad ids raise before the gather."""

import pytest
import torch

from coda_cute.ops.embedding import backward_into

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("v, d, m", [(128256, 4096, 4096), (1003, 40, 999), (77, 2048, 5000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("padding_idx", [-1, 3])
def test_backward_kernel_is_the_rounded_sum_and_deterministic(v, d, m, dtype, padding_idx):
    ids = torch.randint(0, v, (m,), device="cuda")
    ids[: m // 4] = ids[: m // 4] % 7  # frequent tokens: long ranges
    ids[5] = 3
    grad = torch.randn(m, d, device="cuda").to(dtype)
    out = backward_into(torch.full((v, d), float("nan"), dtype=dtype, device="cuda"), grad, ids, padding_idx)
    again = torch.ops.coda.embedding_backward(grad, ids, v, padding_idx)
    assert out.dtype == dtype and out.shape == (v, d) and torch.equal(out, again)
    del again
    # the float64 sums on the used rows alone: a (V, d) float64 table and its temporaries are
    # tens of GB at V = 128256, too much next to other test workers on one GPU
    rows, slot = torch.unique(ids, return_inverse=True)
    exact = torch.zeros(len(rows), d, dtype=torch.float64, device="cuda").index_add_(0, slot, grad.double())
    mag = torch.zeros(len(rows), d, dtype=torch.float64, device="cuda").index_add_(0, slot, grad.double().abs())
    if padding_idx >= 0:
        exact[rows == padding_idx] = 0
        mag[rows == padding_idx] = 0
    got = out[rows].double()
    unit = 2.0 ** -8 if dtype == torch.bfloat16 else 0.0
    assert bool(((got - exact).abs() <= unit * exact.abs() + 2.0 ** -16 * mag).all())
    # every other row (the padding row among them) exactly zero: NaN counts as nonzero
    used = torch.zeros(v, dtype=torch.bool, device="cuda").index_fill_(0, ids, True)
    if padding_idx >= 0:
        used[padding_idx] = False
    assert not bool(torch.count_nonzero(out, dim=1)[~used].any())
    ref = torch.ops.aten.embedding_dense_backward(grad, ids, v, padding_idx, False)[rows].float()
    assert (got.float() - ref).norm() <= 1e-2 * ref.norm()


def test_module_gradient_through_the_op():
    w = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, 1000, (4, 333), device="cuda")
    g = torch.randn(4, 333, 256, device="cuda", dtype=torch.bfloat16)
    out = torch.ops.coda.embedding(w, ids)
    assert torch.equal(out, w.detach()[ids])
    out.backward(g)
    want = torch.zeros(1000, 256, dtype=torch.float64, device="cuda").index_add_(0, ids.reshape(-1), g.reshape(-1, 256).double())
    assert (w.grad.double() - want).norm() <= 4e-3 * want.norm()


def test_ids_outside_the_table_raise_before_any_device_assert():
    w = torch.randn(100, 64, device="cuda")
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 100\); found 100"):
        torch.ops.coda.embedding(w, torch.tensor([[1, 100, 2]], device="cuda"))
    torch.cuda.synchronize()  # the context is still usable
    assert torch.ops.coda.embedding(w, torch.tensor([[1]], device="cuda")).shape == (1, 1, 64)


@pytest.mark.parametrize("d", [64, 60])  # our kernel; torch's (rows of no 16-byte multiple)
def test_backward_ids_outside_the_table_raise(d):
    """The kernel's sorted row ranges never reach an id outside the table: its gradient row
    would be dropped silently. The check is read back after the launch."""
    ids = torch.randint(0, 100, (3, 77), device="cuda")
    ids[2, 5] = -3
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 100\); found -3"):
        torch.ops.coda.embedding_backward(torch.randn(3, 77, d, device="cuda", dtype=torch.bfloat16), ids, 100)
    torch.cuda.synchronize()


def test_model_forward_raises_for_bad_tokens_and_targets_at_its_end(monkeypatch):
    """CodaLlama's forward defers its device-data checks to its end (``deferred_checks``): the
    first host read-back comes after every kernel of the forward is queued, a bad token id or
    target still raises its ValueError before forward returns, and the context stays usable."""
    from coda_cute.nn.llama import CodaLlama, LlamaConfig
    from coda_cute.ops import checks

    cfg = LlamaConfig(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=1000, head_dim=64)
    model = CodaLlama(cfg, device="cuda")
    tokens = torch.randint(0, 1000, (2, 128), device="cuda")
    targets = torch.roll(tokens, -1, 1)
    reads = []
    sync = checks.PendingCheck.wait

    def wait(self):
        reads.append(getattr(checks._DEFERRED, "checks", None) is None)
        return sync(self)

    monkeypatch.setattr(checks.PendingCheck, "wait", wait)
    loss = model(tokens, targets)
    assert torch.isfinite(loss)
    # every op's wait was postponed (context active), then read back at the exit
    assert reads and reads.count(True) == reads.count(False) >= 2
    bad = tokens.clone()
    bad[1, 7] = 1000
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 1000\); found 1000"):
        model(bad, targets)
    bad_t = targets.clone()
    bad_t[0, 3] = -5
    with pytest.raises(ValueError, match="targets must lie in"):
        model(tokens, bad_t)
    torch.cuda.synchronize()
    assert torch.equal(model(tokens, targets), loss)
