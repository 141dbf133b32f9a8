"""The exp-form LM head's per-chunk finish, after its dgrad GEMM, in one pass over the chunk's rows:

    dy[m, k] <- dy[m, k] - r_m^2 (zdz_m / d) y[m, k]     (in place: the RMSNorm backward's
                                                          projection, zdz_m = u_m . G_m from the
                                                          dgrad's row partials, summed)
    us[m, k]  = rs_m * y[m, k] * gamma[k]                (the wgrad's operand: the exp form's row
                                                          scale on u = y * gamma)

each product formed in fp32 and rounded once to bf16. The dgrad epilogue stores dy = G * gamma
and cannot subtract the projection itself: zdz_m sums over all d columns, which its tile does not
hold.

Roles: no specialization; every thread of a 128-thread CTA does the same work. A thread owns one
8-element column group and ``ROWS`` consecutive rows: it loads gamma's vector once, issues the
``ROWS`` 16-byte loads of y and of dy before any math, then per row its three row scalars and
the two 16-byte stores. Row bands are the grid's y (at most 65535): callers split larger row
counts (``MAX_ROWS``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

THREADS = 128
#: rows per thread: independent 16-byte loads in flight
ROWS = 4
#: elements per access (16 bytes of bf16)
VEC = 8
#: rows one launch covers: the grid's y extent (65535 row bands) times ROWS
MAX_ROWS = 65535 * ROWS


class LmHeadRows:
    """See the module docstring. ``dy``, ``y``, ``us`` (M, d) bf16 and ``gamma`` (d,) bf16, rows
    16-byte aligned (d a multiple of 8); ``r``, ``zdz``, ``rs`` (M,) fp32."""

    @cute.jit
    def __call__(self, dy: cute.Tensor, y: cute.Tensor, gamma: cute.Tensor, r: cute.Tensor, zdz: cute.Tensor,
                 rs: cute.Tensor, us: cute.Tensor, stream):
        gdy = cute.zipped_divide(dy, (1, VEC))  # ((1, VEC), (M, d / VEC))
        gy = cute.zipped_divide(y, (1, VEC))
        gus = cute.zipped_divide(us, (1, VEC))
        gg = cute.zipped_divide(
            cute.make_tensor(gamma.iterator, cute.make_layout((1, gamma.shape[0]), stride=(0, 1))), (1, VEC))
        rows, groups = gy.shape[1]
        self.kernel(gdy, gy, gg, r, zdz, rs, gus).launch(
            grid=(cute.ceil_div(groups, THREADS), cute.ceil_div(rows, ROWS), 1),
            block=(THREADS, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, gdy: cute.Tensor, gy: cute.Tensor, gg: cute.Tensor, r: cute.Tensor, zdz: cute.Tensor,
               rs: cute.Tensor, gus: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        rows, groups = gy.shape[1]
        inv_d = Float32(1.0) / Float32(groups * VEC)
        col = Int32(bx * THREADS + tidx)
        row0 = Int32(by * ROWS)
        if col < groups:
            g = gg[(None, (0, col))].load().to(Float32)
            if row0 + ROWS <= rows:
                ys = [gy[(None, (row0 + i, col))].load() for i in range(ROWS)]
                ds = [gdy[(None, (row0 + i, col))].load() for i in range(ROWS)]
                for i in cutlass.range_constexpr(ROWS):
                    self._row(gdy, gus, row0 + i, col, ys[i].to(Float32), ds[i].to(Float32), g, r, zdz, rs, inv_d)
            else:
                for i in cutlass.range_constexpr(ROWS):
                    if row0 + i < rows:
                        self._row(gdy, gus, row0 + i, col, gy[(None, (row0 + i, col))].load().to(Float32),
                                  gdy[(None, (row0 + i, col))].load().to(Float32), g, r, zdz, rs, inv_d)

    @cute.jit
    def _row(self, gdy, gus, row, col, yv, dv, g, r, zdz, rs, inv_d):
        rr = r[row]
        proj = rr * rr * zdz[row] * inv_d
        gdy[(None, (row, col))].store((dv - proj * yv).to(gdy.element_type))
        gus[(None, (row, col))].store((yv * g * rs[row]).to(gus.element_type))
