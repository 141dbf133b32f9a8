"""Column scaling, ``out[n, k] = w[n, k] * gamma[k]``: the RMSNorm weight folded into the weight
that consumes the normalized activations (coda-math section 2, ``W' = W diag(gamma)``); and its
scalar form, ``out[n, k] = w[n, k] * s`` with ``s`` one fp32 number in device memory (a gradient
times the incoming ``dloss``, which torch multiplies element by element without 16-byte access
because ``dloss`` is a broadcast operand).

A bandwidth-bound pass over the whole weight (96 MiB read + written for Llama-3-8B's QKV, 448 MiB
for gate/up) that runs before the GEMM on every forward that refolds. torch's broadcast multiply
takes its unvectorized path for a broadcast operand; this kernel moves 16 bytes per access.

Roles: no specialization; every thread of a 128-thread CTA does the same work. A thread owns one
8-element column group ``k8`` and ``ROWS`` consecutive rows: it loads gamma[k8] once, issues the
``ROWS`` independent 16-byte loads of W before any multiply, and stores ``ROWS`` 16-byte results.
The product is formed in fp32 and rounded once, as torch's ``w * gamma`` does, so the two agree
bit for bit. The scalar form loads its one fp32 factor instead of gamma[k8] (every thread the
same word: one L1 line).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

THREADS = 128
#: rows per thread: enough independent 16-byte loads in flight to cover HBM latency
ROWS = 8
#: elements per access (16 bytes of a 16-bit type)
VEC = 8


class ScaleColumns:
    """``out = w * gamma[None, :]`` for 16-bit ``w`` (N, K) and ``gamma`` (K,) of the same dtype,
    rows 16-byte aligned (K a multiple of 8). ``scalar``: ``out = w * gamma[0]`` with ``gamma``
    a (1,) fp32 tensor, and ``w`` 16-bit or fp32 (two 16-byte loads per 8 elements); ``dtype``
    is out's."""

    def __init__(self, dtype, scalar: bool = False):
        self.dtype = dtype
        self.scalar = scalar

    @cute.jit
    def __call__(self, w: cute.Tensor, gamma: cute.Tensor, out: cute.Tensor, stream):
        gw = cute.zipped_divide(w, (1, VEC))  # ((1, VEC), (N, K / VEC))
        go = cute.zipped_divide(out, (1, VEC))
        gg = gamma
        if const_expr(not self.scalar):
            # gamma as a (1, K) row, so its vectors have the shape of W's: ((1, VEC), (1, K / VEC))
            gg = cute.zipped_divide(
                cute.make_tensor(gamma.iterator, cute.make_layout((1, gamma.shape[0]), stride=(0, 1))), (1, VEC))
        rows, groups = gw.shape[1]
        self.kernel(gw, gg, go).launch(
            grid=(cute.ceil_div(groups, THREADS), cute.ceil_div(rows, ROWS), 1),
            block=(THREADS, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, gw: cute.Tensor, gg: cute.Tensor, go: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        rows, groups = gw.shape[1]
        col = Int32(bx * THREADS + tidx)
        row0 = Int32(by * ROWS)
        if col < groups:
            g = gg[0] if const_expr(self.scalar) else gg[(None, (0, col))].load().to(Float32)
            if row0 + ROWS <= rows:
                # a full band of rows: every load issued before the first multiply
                vals = [gw[(None, (row0 + r, col))].load() for r in range(ROWS)]
                for r in cutlass.range_constexpr(ROWS):
                    go[(None, (row0 + r, col))].store((vals[r].to(Float32) * g).to(self.dtype))
            else:
                for r in cutlass.range_constexpr(ROWS):
                    if row0 + r < rows:
                        go[(None, (row0 + r, col))].store(
                            (gw[(None, (row0 + r, col))].load().to(Float32) * g).to(self.dtype))
