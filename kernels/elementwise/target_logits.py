"""Each row's target logit, before the logits GEMM (the exp-form LM head's anchor and the loss's
target term):

    tl[m] = rstd[m] * sum_k u[m, k] * w[t_m, k],   t_m = targets[m] clamped into [0, V)

in fp32 (the bf16 products are exact in fp32; the sum's order differs from the GEMM's, by fp32
rounding). Ignored rows (any target outside [0, V)) read row 0 or V - 1 of ``w``: their value only
anchors a row whose gradient is zero.

Roles: no specialization. A 128-thread CTA takes four rows, one per warp. Each lane reads 16-byte
vectors of its row of ``u`` and of the target's row of ``w``, 32 vectors apart, and accumulates the
products in fp32; a butterfly sum in a fixed order (deterministic) and lane 0's store end the row.
Bandwidth-bound: 2 x d x 2 bytes per row.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .warp_dot import VEC, warp_row_dot

THREADS = 128
WARPS = THREADS // 32


class TargetLogits:
    """``tl (M,) <- rstd * rowwise dot(u, w[clamp(targets)])`` for bf16 ``u`` (M, d) and ``w``
    (V, d), rows 16-byte aligned (d a multiple of 8); ``targets`` (M,) int32, ``rstd`` and ``tl``
    (M,) fp32."""

    @cute.jit
    def __call__(self, u: cute.Tensor, w: cute.Tensor, targets: cute.Tensor, rstd: cute.Tensor,
                 tl: cute.Tensor, stream):
        gu = cute.zipped_divide(u, (1, VEC))  # ((1, VEC), (M, d / VEC))
        gw = cute.zipped_divide(w, (1, VEC))
        self.kernel(gu, gw, targets, rstd, tl).launch(
            grid=(cute.ceil_div(u.shape[0], WARPS), 1, 1),
            block=(THREADS, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, gu: cute.Tensor, gw: cute.Tensor, targets: cute.Tensor, rstd: cute.Tensor,
               tl: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        m = gu.shape[1][0]
        v = gw.shape[1][0]
        lane = tidx % 32
        row = bid * WARPS + tidx // 32
        if row < m:
            t = Int32(cutlass.max(cutlass.min(targets[row], v - 1), 0))
            acc = warp_row_dot(gu, gw, row, t, lane, 2)
            if lane == 0:
                tl[row] = rstd[row] * acc
