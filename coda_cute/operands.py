"""GEMM operand rules shared by every op: dtypes, shapes, layouts and TMA alignment.

The kernels take A as (M, K, L), B as (N, K, L) and (M, N)-shaped tensors as (M, N, L) views;
these helpers validate torch tensors against the rules the Hopper kernels need and build those
views without copies. Every failure is a clear exception naming the argument and the rule.
"""

from __future__ import annotations

import torch

WIDE = (torch.bfloat16, torch.float16)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def pointer_offset(t: torch.Tensor) -> int:
    """Bytes by which ``t``'s data pointer misses a 16-byte boundary. Fake and meta tensors (the
    tracing path) have no real pointer: their storage offset decides, as allocations are
    16-byte aligned."""
    from torch._subclasses.fake_tensor import is_fake

    if t.device.type == "meta" or is_fake(t):
        return t.storage_offset() * t.element_size() % 16
    return t.data_ptr() % 16


def check_pointer_aligned(t: torch.Tensor, name: str, op: str) -> None:
    off = pointer_offset(t)
    if off:
        raise ValueError(f"{op}: {name}'s data pointer must be 16-byte aligned (got offset {off} "
                         "bytes); use a fresh or .contiguous() tensor")


def check_operands(a, b, op: str):
    """Shape and dtype rules for the GEMM operands. Returns (M, N, K, L, is_fp8)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"{op}: a and b must be torch.Tensors")
    if a.dim() not in (2, 3) or b.dim() != a.dim():
        raise ValueError(
            f"{op}: a and b must both be 2-D (torch.mm) or both 3-D (torch.bmm); "
            f"got a.dim()={a.dim()}, b.dim()={b.dim()}"
        )
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(
            f"{op}: inner dimensions differ: a is {tuple(a.shape)} (K={a.shape[-1]}), "
            f"b is {tuple(b.shape)} (K={b.shape[-2]})"
        )
    batch = 1
    if a.dim() == 3:
        if a.shape[0] != b.shape[0]:
            raise ValueError(f"{op}: batch sizes differ: a has {a.shape[0]}, b has {b.shape[0]}")
        batch = a.shape[0]
    fp8 = a.dtype in FP8
    if fp8 != (b.dtype in FP8):
        raise TypeError(f"{op}: cannot mix FP8 and 16-bit operands: a is {a.dtype}, b is {b.dtype}")
    if not fp8 and (a.dtype not in WIDE or b.dtype != a.dtype):
        raise TypeError(
            f"{op}: a and b must be both bfloat16, both float16, or both FP8 "
            f"(float8_e4m3fn / float8_e5m2); got a={a.dtype}, b={b.dtype}"
        )
    return a.shape[-2], b.shape[-1], a.shape[-1], batch, fp8


def _unit(dim_extent: int, stride: int) -> bool:
    return stride == 1 or dim_extent == 1


def operand_view(t: torch.Tensor, name: str, transpose: bool, other_name: str, op: str):
    """View ``t`` as the kernel's (rows, K, L) operand; returns (view, major) with major "k" when
    K is the contiguous dimension. Strides of extent-1 dims are replaced by TMA-legal ones."""
    x = t.transpose(-1, -2) if transpose else t
    x = x.unsqueeze(0) if x.dim() == 2 else x
    x = x.permute(1, 2, 0)  # (rows, K, L)
    rows, kk, _ = x.shape
    s_rows, s_k, _ = x.stride()
    # With K == 1 both dims look unit-stride; a contiguous (rows, 1) operand must then be
    # rows-major, since its row stride (1 element) is no legal K-major TMA stride.
    if _unit(kk, s_k) and not (kk == 1 and rows > 1 and s_rows == 1):
        major = "k"
    elif _unit(rows, s_rows):
        major = other_name
    else:
        raise ValueError(
            f"{op}: {name} has strides {tuple(t.stride())}: one of its last two dimensions "
            f"must be contiguous (stride 1); call .contiguous() first"
        )
    return tma_view(x, name, major == "k", op=op), major


def mn_view(t: torch.Tensor):
    """An (M, N) or (L, M, N) tensor as the kernel's (M, N, L)."""
    return t.unsqueeze(0).permute(1, 2, 0) if t.dim() == 2 else t.permute(1, 2, 0)


def tma_view(x: torch.Tensor, name: str, k_major: bool, dims=("rows", "K", "batch"),
             op: str = "coda.gemm") -> torch.Tensor:
    """Check TMA's rules on a (rows, cols, L) view whose contiguous dim is 1 (``k_major``) or 0."""
    esize = x.element_size()
    align = 16 // esize
    check_pointer_aligned(x, name, op)
    shape = list(x.shape)
    stride = list(x.stride())
    unit = 1 if k_major else 0
    stride[unit] = 1
    span = max(e * s for e, s in zip(shape, stride))
    safe = -(-span // align) * align
    for d in range(3):
        if d == unit:
            continue
        if shape[d] == 1:
            stride[d] = safe  # never stepped over; any aligned positive stride describes it
        elif stride[d] == 0:
            raise ValueError(
                f"{op}: {name} is broadcast (stride 0) along {dims[d]}; TMA needs real "
                f"strides: materialize it with .contiguous()"
            )
        elif stride[d] % align:
            lead = dims[1 - unit] if d != 2 else dims[2]
            raise ValueError(
                f"{op}: {name}'s strides must be multiples of 16 bytes ({align} elements of "
                f"{x.dtype}) except the contiguous one; got {tuple(x.stride())} in kernel order "
                f"({', '.join(dims)}): {dims[unit]} must be a multiple of {align} (or pad the "
                f"{lead} stride)"
            )
    return x.as_strided(shape, stride)
