"""Epilogue math in the CuTe DSL: turns tree nodes into fp32 register arithmetic.

Arch-independent: values are produced element by element of the current epilogue sub-tile, and
every leaf is fetched through a *context* supplied by the architecture's epilogue plumbing:

    ctx.acc(i)            the accumulator value of sub-tile element i
    ctx.row(name, i)      a row vector's value for element i's row
    ctx.col(name, i)      a column vector's value for element i's column
    ctx.tile(name, i)     a tile input's value at element i
    ctx.tile_half(name, i, h)   a wide tile's value h (0: column 2n, 1: 2n + 1) at element i
    ctx.scalar(name)      a runtime scalar
    ctx.lookup(name, r, c)  a 2-D table read at int32 indices
    ctx.ahead             values read before the sub-tile's math: {(id(lookup node), i): value}
    ctx.segment(node, i)  a segment_reduce node's value for element i (computed in a prepass)
    ctx.row_index(i), ctx.col_index(i)   element i's global m and n (Int32)

Elements 2j and 2j+1 of a sub-tile are adjacent output columns of the same row (the WGMMA
accumulator layout keeps column pairs in one thread), which is what ``pairwise`` relies on.
Double-width values (wide tiles, ``interleave``) have two values per element: they are indexed
2i + h, h = 0 for the wide tensor's column 2n and 1 for 2n + 1 of element i's column n, and
their row-uniform operands are read at element i.
Transcendentals use the fast hardware paths (ex2/lg2/rsqrt/sin/cos approximations, ~1e-6
relative; sin and cos after reducing the angle into [-pi, pi]), well inside the bf16 output
rounding.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cutlass_dsl import cutlass_arith

from ..common.fastmath import fast_cos, fast_exp, fast_max, fast_min, fast_sigmoid, fast_sin
from . import nodes as N

_LN2 = math.log(2.0)
_GELU_C = math.sqrt(2.0 / math.pi)


def _f(x):
    """Promote Int32 / Python numbers to Float32."""
    if isinstance(x, Float32):
        return x
    return Float32(x)


def _unary(op: str, x):
    if op == "to_float":
        return _f(x)
    x = _f(x)
    if op == "neg":
        return -x
    if op == "abs":
        return cute.math.abs(x)
    if op == "exp":
        return fast_exp(x)
    if op == "exp2":
        return cute.math.exp2(x, fastmath=True)
    if op == "log":
        return cute.math.log2(x, fastmath=True) * _LN2
    if op == "log2":
        return cute.math.log2(x, fastmath=True)
    if op == "sqrt":
        return cute.math.sqrt(x, fastmath=True)
    if op == "rsqrt":
        return cute.math.rsqrt(x, fastmath=True)
    if op == "recip":
        return 1.0 / x
    if op == "sin":
        return fast_sin(x)
    if op == "cos":
        return fast_cos(x)
    if op == "tanh":
        return cute.math.tanh(x, fastmath=True)
    if op == "sigmoid":
        return fast_sigmoid(x)
    if op == "silu":
        return x * fast_sigmoid(x)
    if op == "gelu":  # tanh approximation (torch's approximate="tanh")
        return 0.5 * x * (1.0 + cute.math.tanh(_GELU_C * (x + 0.044715 * x * x * x), fastmath=True))
    if op == "relu":
        return fast_max(x, Float32(0.0))
    if op == "square":
        return x * x
    raise N.EpilogueError(f"no code for unary op {op!r}")


def _plain_int(coord):
    """A coordinate as a plain signed Int32. CuTe's coordinate integers divide with the layout
    algebra's truncating ``tuple_div``; the tree's ``//`` and ``%`` floor (like torch)."""
    if isinstance(coord, int):
        return Int32(coord)
    return Int32(cutlass_arith.ArithValue(Int32(coord).ir_value(), True))


def _binary(op: str, x, y, as_int: bool):
    if not as_int:
        x, y = _f(x), _f(y)
    if op == "add":
        return x + y
    if op == "sub":
        return x - y
    if op == "mul":
        return x * y
    if op == "div":
        return x / y
    if op == "max":
        return cutlass.max(x, y) if as_int else fast_max(x, y)
    if op == "floordiv":
        return x // y
    if op == "mod":
        # The DSL's % truncates (C); the tree's mod is Python's / torch.remainder's, which pairs
        # with the flooring // so that x == (x // y) * y + x % y also for negative x.
        return x - (x // y) * y
    return cutlass.min(x, y) if as_int else fast_min(x, y)


def _compare(op: str, x, y):
    if op == "lt":
        return x < y
    if op == "le":
        return x <= y
    if op == "gt":
        return x > y
    if op == "ge":
        return x >= y
    if op == "eq":
        return x == y
    return x != y


def tile_uniform_split(tree: N.Epilogue, tile_n: int):
    """A ``where`` condition ``col_index() <op> c`` (c an integral constant) that has one value per
    ``tile_n``-column tile (c on a tile boundary), or None. The epilogue evaluates such a tile
    twice, once per value: each version computes only its side of the ``where`` (e.g. the RoPE
    and QK-norm math of a QKV projection skipped on V tiles) and none selects per element."""
    for n in (n for s in tree.sinks for n in N.walk(s.x)):
        if not isinstance(n, N.Select):
            continue
        cond = n.children[0]
        col, c = cond.children
        # |c| < 2^24: an fp32 threshold is exact there and its int32 value does not wrap.
        if (isinstance(col, N.ColIndex) and isinstance(c, N.Const) and float(c.value).is_integer()
                and abs(c.value) < 2 ** 24 and cond.op in ("lt", "ge", "le", "gt")
                and (int(c.value) + (cond.op in ("le", "gt"))) % tile_n == 0):
            return cond
    return None


def split_value(cond: N.Compare, first_col):
    """The tile-uniform value of :func:`tile_uniform_split`'s ``cond`` for the tile starting at
    column ``first_col``."""
    return _compare(cond.op, first_col, Int32(int(cond.children[1].value)))


def _live_children(n: N.Node, assume: dict) -> tuple:
    """``n``'s children, a ``where`` whose condition is in ``assume`` reduced to the side it picks."""
    kids = n.children
    if isinstance(n, N.Select) and id(kids[0]) in assume:
        return (kids[1] if assume[id(kids[0])] else kids[2],)
    return kids


def assumed_walk(roots, assume: dict) -> list:
    """The nodes reachable from ``roots`` (each once) when every ``where`` whose condition is in
    ``assume`` ({id(condition): bool}) is replaced by the side it picks."""
    seen, order = set(), []

    def visit(n):
        if id(n) in seen:
            return
        seen.add(id(n))
        for c in _live_children(n, assume):
            visit(c)
        if isinstance(n, N.Pairwise):
            for b in n.body:
                visit(b)
        order.append(n)

    for r in roots:
        visit(r)
    return order


def lookups_ahead(tree: N.Epilogue, assume: dict | None = None) -> list:
    """The tree's lookups with the element stride the Emitter reads each at: (node, 2) if it is
    only used inside pairwise bodies (read once per pair, at the even element), else (node, 1).

    Every lookup can be read a sub-tile ahead of its use: its indices are int32 expressions, and
    int32 values come only from row/column indices, int32 vectors and constants, never from the
    accumulator, tiles or other lookups. Its table lives in global memory, so a read issued next
    to its use stalls the sub-tile for an L2 round trip; issued one sub-tile early it overlaps
    that sub-tile's math, stores and barriers.
    """
    stride, seen, assume = {}, set(), assume or {}

    def visit(n, in_body):
        if (id(n), in_body) in seen:
            return
        seen.add((id(n), in_body))
        if isinstance(n, N.Lookup):
            stride[id(n)] = (n, min(stride.get(id(n), (n, 2))[1], 2 if in_body else 1))
        for c in _live_children(n, assume):
            visit(c, in_body)
        if isinstance(n, N.Pairwise):
            for b in n.body:
                visit(b, True)

    for sink in tree.sinks:
        visit(sink.x, False)
    return list(stride.values())


def read_lookups_ahead(ctx, lookups: list, n_frag: int) -> dict:
    """Issue the reads of ``lookups`` (from :func:`lookups_ahead`) for ctx's sub-tile."""
    emit, out = Emitter(ctx), {}  # lookup indices are int32: no where() with an assumed condition
    for node, step in lookups:
        for i in range(0, n_frag, step):
            r, c = (emit.value(ch, i) for ch in node.children)
            out[(id(node), i)] = ctx.lookup(node.name, r, c)
    return out


_DSL = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


class Emitter:
    """Evaluates tree nodes for the elements of one epilogue sub-tile (memoized per element)."""

    def __init__(self, ctx, binding=None, assume=None):
        self.ctx = ctx
        self.binding = binding  # (even, odd) values inside a pairwise body
        self.assume = assume or {}  # {id(condition): bool} of tile-uniform where()s
        self.memo = {}

    def value(self, node: N.Node, i: int):
        """``node``'s value at index ``i`` of its domain (2i + h for a double-width node)."""
        key = (id(node), i)
        hit = self.memo.get(key)
        if hit is None:
            hit = self.memo[key] = self._emit(node, i)
        return hit

    def _kid(self, node: N.Node, c: N.Node, i: int):
        """Child ``c`` of ``node`` at ``node``'s index ``i``: a double-width node's narrower
        operands are read at the element its value pair belongs to."""
        return self.value(c, i // 2 if node.domain == N.DOUBLE and c.domain != N.DOUBLE else i)

    def _emit(self, node: N.Node, i: int):
        ctx = self.ctx
        if isinstance(node, N.Acc):
            return ctx.acc(i)
        if isinstance(node, N.Const):
            return Int32(node.value) if node.dtype == "int32" else Float32(node.value)
        if isinstance(node, (N.Scalar, N.ScalarTensor)):
            return ctx.scalar(node.name)
        if isinstance(node, (N.RowVec, N.RowSum)):
            return ctx.row(node.name, i)
        if isinstance(node, N.Lookup):
            early = ctx.ahead.get((id(node), i))
            if early is not None:
                return early
            r, c = (self.value(ch, i) for ch in node.children)
            return ctx.lookup(node.name, r, c)
        if isinstance(node, N.SegmentReduce):
            return ctx.segment(node, i)
        if isinstance(node, N.ColVec):
            return ctx.col(node.name, i)
        if isinstance(node, N.Tile):
            return ctx.tile_half(node.name, i // 2, i % 2) if node.wide else ctx.tile(node.name, i)
        if isinstance(node, N.Interleave):
            return _f(self.value(node.children[i % 2], i // 2))
        if isinstance(node, N.RowIndex):
            return _plain_int(ctx.row_index(i))
        if isinstance(node, N.ColIndex):
            return _plain_int(ctx.col_index(i))
        if isinstance(node, N.PairArg):
            return self.binding[node.which]
        if isinstance(node, N.Unary):
            return _unary(node.op, self._kid(node, node.children[0], i))
        if isinstance(node, N.Binary):
            x, y = (self._kid(node, c, i) for c in node.children)
            c = node.children[1]
            if (node.dtype == "int32" and node.op in ("floordiv", "mod") and isinstance(c, N.Const)
                    and c.value > 0 and c.value & (c.value - 1) == 0):
                # Flooring by a power of two is an arithmetic shift / a mask for either sign; the
                # general floor sequences cost ~5 instructions each (RoPE's pair index per pair).
                shift = int(c.value).bit_length() - 1
                return x >> shift if node.op == "floordiv" else x & (int(c.value) - 1)
            return _binary(node.op, x, y, node.dtype == "int32")
        if isinstance(node, N.Compare):
            x, y = (self._kid(node, c, i) for c in node.children)
            if node.children[0].dtype != "int32" or node.children[1].dtype != "int32":
                x, y = _f(x), _f(y)
            return _compare(node.op, x, y)
        if isinstance(node, N.Select):
            cond = node.children[0]
            if id(cond) in self.assume:
                return _f(self._kid(node, node.children[1 if self.assume[id(cond)] else 2], i))
            c, a, b = (self._kid(node, ch, i) for ch in node.children)
            return Float32(cutlass.select_(c, _f(a), _f(b)))
        if isinstance(node, N.Cast):
            x = _f(self._kid(node, node.children[0], i))
            if node.to == "float32":
                return x
            return _DSL[node.to](x).to(Float32)
        if isinstance(node, N.Pairwise):
            x = node.children[0]
            one = len(node.body) == 1
            # The pair's indices in x's domain, and the element the body's leaves are read at.
            if x.domain == N.DOUBLE:
                base, at = (2 * i, i) if one else (i - i % 2, i // 2)
            else:
                base = at = i - i % 2
            pair = (_f(self.value(x, base)), _f(self.value(x, base + 1)))
            body = Emitter(self.ctx, pair, self.assume)
            # Leaves inside the body (rows, indices, lookups) are read once per pair; both
            # outputs of a pair come from that one evaluation.
            outs = [_f(body.value(b, at)) for b in node.body]
            if one:
                return outs[0]
            self.memo[(id(node), base + 1)] = outs[1]
            return outs[i % 2]
        raise N.EpilogueError(f"no code for node kind {node.kind!r}")


