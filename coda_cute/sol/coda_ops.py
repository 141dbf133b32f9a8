"""Launches of the CODA Llama-block ops for the reporter: random bf16 inputs (never zeros) of a
preset layer's shape, and a zero-argument callable running the op once. Each op is timed next to
its shadow, the plain ``coda.gemm`` of the same (m, n, k) (see :mod:`.registry`).

Norm partials are given as one column, ``ss`` (M, 1) = sum of squares of the row, which is a
valid (M, T) partials tensor for every consumer op.
"""

from __future__ import annotations

import torch

from ..reference import rope_inv_freq
from .registry import register_op
from .shapes import Shape

EPS = 1e-5


def _rand(*shape, device, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def _norm_input(m: int, d: int, device):
    y = _rand(m, d, device=device)
    return y, y.float().square().sum(-1, keepdim=True)


def _only_bf16(dtype: str) -> None:
    if dtype != "bf16":
        raise NotImplementedError("the CODA block ops run on bf16 activations")


def build_residual_norm_stats(shape: Shape, dtype: str, device):
    _only_bf16(dtype)
    m, n, k = shape.mnk
    a, res = _rand(m, k, device=device), _rand(m, n, device=device)
    w = _rand(n, k, device=device, scale=k ** -0.5)
    return lambda: torch.ops.coda.residual_gemm_norm_stats(a, w, res)


def build_scaled_swiglu(shape: Shape, dtype: str, device):
    _only_bf16(dtype)
    m, n, k = shape.mnk
    y, ss = _norm_input(m, k, device)
    w = _rand(n, k, device=device, scale=k ** -0.5)
    return lambda: torch.ops.coda.norm_swiglu(y, w, ss, EPS)


def build_scaled_rope(shape: Shape, dtype: str, device):
    _only_bf16(dtype)
    c = shape.model
    m, n, k = shape.mnk
    y, ss = _norm_input(m, k, device)
    w = _rand(n, k, device=device, scale=k ** -0.5)
    positions = (torch.arange(m, device=device) % 8192).to(torch.int32)
    inv_freq = rope_inv_freq(c.head_dim, 500000.0, device=device)
    return lambda: torch.ops.coda.norm_rope_qkv(y, w, ss, EPS, positions, inv_freq, c.n_heads,
                                                c.n_kv_heads, c.head_dim)


def build_lm_head_ce(shape: Shape, dtype: str, device):
    _only_bf16(dtype)
    m, n, k = shape.mnk
    y, ss = _norm_input(m, k, device)
    w = _rand(n, k, device=device, scale=k ** -0.5)
    targets = torch.randint(0, n, (m,), device=device)
    return lambda: torch.ops.coda.lm_head_ce(y, w, ss, EPS, targets)


register_op("residual_norm_stats", build=build_residual_norm_stats)
register_op("scaled_swiglu", build=build_scaled_swiglu)
register_op("scaled_rope", build=build_scaled_rope)
register_op("lm_head_ce", build=build_lm_head_ce)
