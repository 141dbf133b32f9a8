"""The in-place cross-entropy gradient kernel (``kernels/elementwise/ce_grad.py``) on the GPU,
against the fp32 reference of ``test_ce_grad_cpu.py`` (itself checked there against float64
``softmax - onehot``): ragged vocabularies in rows of a padded stride (the padding poisoned and
checked untouched), ignored rows with a NaN lse, targets at the edges of the last chunk, fresh
inputs each run."""

from __future__ import annotations

import pytest
import torch

from coda_cute.elementwise import cross_entropy_grad_
from coda_cute.kernels.elementwise import ce_grad
from test_ce_grad_cpu import _problem, ce_grad_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("m, v", [
    (37, 1000),  # one partial chunk
    (5, 33),  # V % 8 == 1: a ragged last vector
    (9, 32003),  # 8 chunks, the last ragged
    (130, 128256),  # Llama-3's vocabulary: 32 whole chunks
])
def test_kernel_is_its_reference(m, v):
    seed = int(torch.randint(0, 2 ** 31 - 1, ()))
    logits, lse, rstd, coef, targets, target_logit, ignored = _problem(m, v, seed, ce_grad.CHUNK)
    want_grad, want_partials = ce_grad_reference(logits, lse, rstd, coef, targets, target_logit)

    stride = -(-v // 8) * 8 + 8  # rows on 16-byte boundaries, with padding past V
    buf = torch.full((m, stride), float("nan"), dtype=torch.bfloat16, device="cuda")
    buf[:, :v] = logits.cuda()
    got_partials = cross_entropy_grad_(buf[:, :v], *(t.cuda() for t in (lse, rstd, coef, targets, target_logit)))
    got_grad = buf[:, :v].cpu()

    where = f"seed {seed}"
    assert torch.isnan(buf[:, v:]).all(), f"{where}: the kernel wrote past V"
    assert (got_grad[ignored] == 0).all() and (got_partials.cpu()[ignored] == 0).all(), where
    # the kernel's exp is ex2.approx (2 ulp in fp32): at most one bf16 rounding step apart
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=2 ** -7, atol=1e-6, msg=where)
    assert got_partials.shape == want_partials.shape and got_partials.dtype == torch.float32
    torch.testing.assert_close(got_partials.cpu(), want_partials, rtol=1e-4, atol=1e-4, msg=where)
