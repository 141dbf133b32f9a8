"""The exp-form LM head's warp-wide row dot: one logit u[row] . w[col] recomputed in fp32 by a
whole warp (``target_logits`` for every row's target, ``exp_combine`` for a rare tile's K)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

#: elements per access (16 bytes of bf16)
VEC = 8


@cute.jit
def warp_sum(x):
    """The warp's sum of ``x``, in every lane: a butterfly in a fixed order (deterministic)."""
    for off in (16, 8, 4, 2, 1):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=off)
    return x


@cute.jit
def warp_row_dot(gu: cute.Tensor, gw: cute.Tensor, row, col, lane, unroll: cutlass.Constexpr = 0):
    """sum_k u[row, k] w[col, k] in fp32, in every lane, for ``gu``, ``gw`` divided into (1, VEC)
    groups (((1, VEC), (rows, d / VEC))): lane i takes groups i, i + 32, ..., products fused into
    its fp32 sum (bf16 products are exact in fp32), then :func:`warp_sum`. ``unroll``: the
    loop's unroll factor (0: the compiler's choice)."""
    acc = Float32(0.0)
    for q in cutlass.range(lane, gu.shape[1][1], 32, unroll=unroll):
        a = gu[(None, (row, q))].load().to(Float32)
        b = gw[(None, (col, q))].load().to(Float32)
        for i in cutlass.range_constexpr(VEC):
            acc = cute.math.fma(a[i], b[i], acc)
    return warp_sum(acc)
