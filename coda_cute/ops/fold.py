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

``torch.ops.coda.scale(x, s, out_dtype=None)`` is the same kernel's scalar form, ``x * s`` with
``s`` one fp32 number on x's device, optionally cast (fp32 to 16-bit in the same pass): the LM
head's gradients times the incoming ``dloss`` (a device scalar, which torch's broadcast multiply
reads element by element: 0.9 TB/s on a (16384, 2048) bf16 gradient on the H200).
"""

from __future__ import annotations

from typing import Optional

import torch

from .eager import direct
from .. import dispatch
from ..compiler import get_kernel
from ..elementwise import ScaleColumnsSpec, fold_backward
from ..operands import dtype_name

OP = "coda.fold_gamma"
OP_SCALE = "coda.scale"
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


def check_fold_backward(dw: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor) -> None:
    """:func:`check_fold`, and dw: the gradient of W' = W * gamma, shaped like w (it would
    broadcast against gamma otherwise), floating point, on w's device."""
    check_fold(w, gamma)
    if not isinstance(dw, torch.Tensor) or tuple(dw.shape) != tuple(w.shape) or not dw.is_floating_point():
        raise ValueError(f"{OP}_backward: dw must be a floating-point tensor shaped like w {tuple(w.shape)}, got "
                         f"{getattr(dw, 'dtype', type(dw).__name__)} {tuple(getattr(dw, 'shape', ()))}")
    if dw.device != w.device:
        raise ValueError(f"{OP}_backward: dw is on {dw.device} but w is on {w.device}")


def _kernel_applies(w: torch.Tensor, gamma: torch.Tensor) -> bool:
    """Our kernel's rules: one 16-bit dtype, 16-byte vectors along K, a Hopper GPU."""
    if not (w.is_cuda and w.dtype == gamma.dtype and w.dtype in KERNEL_DTYPES and w.numel()):
        return False
    if w.stride(1) != 1 or w.stride(0) % 8 or w.shape[1] % 8 or gamma.stride(0) != 1:
        return False
    if w.data_ptr() % 16 or gamma.data_ptr() % 16:
        return False
    return _on_hopper(w)


def _on_hopper(t: torch.Tensor) -> bool:
    """Whether t's GPU runs the sm_90a build of these kernels."""
    try:
        return dispatch.arch_of(t.device) == "sm_90a"
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
    check_fold_backward(dw, w, gamma)
    if dw.dtype == w.dtype and dw.is_contiguous() and _kernel_applies(w, gamma) and dw.data_ptr() % 16 == 0:
        return fold_backward(dw, w, gamma)
    # contiguous whatever the gradient's strides (a transposed one too): the fake's layout
    return ((dw * gamma).to(w.dtype).contiguous(),
            (dw.float() * w.float()).sum(0).to(gamma.dtype))


@fold_gamma_backward.register_fake
def _(dw, w, gamma):
    check_fold_backward(dw, w, gamma)
    return w.new_empty(w.shape), gamma.new_empty(gamma.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dw):
    w, gamma = ctx.saved_tensors
    gw, gg = fold_gamma_backward(dw, w, gamma)
    return (gw if ctx.needs_input_grad[0] else None), (gg if ctx.needs_input_grad[1] else None)


fold_gamma.register_autograd(_backward, setup_context=_setup)


def check_scale(x: torch.Tensor, s: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """The op's rules; returns the result's dtype."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{OP_SCALE}: x must be a floating-point tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.numel() != 1:
        raise ValueError(f"{OP_SCALE}: s must be a float32 tensor of one element, got "
                         f"{getattr(s, 'dtype', type(s).__name__)} {tuple(getattr(s, 'shape', ()))}")
    if x.device != s.device:
        raise ValueError(f"{OP_SCALE}: x is on {x.device} but s is on {s.device}")
    if out_dtype is not None and not out_dtype.is_floating_point:
        raise TypeError(f"{OP_SCALE}: out_dtype must be a floating-point dtype or None, got {out_dtype}")
    return x.dtype if out_dtype is None else out_dtype


def _scale_kernel_applies(x: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """The kernel's rules: a contiguous 16-bit or fp32 x on Hopper whose last dim is a multiple
    of 8 and whose data is 16-byte aligned, a 16-bit result."""
    if out_dtype not in KERNEL_DTYPES or x.dtype not in KERNEL_DTYPES + (torch.float32,):
        return False
    if not (x.is_cuda and x.dim() and x.numel() and x.is_contiguous()):
        return False
    if x.shape[-1] % 8 or x.data_ptr() % 16:
        return False
    return _on_hopper(x)


@torch.library.custom_op("coda::scale", mutates_args=())
def scale(x: torch.Tensor, s: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """x * s in ``out_dtype`` (default x's), the product in fp32 and rounded once: x any shape,
    s a one-element fp32 tensor on x's device. Our vectorized kernel (one pass: read x, write the
    result) for contiguous 16-bit or fp32 x with a last dim that is a multiple of 8 and a 16-bit
    result on Hopper, torch otherwise (the same values)."""
    dtype = check_scale(x, s, out_dtype)
    if not _scale_kernel_applies(x, dtype):
        return (x.float() * s.reshape(())).to(dtype)
    rows = x.view(-1, x.shape[-1])
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    spec = ScaleColumnsSpec(dtype_name(dtype), dispatch.arch_of(x.device), scalar=True, in_dtype=dtype_name(x.dtype))
    get_kernel(spec).fn(rows, s.reshape(1), out.view(rows.shape))
    return out


@scale.register_fake
def _(x, s, out_dtype=None):
    return torch.empty_like(x, dtype=check_scale(x, s, out_dtype))


# Python callers skip the dispatcher where nothing needs it (ops.eager)
scale = direct(scale)
fold_gamma = direct(fold_gamma)
fold_gamma_backward = direct(fold_gamma_backward)
