"""Training precisions: ``bf16`` and the FP8 recipe (``Fp8Recipe``) the FP8 ops follow.

The FP8 recipe is DeepSeek-V3's and Transformer Engine's ``Float8BlockScaling``, with current
scaling (the amax of the data being quantized, no history) and fp32 scales:

* activations and output gradients: E4M3 (gradients E5M2 with ``grad_format="e5m2"``), one scale
  per 1 x 128 block along K;
* weights: E4M3, one scale per 128 x 128 block (so the transposed copy for dgrad reuses them);
* weight gradients dW = dY^T X from both operands in 1 x 128 blocks along the token dimension,
  accumulated in fp32;
* ``scaling="row"``: the second recipe, one scale per whole row along K of every GEMM operand
  (activations and gradients per token, a weight per row and, for the dgrad, per column): the
  GEMM's row-wise FP8, the scales applied to the accumulator in the sublayers' epilogue trees; a
  weight gradient dW = G^T X takes G's FP8 bytes transposed with its token scales folded into X's
  rows, whose columns then get one scale per feature over the tokens (``ops.fp8_gemms.wgrad``),
  or, where X is the wider and its rows were quantized for the forward (the MLP's down-proj: h),
  X's kept FP8 bytes transposed with X's token scales folded into G (``ops.fp8_gemms.wgrad_kept``);
* ``fast_accum`` (row-wise only): which GEMMs keep their FP8 products in the tensor core's
  accumulator for the whole k-loop rather than promoting each k-tile's partial sum into fp32:
  "none" (the default), "forward" (the forward GEMMs, as torchao's float8 training does by
  default) or "all" (also the dgrads and weight gradients). The block recipe always promotes;
* ``pow2_scales``: scales rounded up to powers of two (TE's default; DeepGEMM's users report it
  costs accuracy, so off here);
* the LM head and the attention core stay bf16; ``lm_head_fp8`` puts the LM head in FP8.

The models (``LlamaConfig``, ``apply_coda``) run either recipe, with E4M3 or E5M2 gradients,
fp32 or power-of-two scales (every quantizer kernel and FP8 op takes ``pow2_scales``; the scale is
rounded up on its bits, so no value overflows), and the LM head in bf16 or, with ``lm_head_fp8``,
in FP8 (``coda.lm_head_ce_train_fp8``, block recipe only: ``scaling="row"`` with ``lm_head_fp8``
is refused rather than run another recipe than the one asked for).

``coda_cute.reference.quantize_blocks_ref`` defines the quantization exactly (zeros, inf, NaN).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SCALINGS = ("block", "row")
#: ``Fp8Recipe.fast_accum``: which GEMMs accumulate in the tensor core for the whole k-loop
FAST_ACCUM = ("none", "forward", "all")
BLOCK = 128


def block_scales_m_major(rows: int, cols: int, device) -> torch.Tensor:
    """An empty fp32 (rows, ceil(cols / 128)) tensor of 1 x 128 block scales, M-major (strides (1,
    R), R = rows rounded up to 128): the block-scaled GEMM loads one k-block's scales of a tile's
    consecutive rows or columns together, one sector per warp and load, where a row-major layout
    puts each in a sector of its own; and the weight-gradient form reads a whole tile's column of
    scales without clamping each column to the last (the padding past ``rows``, never used)."""
    pad = -(-rows // BLOCK) * BLOCK
    kb = -(-cols // BLOCK)
    return torch.empty((kb, pad), dtype=torch.float32, device=device).as_strided((rows, kb), (1, pad))


@dataclass(frozen=True)
class Fp8Recipe:
    scaling: str = "block"
    grad_format: str = "e4m3"
    pow2_scales: bool = False
    lm_head_fp8: bool = False
    fast_accum: str = "none"

    def __post_init__(self):
        if self.scaling not in SCALINGS:
            raise ValueError(f"Fp8Recipe: scaling must be one of {SCALINGS}, got {self.scaling!r}")
        if self.fast_accum not in FAST_ACCUM:
            raise ValueError(f"Fp8Recipe: fast_accum must be one of {FAST_ACCUM}, got {self.fast_accum!r}")
        if self.fast_accum != "none" and self.scaling != "row":
            raise ValueError(f"Fp8Recipe: fast_accum must be 'none' with scaling='block' (block scales are "
                             f"promoted per k-block), got {self.fast_accum!r}")
        if not isinstance(self.grad_format, str) or self.grad_format not in FORMATS:
            raise ValueError(f"Fp8Recipe: grad_format must be one of {tuple(FORMATS)}, got {self.grad_format!r}")
        for name in ("pow2_scales", "lm_head_fp8"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Fp8Recipe: {name} must be a bool, got {getattr(self, name)!r}")
        if self.lm_head_fp8 and self.scaling == "row":
            raise ValueError("Fp8Recipe: the FP8 LM head runs the block recipe: with scaling='row' it stays "
                             "bf16 (lm_head_fp8=False)")

    @property
    def grad_dtype(self) -> torch.dtype:
        return FORMATS[self.grad_format]

    def blocks(self, role: str, shape: tuple[int, int]) -> tuple[int, int]:
        """The (rows, cols) scale block of an operand of ``shape`` (as stored) by role:
        "activation" and "grad" (M x K: along K), "weight" (N x K), "wgrad" (an activation or
        gradient M x K read along the token dimension M by the weight-gradient GEMM)."""
        if not (isinstance(shape, tuple) and len(shape) == 2):
            raise ValueError(f"Fp8Recipe.blocks: shape must be (rows, cols) as stored, got {shape!r}")
        rows, cols = shape
        block = {"activation": (1, BLOCK), "grad": (1, BLOCK), "weight": (BLOCK, BLOCK), "wgrad": (BLOCK, 1)}
        whole = {"activation": (1, cols), "grad": (1, cols), "weight": (1, cols), "wgrad": (rows, 1)}
        if role not in block:
            raise ValueError(f"Fp8Recipe.blocks: role must be one of {tuple(block)}, got {role!r}")
        return (whole if self.scaling == "row" else block)[role]


PRECISIONS = ("bf16", "fp8")


def recipe_for(precision: Union[str, Fp8Recipe]) -> Optional[Fp8Recipe]:
    """None for "bf16", the default :class:`Fp8Recipe` for "fp8", a given recipe as it is."""
    if isinstance(precision, Fp8Recipe):
        return precision
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} or an Fp8Recipe, got {precision!r}")
    return Fp8Recipe() if precision == "fp8" else None
