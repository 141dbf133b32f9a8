"""``torch.ops.coda.quantize_fp8``: the FP8 recipe's block quantization (``coda_cute.precision``)
for the operands no GEMM epilogue quantizes:

* ``block="1x128"`` (activations, gradients): x (M, K) 16-bit, one scale per row and 128
  columns, returned M-major ((M, ceil(K / 128)) with strides (1, M)), the layout the block-scaled
  GEMM reads (``coda.gemm_blockwise``);
* ``block="128x128"`` (weights): W (N, K) fp32 masters or 16-bit, one scale per 128 x 128 block,
  with the consumer's RMSNorm weight ``gamma`` folded in first when given (W' = W diag(gamma),
  the fp32 product quantized, never rounded to 16 bits).

    amax_b = max |x| over block b;  s_b = amax_b / FP8_MAX (1 for a zero block, NaN for a block
    holding inf or NaN);  q = fp8(clamp(x * (1 / s_b), +-FP8_MAX))

exactly ``coda_cute.reference.quantize_blocks_ref`` (bit for bit on the GPU). Returns (q, scales).
``coda.quantize_fp8_dual`` quantizes x along K and x^T along M in one pass (the weight
gradient's operands, quantized along the tokens). ``coda.quantize_fp8_rowwise`` does the same in
the row-wise recipe (``Fp8Recipe(scaling="row")``): one scale per whole row of x and one per whole
column (the row-wise GEMM's ``scale_a`` / ``scale_b``).

No autograd: the FP8 training ops quantize detached values and carry their own backward.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import dispatch
from ..elementwise_fp8 import (quantize_dual, quantize_grad_rows, quantize_rows, quantize_rowwise, quantize_weight,
                               transpose_fp8)
from ..operands import check_pointer_aligned
from ..precision import block_scales_m_major
from ..reference import fold_factors_ref, quantize_blocks_ref
from .checks import BF16, F32, check_same_device
from .eager import direct

OP = "coda.quantize_fp8"
BLOCKS = {"1x128": (1, 128), "128x128": (128, 128)}
FP8_OUT = (torch.float8_e4m3fn, torch.float8_e5m2)
_INPUTS = {"1x128": (BF16, torch.float16), "128x128": (F32, BF16, torch.float16)}


def check_quantize(x, block, gamma, dtype, op=OP):
    """The op's rules, on every path (``op``: the name errors give). Returns (rows, cols, scale
    grid shape)."""
    if block not in BLOCKS:
        raise ValueError(f"{op}: block must be one of {tuple(BLOCKS)}, got {block!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _INPUTS[block]:
        raise ValueError(f"{op}: x must be a 2-D tensor of {[str(t)[6:] for t in _INPUTS[block]]} for "
                         f"block {block}, got {getattr(x, 'dtype', type(x).__name__)} "
                         f"{tuple(getattr(x, 'shape', ()))}")
    rows, cols = x.shape
    # an empty x reads nothing: its strides (an expanded gradient's (0, 0)) and pointer are free
    if cols % 8 or (x.numel() and (x.stride(1) != 1 or (rows > 1 and x.stride(0) * x.element_size() % 16))):
        raise ValueError(f"{op}: x's rows must be contiguous and start on 16-byte boundaries with K a "
                         f"multiple of 8 (16-byte loads, 8-byte FP8 stores); got shape {tuple(x.shape)}, "
                         f"strides {tuple(x.stride())}")
    if x.numel():
        check_pointer_aligned(x, "x", op)
    if dtype not in FP8_OUT:
        raise ValueError(f"{op}: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if gamma is not None:
        if block != "128x128":
            raise ValueError(f"{op}: gamma (a folded RMSNorm weight) applies to weights, block 128x128")
        if gamma.dim() != 1 or gamma.shape[0] != cols or gamma.dtype not in _INPUTS["128x128"] \
                or gamma.stride(0) != 1:
            raise ValueError(f"{op}: gamma must be a contiguous ({cols},) fp32 / bf16 / fp16 tensor "
                             f"(one per column of x), got {gamma.dtype} {tuple(gamma.shape)}")
        if gamma.numel():  # the weight kernel loads it in 16-byte vectors
            check_pointer_aligned(gamma, "gamma", op)
    check_same_device(op, x=x, gamma=gamma)
    br, bc = BLOCKS[block]
    return rows, cols, (-(-rows // br), -(-cols // bc))


def _outputs(x, block, grid, dtype):
    """q (rows, cols) and the scales in the op's layout: M-major for 1x128, row-major for 128x128."""
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    if block == "1x128":
        return q, block_scales_m_major(*x.shape, x.device)
    return q, torch.empty(grid, dtype=F32, device=x.device)


@torch.library.custom_op("coda::quantize_fp8", mutates_args=())
def quantize_fp8(x: torch.Tensor, block: str = "1x128", gamma: Optional[torch.Tensor] = None,
                 dtype: torch.dtype = torch.float8_e4m3fn, pow2_scales: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales) of ``x`` in FP8 blocks (module docstring); ``pow2_scales``: each scale rounded
    up to a power of two."""
    _, _, grid = check_quantize(x, block, gamma, dtype)
    q, scales = _outputs(x, block, grid, dtype)
    if block == "1x128":
        return quantize_rows(x, dtype, scales, q, pow2_scales)
    return quantize_weight(x, gamma, dtype, scales, q, pow2=pow2_scales)


@quantize_fp8.register_fake
def _fake(x, block="1x128", gamma=None, dtype=torch.float8_e4m3fn, pow2_scales=False):
    _, _, grid = check_quantize(x, block, gamma, dtype)
    return _outputs(x, block, grid, dtype)


@quantize_fp8.register_kernel("cpu")
def _cpu(x, block="1x128", gamma=None, dtype=torch.float8_e4m3fn, pow2_scales=False):
    dispatch.require_reference(OP)
    _, _, grid = check_quantize(x, block, gamma, dtype)
    values = x.float() if gamma is None else x.float() * gamma.float()
    want_q, want_s = quantize_blocks_ref(values, BLOCKS[block], dtype, pow2_scales)
    q, scales = _outputs(x, block, grid, dtype)
    return q.copy_(want_q), scales.copy_(want_s)


# == both 1 x 128 quantizations in one pass: x along K and x^T along M (the wgrad operand) =========
OP_DUAL = "coda.quantize_fp8_dual"


def check_dual(x, dtype, op=OP_DUAL):
    """``coda.quantize_fp8_dual``'s rules (those of 1 x 128 blocks, and M a multiple of 16: the
    rows of the transposed FP8 copy start on 16-byte boundaries), also the row-wise op's. Returns
    (M, K)."""
    m, k, _ = check_quantize(x, "1x128", None, dtype, op)
    if m % 16:
        raise ValueError(f"{op}: x's rows (M = {m}) must be a multiple of 16: the transposed FP8 "
                         "copy's rows start on 16-byte boundaries")
    return m, k


def quantize_dual_fp8(x: torch.Tensor, dtype=torch.float8_e4m3fn, rows: bool = True, pow2_scales: bool = False):
    """(q, s, qt, st): x's 1 x 128 quantization and that of x^T (K, M), scales (rows,
    ceil(cols / 128)) M-major (``precision.block_scales_m_major``), as ``coda.quantize_fp8``'s;
    ``rows`` False: (None, None, qt, st). The kernel on CUDA (``kernels.elementwise.quantize_dual``),
    the reference inside ``reference_on_cpu``."""
    check_dual(x, dtype)
    if x.device.type == "cuda":
        return quantize_dual(x, dtype, rows, pow2_scales)
    dispatch.require_reference(OP_DUAL)
    qt, st = quantize_blocks_ref(x.t().contiguous().float(), (1, 128), dtype, pow2_scales)
    st = block_scales_m_major(*qt.shape, x.device).copy_(st)
    if not rows:
        return None, None, qt, st
    q, s = quantize_blocks_ref(x.float(), (1, 128), dtype, pow2_scales)
    return q, block_scales_m_major(*q.shape, x.device).copy_(s), qt, st


@torch.library.custom_op("coda::quantize_fp8_dual", mutates_args=())
def quantize_fp8_dual(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, pow2_scales: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, s, qt, st) of 16-bit ``x`` (M, K) in one pass: q, s = its 1 x 128 quantization along K,
    qt, st = that of ``x.t()`` (K, M) along M, each ``reference.quantize_blocks_ref``'s (bit for
    bit on the GPU); scales (rows, ceil(cols / 128)) fp32, M-major. The weight gradient's operands
    are quantized along the tokens, which a 1 x 128 tensor cannot be transposed into.
    ``pow2_scales``: scales rounded up to powers of two."""
    return quantize_dual_fp8(x, dtype, pow2_scales=pow2_scales)


@quantize_fp8_dual.register_fake
def _dual_fake(x, dtype=torch.float8_e4m3fn, pow2_scales=False):
    m, k = check_dual(x, dtype)
    return (x.new_empty((m, k), dtype=dtype), block_scales_m_major(m, k, x.device),
            x.new_empty((k, m), dtype=dtype), block_scales_m_major(k, m, x.device))


# == the row-wise recipe: one scale per whole row and per whole column ===============================
OP_ROWWISE = "coda.quantize_fp8_rowwise"


def quantize_rowwise_fp8(x: torch.Tensor, dtype=torch.float8_e4m3fn, rows: bool = True, cols: bool = True,
                         pow2_scales: bool = False, fold: Optional[torch.Tensor] = None):
    """(q, s, qt, st): x (M, K) in FP8 with one scale per whole row, s (M, 1), and x^T (K, M) with
    one per whole column of x, st (K, 1): ``quantize_blocks_ref`` with blocks (1, K) and (1, M),
    the operands of the row-wise GEMM (x @ B with ``scale_a=s``; a weight gradient x^T @ B over the
    tokens with ``scale_a=st``). ``coda.quantize_fp8_dual``'s rules (M a multiple of 16 only with
    ``cols``); ``rows`` / ``cols`` False: None for that pair. ``fold`` (M,) fp32, the columns
    alone: qt, st of ``fold[:, None] * x`` (fp32 products), a weight gradient's operand taking
    the other operand's row scales (:func:`quantize_grad_rowwise_fp8`). The kernel on CUDA
    (``elementwise_fp8.quantize_rowwise``), the reference inside ``reference_on_cpu``."""
    if cols:
        m, k = check_dual(x, dtype, OP_ROWWISE)
    else:
        m, k, _ = check_quantize(x, "1x128", None, dtype, OP_ROWWISE)
    if fold is not None:
        if rows or not cols:
            raise ValueError(f"{OP_ROWWISE}: fold scales the columns alone (rows=False, cols=True)")
        if fold.dtype != F32 or tuple(fold.shape) != (m,) or fold.stride(0) != 1:
            raise ValueError(f"{OP_ROWWISE}: fold must be a contiguous ({m},) fp32 tensor (one factor per row "
                             f"of x), got {fold.dtype} {tuple(fold.shape)}")
    check_same_device(OP_ROWWISE, x=x, fold=fold)
    if x.device.type == "cuda":
        return quantize_rowwise(x, dtype, rows, cols, pow2_scales, fold)
    dispatch.require_reference(OP_ROWWISE)

    def whole_rows(t):  # a row without values is a zero block: scale 1
        if t.numel() == 0:
            return t.to(dtype), torch.ones((t.shape[0], 1), dtype=F32)
        return quantize_blocks_ref(t.float(), (1, t.shape[1]), dtype, pow2_scales)
    q_s = whole_rows(x) if rows else (None, None)
    values = x.float() if fold is None else x.float() * fold[:, None]
    qt_st = whole_rows(values.t().contiguous()) if cols else (None, None)
    return (*q_s, *qt_st)


def quantize_grad_rowwise_fp8(g: torch.Tensor, dtype=torch.float8_e4m3fn, pow2_scales: bool = False,
                              transposed: bool = True):
    """(q, s, qt, fold) of a gradient g (M, K) in the row-wise recipe (or of an activation whose
    weight gradient folds its rows' scales into the gradient: the MLP's h): q, s (M, 1) one scale per
    whole row (:func:`quantize_rowwise_fp8`'s rows, for its dgrad), qt = q^T (K, M) the same
    bytes transposed (``transposed``, M and K multiples of 16; else None) and fold (M,) the rows' fold
    factors, s with 0 for a zero row. Its weight gradient over the tokens folds each row's scale
    into the other operand instead of quantizing g's columns:

        dW = sum_m (q[m, :] s_m)^T x[m, :] = qt @ (fold[:, None] * x)     (fold_m = s_m or 0)

    so g is read once (no column amaxes); the zero rows' factor 0 keeps their x rows out of the
    folded columns' amaxes. The kernels on CUDA (``elementwise_fp8.quantize_grad_rows``, then
    ``elementwise_fp8.transpose_fp8``), the reference inside ``reference_on_cpu``."""
    if transposed:
        m, k = check_dual(g, dtype, OP_ROWWISE)
        if k % 16:
            raise ValueError(f"{OP_ROWWISE}: g's columns (K = {k}) must be a multiple of 16 for its FP8 "
                             "transpose: the rows of q start on 16-byte boundaries")
    else:
        m, k, _ = check_quantize(g, "1x128", None, dtype, OP_ROWWISE)
    if g.device.type == "cuda":
        q, s, fold = quantize_grad_rows(g, dtype, pow2_scales)
        return q, s, transpose_fp8(q) if transposed else None, fold
    dispatch.require_reference(OP_ROWWISE)
    q, s, _, _ = quantize_rowwise_fp8(g, dtype, cols=False, pow2_scales=pow2_scales)
    amax = g.float().abs().amax(1) if g.numel() else torch.zeros(m, dtype=F32)
    return q, s, transpose_bytes(q) if transposed else None, fold_factors_ref(amax, s[:, 0])


def transpose_bytes(q: torch.Tensor) -> torch.Tensor:
    """``q.t()`` of a contiguous FP8 (M, N) as a contiguous tensor: ``elementwise_fp8.transpose_fp8`` on
    CUDA (M and N multiples of 16), torch's copy on the CPU reference path."""
    return transpose_fp8(q) if q.device.type == "cuda" else q.t().contiguous()


@torch.library.custom_op("coda::quantize_fp8_rowwise", mutates_args=())
def quantize_fp8_rowwise(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, pow2_scales: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, s, qt, st) of 16-bit ``x`` (M, K) in the row-wise recipe (:func:`quantize_rowwise_fp8`):
    q (M, K) with s (M, 1), one fp32 scale per whole row; qt = x^T in FP8 (K, M) with st (K, 1),
    one per whole column of x. ``pow2_scales``: scales rounded up to powers of two."""
    return quantize_rowwise_fp8(x, dtype, pow2_scales=pow2_scales)


@quantize_fp8_rowwise.register_fake
def _rowwise_fake(x, dtype=torch.float8_e4m3fn, pow2_scales=False):
    m, k = check_dual(x, dtype, OP_ROWWISE)
    return (x.new_empty((m, k), dtype=dtype), x.new_empty((m, 1), dtype=F32),
            x.new_empty((k, m), dtype=dtype), x.new_empty((k, 1), dtype=F32))


# Python callers skip the dispatcher where nothing needs it (ops.eager): the FP8 sublayers quantize
# their activations between GEMMs, several times a step
quantize_fp8 = direct(quantize_fp8)
quantize_fp8_dual = direct(quantize_fp8_dual)
quantize_fp8_rowwise = direct(quantize_fp8_rowwise)
