"""The quantize and amax kernels' loads: a thread's 16-byte groups of several rows of a 16-bit
matrix into registers, zeros past the matrix (they add nothing to an amax)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


@cute.jit
def load_row_groups(gx: cute.Tensor, buf: cute.Tensor, row0, step, col, n: cutlass.Constexpr):
    """``buf[:, i]`` = group ``col`` of row ``row0 + step * i`` of ``gx`` (a matrix divided into
    (1, VEC) groups: ((1, VEC), (rows, groups))), for i < n; issued together, so their loads are
    in flight at once."""
    rows, groups = gx.shape[1]
    buf.fill(0.0)
    for i in cutlass.range_constexpr(n):
        row = row0 + step * i
        if row < rows and col < groups:
            buf[(None, i)].store(gx[(None, (row, col))].load())
