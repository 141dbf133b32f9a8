"""Launches of the CODA Llama-block ops for the reporter: random bf16 inputs (never zeros) of a
preset layer's shape, and a zero-argument callable running the op once. Each op is timed next to
its shadow, the plain ``coda.gemm`` of the same (m, n, k) (see :mod:`.registry`).

Norm partials are given as one column, ``ss`` (M, 1) = sum of squares of the row, which is a
valid (M, T) partials tensor for every consumer op.
"""

from __future__ import annotations

import torch

from ..reference import quantize_blocks_ref, rope_inv_freq
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


def _blockwise_build(b_block: str):
    """A layer's product on ``coda.gemm_blockwise``: its forward x @ W.T (W in 128 x 128 blocks),
    or with ``b_block="1x128"`` its weight gradient dY^T X over the tokens (both operands in
    1 x 128 blocks along them), from standard-normal data quantized by the reference."""
    def build(shape: Shape, dtype: str, device):
        if dtype != "fp8":
            raise NotImplementedError("the block-scaled GEMM runs on fp8 (e4m3) operands")
        m, n, k = (shape.n, shape.k, shape.m) if b_block == "1x128" else shape.mnk
        a, sa = quantize_blocks_ref(torch.randn(m, k, device=device), (1, 128))
        b, sb = quantize_blocks_ref(torch.randn(n, k, device=device), (1, 128) if b_block == "1x128" else (128, 128))
        return lambda: torch.ops.coda.gemm_blockwise(a, sa, b, sb, None, b_block)
    return build


register_op("residual_norm_stats", build=build_residual_norm_stats)
register_op("gemm_blockwise", build=_blockwise_build("128x128"))
register_op("gemm_blockwise_wgrad", build=_blockwise_build("1x128"))
register_op("scaled_swiglu", build=build_scaled_swiglu)
register_op("scaled_rope", build=build_scaled_rope)
register_op("lm_head_ce", build=build_lm_head_ce)
