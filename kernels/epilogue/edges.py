"""What a tree's values are in the columns of the last tile past the problem's edge N.

A tile that straddles N evaluates the tree on its columns past N too; sinks never write them, but
a row sum over the tile has to leave them out. Where a value is provably zero there, a sum (of
squares) of it needs no per-element column mask (a compare and a select per element, and the
registers of the flags: with the mask the LM head's dlogits tree spilled on ping-pong 128 x 128).

Past N the accumulator is zero (TMA fills B's elements past N with zeros, and the block-scaled
kernel's scales with them) and so are tile inputs (their TMA loads fill the same way). Column
vectors are zero-padded too, but rsqrt or 1 / x of one is inf there, so they count as unknown;
so do indices, lookups and segment sums. Row-uniform values (row vectors, scalars, row sums) are
unknown numbers, the same past the edge as inside it: a product of one with a value that is zero
past N is taken as zero (0 * inf only where that row is inf inside the problem as well).
"""

from __future__ import annotations

import math
from typing import Union

from . import nodes as N

#: an unknown row-uniform number (:func:`edge_value`)
ROW = "row"

_ROW_LEAVES = (N.RowVec, N.Scalar, N.ScalarTensor, N.RowSum, N.RowIndex)


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

Edge = Union[float, str, None]


def _finite_math(fn, *args) -> float:
    """fn on floats with IEEE results instead of Python's exceptions (inf - inf, inf * 0: NaN)."""
    if any(math.isnan(a) for a in args):
        return math.nan
    try:
        return float(fn(*args))
    except (OverflowError, ValueError, ZeroDivisionError):
        return math.nan


def edge_value(x: N.Node, pair: tuple = (0.0, 0.0)) -> Edge:
    """``x``'s value past N: a float where it follows from the zeros there and constants,
    :data:`ROW` where it is an unknown row-uniform number, None where unknown. ``pair``: the
    values of a pairwise body's (even, odd) arguments."""
    if isinstance(x, (N.Acc, N.Tile)):
        return 0.0
    if isinstance(x, N.Const):
        return float(x.value)
    if isinstance(x, N.PairArg):
        return pair[x.which]
    if isinstance(x, _ROW_LEAVES):
        return ROW
    if isinstance(x, N.Cast):
        return edge_value(x.children[0], pair)
    if isinstance(x, N.Unary):
        v = edge_value(x.children[0], pair)
        return _finite_math(_UNARY[x.op], v) if isinstance(v, float) else v
    if isinstance(x, N.Binary) and x.op in _BINARY:
        a, b = (edge_value(c, pair) for c in x.children)
        if isinstance(a, float) and isinstance(b, float):
            return _finite_math(_BINARY[x.op], a, b)
        if x.op == "mul" and ROW in (a, b) and 0.0 in (a, b):
            return 0.0  # zero times a row's number (see the module docstring)
        return ROW if None not in (a, b) else None
    if isinstance(x, N.Select):
        a, b = (edge_value(c, pair) for c in x.children[1:])
        return a if isinstance(a, float) and a == b else None
    if isinstance(x, N.Pairwise):
        v = edge_value(x.children[0], pair)
        if not isinstance(v, float):
            return None
        outs = [edge_value(b, (v, v)) for b in x.body]
        return outs[0] if all(isinstance(o, float) and o == outs[0] for o in outs) else None
    if isinstance(x, N.Interleave):
        a, b = (edge_value(c, pair) for c in x.children)
        return a if isinstance(a, float) and a == b else None
    return None


def zero_past_edge(x: N.Node) -> bool:
    """Whether ``x`` is zero in every column past N (:func:`edge_value`), so that a row sum or
    sum of squares over a tile may add those columns unmasked."""
    v = edge_value(x)
    return isinstance(v, float) and v == 0.0
