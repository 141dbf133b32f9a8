"""Dequantization scales applied to the fp32 accumulator (arch-independent epilogue math).

    D[m, n] = acc[m, n] * sa * sb

where ``sa`` is one fp32 number for all of A (``"tensor"``), one per row of A (``"row"``, indexed
by m) or absent (``"none"``), and ``sb`` likewise for B with one number per column n of the output.
Row-wise scales are indexed per batch: ``scale[m, l]``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

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
    def _load(self, mode: cutlass.Constexpr, vec: cute.Tensor, idx: Int32, extent: Int32, batch: Int32):
        val = Float32(1.0)
        if cutlass.const_expr(mode == "tensor"):
            val = vec[0]
        elif cutlass.const_expr(mode == "row"):
            # Rows/columns past the problem edge are computed but never stored; clamp the index
            # so their (discarded) scale read stays in bounds.
            val = vec[(cutlass.min(idx, extent - 1), batch)]
        return val

    @cute.jit
    def visit(self, frag: cute.Tensor, coords: cute.Tensor, problem_mnl, batch: Int32,
              scale_a, scale_b):
        """Scale ``frag`` (fp32 registers) in place; ``coords[i]`` is the global (m, n) of ``frag[i]``."""
        if cutlass.const_expr(not self.is_identity):
            for i in cutlass.range_constexpr(cute.size(frag)):
                m, n = coords[i]
                s = self._load(self.a_mode, scale_a, m, problem_mnl[0], batch)
                s = s * self._load(self.b_mode, scale_b, n, problem_mnl[1], batch)
                frag[i] = frag[i] * s
