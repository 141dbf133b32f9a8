"""The element-wise (bandwidth-bound) kernels: their specs, fake compile signatures and launchers.

A spec names everything a binary depends on (dtype, compile-time constants, target arch) and
``build()`` returns the kernel object and fake arguments with symbolic extents, which is how
``coda_cute.compiler`` compiles it (no GPU needed) and caches it (in-process and on disk, like
the GEMMs). The launchers check nothing: the ops that call them validate first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .compiler import compile_elementwise, cutlass_dtype, get_kernel, short_dtype
from .precision import block_scales_m_major
from .reference import fold_factors_ref

__all__ = ["ScaleColumnsSpec", "FoldBackwardSpec", "CrossEntropyGradSpec", "LseCombineSpec", "RopeBackwardSpec",
           "QuantizeRowsSpec", "QuantizeWholeRowsSpec", "QuantizeWeightSpec", "QuantizeDualSpec", "EmbeddingBackwardSpec",
           "TransposeBytesSpec",
           "compile_elementwise", "fold_backward", "embedding_backward",
           "cross_entropy_grad_", "lse_combine", "rope_backward_kernel", "quantize_rows", "quantize_weight",
           "quantize_dual", "quantize_rowwise", "quantize_grad_rows", "AbsMaxSpec", "abs_max",
           "transpose_fp8"]


def _fake(dtype: str, shape, stride, align: int = 4):
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(cutlass_dtype(dtype), shape, stride=stride, assumed_align=align)


def _pow2(pow2: bool) -> str:
    """A kernel name's mark of power-of-two scales (``Fp8Recipe.pow2_scales``)."""
    return "_pow2" if pow2 else ""


def _rows16(dtype: str, n, k):
    """A fake (n, k) matrix whose row stride is a multiple of 8 elements (rows start on 16-byte
    boundaries for 16-bit types, 32-byte for fp32), unit column stride."""
    import cutlass.cute as cute

    return _fake(dtype, (n, k), (cute.sym_int64(divisibility=8), 1), 16)


@dataclass(frozen=True)
class ScaleColumnsSpec:
    """``out = w * gamma[None, :]`` (``kernels.elementwise.scale_columns``) for one 16-bit dtype;
    ``scalar``: ``out = w * s`` with ``s`` a (1,) fp32 tensor, and ``in_dtype`` w's dtype
    ("float32" or 16-bit; None: ``dtype``, out's). The kernel uses no architecture-specific
    instruction; it is built per target like the GEMMs."""

    dtype: str
    arch: str = "sm_90a"
    scalar: bool = False
    in_dtype: str | None = None

    def __post_init__(self):
        if self.in_dtype not in (None, self.dtype) and not self.scalar:
            raise ValueError("ScaleColumnsSpec: only the scalar form converts dtypes")

    @property
    def name(self) -> str:
        src = f"_from_{short_dtype(self.in_dtype)}" if self.in_dtype not in (None, self.dtype) else ""
        return f"scale_{'scalar' if self.scalar else 'columns'}_{self.arch}_{short_dtype(self.dtype)}{src}"

    def build(self):
        import cutlass.cute as cute

        from .kernels.elementwise.scale_columns import ScaleColumns

        n, k = cute.sym_int(), cute.sym_int()
        gamma = _fake("float32", (1,), (1,)) if self.scalar else _fake(self.dtype, (k,), (1,), 16)
        w = _rows16(self.in_dtype or self.dtype, n, k)
        return ScaleColumns(cutlass_dtype(self.dtype), self.scalar), (w, gamma, _rows16(self.dtype, n, k))


@dataclass(frozen=True)
class FoldBackwardSpec:
    """The fold's backward in one pass (``kernels.elementwise.fold_backward``), one 16-bit dtype."""

    dtype: str
    arch: str = "sm_90a"

    @property
    def name(self) -> str:
        return f"fold_backward_{self.arch}_{short_dtype(self.dtype)}"

    def build(self):
        import cutlass.cute as cute

        from .kernels.elementwise.fold_backward import FoldBackward

        n, k = cute.sym_int(), cute.sym_int()
        partial = _fake("float32", (cute.sym_int(), k), (cute.sym_int64(divisibility=8), 1), 16)
        dw, w, out = (_rows16(self.dtype, n, k) for _ in range(3))
        gamma = _fake(self.dtype, (k,), (1,), 16)
        return FoldBackward(cutlass_dtype(self.dtype)), (dw, w, gamma, out, partial)


def fold_backward(dw: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor):
    """(dW = dw * gamma, d gamma = sum_n dw * w) in one pass of our kernel, for 16-bit dw, w (N, K)
    and gamma (K,) of one dtype on a Hopper GPU (the caller checks that); d gamma in gamma's dtype."""
    from .kernels.elementwise.fold_backward import num_bands

    from . import dispatch

    n, k = w.shape
    out = torch.empty_like(w)
    partial = torch.empty((num_bands(n), k), dtype=torch.float32, device=w.device)
    get_kernel(FoldBackwardSpec(str(w.dtype).removeprefix("torch."), dispatch.arch_of(w.device))).fn(
        dw, w, gamma, out, partial)
    return out, partial.sum(0).to(gamma.dtype)


@dataclass(frozen=True)
class EmbeddingBackwardSpec:
    """The token embedding's backward in one deterministic pass over the table
    (``kernels.elementwise.embedding_backward``), for one dtype of the gradient and table."""

    dtype: str
    arch: str = "sm_90a"

    @property
    def name(self) -> str:
        return f"embedding_backward_{self.arch}_{short_dtype(self.dtype)}"

    def build(self):
        import cutlass.cute as cute

        from .kernels.elementwise.embedding_backward import EmbeddingBackward

        m, v, d = cute.sym_int(), cute.sym_int(), cute.sym_int()
        per16 = 16 // (torch.finfo(getattr(torch, self.dtype)).bits // 8)  # elements per 16 bytes

        def rows(n):
            return _fake(self.dtype, (n, d), (cute.sym_int64(divisibility=per16), 1), 16)

        return EmbeddingBackward(cutlass_dtype(self.dtype)), (
            rows(m), _fake("int32", (m,), (1,)), _fake("int32", (v,), (1,)), _fake("int32", (v,), (1,)),
            rows(v))


def embedding_backward(dx: torch.Tensor, order: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                       out: torch.Tensor) -> torch.Tensor:
    """Writes every row of ``out`` (V, d), dx's dtype, contiguous: row v the sum of dx[order[i]]
    over i in [starts[v], ends[v]) (fp32, in order), zeros for an empty range; dx (M, d) rows
    16-byte aligned, d a multiple of 8, order / starts / ends int32 (the caller checks that)."""
    from . import dispatch

    spec = EmbeddingBackwardSpec(str(dx.dtype).removeprefix("torch."), dispatch.arch_of(dx.device))
    get_kernel(spec).fn(dx, order, starts, ends, out)
    return out


@dataclass(frozen=True)
class QuantizeRowsSpec:
    """1 x 128 block quantization to FP8 (``kernels.elementwise.quantize_rows``): a 16-bit input
    dtype, an FP8 output dtype, and whether the scales are powers of two; ``whole``: the row-wise
    recipe's, one scale per whole row, from given amaxes."""

    dtype: str
    out_dtype: str = "float8_e4m3fn"
    arch: str = "sm_90a"
    pow2: bool = False
    whole: bool = False

    @property
    def name(self) -> str:
        part = "rowwise_rows" if self.whole else "rows"
        return f"quantize_{part}_{self.arch}_{short_dtype(self.dtype)}_{short_dtype(self.out_dtype)}{_pow2(self.pow2)}"

    def build(self):
        import cutlass.cute as cute

        from .kernels.elementwise.quantize_rows import QuantizeRows
        from .reference import FP8_MAX

        m, k = cute.sym_int(), cute.sym_int()
        fp8_max = FP8_MAX[getattr(torch, self.out_dtype)]
        kernel = QuantizeRows(cutlass_dtype(self.dtype), cutlass_dtype(self.out_dtype), fp8_max, self.pow2, self.whole)
        args = (_fake(self.dtype, (m, k), (cute.sym_int64(divisibility=8), 1), 16),
                _fake(self.out_dtype, (m, k), (cute.sym_int64(divisibility=8), 1), 16),
                _fake("float32", (m, cute.sym_int()), (cute.sym_int64(), cute.sym_int64())))
        if not self.whole:
            return kernel, args
        return kernel.rowwise, args + (_fake("float32", (cute.sym_int(),), (1,)),)


@dataclass(frozen=True)
class QuantizeWholeRowsSpec:
    """The row-wise recipe's rows alone with each row's amax found in the kernel
    (``kernels.elementwise.quantize_rows.QuantizeWholeRows``): dtypes, power-of-two scales, and
    the 16-byte groups each thread holds (rows up to ``groups * 8 * 256`` values); ``fold``: also
    the rows' fold factors (a gradient's, for its weight gradient: ``fp8_math.fold_factor``)."""

    dtype: str
    out_dtype: str = "float8_e4m3fn"
    arch: str = "sm_90a"
    pow2: bool = False
    groups: int = 1
    fold: bool = False

    @property
    def name(self) -> str:
        return (f"quantize_rowwise_rows_amax_g{self.groups}{'_fold' if self.fold else ''}_{self.arch}_"
                f"{short_dtype(self.dtype)}_{short_dtype(self.out_dtype)}{_pow2(self.pow2)}")

    def build(self):
        import cutlass.cute as cute

        from .kernels.elementwise.quantize_rows import QuantizeWholeRows
        from .reference import FP8_MAX

        kernel = QuantizeWholeRows(cutlass_dtype(self.dtype), cutlass_dtype(self.out_dtype),
                                   FP8_MAX[getattr(torch, self.out_dtype)], self.pow2, self.groups, self.fold)
        m, k = cute.sym_int(), cute.sym_int()
        args = (_rows16(self.dtype, m, k), _rows16(self.out_dtype, m, k),
                _fake("float32", (m, 1), (cute.sym_int64(), cute.sym_int64())))
        if not self.fold:
            return kernel, args
        return kernel.with_fold, args + (_fake("float32", (m,), (1,)),)


#: most 16-byte groups per thread of :class:`QuantizeWholeRowsSpec` (rows up to 32768 values);
#: longer rows take the amax pass and the ``whole`` 1 x 128 build
WHOLE_ROW_GROUPS = 16


def whole_row_groups(k: int) -> int:
    """The groups per thread a row of ``k`` values takes in one ``QuantizeWholeRows`` CTA
    (0: too long for one)."""
    from .kernels.elementwise.quantize_rows import VEC, WHOLE_THREADS

    groups = -(-k // (VEC * WHOLE_THREADS))
    return groups if groups <= WHOLE_ROW_GROUPS else 0


def quantize_rows(x: torch.Tensor, out_dtype=torch.float8_e4m3fn, scales: torch.Tensor | None = None,
                  q: torch.Tensor | None = None, pow2: bool = False):
    """(q, scales): ``x`` (M, K) 16-bit, rows 16-byte aligned, in FP8 with one fp32 scale per
    1 x 128 block (``reference.quantize_blocks_ref``); ``scales`` may be a preallocated
    (M, ceil(K / 128)) fp32 tensor of any strides (e.g. the M-major layout a GEMM reads), ``q`` a
    preallocated contiguous (M, K) tensor of ``out_dtype``."""
    from . import dispatch

    m, k = x.shape
    if q is None:
        q = torch.empty((m, k), dtype=out_dtype, device=x.device)
    if scales is None:
        scales = torch.empty((m, -(-k // 128)), dtype=torch.float32, device=x.device)
    spec = QuantizeRowsSpec(str(x.dtype).removeprefix("torch."), str(out_dtype).removeprefix("torch."),
                            dispatch.arch_of(x.device), pow2)
    if x.numel():  # an empty x has no blocks (and a grid of no CTAs is no launch)
        get_kernel(spec).fn(x, q, scales)
    return q, scales


@dataclass(frozen=True)
class QuantizeDualSpec:
    """Both 1 x 128 FP8 quantizations of a 16-bit matrix, along its rows and along its columns
    (``kernels.elementwise.quantize_dual``); ``rows=False``: the column one only; ``whole``: the
    row-wise recipe's, one scale per whole row and per whole column, from given amaxes; ``fold``
    (``whole``, columns only): the columns of x scaled by the rows' fold factors."""

    dtype: str
    out_dtype: str = "float8_e4m3fn"
    rows: bool = True
    arch: str = "sm_90a"
    pow2: bool = False
    whole: bool = False
    fold: bool = False

    @property
    def name(self) -> str:
        part = ("rowwise_" if self.whole else "") + ("dual" if self.rows else "cols") + ("_fold" if self.fold else "")
        return f"quantize_{part}_{self.arch}_{short_dtype(self.dtype)}_{short_dtype(self.out_dtype)}{_pow2(self.pow2)}"

    def build(self):
        import cutlass.cute as cute

        from .kernels.elementwise.quantize_dual import QuantizeDual
        from .reference import FP8_MAX

        m, k = cute.sym_int(), cute.sym_int()
        fp8_max = FP8_MAX[getattr(torch, self.out_dtype)]

        def scales(rows):
            return _fake("float32", (rows, cute.sym_int()), (cute.sym_int64(), cute.sym_int64()))
        # rows=False: q, s are placeholders the kernel never touches, of any shape
        qm, qk = (m, k) if self.rows else (cute.sym_int(), cute.sym_int())
        kernel = QuantizeDual(cutlass_dtype(self.dtype), cutlass_dtype(self.out_dtype), fp8_max, self.rows, self.pow2,
                              self.whole, self.fold)
        args = (_fake(self.dtype, (m, k), (cute.sym_int64(divisibility=8), 1), 16),
                _fake(self.out_dtype, (qm, qk), (cute.sym_int64(divisibility=8), 1), 16), scales(qm),
                _fake(self.out_dtype, (k, m), (cute.sym_int64(divisibility=16), 1), 16), scales(k))
        if not self.whole:
            return kernel, args
        amax = lambda: _fake("float32", (cute.sym_int(),), (1,))  # noqa: E731  (row / column amaxes)
        return kernel.folded if self.fold else kernel.rowwise, args + (amax(), amax())


def quantize_dual(x: torch.Tensor, out_dtype=torch.float8_e4m3fn, rows: bool = True, pow2: bool = False):
    """(q, s, qt, st) of ``x`` (M, K) 16-bit, K a multiple of 8 and M of 16: q, s its 1 x 128
    quantization (``reference.quantize_blocks_ref``), qt, st that of ``x.t()`` (K, M); ``rows``
    False: (None, None, qt, st). Scales fp32 (rows, ceil(cols / 128)), M-major
    (``precision.block_scales_m_major``)."""
    from . import dispatch

    m, k = x.shape
    qt = torch.empty((k, m), dtype=out_dtype, device=x.device)
    st = block_scales_m_major(k, m, x.device)
    if rows:
        q = torch.empty((m, k), dtype=out_dtype, device=x.device)
        s = block_scales_m_major(m, k, x.device)
    else:  # placeholders: the kernel writes neither
        q, s = torch.empty((1, 16), dtype=out_dtype, device=x.device), st[:1]
    spec = QuantizeDualSpec(str(x.dtype).removeprefix("torch."), str(out_dtype).removeprefix("torch."), rows,
                            dispatch.arch_of(x.device), pow2)
    if x.numel():  # an empty x has no blocks (and a grid of no CTAs is no launch)
        get_kernel(spec).fn(x, q, s, qt, st)
    return (q, s, qt, st) if rows else (None, None, qt, st)


@dataclass(frozen=True)
class TransposeBytesSpec:
    """The transpose of a matrix of 1-byte elements (``kernels.elementwise.transpose_bytes``):
    one build serves every 1-byte dtype, viewed as ``uint8``."""

    arch: str = "sm_90a"

    @property
    def name(self) -> str:
        return f"transpose_bytes_{self.arch}"

    def build(self):
        import cutlass.cute as cute

        from .kernels.elementwise.transpose_bytes import TransposeBytes

        m, n = cute.sym_int(), cute.sym_int()
        return TransposeBytes(), (_fake("uint8", (m, n), (cute.sym_int64(divisibility=16), 1), 16),
                                  _fake("uint8", (n, m), (cute.sym_int64(divisibility=16), 1), 16))


def transpose_fp8(q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q.t()`` (N, M) as a new contiguous tensor of q's dtype, for ``q`` (M, N) contiguous of a
    1-byte dtype, M and N multiples of 16; ``out`` may be a preallocated contiguous (N, M) tensor
    of q's dtype."""
    from . import dispatch

    m, n = q.shape
    if out is None:
        out = torch.empty((n, m), dtype=q.dtype, device=q.device)
    if q.numel():  # a grid of no CTAs is no launch
        get_kernel(TransposeBytesSpec(dispatch.arch_of(q.device))).fn(q.view(torch.uint8), out.view(torch.uint8))
    return out


@dataclass(frozen=True)
class AbsMaxSpec:
    """The row and column absolute maxima of a 16-bit matrix in one read
    (``kernels.elementwise.amax``): the input dtype, which of the two, and ``fold`` (the columns
    alone, of x's rows scaled by given factors)."""

    dtype: str
    rows: bool = True
    cols: bool = True
    arch: str = "sm_90a"
    fold: bool = False

    @property
    def name(self) -> str:
        part = "_".join(p for p, on in (("rows", self.rows), ("cols", self.cols), ("fold", self.fold)) if on)
        return f"amax_{part}_{self.arch}_{short_dtype(self.dtype)}"

    def build(self):
        import cutlass.cute as cute

        from .kernels.elementwise.amax import AbsMax

        vec = lambda: _fake("float32", (cute.sym_int(),), (1,))  # noqa: E731
        kernel = AbsMax(cutlass_dtype(self.dtype), self.rows, self.cols, self.fold)
        args = (_fake(self.dtype, (cute.sym_int(), cute.sym_int()), (cute.sym_int64(divisibility=8), 1), 16), vec(),
                vec())
        return (kernel.with_fold, args + (vec(),)) if self.fold else (kernel, args)


def abs_max(x: torch.Tensor, rows: bool = True, cols: bool = True, fold: torch.Tensor | None = None):
    """(row_amax (M,), col_amax (K,)) fp32 of 16-bit ``x`` (M, K), rows 16-byte aligned: max |x|
    over each row and each column, NaN where one holds a NaN; None for the one not asked for.
    ``fold`` (M,) fp32 (columns only): the column maxima of |fold[m] x[m, k]|."""
    from . import dispatch

    m, k = x.shape
    row_amax = torch.zeros(m if rows else 1, dtype=torch.float32, device=x.device)
    col_amax = torch.zeros(k if cols else 1, dtype=torch.float32, device=x.device)
    if x.numel() == 0:  # the max over no values is 0 here: a zero block's scale is 1
        return row_amax if rows else None, col_amax if cols else None
    kernel = get_kernel(AbsMaxSpec(str(x.dtype).removeprefix("torch."), rows, cols, dispatch.arch_of(x.device),
                                   fold is not None)).fn
    kernel(x, row_amax, col_amax, *(() if fold is None else (fold,)))
    return row_amax if rows else None, col_amax if cols else None


def quantize_rowwise(x: torch.Tensor, out_dtype=torch.float8_e4m3fn, rows: bool = True, cols: bool = True,
                     pow2: bool = False, fold: torch.Tensor | None = None):
    """(q, s, qt, st) of ``x`` (M, K) 16-bit, K a multiple of 8 (and M of 16 with ``cols``), in
    the row-wise recipe: q, s (M, 1) with one scale per whole row, qt = x^T's (K, M), st (K, 1)
    one per whole column of x (``reference.quantize_blocks_ref`` with blocks (1, K) and (1, M));
    ``rows`` / ``cols`` False: None for that pair. Two passes: :func:`abs_max` reads x for both
    amaxes, then ``QuantizeDual(whole=True)`` (``QuantizeRows(whole=True)`` for the rows alone)
    scales and casts; the rows alone take one pass (:class:`QuantizeWholeRowsSpec`) where a row
    fits one CTA's registers. ``fold`` (M,) fp32, the columns alone: those of ``fold[m] x[m, k]``
    (a weight gradient's operand taking the other operand's row scales, :func:`quantize_grad_rows`)."""
    from . import dispatch

    if not (rows or cols):
        raise ValueError("quantize_rowwise: ask for the rows, the columns or both")
    m, k = x.shape
    if x.numel() == 0:  # rows or columns without values: zero blocks, scale 1, nothing to launch
        ones = lambda n: torch.ones((n, 1), dtype=torch.float32, device=x.device)  # noqa: E731
        empty = lambda r, c: torch.empty((r, c), dtype=out_dtype, device=x.device)  # noqa: E731
        return (empty(m, k) if rows else None, ones(m) if rows else None,
                empty(k, m) if cols else None, ones(k) if cols else None)
    dtypes = str(x.dtype).removeprefix("torch."), str(out_dtype).removeprefix("torch.")
    arch = dispatch.arch_of(x.device)
    groups = whole_row_groups(k)
    if rows and not cols and groups:  # one read: amax in the kernel
        q, s, _ = _whole_rows(x, out_dtype, pow2, groups, False)
        return q, s, None, None
    row_amax, col_amax = abs_max(x, rows, cols, fold)
    if rows:
        q = torch.empty((m, k), dtype=out_dtype, device=x.device)
        s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if not cols:
        get_kernel(QuantizeRowsSpec(*dtypes, arch, pow2, whole=True)).fn(x, q, s, row_amax)
        return q, s, None, None
    qt = torch.empty((k, m), dtype=out_dtype, device=x.device)
    st = torch.empty((k, 1), dtype=torch.float32, device=x.device)
    if not rows:  # placeholders: the kernel reads and writes none of them (the factors ride in the rows' slot)
        q, s, row_amax = torch.empty((1, 16), dtype=out_dtype, device=x.device), st[:1], \
            (col_amax[:1] if fold is None else fold)
    get_kernel(QuantizeDualSpec(*dtypes, rows, arch, pow2, whole=True, fold=fold is not None)).fn(
        x, q, s, qt, st, row_amax, col_amax)
    return (q, s, qt, st) if rows else (None, None, qt, st)


def _whole_rows(x, out_dtype, pow2: bool, groups: int, fold: bool):
    """q, s (M, 1) and with ``fold`` the fold factors (M,) of ``x``'s rows in one read
    (:class:`QuantizeWholeRowsSpec`)."""
    from . import dispatch

    m, k = x.shape
    q = torch.empty((m, k), dtype=out_dtype, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    factors = torch.empty((m,), dtype=torch.float32, device=x.device) if fold else None
    spec = QuantizeWholeRowsSpec(str(x.dtype).removeprefix("torch."), str(out_dtype).removeprefix("torch."),
                                 dispatch.arch_of(x.device), pow2, groups, fold)
    get_kernel(spec).fn(x, q, s, *((factors,) if fold else ()))
    return q, s, factors


def quantize_grad_rows(x: torch.Tensor, out_dtype=torch.float8_e4m3fn, pow2: bool = False):
    """(q, s, fold) of a gradient ``x`` (M, K) 16-bit in the row-wise recipe: q, s (M, 1) its
    whole-row quantization (as :func:`quantize_rowwise`'s rows) and fold (M,) fp32 the rows' fold
    factors, s with 0 for a zero row (``fp8_math.fold_factor``): its weight gradient takes q^T and
    the other operand scaled by them. One read where a row fits a CTA's registers, else the amax
    pass first (the factors then from torch)."""
    from . import dispatch

    m, k = x.shape
    if x.numel() == 0:  # zero blocks: scale 1, factor 0
        return (torch.empty((m, k), dtype=out_dtype, device=x.device),
                torch.ones((m, 1), dtype=torch.float32, device=x.device),
                torch.zeros((m,), dtype=torch.float32, device=x.device))
    groups = whole_row_groups(k)
    if groups:
        return _whole_rows(x, out_dtype, pow2, groups, True)
    amax, _ = abs_max(x, cols=False)
    q = torch.empty((m, k), dtype=out_dtype, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    spec = QuantizeRowsSpec(str(x.dtype).removeprefix("torch."), str(out_dtype).removeprefix("torch."),
                            dispatch.arch_of(x.device), pow2, whole=True)
    get_kernel(spec).fn(x, q, s, amax)
    return q, s, fold_factors_ref(amax, s[:, 0])


@dataclass(frozen=True)
class QuantizeWeightSpec:
    """A weight's fold and 128 x 128 FP8 quantization (``kernels.elementwise.quantize_weight``):
    the weight's dtype (fp32 masters or 16-bit), gamma's (None: no fold), the FP8 dtype, and
    whether it also writes the FP8 transpose (the dgrad operand)."""

    dtype: str
    gamma_dtype: str | None = None
    out_dtype: str = "float8_e4m3fn"
    arch: str = "sm_90a"
    transposed: bool = False
    pow2: bool = False

    @property
    def name(self) -> str:
        g = f"_g{short_dtype(self.gamma_dtype)}" if self.gamma_dtype else ""
        t = "_t" if self.transposed else ""
        return f"quantize_weight_{self.arch}_{short_dtype(self.dtype)}{g}_{short_dtype(self.out_dtype)}{t}{_pow2(self.pow2)}"

    def build(self):
        import cutlass.cute as cute

        from .kernels.elementwise.quantize_weight import QuantizeWeight
        from .reference import FP8_MAX

        n, k = cute.sym_int(), cute.sym_int()
        row16 = 16 // torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        gamma = None if self.gamma_dtype is None else _fake(self.gamma_dtype, (k,), (1,), 16)
        kernel = QuantizeWeight(cutlass_dtype(self.dtype), self.gamma_dtype and cutlass_dtype(self.gamma_dtype),
                                cutlass_dtype(self.out_dtype), FP8_MAX[getattr(torch, self.out_dtype)],
                                self.transposed, self.pow2)
        # qt's rows take 16-byte stores: N a multiple of 16
        qt = _fake(self.out_dtype, (k, n), (cute.sym_int64(divisibility=16), 1), 16) if self.transposed else None
        return kernel, (
            _fake(self.dtype, (n, k), (cute.sym_int64(divisibility=row16), 1), 16), gamma,
            # 8-byte stores of q: a K that is a multiple of 8 (not 16) keeps them aligned
            _fake(self.out_dtype, (n, k), (cute.sym_int64(divisibility=8), 1), 16),
            _fake("float32", (cute.sym_int(), cute.sym_int()), (cute.sym_int64(), cute.sym_int64())),
            qt,
        )


def quantize_weight(w: torch.Tensor, gamma: torch.Tensor | None = None, out_dtype=torch.float8_e4m3fn,
                    scales: torch.Tensor | None = None, q: torch.Tensor | None = None,
                    transposed: bool = False, qt: torch.Tensor | None = None, pow2: bool = False):
    """(q, scales) of ``w * gamma`` (N, K) in FP8 with one fp32 scale per 128 x 128 block
    (``reference.quantize_blocks_ref`` on ``w.float() * gamma.float()``); ``scales``, ``q`` may be
    preallocated ((ceil(N / 128), ceil(K / 128)) fp32 any strides; (N, K) contiguous).
    ``transposed`` (N a multiple of 16): (q, scales, qt) with qt = q^T (K, N) contiguous (may
    be preallocated too)."""
    from . import dispatch

    n, k = w.shape
    if q is None:
        q = torch.empty((n, k), dtype=out_dtype, device=w.device)
    if scales is None:
        scales = torch.empty((-(-n // 128), -(-k // 128)), dtype=torch.float32, device=w.device)
    if transposed and qt is None:
        qt = torch.empty((k, n), dtype=out_dtype, device=w.device)
    name = lambda t: str(t.dtype).removeprefix("torch.")  # noqa: E731
    spec = QuantizeWeightSpec(name(w), None if gamma is None else name(gamma),
                              str(out_dtype).removeprefix("torch."), dispatch.arch_of(w.device), transposed, pow2)
    if w.numel():  # an empty w has no blocks (and a grid of no CTAs is no launch)
        get_kernel(spec).fn(w, gamma, q, scales, qt)
    return (q, scales, qt) if transposed else (q, scales)


@dataclass(frozen=True)
class CrossEntropyGradSpec:
    """The cross-entropy gradient in place (``kernels.elementwise.ce_grad``), bf16 logits."""

    arch: str = "sm_90a"

    @property
    def name(self) -> str:
        return f"ce_grad_{self.arch}_bf16"

    def build(self):
        import cutlass.cute as cute

        from .kernels.elementwise.ce_grad import CrossEntropyGrad

        m, v = cute.sym_int(), cute.sym_int()
        vec = (m,)
        return CrossEntropyGrad(), (
            _fake("bfloat16", (m, v), (cute.sym_int64(divisibility=8), 1), 16),
            _fake("float32", vec, (1,)), _fake("float32", vec, (1,)), _fake("float32", vec, (1,)),
            _fake("int32", vec, (1,)), _fake("float32", vec, (1,)),
            _fake("float32", (m, cute.sym_int()), (cute.sym_int64(), 1)),
        )


def cross_entropy_grad_(logits: torch.Tensor, lse, rstd, coef, targets, target_logit) -> torch.Tensor:
    """In place on ``logits`` (M, V) bf16 (rows 16-byte aligned): rstd coef (softmax - onehot),
    the target's probability from ``target_logit`` (M,) fp32 rather than its bf16 logit;
    returns the (M, T) fp32 partials of coef sum_v (softmax - onehot) logits per column chunk
    (``kernels.elementwise.ce_grad``)."""
    from .kernels.elementwise.ce_grad import num_chunks

    from . import dispatch

    m, v = logits.shape
    partials = torch.empty((m, num_chunks(v)), dtype=torch.float32, device=logits.device)
    get_kernel(CrossEntropyGradSpec(dispatch.arch_of(logits.device))).fn(
        logits, lse, rstd, coef, targets, target_logit, partials)
    return partials


@dataclass(frozen=True)
class LseCombineSpec:
    """A row's log-sum-exp from its per-tile (max, sum exp) partials (``kernels.elementwise.lse_combine``)."""

    arch: str = "sm_90a"

    @property
    def name(self) -> str:
        return f"lse_combine_{self.arch}"

    def build(self):
        import cutlass.cute as cute

        from .kernels.elementwise.lse_combine import LseCombine

        m, t = cute.sym_int(), cute.sym_int()
        parts = [_fake("float32", (m, t), (cute.sym_int64(), 1)) for _ in range(2)]
        return LseCombine(), (*parts, _fake("float32", (m,), (1,)))


def lse_combine(mx: torch.Tensor, se: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``epilogue.finalize_lse(mx, se)`` in one launch: mx, se (M, T) fp32 with unit stride along
    T (an ``lse`` reduction's partials), into ``out`` (M,) fp32 contiguous (allocated if None)."""
    from . import dispatch

    if out is None:
        out = torch.empty(mx.shape[0], dtype=torch.float32, device=mx.device)
    get_kernel(LseCombineSpec(dispatch.arch_of(mx.device))).fn(mx, se, out)
    return out


@dataclass(frozen=True)
class RopeBackwardSpec:
    """The RoPE (+ QK-norm) backward (``kernels.elementwise.rope_backward``) for one head layout;
    ``weight_dtype``: the QK-norm weights' ("float32" or "bfloat16", read as they are);
    ``tuning``: (option, value) pairs over the kernel's defaults (``RopeBackward.DEFAULTS``;
    ``scripts/bench_rope_backward.py --sweep``)."""

    qk_norm: bool
    head_dim: int
    n_heads: int
    n_kv_heads: int
    arch: str = "sm_90a"
    num_sms: int = 132
    tuning: tuple = ()
    weight_dtype: str = "float32"

    def __post_init__(self):
        if self.weight_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"RopeBackwardSpec: weight_dtype must be float32 or bfloat16, got {self.weight_dtype!r}")
        # one spec (and one compiled kernel) per distinct tuning: pairs sorted, a dict taken too
        if not self.tuning:
            object.__setattr__(self, "tuning", ())
            return
        pairs = tuple(sorted(dict(self.tuning).items()))
        from .kernels.elementwise.rope_backward import RopeBackward

        unknown = {k for k, _ in pairs} - set(RopeBackward.DEFAULTS[bool(self.qk_norm)])
        if unknown:
            raise ValueError(f"RopeBackwardSpec: unknown tuning options {sorted(unknown)}")
        object.__setattr__(self, "tuning", pairs)

    @property
    def name(self) -> str:
        qk = ("_qknorm" + ("_wbf16" if self.weight_dtype == "bfloat16" else "")) if self.qk_norm else ""
        tuned = "".join(f"_{k}{v}" for k, v in self.tuning)
        return f"rope_backward_{self.arch}_h{self.n_heads}x{self.n_kv_heads}_d{self.head_dim}{qk}{tuned}"

    def kernel(self):
        from .kernels.elementwise.rope_backward import RopeBackward

        return RopeBackward(self.qk_norm, self.head_dim, self.n_heads, self.n_kv_heads, self.num_sms,
                            **dict(self.tuning))

    def build(self):
        import cutlass
        import cutlass.cute as cute

        kernel = self.kernel()
        b, s, m = cute.sym_int(), cute.sym_int(), cute.sym_int()
        d, n = self.head_dim, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

        def d8():
            return cute.sym_int64(divisibility=8)

        def heads(h):
            return _fake("bfloat16", (b, h, s, d), (d8(), d8(), d8(), 1), 16)

        def rows():
            return _fake("bfloat16", (m, n), (d8(), 1), 16)

        args = [heads(self.n_heads), heads(self.n_kv_heads), heads(self.n_kv_heads), rows(),
                _fake("float32", (m,), (1,)), _fake("int32", (m,), (1,)),
                _fake("float32", (d // 2,), (1,), 16), rows(), _fake("float32", (m,), (1,))]
        if self.qk_norm:
            w_align = 4 if self.weight_dtype == "float32" else 2

            def weight():
                return _fake(self.weight_dtype, (d,), (1,), w_align)
            args += [rows(), weight(), weight(), _fake("float32", (cute.sym_int(), 2, d), (2 * d, d, 1), 16),
                     _fake("int32", (1,), (1,)), weight(), weight()]
        else:
            args += [None] * 7
        return kernel, (*args, cutlass.Float32(1e-6))


@functools.lru_cache(maxsize=None)
def _rope_layout(spec: RopeBackwardSpec):
    """The kernel object of ``spec`` (its grid for a row count), built once per spec."""
    return spec.kernel()


_COUNTERS: dict = {}


def _arrival_counter(device) -> torch.Tensor:
    """The int32 zero the QK-norm RoPE backward's CTAs count themselves on (its last CTA sets it
    back to 0): one per device and stream, so that launches that may run at the same time never
    share one; under CUDA-graph capture a new one each call (its zeroing captured with the
    kernel: memory of the graph's pool may not outlive the graph)."""
    with torch.cuda.device(device):  # the capture state and stream of the tensors' device
        capturing = torch.cuda.is_current_stream_capturing()
        stream = torch.cuda.current_stream(device).cuda_stream
    if capturing:
        return torch.zeros(1, dtype=torch.int32, device=device)
    key = (device, stream)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def rope_backward_kernel(dq, dk, dv, qkv, rstd, positions, inv_freq, pre, q_w, k_w, qk_eps: float,
                         tuning: tuple = ()):
    """(g, zdz (M, 1), (dq_w, dk_w) or None): one launch of the RoPE (+ QK-norm) backward kernel;
    with QK-norm dq_w, dk_w (head_dim,) the norm weights' gradients in their dtype. ``q_w``,
    ``k_w``: the QK-norm weights (head_dim,), contiguous, both fp32 or both bf16, with QK-norm,
    else None; ``tuning`` as in ``RopeBackwardSpec``. No rows: nothing launched, zero gradients."""
    from . import dispatch

    b, h, s, d = dq.shape
    if pre is not None and (q_w.dtype != k_w.dtype or q_w.dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError(f"rope_backward_kernel: q_w and k_w must both be float32 or both bfloat16, got "
                         f"{q_w.dtype} and {k_w.dtype}")
    wdt = "float32" if pre is None else {torch.float32: "float32", torch.bfloat16: "bfloat16"}[q_w.dtype]
    spec = RopeBackwardSpec(pre is not None, d, h, dk.shape[1], dispatch.arch_of(qkv.device),
                            dispatch.num_sms(qkv.device), tuple(tuning), wdt)
    m, n = qkv.shape
    g = torch.empty_like(qkv)
    zdz = torch.empty((m, 1), dtype=torch.float32, device=qkv.device)
    if m == 0:
        return g, zdz, (None if pre is None else (torch.zeros_like(q_w), torch.zeros_like(k_w)))
    partials = counter = dws = None
    if pre is not None:
        partials = torch.empty((_rope_layout(spec).num_row_blocks(m), 2, d), dtype=torch.float32, device=qkv.device)
        counter = _arrival_counter(qkv.device)
        dws = (torch.empty_like(q_w), torch.empty_like(k_w))
    get_kernel(spec).fn(dq, dk, dv, qkv, rstd, positions, inv_freq, g, zdz.view(m), pre, q_w, k_w, partials,
                        counter, *(dws or (None, None)), float(qk_eps))
    return g, zdz, dws
