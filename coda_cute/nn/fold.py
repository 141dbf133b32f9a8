"""RMSNorm weights folded into the consumer's weight, W' = W * gamma[None, :], computed once per
version of the weights instead of once per forward.

The fold reads and writes the whole consumer weight (96 MiB for Llama-3-8B's QKV, 448 MiB for
gate/up: 0.36 ms per layer on the H200), independent of the token count. Between two optimizer
steps the weights do not change, so every micro-batch forward (and every inference forward) can
reuse the same W'. :class:`FoldCache` keeps it, keyed by the storage and in-place version
counter of W and gamma (an optimizer step, ``load_hf`` or any in-place write refolds).

With autograd, each micro-batch's backward runs the fold's backward once,

    dW += dW' * gamma,        d gamma += sum_n dW'[n, :] * W[n, :],

exactly what a fresh ``W * gamma`` per forward gives; the cached node keeps W and gamma by
reference (they are the parameters) rather than as saved tensors, which a backward would free.
"""

from __future__ import annotations

import torch


class _Fold(torch.autograd.Function):
    """W * gamma[None, :] whose backward may run once per forward that used the result."""

    @staticmethod
    def forward(ctx, w, gamma):
        # detach() shares the version counter: an in-place write to W or gamma shows up below.
        ctx.w, ctx.gamma = w.detach(), gamma.detach()
        ctx.versions = (w._version, gamma._version)
        return w * gamma

    @staticmethod
    def backward(ctx, dw):
        if (ctx.w._version, ctx.gamma._version) != ctx.versions:
            # what autograd says of a saved tensor written in place: dW and d gamma would be
            # computed from the new values, not those the forward folded
            raise RuntimeError("coda_cute.nn.fold: W or gamma was modified in place (e.g. an "
                               "optimizer step) between the forward that folded them and this "
                               "backward; run the backward before updating the weights")
        return dw * ctx.gamma, (dw * ctx.w).sum(0)


class FoldCache:
    """``cache(w, gamma)`` = W * gamma[None, :], refolded only when W or gamma changed or the grad
    mode did (a fold made without autograd has no backward). Inside ``torch.compile`` it folds
    every call (the compiled graph fuses or hoists it itself)."""

    def __init__(self):
        self.key = None
        self.value = None

    def clear(self):
        """Drop the fold (frees its memory; the next call folds again)."""
        self.key = self.value = None

    def __call__(self, w: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return w * gamma
        grad = torch.is_grad_enabled() and (w.requires_grad or gamma.requires_grad)
        key = (w.data_ptr(), w._version, w.shape, gamma.data_ptr(), gamma._version, grad)
        if key != self.key:
            self.value = _Fold.apply(w, gamma) if grad else w * gamma
            self.key = key
        return self.value
