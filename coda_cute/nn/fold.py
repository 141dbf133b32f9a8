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
from ..ops.fp8_gemms import weight


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


class _PerVersion:
    """A value computed from some tensors, kept while each is the same object with the same
    storage and in-place version counter (and ``extra`` is unchanged), recomputed otherwise."""

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self.clear()

    def clear(self):
        """Drop the value (frees its memory; the next call computes it again)."""
        self.key = self.refs = self.value = None

    def _get(self, tensors: tuple, extra: tuple, compute):
        key = tuple((t.data_ptr(), t._version, t.shape, t.dtype) for t in tensors) + extra
        same = self.refs is not None and all(r() is t for r, t in zip(self.refs, tensors))
        if key != self.key or not same:
            self.value = compute()
            self.key, self.refs = key, tuple(weakref.ref(t) for t in tensors)
        return self.value

    # A copied or pickled module starts empty (a cached fold may be a graph node, which deepcopy
    # refuses, and belongs to the original's parameters).
    def __deepcopy__(self, memo):
        return type(self)(self.enabled)

    def __getstate__(self):
        return {"enabled": self.enabled}

    def __setstate__(self, state):
        self.__init__(state["enabled"])


class FoldCache(_PerVersion):
    """``cache(w, gamma)`` = W * gamma[None, :]. Enabled, the fold is kept and reused until W or
    gamma is replaced or written in place, or the grad or inference mode changes (a fold made
    without autograd has no backward; one made in inference mode cannot enter a graph). Disabled,
    and inside ``torch.compile``, every call folds."""

    def __call__(self, w: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        grad = torch.is_grad_enabled() and (w.requires_grad or gamma.requires_grad)
        if not self.enabled or torch.compiler.is_compiling():
            return fold_gamma(w, gamma)
        return self._get((w, gamma), (grad, torch.is_inference_mode_enabled()),
                         lambda: _Fold.apply(w, gamma) if grad else fold_gamma_impl(w, gamma))


class WeightQuantCache(_PerVersion):
    """``cache(w, pow2, row)`` = W's FP8 quantization as the FP8 sublayers take it (128 x 128
    blocks, or with ``row`` the row-wise recipe's), the flat [q, scales, qt] of
    ``ops.fp8_gemms.weight``, kept like :class:`FoldCache`'s fold: once per
    version of W (an optimizer step re-quantizes), so the micro-batches between two steps share
    one quantization instead of one per forward. W is the cached fold where the weight has a norm
    before it (hit as long as the fold is). No autograd: the sublayers' weight gradients come from
    the activations. Disabled, and inside ``torch.compile``, returns None (the op quantizes)."""

    def __call__(self, w: torch.Tensor, pow2: bool, row: bool = False):
        if not self.enabled or torch.compiler.is_compiling():
            return None
        with torch.no_grad():
            return self._get((w,), (bool(pow2), bool(row), torch.is_inference_mode_enabled()),
                             lambda: list(weight(w.detach(), pow2, row)))
