"""Dequantization scales applied to the fp32 accumulator (arch-independent epilogue math).

    D[m, n] = acc[m, n] * sa * sb

where ``sa`` is one fp32 number for all of A (``"tensor"``), one per row of A (``"row"``, indexed
by m) or absent (``"none"``), and ``sb`` likewise for B with one number per column n of the output.
Row-wise scales are indexed per batch: ``scale[m, l]``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

SCALE_MODES = ("none", "tensor", "row")


class ScaleVisitor:
    """Multiplies each accumulator value by its row's A scale and its column's B scale."""

    def __init__(self, a_mode: str = "none", b_mode: str = "none"):
        for name, mode in (("a", a_mode), ("b", b_mode)):
            if mode not in SCALE_MODES:
                raise ValueError(f"scale_{name} mode must be one of {SCALE_MODES}, got {mode!r}")
        self.a_mode = a_mode
        self.b_mode = b_mode

    @property
    def key(self) -> tuple:
        return ("scale", self.a_mode, self.b_mode)

    @property
    def is_identity(self) -> bool:
        return self.a_mode == "none" and self.b_mode == "none"

    @cute.jit
    def begin_tile(self, vectors, scale_a, scale_b):
        """Per-tile register state: the scales this thread's accumulator registers need."""
        return (self._begin(self.a_mode, vectors.rows, scale_a),
                self._begin(self.b_mode, vectors.cols, scale_b))

    @cute.jit
    def _begin(self, mode: cutlass.Constexpr, load_vector, vec):
        out = None
        if cutlass.const_expr(mode == "tensor"):
            out = Float32(vec[0])
        elif cutlass.const_expr(mode == "row"):
            out = load_vector(vec)
        return out

    @cute.jit
    def visit(self, frag: cute.Tensor, state, offset: cutlass.Constexpr):
        """Scale ``frag`` (fp32 registers) in place; ``frag[v]`` is accumulator register
        ``offset + v``."""
        sa, sb = state
        if cutlass.const_expr(not self.is_identity):
            for v in cutlass.range_constexpr(cute.size(frag)):
                s = _scale_at(self.a_mode, sa, offset + v) * _scale_at(self.b_mode, sb, offset + v)
                frag[v] = frag[v] * s


@cute.jit
def _scale_at(mode: cutlass.Constexpr, state, i: cutlass.Constexpr):
    out = Float32(1.0)
    if cutlass.const_expr(mode == "tensor"):
        out = state
    elif cutlass.const_expr(mode == "row"):
        out = state[i]
    return out
