"""``torch.ops.coda.fold_gamma``: an RMSNorm weight folded into the weight that consumes the
normalized activations (coda-math section 2):

    RMSNorm(x) @ W.T = r * (x @ (W * gamma[None, :]).T),    r_m = (mean_k x[m, k]^2 + eps)^(-1/2)

    W'[n, k] = W[n, k] * gamma[k]             (forward; the product in fp32, rounded once)
    dW = dW' * gamma[None, :],  d gamma = sum_n dW'[n, :] * W[n, :]     (backward)

W (N, K) and gamma (K,) of one 16-bit dtype, W's rows 16-byte aligned, run our vectorized kernel
on Hopper; it reads and writes W at close to copy bandwidth, where torch's broadcast multiply
takes its unvectorized path (coda_cute.nn refolds gamma into the QKV and gate/up weights on every
forward that does not cache the fold). Other dtypes, layouts and devices compute ``W * gamma``
with torch, which gives the same values.
"""

from __future__ import annotations

import torch

from .eager import direct
from .. import dispatch
from ..compiler import get_kernel
from ..elementwise import ScaleColumnsSpec, fold_backward

OP = "coda.fold_gamma"
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def check_fold(w: torch.Tensor, gamma: torch.Tensor) -> None:
    if w.dim() != 2:
        raise ValueError(f"{OP}: w must be 2-D (N, K), got shape {tuple(w.shape)}")
    if gamma.dim() != 1 or gamma.shape[0] != w.shape[1]:
        raise ValueError(f"{OP}: gamma must be 1-D with one entry per column of w ({w.shape[1]}), "
                         f"got shape {tuple(gamma.shape)}")
    if not (w.is_floating_point() and gamma.is_floating_point()):
        raise TypeError(f"{OP}: w and gamma must be floating point, got {w.dtype} and {gamma.dtype}")
    if w.device != gamma.device:
        raise ValueError(f"{OP}: w is on {w.device} but gamma is on {gamma.device}")


def _kernel_applies(w: torch.Tensor, gamma: torch.Tensor) -> bool:
    """Our kernel's rules: one 16-bit dtype, 16-byte vectors along K, a Hopper GPU."""
    if not (w.is_cuda and w.dtype == gamma.dtype and w.dtype in KERNEL_DTYPES and w.numel()):
        return False
    if w.stride(1) != 1 or w.stride(0) % 8 or w.shape[1] % 8 or gamma.stride(0) != 1:
        return False
    if w.data_ptr() % 16 or gamma.data_ptr() % 16:
        return False
    try:
        return dispatch.arch_of(w.device) == "sm_90a"
    except NotImplementedError:
        return False


def fold_gamma_impl(w: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """W * gamma[None, :] without autograd (the op's forward)."""
    check_fold(w, gamma)
    if not _kernel_applies(w, gamma):
        return w * gamma
    out = torch.empty(w.shape, dtype=w.dtype, device=w.device)
    spec = ScaleColumnsSpec(str(w.dtype).removeprefix("torch."), dispatch.arch_of(w.device))
    get_kernel(spec).fn(w, gamma, out)
    return out


@torch.library.custom_op("coda::fold_gamma", mutates_args=())
def fold_gamma(w: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """W' = W * gamma[None, :]: w (N, K), gamma (K,); the result has torch's promoted dtype."""
    return fold_gamma_impl(w, gamma)


@fold_gamma.register_fake
def _(w, gamma):
    check_fold(w, gamma)
    return w.new_empty(w.shape, dtype=torch.result_type(w, gamma))


@torch.library.custom_op("coda::fold_gamma_backward", mutates_args=())
def fold_gamma_backward(dw: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dW, d gamma) of W' = W * gamma[None, :], in the dtypes of W and gamma, d gamma's products
    summed in fp32: one pass of our kernel (``kernels.elementwise.fold_backward``) where it
    applies, else torch. An op of its own so that a compiled backward calls it, not its parts."""
    check_fold(w, gamma)
    if dw.dtype == w.dtype and dw.is_contiguous() and _kernel_applies(w, gamma) and dw.data_ptr() % 16 == 0:
        return fold_backward(dw, w, gamma)
    return (dw * gamma).to(w.dtype), (dw.float() * w.float()).sum(0).to(gamma.dtype)


@fold_gamma_backward.register_fake
def _(dw, w, gamma):
    check_fold(w, gamma)
    return w.new_empty(w.shape), gamma.new_empty(gamma.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dw):
    w, gamma = ctx.saved_tensors
    gw, gg = fold_gamma_backward(dw, w, gamma)
    return (gw if ctx.needs_input_grad[0] else None), (gg if ctx.needs_input_grad[1] else None)


fold_gamma.register_autograd(_backward, setup_context=_setup)


# Python callers skip the dispatcher where nothing needs it (ops.eager)
fold_gamma = direct(fold_gamma)
fold_gamma_backward = direct(fold_gamma_backward)
