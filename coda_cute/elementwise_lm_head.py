"""The exp-form LM head's element-wise kernels (``coda_cute.ops.lm_head_ce``): their specs for
the compiler and their launchers. The target logits before the logits GEMM
(``kernels.elementwise.target_logits``), the row step after it (``kernels.elementwise.exp_combine``)
and the row finish after the dgrad (``kernels.elementwise.lm_head_rows``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .compiler import get_kernel
from .elementwise import _fake, _rows16

__all__ = ["ExpCombineSpec", "exp_combine_", "TargetLogitsSpec", "target_logits", "LmHeadRowsSpec", "lm_head_rows_"]


@dataclass(frozen=True)
class ExpCombineSpec:
    """The exp-form LM head's row step (``kernels.elementwise.exp_combine``): ``tile``-column
    tiles whose K is the target's logit or their max - ``guard``."""

    tile: int = 128
    guard: float = 60.0
    arch: str = "sm_90a"

    @property
    def name(self) -> str:
        return f"exp_combine_{self.arch}_t{self.tile}_g{self.guard:g}"

    def build(self):
        import cutlass.cute as cute

        from .kernels.elementwise.exp_combine import ExpCombine

        m, d = cute.sym_int(), cute.sym_int()
        vec = (m,)
        return ExpCombine(self.tile, self.guard), (
            _fake("bfloat16", (m, cute.sym_int()), (cute.sym_int64(), 1), 2),
            _fake("float32", (m, cute.sym_int()), (cute.sym_int64(), 1)),
            _rows16("bfloat16", m, d), _rows16("bfloat16", cute.sym_int(), d),
            _fake("float32", vec, (1,)), _fake("int32", vec, (1,)), _fake("float32", vec, (1,)),
            _fake("float32", vec, (1,)), _fake("float32", vec, (1,)), _fake("float32", vec, (1,)))


def exp_combine_(e: torch.Tensor, se, u, w, tl, targets, coef, rstd, tile: int, guard: float,
                 lse: torch.Tensor) -> torch.Tensor:
    """In place on ``e`` (M, V) bf16 (``kernels.elementwise.exp_combine``): writes the rows' LSE
    into ``lse`` (M,) fp32 and returns the row scale rs (M,) fp32. se (M, ceil(V / tile)) fp32
    with unit stride along the tiles; u (M, d), w (V, d) the logits GEMM's bf16 operands (rows
    16-byte aligned); tl, coef, rstd (M,) fp32; targets (M,) int32."""
    from . import dispatch

    rs = torch.empty(e.shape[0], dtype=torch.float32, device=e.device)
    get_kernel(ExpCombineSpec(tile, float(guard), dispatch.arch_of(e.device))).fn(
        e, se, u, w, tl, targets, coef, rstd, lse, rs)
    return rs


@dataclass(frozen=True)
class TargetLogitsSpec:
    """Each row's target logit from u and the target's row of W (``kernels.elementwise.target_logits``)."""

    arch: str = "sm_90a"

    @property
    def name(self) -> str:
        return f"target_logits_{self.arch}_bf16"

    def build(self):
        import cutlass.cute as cute

        from .kernels.elementwise.target_logits import TargetLogits

        m, d = cute.sym_int(), cute.sym_int()
        return TargetLogits(), (_rows16("bfloat16", m, d), _rows16("bfloat16", cute.sym_int(), d),
                                _fake("int32", (m,), (1,)), _fake("float32", (m,), (1,)), _fake("float32", (m,), (1,)))


def target_logits(u: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, rstd: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """(M,) fp32 (into ``out`` where given, contiguous): rstd * (u . w[targets]) per row, targets
    (M,) int32 clamped into [0, V) (``kernels.elementwise.target_logits``); u (M, d), w (V, d)
    bf16 with 16-byte-aligned rows."""
    from . import dispatch

    if out is None:
        out = torch.empty(u.shape[0], dtype=torch.float32, device=u.device)
    get_kernel(TargetLogitsSpec(dispatch.arch_of(u.device))).fn(u, w, targets, rstd, out)
    return out


@dataclass(frozen=True)
class LmHeadRowsSpec:
    """The exp-form LM head's per-chunk finish (``kernels.elementwise.lm_head_rows``)."""

    arch: str = "sm_90a"

    @property
    def name(self) -> str:
        return f"lm_head_rows_{self.arch}_bf16"

    def build(self):
        import cutlass.cute as cute

        from .kernels.elementwise.lm_head_rows import LmHeadRows

        m, d = cute.sym_int(), cute.sym_int()
        vec = [_fake("float32", (m,), (1,)) for _ in range(3)]
        return LmHeadRows(), (_rows16("bfloat16", m, d), _rows16("bfloat16", m, d),
                              _fake("bfloat16", (d,), (1,), 16), *vec, _rows16("bfloat16", m, d))


def lm_head_rows_(dy: torch.Tensor, y: torch.Tensor, gamma: torch.Tensor, r, zdz, rs) -> torch.Tensor:
    """``kernels.elementwise.lm_head_rows``: dy (M, d) bf16 in place minus its RMSNorm projection
    r^2 (zdz / d) y; returns us = rs * y * gamma (M, d) bf16. r, zdz, rs (M,) fp32, gamma (d,)
    bf16; rows 16-byte aligned."""
    from . import dispatch

    from .kernels.elementwise.lm_head_rows import MAX_ROWS

    us = torch.empty_like(y)
    fn = get_kernel(LmHeadRowsSpec(dispatch.arch_of(y.device))).fn
    for i in range(0, y.shape[0], MAX_ROWS):  # the grid's y extent bounds one launch's rows
        s = slice(i, i + MAX_ROWS)
        fn(dy[s], y[s], gamma, r[s], zdz[s], rs[s], us[s])
    return us
