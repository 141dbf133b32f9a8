"""What a tree's values are in the columns of the last tile past the problem's edge N.

A tile that straddles N evaluates the tree on its columns past N too; sinks never write them, but
a row sum over the tile has to leave them out. Where a value is provably zero there, a sum (of
squares) of it needs no per-element column mask (a compare and a select per element, and the
registers of the flags: with the mask the LM head's dlogits tree spilled on ping-pong 128 x 128);
nor does a max of it where it is also never negative (an amax's |x|): a zero cannot raise a
max over values >= 0.

Past N the accumulator is zero (TMA fills B's elements past N with zeros, and the block-scaled
kernel's scales with them) and so are tile inputs (their TMA loads fill the same way). Column
vectors are zero-padded too, but rsqrt or 1 / x of one is inf there, so they count as unknown;
so do indices, lookups and segment reductions. (Taking a bare one as zero unmasked the row-wise FP8
SwiGLU backward's zdz sum, and that build then spilled 56 bytes on ping-pong 64 x 128: its down
dgrad went from 2.00 to 2.36 ms on the H200.) Row-uniform values (row vectors, scalars, row sums) are
unknown numbers, the same past the edge as inside it: a product of one with a value that is zero
past N is taken as zero (0 * inf only where that row is inf inside the problem as well); a
column-dependent expression of them (acc + r) is unknown. Known numbers are worked out in double
and trusted only for exact zeros (ops that keep a zero, products of a zero with a finite number)
and finiteness (with a margin for fp32 and the fast approximations). With N odd, a two-output
pairwise of a full-width value pairs column N with column N - 1: unknown. (In the block-scaled
kernel a tile straddling N reads its in-range block's scale, times a zero partial product; with
an inf or NaN in a row's operands, the unmasked sum can be NaN where the masked one is inf.)

The rows past M, where a tile straddles M, mirror this (``axis="row"``): the accumulator and tile
inputs are zero there (TMA fills A's rows past M, and the tiles', with zeros), row vectors and row
sums read row M - 1's value (``acc_vectors`` clamps them), column vectors and column indices are
those of the rows inside: all of them unknown numbers the same as inside the problem. A column
sum, or a column max of a value >= 0, of a value zero past M needs no row mask.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Union

from . import nodes as N
from .rewrites import is_row_uniform, nonnegative

#: an unknown row-uniform number (:func:`edge_value`)
ROW = "row"
#: magnitudes treated as possibly infinite: the kernel computes in fp32 (max 3.4e38) with fast
#: approximations, this analysis in double
_HUGE = 1e30
#: unary ops with f(+-0) = +-0 exactly in the kernel (``codegen._unary``: silu and gelu multiply
#: by x, the approximate sqrt keeps zero)
_ZERO_KEEPING = ("neg", "abs", "relu", "square", "to_float", "silu", "gelu", "sqrt")


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _div(a: float, b: float) -> float:
    if b == 0.0:
        return math.nan if a == 0.0 or math.isnan(a) else math.copysign(math.inf, a) * math.copysign(1.0, b)
    return a / b


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + _exp(-x))


def _log(x: float) -> float:
    return -math.inf if x == 0.0 else (math.nan if x < 0 or math.isnan(x) else math.log(x))


def _tanh_gelu(x: float) -> float:
    return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


_UNARY = {
    "neg": lambda x: -x, "abs": abs, "exp": _exp, "exp2": lambda x: _exp(x * math.log(2.0)),
    "log": _log, "log2": lambda x: _log(x) / math.log(2.0),
    "sqrt": lambda x: math.nan if x < 0 or math.isnan(x) else math.sqrt(x),
    "rsqrt": lambda x: _div(1.0, math.sqrt(x)) if x >= 0 else math.nan,
    "recip": lambda x: _div(1.0, x), "sin": math.sin, "cos": math.cos, "tanh": math.tanh,
    "sigmoid": _sigmoid, "silu": lambda x: x * _sigmoid(x), "gelu": _tanh_gelu,
    "relu": lambda x: max(x, 0.0), "square": lambda x: x * x, "to_float": float,
}
_BINARY = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b, "div": _div,
           "max": max, "min": min}


class Known(tuple):
    """A value past N as (an approximation of the kernel's number, whether it is exactly zero):
    only exact zeros and finiteness are relied on."""

    def __new__(cls, value: float, zero: bool = False):
        return super().__new__(cls, (value, zero))

    @property
    def value(self) -> float:
        return self[0]

    @property
    def zero(self) -> bool:
        return self[1]

    @property
    def finite(self) -> bool:
        return math.isfinite(self.value) and abs(self.value) < _HUGE


Edge = Union[Known, str, None]


def _ieee(fn, *args) -> float:
    """fn on floats with IEEE results instead of Python's exceptions (inf - inf, inf * 0: NaN)."""
    if any(math.isnan(a) for a in args):
        return math.nan
    try:
        return float(fn(*args))
    except (OverflowError, ValueError, ZeroDivisionError):
        return math.nan


def _binary(op: str, a: Edge, b: Edge) -> Edge:
    if op == "mul":
        for z, other in ((a, b), (b, a)):
            # zero times a finite number, or times a row's number (see the module docstring)
            if isinstance(z, Known) and z.zero and (other == ROW or (isinstance(other, Known) and other.finite)):
                return Known(0.0, True)
    if not (isinstance(a, Known) and isinstance(b, Known)):
        return None
    zero = (op in ("add", "sub", "max", "min") and a.zero and b.zero) or (
        op == "div" and a.zero and b.finite and abs(b.value) > 1 / _HUGE)
    return Known(0.0 if zero else _ieee(_BINARY[op], a.value, b.value), zero)


#: leaves whose value past M is one of the problem's own (``axis="row"``)
_SAME_PAST_M = (N.Const, N.Scalar, N.ScalarTensor, N.RowVec, N.RowSum, N.ColVec, N.ColIndex)


def _same_past_edge(x: N.Node, axis: str) -> bool:
    """Whether every leaf of ``x`` reads, past the edge, a number it also has inside the problem."""
    if axis == "col":
        return is_row_uniform(x)
    return all(isinstance(n, _SAME_PAST_M) or not isinstance(n, (N.Leaf, N.Pairwise, N.SegmentReduce))
               for n in N.walk(x))


def edge_value(x: N.Node, pair: Optional[tuple] = None, axis: str = "col") -> Edge:
    """``x``'s value past N (``axis="row"``: past M): :class:`Known` where it follows from the
    zeros there and constants, :data:`ROW` where ``x`` is a number it also has inside the problem
    (row-uniform; past M, see the module docstring), None where unknown. ``pair``: the edges of a
    pairwise body's (even, odd) arguments."""
    if isinstance(x, N.Const):
        return Known(float(x.value), float(x.value) == 0.0)
    if _same_past_edge(x, axis):
        return ROW
    if isinstance(x, (N.Acc, N.Tile)):
        return Known(0.0, True)
    if isinstance(x, N.PairArg):
        return pair[x.which] if pair is not None else None
    if isinstance(x, N.Cast):  # rounding keeps zeros and infinities
        v = edge_value(x.children[0], pair, axis)
        return v if isinstance(v, Known) else None
    if isinstance(x, N.Unary):
        v = edge_value(x.children[0], pair, axis)
        if not isinstance(v, Known):
            return None
        return Known(_ieee(_UNARY[x.op], v.value), v.zero and x.op in _ZERO_KEEPING)
    if isinstance(x, N.Binary) and x.op in _BINARY:
        return _binary(x.op, *(edge_value(c, pair, axis) for c in x.children))
    if isinstance(x, N.Select):
        a, b = (edge_value(c, pair, axis) for c in x.children[1:])
        both = isinstance(a, Known) and isinstance(b, Known)
        return Known(0.0, True) if both and a.zero and b.zero else None
    if isinstance(x, N.Pairwise):
        src = x.children[0]
        if axis == "col" and src.domain == N.FULL and len(x.body) == 2:
            return None  # with N odd, column N pairs with column N - 1, inside the problem
        if isinstance(src, N.Interleave):
            args = tuple(edge_value(c, pair, axis) for c in src.children)
        else:
            v = edge_value(src, pair, axis)
            args = (v, v)
        outs = [edge_value(b, args, axis) for b in x.body]
        if all(isinstance(o, Known) and o.zero for o in outs):
            return Known(0.0, True)
        return outs[0] if len(outs) == 1 else None
    if isinstance(x, N.Interleave):
        a, b = (edge_value(c, pair, axis) for c in x.children)
        return Known(0.0, True) if isinstance(a, Known) and isinstance(b, Known) and a.zero and b.zero else None
    return None


@functools.lru_cache(maxsize=None)
def zero_past_edge(x: N.Node) -> bool:
    """Whether ``x`` is exactly zero in every column past N (:func:`edge_value`), so that a row
    sum or sum of squares over a tile may add those columns unmasked. Cached per node: the
    epilogue asks once per element while it traces a kernel."""
    v = edge_value(x)
    return isinstance(v, Known) and v.zero


@functools.lru_cache(maxsize=None)
def zero_past_rows(x: N.Node) -> bool:
    """Whether ``x`` is exactly zero in every row past M, so that a column sum over a tile may add
    those rows unmasked (as :func:`zero_past_edge` for the columns past N)."""
    v = edge_value(x, axis="row")
    return isinstance(v, Known) and v.zero


@functools.lru_cache(maxsize=None)
def unmasked_max(x: N.Node, axis: str = "col") -> bool:
    """Whether a row max of ``x`` over a tile may take its columns past N unmasked (``axis="row"``:
    a column max its rows past M): ``x`` is zero there and never negative (:func:`rewrites.nonnegative`)."""
    return nonnegative(x) and (zero_past_edge(x) if axis == "col" else zero_past_rows(x))
