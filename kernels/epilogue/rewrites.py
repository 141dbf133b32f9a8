"""Rewrites of epilogue trees by their row-uniform factors (pure Python; no DSL, no torch).

A value that has one number per output row (an RMSNorm's r, a row scale: :func:`is_row_uniform`)
can be taken out of a per-row reduction or applied once after it:

    sum_seg(f x) = f sum_seg(x),  sumsq_seg(f x) = f^2 sumsq_seg(x),  max_seg(f x) = f max_seg(x)

the last only for f >= 0 (:func:`nonnegative`, decided from the tree's structure). Two tree
builders rest on that (:func:`segment_reduce`, :func:`scale_acc`); the epilogue planner asks the
same questions of its trees (``edges``).
"""

from __future__ import annotations

import copy

from .nodes import Acc, Binary, Cast, ColVec, Const, Epilogue, Leaf, Node, Pairwise, RowIndex, RowSum, RowVec, \
    Scalar, ScalarTensor, SegmentReduce, Unary, walk


def segment_reduce(x: Node, op: str, width: int) -> Node:
    """Sum / sum of squares / max of ``x`` over each row's aligned ``width``-column segment.

    Row-uniform factors of a product are taken out of the reduction,
    sum_seg(f x) = f sum_seg(x), sumsq_seg(f x) = f^2 sumsq_seg(x) and, for factors that are
    never negative (:func:`nonnegative`: an rsqrt, an exp, ...), max_seg(f x) = f max_seg(x), so
    the first pass over the tile reads only the accumulator part. Reducing ``acc * r`` directly
    lets the compiler keep the products from that pass for the second one: a second
    accumulator-sized set of live registers next to the accumulator itself, which spills.
    """
    whole = SegmentReduce(x, op, width)  # validates x: full-width, so never wholly row-uniform
    rest, factors = _row_factors(x)
    if op == "max":  # a factor of unknown sign stays inside: max(-x) is -min(x)
        inside = [f for f in factors if not nonnegative(f)]
        factors = [f for f in factors if nonnegative(f)]
        for f in inside:
            rest = f if rest is None else rest * f
    if not factors:
        return whole
    out = SegmentReduce(rest, op, width)
    for f in factors:
        f = Unary("to_float", f) if f.dtype == "int32" else f
        out = out * (f * f if op == "sumsq" else f)
    return out


def scale_acc(tree: Epilogue, row: str, col: str) -> Epilogue:
    """``tree`` with every ``acc()`` read as ``acc() * col_vec(col) * row_vec(row)``: the same
    epilogue on a GEMM whose operands carry one scale per row of A and one per column of B (an
    FP8 recipe's row-wise scaling, applied once to the fp32 accumulator). A segment sum of the
    scaled accumulator keeps the row scale outside (:func:`segment_reduce`); a segment max keeps
    it inside, its sign being unknown to the tree."""
    scaled = Acc() * ColVec(col) * RowVec(row)
    memo: dict = {}

    def rebuild(n: Node) -> Node:
        if isinstance(n, Acc):
            return scaled
        if id(n) not in memo:
            if isinstance(n, SegmentReduce):
                memo[id(n)] = segment_reduce(rebuild(n.children[0]), n.op, n.width)
            elif n.children:
                out = copy.copy(n)
                out.children = tuple(rebuild(c) for c in n.children)
                memo[id(n)] = out
            else:  # other leaves; a pairwise body reads no accumulator (Pairwise checks)
                memo[id(n)] = n
        return memo[id(n)]

    sinks = []
    for sink in tree.sinks:
        out = copy.copy(sink)
        out.x = rebuild(sink.x)
        sinks.append(out)
    return Epilogue(*sinks)


#: unary ops whose result is never negative (NaN aside; and rsqrt(-0) = -inf, a row scale that is
#: infinite, so its row is inf or NaN whichever way a max over it is taken)
_NONNEGATIVE = ("abs", "square", "relu", "exp", "exp2", "sqrt", "rsqrt", "sigmoid")


def nonnegative(x: Node) -> bool:
    """Whether ``x`` is >= 0 (or NaN) everywhere, structurally: |.|, squares, exp and the like,
    constants >= 0, and sums, products, maxima and minima of such values."""
    if isinstance(x, Const):
        return float(x.value) >= 0.0
    if isinstance(x, Cast):
        return nonnegative(x.children[0])
    if isinstance(x, Unary):
        return x.op in _NONNEGATIVE
    if isinstance(x, Binary):
        a, b = (nonnegative(c) for c in x.children)
        return (a or b) if x.op == "max" else (a and b and x.op in ("add", "mul", "min"))
    return False


def is_row_uniform(node: Node) -> bool:
    """Whether ``node`` has one value per row (reads no accumulator, columns, tiles or pairs)."""
    return all(isinstance(n, (Const, Scalar, ScalarTensor, RowVec, RowSum, RowIndex))
               or not isinstance(n, (Leaf, Pairwise, SegmentReduce)) for n in walk(node))


def _row_factors(x: Node):
    """x = rest * f_1 * ... * f_k with each f_i row-uniform: (rest or None, [f_1, ..., f_k])."""
    if isinstance(x, Binary) and x.op == "mul":
        (r0, f0), (r1, f1) = _row_factors(x.children[0]), _row_factors(x.children[1])
        rest = r1 if r0 is None else (r0 if r1 is None else r0 * r1)
        if not f0 + f1:
            return x, []
        return rest, f0 + f1
    return (None, [x]) if is_row_uniform(x) else (x, [])
