"""The token embedding's backward in one pass over the table, deterministic:

    dE[v, :] = sum_{i : ids[i] = v} dx[i, :]     (fp32 sums in the order of i, rounded once;
                                                  zeros for a row no token of the batch uses)

torch's CUDA backward fills the whole table with zeros, then sums the sorted ids' segments into
fp32 partials (``compute_grad_weight``) and adds those into the table (``sum_and_scatter``): the
fill and two kernels (1.5 ms for a 128256 x 4096 bf16 table and 16384 tokens on the H200, next to
0.34 ms to write the table once). Here the caller sorts the ids once (a stable sort: each row's
sum runs in token order, so every run gives the same bits) and finds each table row's range
``[starts[v], ends[v])`` of the sorted order (``searchsorted``), and this kernel writes every row of
dE exactly once: its range's sum, or zeros. It reads dx once and writes the table once, which is
most of the bytes.

Roles: no specialization; every thread of a 128-thread CTA does the same work. A thread owns one
8-element column group of ``ROWS`` consecutive table rows: per row it reads the range, adds the
16-byte (32-byte for fp32) column groups of the range's dx rows in order into eight fp32 sums,
and stores them in the table's dtype (the zeros of an empty range included).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

THREADS = 128
#: table rows per CTA (consecutive, so a CTA's stores are one contiguous stretch of the table)
ROWS = 8
#: elements per column group
VEC = 8


class EmbeddingBackward:
    """``out[v] = sum of dx[order[i]] for i in [starts[v], ends[v])`` for dx (M, d) and out (V, d)
    of one dtype (bf16, fp16 or fp32), rows 16-byte aligned, d a multiple of 8; ``order`` (M,),
    ``starts``, ``ends`` (V,) int32."""

    def __init__(self, dtype):
        self.dtype = dtype

    @cute.jit
    def __call__(self, dx: cute.Tensor, order: cute.Tensor, starts: cute.Tensor, ends: cute.Tensor,
                 out: cute.Tensor, stream):
        gx = cute.zipped_divide(dx, (1, VEC))  # ((1, VEC), (M, d / VEC))
        go = cute.zipped_divide(out, (1, VEC))
        rows, groups = go.shape[1]
        self.kernel(gx, order, starts, ends, go).launch(
            grid=(cute.ceil_div(groups, THREADS), cute.ceil_div(rows, ROWS), 1),
            block=(THREADS, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, gx: cute.Tensor, order: cute.Tensor, starts: cute.Tensor, ends: cute.Tensor,
               go: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        rows, groups = go.shape[1]
        col = Int32(bx * THREADS + tidx)
        if col < groups:
            acc = cute.make_rmem_tensor(go[(None, (0, col))].shape, Float32)
            for r in cutlass.range_constexpr(ROWS):
                v = Int32(by * ROWS + r)
                if v < rows:
                    acc.fill(0.0)
                    for i in cutlass.range(starts[v], ends[v], unroll=4):
                        acc.store(acc.load() + gx[(None, (order[i], col))].load().to(Float32))
                    go[(None, (v, col))].store(acc.load().to(self.dtype))
