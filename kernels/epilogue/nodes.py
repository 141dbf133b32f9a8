"""Epilogue visitor trees: the node vocabulary (pure Python; no DSL, no torch).

An epilogue is a DAG evaluated on every element (m, n) of a GEMM's output tile while the fp32
accumulator is still in registers. Values are fp32 (indices are int32, comparisons boolean):

    leaves    acc()                   the accumulator  sum_k A[m, k] B[n, k]
              scalar(name)            a runtime number (Python float at call time)
              scalar_tensor(name)     a 1-element fp32 device tensor (no host sync)
              row_vec(name, dtype)    v[l, m]      (one per output row, e.g. RMSNorm's r)
              col_vec(name, dtype)    v[l, n]      (one per output column, e.g. a bias)
              tile(name, dtype)       T[l, m, n]   (an (M, N) input, e.g. the residual)
              wide_tile(name, dtype)  T[l, m, 2n], T[l, m, 2n + 1]: an (M, 2N) input, two values
                                      per output column (e.g. SwiGLU's gate/up pre-activation)
              row_index(), col_index()           m and n (int32)
              const(value)            a compile-time constant
              row_sum(name)           sum_t P[l, m, t] of an (M, T) input (finalizes partials)
              lookup(name, r, c)      Tab[r, c] of a 2-D fp32 table at int32 indices
    compute   + - * / (also with Python numbers), max/min, comparisons, where(c, a, b),
              unary math (exp, log, rsqrt, silu, sigmoid, gelu, ...), cast(x, dtype) (round
              to a narrower type and back),
              pairwise(fn, x): fn(x[2j], x[2j+1]) on adjacent columns, returning one value (the
              result has half as many columns) or a pair (written back to columns 2j and 2j+1)
              interleave(a, b): the 1 -> 2 pairwise node, columns 2n = a[n] and 2n + 1 = b[n]
              (a double-width value)
              segment_reduce(x, op, w): sum / sum of squares / max of x over each row's
              aligned w-column segment (per-head statistics), usable as a value; fn may
              use the pair, scalars, row vectors and indices
    sinks     store(x, name, dtype)           an (M, N), (M, N/2) or (M, 2N) output
              row_reduce(x, op, name)         per-tile partials over the tile's columns:
                                              (L, M, n_tiles) fp32; op sum | sumsq | max | lse
                                              (lse: two outputs, ``name`` max and sum of exp)
              col_reduce(x, op, name)         per-tile partials over the tile's rows:
                                              (L, N, m_tiles) fp32; op sum | sumsq | max
              gather(x, index, name)          out[l, m] = x[m, index[l, m]] (fp32, (L, M)); rows
                                              whose index is outside [0, N) are left at 0
              quantize(x, name, dtype, pow2)  x in FP8 with one fp32 scale per row and aligned
                                              128-column block: (values (M, N) FP8, scales
                                              (M, ceil(N / 128)) fp32; a double-width x: (M, 2N)
                                              and (M, ceil(2N / 128))), exactly
                                              ``reference.quantize_blocks_ref(x, (1, 128))``;
                                              ``transposed=True``: x^T in blocks of 128 rows of x
                                              (the weight gradients' operand along the tokens):
                                              (values (N, M), scales (N, ceil(M / 128)))

``segment_reduce`` and ``scale_acc`` build trees by their row-uniform factors (``rewrites``).
``Epilogue(*sinks)`` validates the DAG and gives it a structural key (node kinds, ops, dtypes,
constants, which input each leaf reads by position in the input order; not names or values of
runtime inputs), which kernels are cached by.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

DTYPES = ("float32", "bfloat16", "float16", "int32")
STORE_DTYPES = ("float32", "bfloat16", "float16")
#: a quantize sink's value types, and the columns of one of its scale blocks
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
QUANT_BLOCK = 128
UNARY_OPS = ("neg", "abs", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "recip", "sin", "cos",
             "tanh", "sigmoid", "silu", "gelu", "relu", "square", "to_float")
BINARY_OPS = ("add", "sub", "mul", "div", "max", "min", "floordiv", "mod")
INT_ONLY_OPS = ("floordiv", "mod")
COMPARE_OPS = ("lt", "le", "gt", "ge", "eq", "ne")
ROW_REDUCE_OPS = ("sum", "sumsq", "max", "lse")
COL_REDUCE_OPS = ("sum", "sumsq", "max")
SEGMENT_REDUCE_OPS = ("sum", "sumsq", "max")
FULL, HALF, DOUBLE = "full", "half", "double"
#: columns of a value of each domain per GEMM output column
DOMAIN_WIDTH = {HALF: 0.5, FULL: 1, DOUBLE: 2}
WIDE_DTYPES = ("bfloat16", "float16")


class EpilogueError(ValueError):
    """A malformed epilogue tree or a call that does not match it."""


class Node:
    """A value in the epilogue DAG. ``domain`` is FULL (one value per output column), HALF (one
    per column pair, after a single-output ``pairwise``), DOUBLE (two per output column: a wide
    tile, an ``interleave``) or None (the same for every column of a row: row-uniform)."""

    kind = "node"
    dtype = "float32"
    role = None  # "input" nodes are bound to call arguments by name

    def __init__(self, *children: "Node", domain: Optional[str] = None):
        self.children = tuple(children)
        doms = {c.domain for c in self.children if c.domain is not None}
        if len(doms) > 1:
            raise EpilogueError(
                f"{self.kind}: cannot combine values of different widths {sorted(doms)} (a "
                "single-value pairwise node halves the width, a wide tile or interleave doubles "
                "it: combine values of one width, or use pairwise / interleave to change it)"
            )
        self.domain = domain if domain is not None else (doms.pop() if doms else None)

    # -- structural identity --------------------------------------------------------------------
    def params(self) -> tuple:
        """The node's own parameters that select generated code (not runtime values)."""
        return ()

    # -- operators --------------------------------------------------------------------------------
    def __add__(self, o): return Binary("add", self, _lift(o))
    def __radd__(self, o): return Binary("add", _lift(o), self)
    def __sub__(self, o): return Binary("sub", self, _lift(o))
    def __rsub__(self, o): return Binary("sub", _lift(o), self)
    def __mul__(self, o): return Binary("mul", self, _lift(o))
    def __rmul__(self, o): return Binary("mul", _lift(o), self)
    def __truediv__(self, o): return Binary("div", self, _lift(o))
    def __rtruediv__(self, o): return Binary("div", _lift(o), self)
    def __floordiv__(self, o): return Binary("floordiv", self, _lift_int(o))
    def __mod__(self, o): return Binary("mod", self, _lift_int(o))
    def __neg__(self): return Unary("neg", self)
    def __lt__(self, o): return Compare("lt", self, _lift(o))
    def __le__(self, o): return Compare("le", self, _lift(o))
    def __gt__(self, o): return Compare("gt", self, _lift(o))
    def __ge__(self, o): return Compare("ge", self, _lift(o))
    def eq(self, o): return Compare("eq", self, _lift(o))
    def ne(self, o): return Compare("ne", self, _lift(o))
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        inner = ", ".join(repr(c) for c in self.children)
        p = ", ".join(str(x) for x in self.params())
        return f"{self.kind}({p}{', ' if p and inner else ''}{inner})"


def _lift_int(x) -> Node:
    if isinstance(x, int) and not isinstance(x, bool):
        return Const(x, "int32")
    return _lift(x)


def _lift(x) -> Node:
    if isinstance(x, Node):
        return x
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise EpilogueError(f"cannot use {type(x).__name__} {x!r} in an epilogue expression")
    return Const(float(x))


# -- leaves -----------------------------------------------------------------------------------------
class Leaf(Node):
    def __init__(self, name: Optional[str] = None, dtype: str = "float32", domain=None):
        super().__init__(domain=domain)
        if dtype not in DTYPES:
            raise EpilogueError(f"{self.kind} {name!r}: dtype must be one of {DTYPES}, got {dtype!r}")
        self.name = name
        self.dtype = dtype

    def params(self):
        return (self.dtype,)


class Acc(Leaf):
    kind = "acc"

    def __init__(self):
        super().__init__(domain=FULL)


class Const(Leaf):
    kind = "const"

    def __init__(self, value, dtype: str = "float32"):
        super().__init__(dtype=dtype)
        self.value = int(value) if dtype == "int32" else float(value)

    def params(self):
        return (self.value, self.dtype)

    def __repr__(self):
        return repr(self.value)


class Scalar(Leaf):
    kind = "scalar"
    role = "input"


class ScalarTensor(Leaf):
    kind = "scalar_tensor"
    role = "input"


class RowVec(Leaf):
    kind = "row_vec"
    role = "input"


class ColVec(Leaf):
    kind = "col_vec"
    role = "input"

    def __init__(self, name, dtype="float32"):
        super().__init__(name, dtype, domain=FULL)


class Tile(Leaf):
    """An (M, N) input, or with ``wide`` an (M, 2N) one whose column pair (2n, 2n + 1) belongs to
    output column n (the kernel reads the pair as one 32-bit element)."""

    kind = "tile"
    role = "input"

    def __init__(self, name, dtype="bfloat16", wide: bool = False):
        if dtype == "int32":
            raise EpilogueError(f"tile {name!r}: tile inputs are float32, bfloat16 or float16")
        if wide and dtype not in WIDE_DTYPES:
            raise EpilogueError(f"wide_tile {name!r}: wide tiles are bfloat16 or float16 (a column "
                                f"pair is read as one 32-bit element), got {dtype!r}")
        super().__init__(name, dtype, domain=DOUBLE if wide else FULL)
        self.wide = wide

    def params(self):
        return (self.dtype, self.wide)


class RowIndex(Leaf):
    kind = "row_index"

    def __init__(self):
        super().__init__(dtype="int32")


class ColIndex(Leaf):
    kind = "col_index"

    def __init__(self):
        super().__init__(dtype="int32", domain=FULL)


class PairArg(Leaf):
    """Placeholder for the even (0) or odd (1) element inside a ``pairwise`` body."""

    kind = "pair_arg"

    def __init__(self, which: int):
        super().__init__(domain=FULL)
        self.which = which

    def params(self):
        return (self.which,)


class RowSum(Leaf):
    """Per row: the sum over T of an (M, T) fp32 input, e.g. the per-tile partials of an earlier
    epilogue's row reduction, finalized in this epilogue instead of a separate kernel."""

    kind = "row_sum"
    role = "input"

    def __init__(self, name: str):
        super().__init__(name, "float32")


class Lookup(Node):
    """A 2-D fp32 table (R, C) read at int32 indices ``row``, ``col`` (clamped into the table)."""

    kind = "lookup"
    role = "input"

    def __init__(self, name: str, row: Node, col: Node):
        for what, idx in (("row", row), ("col", col)):
            if not isinstance(idx, Node) or idx.dtype != "int32":
                raise EpilogueError(f"lookup {name!r}: the {what} index must be an int32 expression "
                                    "(row_index(), col_index(), an int32 row_vec, ...)")
        super().__init__(row, col)
        self.name = name


class SegmentReduce(Node):
    """Sum, sum of squares or max of ``x`` over the ``width``-column segment each element lies
    in, per row: e.g. a per-head statistic when ``width`` is the head dimension, or a shift for an
    exp over the segment. Computed in a first pass over the tile, so ``x`` may not read tile
    inputs; ``width`` must divide the kernel's tile width. Columns past the problem's edge N are
    left out."""

    kind = "segment_reduce"

    def __init__(self, x: Node, op: str, width: int):
        if op not in SEGMENT_REDUCE_OPS:
            raise EpilogueError(f"segment_reduce: op must be one of {SEGMENT_REDUCE_OPS}, got {op!r}")
        if not isinstance(width, int) or width < 8 or width % 8:
            raise EpilogueError(f"segment_reduce: width must be a multiple of 8, got {width!r}")
        if x.domain != FULL:
            raise EpilogueError("segment_reduce: its input must be a full-width value")
        for n in walk(x):
            if isinstance(n, (Tile, SegmentReduce)) and n is not x:
                raise EpilogueError("segment_reduce: its input may not read tile inputs or other "
                                    "segment reductions (it is computed before them)")
        super().__init__(x)
        self.op = op
        self.width = width

    def params(self):
        return (self.op, self.width)


# -- compute ----------------------------------------------------------------------------------------
class Unary(Node):
    kind = "unary"

    def __init__(self, op: str, x: Node):
        if op not in UNARY_OPS:
            raise EpilogueError(f"unknown unary op {op!r}; known: {UNARY_OPS}")
        super().__init__(x)
        self.op = op

    def params(self):
        return (self.op,)


class Binary(Node):
    kind = "binary"

    def __init__(self, op: str, x: Node, y: Node):
        if op not in BINARY_OPS:
            raise EpilogueError(f"unknown binary op {op!r}; known: {BINARY_OPS}")
        if op in INT_ONLY_OPS and not (x.dtype == y.dtype == "int32"):
            raise EpilogueError(f"{op}: integer division and remainder take int32 operands")
        super().__init__(x, y)
        self.op = op
        self.dtype = "int32" if x.dtype == y.dtype == "int32" and op != "div" else "float32"

    def params(self):
        return (self.op,)


class Compare(Node):
    kind = "compare"
    dtype = "bool"

    def __init__(self, op: str, x: Node, y: Node):
        if op not in COMPARE_OPS:
            raise EpilogueError(f"unknown comparison {op!r}; known: {COMPARE_OPS}")
        super().__init__(x, y)
        self.op = op

    def params(self):
        return (self.op,)


class Select(Node):
    kind = "select"

    def __init__(self, cond: Node, a: Node, b: Node):
        if cond.dtype != "bool":
            raise EpilogueError("where(cond, a, b): cond must be a comparison")
        super().__init__(cond, a, b)


class Cast(Node):
    kind = "cast"

    def __init__(self, x: Node, dtype: str):
        if dtype not in STORE_DTYPES:
            raise EpilogueError(f"cast: dtype must be one of {STORE_DTYPES}, got {dtype!r}")
        super().__init__(x)
        self.to = dtype

    def params(self):
        return (self.to,)


class Pairwise(Node):
    """fn(x[2j], x[2j+1]) per column pair of a full-width or double-width ``x``; one output halves
    the width (FULL -> HALF, DOUBLE -> FULL), two keep it."""

    kind = "pairwise"

    def __init__(self, fn: Callable, x: Node):
        if x.domain not in (FULL, DOUBLE):
            raise EpilogueError("pairwise: its input must be a full-width value (depend on acc, "
                                "a column vector or a tile) or a double-width one (a wide tile, "
                                "an interleave)")
        even, odd = PairArg(0), PairArg(1)
        body = fn(even, odd)
        body = tuple(_lift(b) for b in body) if isinstance(body, tuple) else (_lift(body),)
        if len(body) not in (1, 2):
            raise EpilogueError("pairwise: fn must return one value or a pair of values")
        narrow = HALF if x.domain == FULL else FULL
        super().__init__(x, domain=narrow if len(body) == 1 else x.domain)
        self.body = body
        for b in body:
            for n in walk(b):
                # The kernel evaluates the body once per pair, at the even column: only values
                # that are the same for both columns (or the pair itself) are meaningful there.
                if isinstance(n, (Acc, Tile, ColVec, Pairwise)):
                    raise EpilogueError("pairwise: fn may use the pair, scalars, row vectors and "
                                        "indices; the accumulator, column vectors, tiles and "
                                        "other pairwise nodes go outside it")

    def params(self):
        return (len(self.body),)


class Interleave(Node):
    """The 1 -> 2 pairwise node: a double-width value whose columns 2n and 2n + 1 are the
    full-width ``even`` and ``odd`` at column n (e.g. a gradient pair per SwiGLU output column)."""

    kind = "interleave"

    def __init__(self, even: Node, odd: Node):
        for what, v in (("even", even), ("odd", odd)):
            if v.domain not in (FULL, None):
                raise EpilogueError(f"interleave: {what} must be a full-width (or row-uniform) "
                                    f"value, got a {v.domain}-width one")
        if FULL not in (even.domain, odd.domain):
            raise EpilogueError("interleave: at least one of even / odd must vary over the tile")
        super().__init__(even, odd)
        self.domain = DOUBLE


# -- sinks ------------------------------------------------------------------------------------------
class Sink:
    kind = "sink"

    def __init__(self, x: Node, name: str):
        if not isinstance(x, Node):
            raise EpilogueError(f"{self.kind} {name!r}: expects an epilogue value, got {type(x).__name__}")
        if not isinstance(name, str) or not name.isidentifier():
            raise EpilogueError(f"{self.kind}: output name must be an identifier, got {name!r}")
        self.x = x
        self.name = name

    def params(self) -> tuple:
        return ()

    @property
    def half(self) -> bool:
        """A half-width value: one per output column pair."""
        return self.x.domain == HALF

    @property
    def wide(self) -> bool:
        """A double-width value: two per output column (a store or quantize sink writes each pair
        as one word)."""
        return self.x.domain == DOUBLE


class Store(Sink):
    kind = "store"

    def __init__(self, x, name, dtype="bfloat16"):
        super().__init__(x, name)
        if dtype not in STORE_DTYPES:
            raise EpilogueError(f"store {name!r}: dtype must be one of {STORE_DTYPES}, got {dtype!r}")
        if x.domain is None:
            raise EpilogueError(f"store {name!r}: the value does not vary over the tile (it uses "
                                "neither acc, a column vector, a tile nor col_index)")
        if x.domain == DOUBLE and dtype not in WIDE_DTYPES:
            raise EpilogueError(f"store {name!r}: double-width values are stored as bfloat16 or "
                                f"float16 (a column pair is written as one 32-bit element), got {dtype!r}")
        self.dtype = dtype

    def params(self):
        return (self.dtype, self.half, self.wide)


class RowReduce(Sink):
    kind = "row_reduce"

    def __init__(self, x, op, name):
        super().__init__(x, name)
        if op not in ROW_REDUCE_OPS:
            raise EpilogueError(f"row_reduce {name!r}: op must be one of {ROW_REDUCE_OPS}, got {op!r}")
        if x.domain == DOUBLE:
            raise EpilogueError(f"row_reduce {name!r}: reduce full- or half-width values (split a "
                                "double-width one with pairwise first)")
        self.op = op

    def params(self):
        return (self.op,)


class ColReduce(Sink):
    kind = "col_reduce"

    def __init__(self, x, op, name):
        super().__init__(x, name)
        if op not in COL_REDUCE_OPS:
            raise EpilogueError(f"col_reduce {name!r}: op must be one of {COL_REDUCE_OPS}, got {op!r}")
        if x.domain in (HALF, DOUBLE):
            raise EpilogueError(f"col_reduce {name!r}: only full-width values have a column reduction")
        self.op = op

    def params(self):
        return (self.op,)


class Gather(Sink):
    kind = "gather"

    def __init__(self, x, index: Node, name):
        super().__init__(x, name)
        if not isinstance(index, RowVec) or index.dtype != "int32":
            raise EpilogueError(f"gather {name!r}: index must be an int32 row_vec")
        if x.domain in (HALF, DOUBLE):
            raise EpilogueError(f"gather {name!r}: gathers read full-width values")
        self.index = index


class Quantize(Sink):
    """x in FP8 blocks of 1 x QUANT_BLOCK along each row (the activations' and gradients' blocks
    of ``precision.Fp8Recipe``): amax over the block, s = the scale of ``quantize_blocks_ref``
    (``pow2``: rounded up to a power of two), q = cast(x / s). Two outputs: the values (M, N) in
    ``dtype`` and the scales (M, ceil(N / 128)) fp32. A GEMM whose output is the next GEMM's
    operand hands it over quantized without a pass of its own. ``transposed``: x^T (N, M) in
    blocks of 128 rows of x, scales (N, ceil(M / 128)): a 128-row tile holds whole blocks of each
    column, so one pass can write both layouts of the tile (two sinks of the same x)."""

    kind = "quantize"

    def __init__(self, x, name, dtype="float8_e4m3fn", pow2: bool = False, transposed: bool = False):
        super().__init__(x, name)
        self.transposed = bool(transposed)
        if self.transposed:
            self.kind = "quantize_t"
        if dtype not in FP8_DTYPES:
            raise EpilogueError(f"quantize {name!r}: dtype must be one of {FP8_DTYPES}, got {dtype!r}")
        if x.domain not in ((FULL, HALF, DOUBLE) if self.transposed else (FULL, DOUBLE)):
            raise EpilogueError(f"quantize {name!r}: quantize full-width values (one per output column) "
                                "or double-width ones (a column pair each); half-width ones only "
                                f"transposed (their rows' blocks would span two tiles); got a {x.domain}-width one")
        self.dtype = dtype
        self.pow2 = bool(pow2)

    def params(self):
        return (self.dtype, self.pow2, self.transposed, self.x.domain)


# -- traversal and identity ------------------------------------------------------------------------
def walk(node: Node):
    """Every node reachable from ``node`` (each once), children before parents."""
    seen, order = set(), []

    def visit(n):
        if id(n) in seen:
            return
        seen.add(id(n))
        for c in n.children:
            visit(c)
        if isinstance(n, Pairwise):
            for b in n.body:
                visit(b)
        order.append(n)

    visit(node)
    return order


def structure(node: Node, slots: dict, _memo=None) -> tuple:
    """Hashable structural description of the DAG under ``node`` (shared nodes numbered).

    An input leaf is described by ``slots[name]``, the position of its input in the tree's
    input order, which is how a compiled kernel binds it: trees that differ only in their input
    names share a key, trees that feed the same leaves from different inputs do not.
    """
    memo = {} if _memo is None else _memo
    if id(node) in memo:
        return ("ref", memo[id(node)])
    memo[id(node)] = len(memo)
    slot = ("input", slots[node.name]) if node.role == "input" else ()
    body = tuple(structure(b, slots) for b in node.body) if isinstance(node, Pairwise) else ()
    return (node.kind, node.params(), slot, body, tuple(structure(c, slots, memo) for c in node.children))


@dataclass(frozen=True)
class InputSpec:
    name: str
    kind: str  # scalar | scalar_tensor | row_vec | col_vec | tile | row_sum | lookup
    dtype: str
    wide: bool = False  # a wide tile: (M, 2N), read as 32-bit column pairs

    @property
    def kernel_dtype(self) -> str:
        """The element type the kernel moves (a wide tile's column pair is one 32-bit word)."""
        return "float32" if self.wide else self.dtype


@dataclass(frozen=True)
class OutputSpec:
    name: str
    kind: str  # store | row_reduce | col_reduce | gather | quantize
    dtype: str
    half: bool = False
    op: str = ""
    wide: bool = False  # a double-width store: (M, 2N), written as 32-bit column pairs
    pow2: bool = False  # quantize: power-of-two scales

    @property
    def kernel_dtype(self) -> str:
        """What the kernel writes: a double-width store's column pairs as 32-bit words, a quantize
        sink's FP8 column pairs as 16-bit ones."""
        if self.kind == "quantize":
            return "int16"
        return "float32" if self.wide else self.dtype

    @property
    def quantizes(self) -> bool:
        return self.kind in ("quantize", "quantize_t")


class Epilogue:
    """A validated epilogue: its sinks, named inputs and outputs, and a structural key."""

    def __init__(self, *sinks: Sink):
        if not sinks:
            raise EpilogueError("an epilogue needs at least one output (store, reduction or gather)")
        for s in sinks:
            if not isinstance(s, Sink):
                raise EpilogueError(f"Epilogue takes outputs (store, row_reduce, col_reduce, gather, quantize), "
                                    f"got {s!r}")
        self.sinks = tuple(sinks)
        if len({s.wide for s in sinks if isinstance(s, Quantize) and not s.transposed}) > 1:
            raise EpilogueError("a tree quantizes either full-width or double-width values, not both "
                                "(their sub-tiles are 128 and 64 columns wide)")
        names = [s.name for s in sinks]
        if len(set(names)) != len(names):
            raise EpilogueError(f"output names must be distinct, got {names}")
        inputs: dict[str, Node] = {}
        for s in sinks:
            roots = [s.x] + ([s.index] if isinstance(s, Gather) else [])
            for root in roots:
                for n in walk(root):
                    if n.role == "input":
                        if n.name is None or not n.name.isidentifier():
                            raise EpilogueError(f"{n.kind}: input name must be an identifier, got {n.name!r}")
                        prev = inputs.get(n.name)
                        if prev is not None and (prev.kind, prev.dtype, _wide(prev)) != (n.kind, n.dtype, _wide(n)):
                            raise EpilogueError(f"input {n.name!r} is used as {_describe(prev)} "
                                                f"and as {_describe(n)}")
                        inputs.setdefault(n.name, n)
        clash = set(inputs) & set(names)
        if clash:
            raise EpilogueError(f"names used for both an input and an output: {sorted(clash)}")
        self.inputs = tuple(InputSpec(n.name, n.kind, n.dtype, _wide(n)) for n in inputs.values())
        self.outputs = tuple(_output_spec(s) for s in sinks)
        memo: dict = {}
        slots = {name: k for k, name in enumerate(inputs)}
        self.key = (
            tuple((s.kind, s.params(), structure(s.x, slots, memo),
                   structure(s.index, slots, memo) if isinstance(s, Gather) else None) for s in sinks),
            tuple((i.kind, i.dtype, i.wide) for i in self.inputs),
        )

    def input_order(self) -> tuple:
        return tuple(i.name for i in self.inputs)

    def __repr__(self):
        return "Epilogue(" + ", ".join(f"{s.kind}:{s.name}" for s in self.sinks) + ")"


def _wide(n: Node) -> bool:
    return bool(getattr(n, "wide", False))


def _describe(n: Node) -> str:
    return f"{'wide_' if _wide(n) else ''}{n.kind}[{n.dtype}]"


def _output_spec(s: Sink) -> OutputSpec:
    if isinstance(s, Store):
        return OutputSpec(s.name, "store", s.dtype, s.half, wide=s.wide)
    if isinstance(s, RowReduce):
        return OutputSpec(s.name, "row_reduce", "float32", s.x.domain == HALF, s.op)
    if isinstance(s, ColReduce):
        return OutputSpec(s.name, "col_reduce", "float32", False, s.op)
    if isinstance(s, Quantize):
        return OutputSpec(s.name, s.kind, s.dtype, s.half, pow2=s.pow2, wide=s.wide)
    return OutputSpec(s.name, "gather", "float32")


# -- the public vocabulary (functions) --------------------------------------------------------------
def acc() -> Node: return Acc()
def const(v, dtype: str = "float32") -> Node: return Const(v, dtype)
def scalar(name: str) -> Node: return Scalar(name)
def scalar_tensor(name: str) -> Node: return ScalarTensor(name)
def row_vec(name: str, dtype: str = "float32") -> Node: return RowVec(name, dtype)
def col_vec(name: str, dtype: str = "float32") -> Node: return ColVec(name, dtype)
def tile(name: str, dtype: str = "bfloat16") -> Node: return Tile(name, dtype)
def wide_tile(name: str, dtype: str = "bfloat16") -> Node: return Tile(name, dtype, wide=True)
def interleave(even, odd) -> Node: return Interleave(_lift(even), _lift(odd))
def row_index() -> Node: return RowIndex()
def col_index() -> Node: return ColIndex()
def where(cond: Node, a, b) -> Node: return Select(cond, _lift(a), _lift(b))
def maximum(a, b) -> Node: return Binary("max", _lift(a), _lift(b))
def minimum(a, b) -> Node: return Binary("min", _lift(a), _lift(b))
def cast(x: Node, dtype: str) -> Node: return Cast(x, dtype)
def pairwise(fn: Callable, x: Node) -> Node: return Pairwise(fn, x)
def store(x: Node, name: str, dtype: str = "bfloat16") -> Sink: return Store(x, name, dtype)
def row_reduce(x: Node, op: str, name: str) -> Sink: return RowReduce(x, op, name)
def col_reduce(x: Node, op: str, name: str) -> Sink: return ColReduce(x, op, name)
def gather(x: Node, index: Node, name: str) -> Sink: return Gather(x, index, name)
def quantize(x: Node, name: str, dtype: str = "float8_e4m3fn", pow2: bool = False,
             transposed: bool = False) -> Sink:
    return Quantize(x, name, dtype, pow2, transposed)
def row_sum(name: str) -> Node: return RowSum(name)
def lookup(name: str, row: Node, col: Node) -> Node: return Lookup(name, row, col)


def _unary(op):
    def f(x):
        return Unary(op, _lift(x))
    f.__name__ = op
    f.__doc__ = f"Elementwise {op}."
    return f


neg, absolute, exp, exp2, log, log2, sqrt, rsqrt, recip = map(
    _unary, ("neg", "abs", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "recip"))
sin, cos, tanh, sigmoid, silu, gelu, relu, square, to_float = map(
    _unary, ("sin", "cos", "tanh", "sigmoid", "silu", "gelu", "relu", "square", "to_float"))
