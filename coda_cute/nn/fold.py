"""RMSNorm weights folded into the consumer's weight, W' = W * gamma[None, :], optionally computed
once per version of the weights instead of once per forward.

The fold (``torch.ops.coda.fold_gamma``) reads and writes the whole consumer weight (96 MiB for
Llama-3-8B's QKV, 448 MiB for gate/up), independent of the token count. Between two optimizer
steps the weights do not change, so every micro-batch forward (and every inference forward) could
reuse the same W'. :class:`FoldCache` with ``enabled=True`` keeps it, keyed by the identity,
storage and in-place version counter of W and gamma: an optimizer step, ``load_state_dict``,
``load_hf``, any in-place write or a replaced parameter refolds. Off by default, because writes
that bypass the version counter are invisible to it: ``p.data.copy_(...)`` or ``p.data -= ...``,
and frameworks that swap a parameter's storage in place (sharded data parallel). After such writes
call :meth:`FoldCache.clear` (``CodaLlama.clear_folds()``).

With autograd, each micro-batch's backward runs the fold's backward once,

    dW += dW' * gamma,        d gamma += sum_n dW'[n, :] * W[n, :],

exactly what a fresh ``W * gamma`` per forward gives; the cached node keeps W and gamma by
reference (they are the parameters) rather than as saved tensors, which a backward would free.
"""

from __future__ import annotations

import weakref

import torch

from ..ops.fold import fold_gamma, fold_gamma_backward, fold_gamma_impl


class _Fold(torch.autograd.Function):
    """W * gamma[None, :] whose backward may run once per forward that used the result."""

    @staticmethod
    def forward(ctx, w, gamma):
        # detach() shares the version counter: an in-place write to W or gamma shows up below.
        ctx.w, ctx.gamma = w.detach(), gamma.detach()
        ctx.versions = (w._version, gamma._version)
        return fold_gamma_impl(w, gamma)

    @staticmethod
    def backward(ctx, dw):
        if (ctx.w._version, ctx.gamma._version) != ctx.versions:
            # what autograd says of a saved tensor written in place: dW and d gamma would be
            # computed from the new values, not those the forward folded
            raise RuntimeError("coda_cute.nn.fold: W or gamma was modified in place (e.g. an "
                               "optimizer step) between the forward that folded them and this "
                               "backward; run the backward before updating the weights")
        return fold_gamma_backward(dw, ctx.w, ctx.gamma)


class FoldCache:
    """``cache(w, gamma)`` = W * gamma[None, :]. Enabled, the fold is kept and reused until W or
    gamma is replaced or written in place, or the grad or inference mode changes (a fold made
    without autograd has no backward; one made in inference mode cannot enter a graph). Disabled,
    and inside ``torch.compile``, every call folds."""

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self.clear()

    def clear(self):
        """Drop the fold (frees its memory; the next call folds again)."""
        self.key = self.refs = self.value = None

    def __call__(self, w: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        grad = torch.is_grad_enabled() and (w.requires_grad or gamma.requires_grad)
        if not self.enabled or torch.compiler.is_compiling():
            return fold_gamma(w, gamma)
        key = (w.data_ptr(), w._version, w.shape, w.dtype, gamma.data_ptr(), gamma._version, grad,
               torch.is_inference_mode_enabled())
        same = self.refs is not None and self.refs[0]() is w and self.refs[1]() is gamma
        if key != self.key or not same:
            self.value = _Fold.apply(w, gamma) if grad else fold_gamma_impl(w, gamma)
            self.key, self.refs = key, (weakref.ref(w), weakref.ref(gamma))
        return self.value

    # A copied or pickled module starts without a fold (the cached one may be a graph node, which
    # deepcopy refuses, and belongs to the original's parameters).
    def __deepcopy__(self, memo):
        return FoldCache(self.enabled)

    def __getstate__(self):
        return {"enabled": self.enabled}

    def __setstate__(self, state):
        self.__init__(state["enabled"])
