"""The RMSNorm-weight fold's backward in one pass: for ``W' = W diag(gamma)`` and its gradient dW',

    dW[n, k]          = dW'[n, k] * gamma[k]                  (rounded once, as torch's product)
    partial[b, k]     = sum_{n in row band b} dW'[n, k] W[n, k]   (fp32; d gamma = sum_b partial)

A bandwidth-bound pass over the consumer weight (read dW' and W, write dW: 6 bytes per element),
where torch's ``dW' * gamma`` and ``(dW' * W).sum(0)`` take three kernels and about 14 bytes per
element, and round the products to 16 bits before summing them.

Roles: no specialization; every thread of a 128-thread CTA does the same work. A thread owns one
8-element column group ``k8`` and a band of ``BAND`` consecutive rows: it loads gamma[k8] once,
walks the band ``ROWS`` rows at a time (all 16-byte loads of a step issued before its math),
stores the ``dW`` rows and keeps eight fp32 column sums, written once at the band's end.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

THREADS = 128
#: rows whose loads one step issues together (independent 16-byte loads in flight)
ROWS = 8
#: rows per band: one fp32 partial per (band, column), BAND / ROWS steps per thread
BAND = 64
#: elements per access (16 bytes of a 16-bit type)
VEC = 8


def num_bands(n: int) -> int:
    return -(-n // BAND)


class FoldBackward:
    """``dw_out = dw * gamma``, ``partial[b] = column sums of dw * w`` over row band b, for 16-bit
    ``dw``, ``w`` (N, K) and ``gamma`` (K,) of one dtype, rows 16-byte aligned (K a multiple of 8)."""

    def __init__(self, dtype):
        self.dtype = dtype

    @cute.jit
    def __call__(self, dw: cute.Tensor, w: cute.Tensor, gamma: cute.Tensor, dw_out: cute.Tensor,
                 partial: cute.Tensor, stream):
        gd = cute.zipped_divide(dw, (1, VEC))  # ((1, VEC), (N, K / VEC))
        gw = cute.zipped_divide(w, (1, VEC))
        go = cute.zipped_divide(dw_out, (1, VEC))
        gp = cute.zipped_divide(partial, (1, VEC))  # ((1, VEC), (bands, K / VEC)), fp32
        gg = cute.zipped_divide(
            cute.make_tensor(gamma.iterator, cute.make_layout((1, gamma.shape[0]), stride=(0, 1))), (1, VEC))
        rows, groups = gd.shape[1]
        self.kernel(gd, gw, gg, go, gp).launch(
            grid=(cute.ceil_div(groups, THREADS), cute.ceil_div(rows, BAND), 1),
            block=(THREADS, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, gd: cute.Tensor, gw: cute.Tensor, gg: cute.Tensor, go: cute.Tensor, gp: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        rows, groups = gd.shape[1]
        col = Int32(bx * THREADS + tidx)
        if col < groups:
            g = gg[(None, (0, col))].load().to(Float32)
            acc = cute.make_rmem_tensor(gd[(None, (0, col))].shape, Float32)
            acc.fill(0.0)
            for step in cutlass.range_constexpr(BAND // ROWS):
                row0 = Int32(by * BAND + step * ROWS)
                if row0 + ROWS <= rows:
                    # a full step: every load issued before the first product
                    ds = [gd[(None, (row0 + r, col))].load() for r in range(ROWS)]
                    ws = [gw[(None, (row0 + r, col))].load() for r in range(ROWS)]
                    for r in cutlass.range_constexpr(ROWS):
                        d = ds[r].to(Float32)
                        go[(None, (row0 + r, col))].store((d * g).to(self.dtype))
                        acc.store(acc.load() + d * ws[r].to(Float32))
                else:
                    for r in cutlass.range_constexpr(ROWS):
                        if row0 + r < rows:
                            d = gd[(None, (row0 + r, col))].load().to(Float32)
                            go[(None, (row0 + r, col))].store((d * g).to(self.dtype))
                            acc.store(acc.load() + d * gw[(None, (row0 + r, col))].load().to(Float32))
            gp[(None, (by, col))].store(acc.load())
