"""How the CODA ops behave under ``torch.autocast``: the usual mixed-precision setup keeps fp32
master weights and lets autocast run each op in 16 bits.

:func:`bf16_under_autocast` registers an op's autocast rule (CUDA and CPU): inside an autocast
region its activation and weight arguments that are fp16 or fp32 are cast to bf16, whatever dtype
the region names (the kernels compute in bf16); fp32 statistics, RoPE frequencies, FP8 tensors
and scales pass unchanged; the op then runs with autocast off, and autograd carries the
gradients back to the arguments in their own dtype. (``torch.library.register_autocast`` casts
every floating-point argument, which would round the fp32 statistics the ops require.)
"""

from __future__ import annotations

import torch

_WIDE = (torch.float16, torch.float32)
_libs: list = []
#: qualname -> the positional indices its rule casts (read by ops.eager's dispatcher-free calls)
_CASTS: dict[str, tuple[int, ...]] = {}


def cast_indices(qualname: str):
    """The argument indices ``qualname``'s autocast rule casts to bf16; None without a rule."""
    return _CASTS.get(qualname)


def bf16_under_autocast(qualname: str, cast: tuple[int, ...]) -> None:
    """Register the autocast rule of ``coda::<name>`` (``qualname``): positional arguments at
    the indices ``cast`` go to bf16 when they are fp16 / fp32 tensors (or None, left alone)."""
    ns, name = qualname.split("::")
    _CASTS[qualname] = tuple(cast)
    lib = torch.library.Library(ns, "FRAGMENT")
    _libs.append(lib)
    overload = getattr(getattr(torch.ops, ns), name).default
    names = {overload._schema.arguments[i].name for i in cast}
    for device_type in ("cuda", "cpu"):
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def kernel(_keyset, *args, excluded=excluded, device_type=device_type, **kwargs):
            args = tuple(bf16_arg(a, device_type) if i in cast else a for i, a in enumerate(args))
            kwargs = {k: bf16_arg(v, device_type) if k in names else v for k, v in kwargs.items()}
            with torch._C._ExcludeDispatchKeyGuard(excluded):
                return overload(*args, **kwargs)

        lib.impl(name, kernel, key, with_keyset=True)


def bf16_arg(t, device_type: str):
    """``t`` in bf16 if it is an fp16 / fp32 tensor on ``device_type``; anything else unchanged."""
    if isinstance(t, torch.Tensor) and t.dtype in _WIDE and t.device.type == device_type:
        return t.to(torch.bfloat16)
    return t
