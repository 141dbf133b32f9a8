"""CPU tests of the cached gamma fold (coda_cute.nn.fold): W * gamma is computed once per version
of the weights, and gradients over several micro-batches match a fresh fold per forward."""

import pytest
import torch

from coda_cute.nn.fold import FoldCache


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(24, 16, generator=g).requires_grad_()
    gamma = (1 + 0.1 * torch.randn(16, generator=g)).requires_grad_()
    return w, gamma


def test_fold_is_reused_until_a_weight_changes():
    w, gamma = _params(0)
    cache = FoldCache()
    first = cache(w, gamma)
    assert cache(w, gamma) is first
    torch.testing.assert_close(first, w * gamma, rtol=0, atol=0)
    with torch.no_grad():
        w.add_(1.0)  # an optimizer step
    second = cache(w, gamma)
    assert second is not first
    torch.testing.assert_close(second, w * gamma, rtol=0, atol=0)
    with torch.no_grad():
        gamma.mul_(2.0)
        assert cache(w, gamma) is not second
        torch.testing.assert_close(cache(w, gamma), w * gamma, rtol=0, atol=0)


def test_fold_follows_the_grad_mode():
    w, gamma = _params(1)
    cache = FoldCache()
    with torch.no_grad():
        assert cache(w, gamma).grad_fn is None
    assert cache(w, gamma).grad_fn is not None
    with torch.no_grad():
        assert cache(w, gamma).grad_fn is None


def test_gradients_over_micro_batches_match_a_fresh_fold_each():
    w, gamma = _params(2)
    w2, gamma2 = (t.detach().clone().requires_grad_() for t in (w, gamma))
    xs = [torch.randn(5, 16) for _ in range(3)]
    cache = FoldCache()
    for x in xs:  # one cached fold, three backwards through it
        (x @ cache(w, gamma).t()).square().sum().backward()
        (x @ (w2 * gamma2).t()).square().sum().backward()
    torch.testing.assert_close(w.grad, w2.grad)
    torch.testing.assert_close(gamma.grad, gamma2.grad)


def test_backward_after_an_in_place_update_raises_like_autograd():
    w, gamma = _params(3)
    cache = FoldCache()
    loss = (torch.randn(5, 16) @ cache(w, gamma).t()).sum()
    with torch.no_grad():
        w.add_(0.5)
    with pytest.raises(RuntimeError, match="modified in place"):
        loss.backward()
