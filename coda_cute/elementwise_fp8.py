"""The FP8 quantization kernels (bandwidth-bound): their specs, fake compile signatures and
launchers, as in ``coda_cute.elementwise``. 1 x 128 rows (``quantize_rows``), the weights' fold
and 128 x 128 blocks with their transpose (``quantize_weight``), both 1 x 128 layouts of a
gradient in one pass (``quantize_dual``), the row-wise recipe's whole rows and columns with their
amaxes (``quantize_rowwise``, ``abs_max``), a gradient's rows with their fold factors
(``quantize_grad_rows``) and the FP8 byte transpose (``transpose_fp8``). The launchers check
nothing: ``coda_cute.ops.quantize`` validates first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .compiler import cutlass_dtype, get_kernel, short_dtype
from .elementwise import _fake, _rows16
from .precision import block_scales_m_major
from .reference import fold_factors_ref

__all__ = ["QuantizeRowsSpec", "QuantizeWholeRowsSpec", "QuantizeWeightSpec", "QuantizeDualSpec", "TransposeBytesSpec",
           "AbsMaxSpec", "quantize_rows", "quantize_weight", "quantize_dual", "quantize_rowwise", "quantize_grad_rows",
           "abs_max", "transpose_fp8", "whole_row_groups"]


def _pow2(pow2: bool) -> str:
    """A kernel name's mark of power-of-two scales (``Fp8Recipe.pow2_scales``)."""
    return "_pow2" if pow2 else ""


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
