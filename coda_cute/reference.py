"""Torch reference implementations (CPU-runnable, fp32 math): the oracle for every test.

Each function computes exactly what the matching ``torch.ops.coda`` op is specified to compute,
in fp32 on the inputs' device, and rounds once to the output dtype at the end.
"""

from __future__ import annotations

import torch


def gemm_ref(a: torch.Tensor, b: torch.Tensor, scale_a=None, scale_b=None, out_dtype=None,
             round_output: bool = True) -> torch.Tensor:
    """``(a @ b) * scale_a * scale_b`` in fp32.

    ``a``: (M, K) or (L, M, K); ``b``: (K, N) or (L, K, N). ``scale_a`` is a single number or one
    per row of A ((M, 1), (M,), or per batch (L, M, 1)); ``scale_b`` a single number or one per
    column of B ((1, N), (N,), (L, 1, N)). ``round_output=False`` returns the fp32 result.
    """
    acc = torch.matmul(a.float(), b.float())
    if scale_a is not None:
        acc = acc * _row_scale(scale_a, a)
    if scale_b is not None:
        acc = acc * _col_scale(scale_b, b)
    if out_dtype is None:
        out_dtype = torch.bfloat16 if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else a.dtype
    return acc.to(out_dtype) if round_output else acc


def _row_scale(s: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    s = s.float()
    if s.numel() == 1:
        return s.reshape(())
    m = a.shape[-2]
    return s.reshape(*a.shape[:-2], m, 1)


def _col_scale(s: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    s = s.float()
    if s.numel() == 1:
        return s.reshape(())
    n = b.shape[-1]
    return s.reshape(*b.shape[:-2], 1, n)
