"""CPU (CI) tests of epilogue visitor trees: the node vocabulary's rules, the structural key that
kernels are cached by, the torch evaluator (the oracle of every GPU test) against hand-written
torch math for every node kind, and sm_90a compiles of representative trees. The runner's
validation and op registration are ``test_epilogue_runner_cpu.py``'s.
"""

import functools
import math

import pytest
import torch

from coda_cute import epilogue as E
from coda_cute.artifacts import scan_ptx
from coda_cute.compiler import KernelSpec, compile_gemm
from coda_cute.kernels.common.config import GemmConfig
from coda_cute.kernels.epilogue import nodes as N
from helpers import generator

BF16, F16, F32, I32 = torch.bfloat16, torch.float16, torch.float32, torch.int32
COOP = GemmConfig(128, 256, 64, "cooperative", 2, 1)


def swiglu(x):
    return E.pairwise(lambda g, u: E.silu(g) * u, x)


# -- vocabulary rules -------------------------------------------------------------------------------
BAD_TREES = {
    "full and half mixed": (lambda: swiglu(E.acc()) + E.acc(),
                            r"cannot combine values of different widths \[.full., .half.\]"),
    "col_vec in pairwise": (lambda: E.pairwise(lambda g, u: g * E.col_vec("c"), E.acc()),
                            r"pairwise: fn may use the pair, scalars, row vectors and indices"),
    "tile in pairwise": (lambda: E.pairwise(lambda g, u: g + E.tile("t"), E.acc()),
                         r"column vectors, tiles .* go outside it"),
    "acc in pairwise": (lambda: E.pairwise(lambda g, u: g * E.acc(), E.acc()),
                        r"the accumulator, .* go outside it"),
    "nested pairwise": (lambda: E.pairwise(lambda g, u: swiglu(g), E.acc()),
                        r"other pairwise nodes go outside it"),
    "pairwise returns 3": (lambda: E.pairwise(lambda g, u: (g, u, g), E.acc()),
                           r"fn must return one value or a pair of values"),
    "pairwise of a row value": (lambda: E.pairwise(lambda g, u: g, E.row_vec("r")),
                                r"its input must be a full-width value"),
    "unknown unary": (lambda: N.Unary("erf", E.acc()), r"unknown unary op 'erf'; known: \('neg'"),
    "unknown binary": (lambda: N.Binary("pow", E.acc(), E.acc()), r"unknown binary op 'pow'"),
    "unknown comparison": (lambda: N.Compare("approx", E.acc(), E.acc()), r"unknown comparison 'approx'"),
    "unknown row_reduce op": (lambda: E.row_reduce(E.acc(), "mean", "m"),
                              r"row_reduce 'm': op must be one of \('sum', 'sumsq', 'max', 'lse'\), got 'mean'"),
    "col_reduce lse": (lambda: E.col_reduce(E.acc(), "lse", "c"), r"col_reduce 'c': op must be one of"),
    "duplicate outputs": (lambda: E.Epilogue(E.store(E.acc(), "o"), E.row_reduce(E.acc(), "sum", "o")),
                          r"output names must be distinct, got \['o', 'o'\]"),
    "input as two kinds": (lambda: E.Epilogue(E.store(E.acc() * E.row_vec("v") + E.col_vec("v"), "o")),
                           r"input 'v' is used as row_vec\[float32\] and as col_vec\[float32\]"),
    "input as two dtypes": (lambda: E.Epilogue(E.store(E.acc() * E.col_vec("v") + E.col_vec("v", "bfloat16"), "o")),
                            r"input 'v' is used as col_vec\[float32\] and as col_vec\[bfloat16\]"),
    "input/output clash": (lambda: E.Epilogue(E.store(E.acc() + E.col_vec("out"), "out")),
                           r"names used for both an input and an output: \['out'\]"),
    "store of a row value": (lambda: E.store(E.row_vec("r"), "o"), r"store 'o': the value does not vary over the tile"),
    "store of a scalar": (lambda: E.store(E.scalar("s") * 2, "o"), r"does not vary over the tile"),
    "gather fp32 index": (lambda: E.gather(E.acc(), E.row_vec("i"), "g"), r"gather 'g': index must be an int32 row_vec"),
    "gather col index": (lambda: E.gather(E.acc(), E.col_vec("i", "int32"), "g"), r"index must be an int32 row_vec"),
    "gather of half": (lambda: E.gather(swiglu(E.acc()), E.row_vec("i", "int32"), "g"), r"gathers read full-width"),
    "col_reduce of half": (lambda: E.col_reduce(swiglu(E.acc()), "sum", "c"),
                           r"col_reduce 'c': only full-width values have a column reduction"),
    "col_reduce of double": (lambda: E.col_reduce(E.wide_tile("z"), "sum", "c"),
                             r"col_reduce 'c': only full-width values have a column reduction"),
    "row_reduce of double": (lambda: E.row_reduce(E.interleave(E.acc(), E.acc()), "sum", "r"),
                             r"row_reduce 'r': reduce full- or half-width values"),
    "gather of double": (lambda: E.gather(E.wide_tile("z"), E.row_vec("i", "int32"), "g"), r"gathers read full-width"),
    "full and double mixed": (lambda: E.wide_tile("z") + E.acc(),
                              r"cannot combine values of different widths \[.double., .full.\]"),
    "interleave of half": (lambda: E.interleave(swiglu(E.acc()), E.acc()),
                           r"interleave: even must be a full-width \(or row-uniform\) value, got a half-width one"),
    "interleave of rows only": (lambda: E.interleave(E.row_vec("a"), 1.0),
                                r"interleave: at least one of even / odd must vary over the tile"),
    "wide tile fp32": (lambda: E.wide_tile("z", "float32"), r"wide_tile 'z': wide tiles are bfloat16 or float16"),
    "double store fp32": (lambda: E.store(E.wide_tile("z"), "o", "float32"),
                          r"store 'o': double-width values are stored as bfloat16 or float16"),
    "tile and wide tile": (lambda: E.Epilogue(E.store(E.acc() + E.tile("t"), "o"), E.store(E.wide_tile("t"), "w")),
                           r"input 't' is used as tile\[bfloat16\] and as wide_tile\[bfloat16\]"),
    "store int32": (lambda: E.store(E.acc(), "o", "int32"), r"store 'o': dtype must be one of \('float32', 'bfloat16', 'float16'\)"),
    "store float64": (lambda: E.store(E.acc(), "o", "float64"), r"got 'float64'"),
    "cast to int32": (lambda: E.cast(E.acc(), "int32"), r"cast: dtype must be one of"),
    "tile int32": (lambda: E.tile("t", "int32"), r"tile 't': tile inputs are float32, bfloat16 or float16"),
    "row_vec float64": (lambda: E.row_vec("r", "float64"), r"row_vec 'r': dtype must be one of"),
    "input name with a space": (lambda: E.Epilogue(E.store(E.acc() + E.col_vec("my bias"), "o")),
                                r"col_vec: input name must be an identifier, got 'my bias'"),
    "unnamed scalar": (lambda: E.Epilogue(E.store(E.acc() * E.scalar(None), "o")), r"got None"),
    "output name with a dash": (lambda: E.store(E.acc(), "my-out"), r"store: output name must be an identifier, got 'my-out'"),
    "str in expression": (lambda: E.acc() + "x", r"cannot use str 'x' in an epilogue expression"),
    "bool in expression": (lambda: E.acc() * True, r"cannot use bool True"),
    "tensor in expression": (lambda: E.acc() * torch.ones(1), r"cannot use Tensor"),
    "where on a number": (lambda: E.where(E.acc(), 1.0, 0.0), r"where\(cond, a, b\): cond must be a comparison"),
    "sink of a number": (lambda: E.store(1.0, "o"), r"store 'o': expects an epilogue value, got float"),
    "no outputs": (lambda: E.Epilogue(), r"needs at least one output"),
    "value instead of output": (lambda: E.Epilogue(E.acc()), r"Epilogue takes outputs .*got acc"),
}


@pytest.mark.parametrize("case", list(BAD_TREES))
def test_bad_trees_raise(case):
    build, match = BAD_TREES[case]
    with pytest.raises(N.EpilogueError, match=match):
        build()


def test_epilogue_error_is_a_value_error():
    assert issubclass(E.EpilogueError, ValueError) and E.EpilogueError is N.EpilogueError


def test_inputs_and_outputs_of_a_tree():
    x = E.acc() * E.row_vec("r") + E.col_vec("bias", "bfloat16")
    tree = E.Epilogue(E.store(x, "y"), E.store(swiglu(x), "h", "float16"), E.row_reduce(x, "lse", "l"),
                      E.col_reduce(x, "max", "c"), E.gather(x * E.scalar("t"), E.row_vec("idx", "int32"), "g"))
    assert tree.input_order() == ("r", "bias", "t", "idx")
    assert [(i.kind, i.dtype) for i in tree.inputs] == [
        ("row_vec", "float32"), ("col_vec", "bfloat16"), ("scalar", "float32"), ("row_vec", "int32")]
    assert tree.outputs == (N.OutputSpec("y", "store", "bfloat16"), N.OutputSpec("h", "store", "float16", True),
                            N.OutputSpec("l", "row_reduce", "float32", False, "lse"),
                            N.OutputSpec("c", "col_reduce", "float32", False, "max"),
                            N.OutputSpec("g", "gather", "float32"))


# -- structural key ---------------------------------------------------------------------------------
def bias_gelu_residual(bias="bias", residual="residual", op=E.gelu, const=None, out_dtype="bfloat16"):
    y = op(E.acc() + E.col_vec(bias)) + E.tile(residual)
    return E.Epilogue(E.store(y if const is None else y * const, "out", out_dtype))


def spec(tree, config=COOP):
    return KernelSpec.of("bfloat16", "bfloat16", "k", "k", config, tree)


def test_identical_trees_share_a_key_and_a_kernel():
    t1, t2 = bias_gelu_residual(), bias_gelu_residual()
    assert t1 is not t2 and t1.key == t2.key
    assert spec(t1) == spec(t2) and hash(spec(t1)) == hash(spec(t2))
    assert spec(t1) != spec(t1, GemmConfig(128, 128, 64, "pingpong", 1, 1))


@pytest.mark.parametrize("other", [
    lambda: bias_gelu_residual(op=E.silu),
    lambda: bias_gelu_residual(out_dtype="float16"),
    lambda: bias_gelu_residual(const=2.0),
    lambda: E.Epilogue(E.store(E.gelu(E.acc() + E.col_vec("bias", "bfloat16")) + E.tile("residual"), "out")),
    lambda: E.Epilogue(E.store(E.gelu(E.acc() + E.col_vec("bias")) + E.tile("residual", "float32"), "out")),
    lambda: E.Epilogue(E.store(E.gelu(E.acc() + E.row_vec("bias")) + E.tile("residual"), "out")),
    lambda: E.Epilogue(E.store(E.gelu(E.acc() + E.col_vec("bias")) - E.tile("residual"), "out")),
    lambda: E.Epilogue(E.row_reduce(E.gelu(E.acc() + E.col_vec("bias")) + E.tile("residual"), "sum", "out")),
], ids=["op", "store dtype", "extra const", "vector dtype", "tile dtype", "leaf kind", "binary op", "sink kind"])
def test_different_trees_have_different_keys(other):
    assert other().key != bias_gelu_residual().key


def test_constants_are_compiled_in_scalars_are_not():
    assert bias_gelu_residual(const=2.0).key != bias_gelu_residual(const=3.0).key
    scaled = E.Epilogue(E.store(E.acc() * E.scalar("s"), "o"))
    assert scaled.key == E.Epilogue(E.store(E.acc() * E.scalar("t"), "o")).key


def test_input_names_are_not_part_of_the_key():
    t1, t2 = bias_gelu_residual(), bias_gelu_residual("b", "skip")
    assert t1.key == t2.key and spec(t1) == spec(t2)
    assert t2.input_order() == ("b", "skip")


def test_key_records_which_input_each_leaf_reads():
    # Same leaves, same input kinds, but the third leaf reads a different input: a kernel built
    # for one tree would read the wrong vector for the other.
    c1 = E.Epilogue(E.store(E.acc() * E.col_vec("a") + E.col_vec("b") + E.col_vec("a"), "o"))
    c2 = E.Epilogue(E.store(E.acc() * E.col_vec("a") + E.col_vec("a") + E.col_vec("b"), "o"))
    assert c1.input_order() == c2.input_order() == ("a", "b")
    assert c1.key != c2.key
    p1 = E.Epilogue(E.store(E.pairwise(lambda g, u: g * E.row_vec("x") + u * E.row_vec("y") + E.row_vec("x"), E.acc()), "o"))
    p2 = E.Epilogue(E.store(E.pairwise(lambda g, u: g * E.row_vec("x") + u * E.row_vec("x") + E.row_vec("y"), E.acc()), "o"))
    assert p1.key != p2.key


# -- the torch evaluator ---------------------------------------------------------------------------
M, NN, L = 6, 10, 2


@pytest.fixture
def acc():
    return torch.randn(M, NN)


def ev(x, acc, dtype="float32", **inputs):
    return E.evaluate(E.Epilogue(E.store(x, "o", dtype)), acc, inputs)["o"]


def test_leaves(acc):
    r, c = torch.randn(M), torch.randn(NN)
    t = torch.randn(M, NN).to(BF16)
    assert ev(E.acc(), acc).equal(acc)
    assert ev(E.acc() + E.const(2.5), acc).equal(acc + 2.5)
    assert ev(E.acc() * E.scalar("s"), acc, s=1.5).equal(acc * 1.5)
    assert ev(E.acc() * E.scalar_tensor("s"), acc, s=torch.tensor([0.25])).equal(acc * 0.25)
    assert ev(E.acc() + E.row_vec("r"), acc, r=r).equal(acc + r[:, None])
    assert ev(E.acc() + E.row_vec("r", "bfloat16"), acc, r=r.to(BF16)).equal(acc + r.to(BF16).float()[:, None])
    ri = torch.arange(M, dtype=I32) * 3 - 4
    assert ev(E.acc() + E.row_vec("r", "int32"), acc, r=ri).equal(acc + ri.float()[:, None])
    assert ev(E.acc() * E.col_vec("c"), acc, c=c).equal(acc * c)
    assert ev(E.acc() - E.tile("t"), acc, t=t).equal(acc - t.float())
    m, n = torch.meshgrid(torch.arange(M), torch.arange(NN), indexing="ij")
    assert ev(E.to_float(E.col_index() - E.row_index() * 100), acc).equal((n - m * 100).float())


def test_int32_arithmetic_stays_integral(acc):
    # 2^24 + 1 is no fp32 number: v - n is exact only if computed in int32 before to_float.
    big = torch.full((NN,), 2 ** 24 + 1, dtype=I32)
    want = (2 ** 24 + 1 - torch.arange(NN)).float().expand(M, NN)
    for leaf, v in ((E.row_vec("v", "int32"), big[:M]), (E.col_vec("v", "int32"), big)):
        assert ev(E.to_float(leaf - E.col_index()), acc, v=v).equal(want), leaf.kind
    assert (E.col_index() - E.row_index()).dtype == "int32"
    assert E.maximum(E.col_index(), E.row_index()).dtype == "int32"
    assert (E.col_index() / E.row_index()).dtype == "float32"
    assert (E.col_index() + 1).dtype == "float32"  # Python numbers are fp32 constants


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


UNARY = {
    "neg": lambda x: -x, "abs": torch.abs, "exp": torch.exp, "exp2": lambda x: 2 ** x,
    "log": torch.log, "log2": torch.log2, "sqrt": torch.sqrt, "rsqrt": lambda x: 1 / torch.sqrt(x),
    "recip": lambda x: 1 / x, "sin": torch.sin, "cos": torch.cos, "tanh": torch.tanh,
    "sigmoid": lambda x: 1 / (1 + torch.exp(-x)), "silu": lambda x: x / (1 + torch.exp(-x)),
    "gelu": _gelu_tanh, "relu": lambda x: x.clamp_min(0), "square": lambda x: x * x,
    "to_float": lambda x: x,
}


def test_every_unary_op_is_covered():
    assert set(UNARY) == set(N.UNARY_OPS)


@pytest.mark.parametrize("op", list(UNARY))
def test_unary(op, acc):
    fn = getattr(E, "absolute" if op == "abs" else op)
    positive = op in ("log", "log2", "sqrt", "rsqrt")
    x = E.absolute(E.acc()) + 0.5 if positive else E.acc()
    xt = acc.abs() + 0.5 if positive else acc
    torch.testing.assert_close(ev(fn(x), acc), UNARY[op](xt), rtol=1e-6, atol=1e-6)


def test_binary(acc):
    c = torch.randn(NN)
    x, y = E.acc(), E.col_vec("c")
    cases = [(x + y, acc + c), (x - y, acc - c), (x * y, acc * c), (x / y, acc / c),
             (E.maximum(x, y), torch.maximum(acc, c)), (E.minimum(x, y), torch.minimum(acc, c)),
             (2 - x, 2 - acc), (3 / x, 3 / acc), (1 + x, 1 + acc), (0.5 * x, 0.5 * acc),
             (-x, -acc), (E.maximum(x, 0), acc.clamp_min(0)), (E.minimum(1, x), acc.clamp_max(1))]
    for node, want in cases:
        torch.testing.assert_close(ev(node, acc, c=c), want, rtol=1e-6, atol=0, msg=repr(node))
    assert set(N.BINARY_OPS) == {"add", "sub", "mul", "div", "max", "min", "floordiv", "mod"}


def test_integer_index_ops(acc):
    # (n mod 128) // 2: the pair index inside a 128-wide head, as RoPE lookups use it.
    node = E.to_float((E.col_index() % 128) // 2) + E.to_float(E.row_index() % 5)
    cols = torch.arange(NN).reshape(1, NN)
    rows = torch.arange(acc.shape[0]).reshape(-1, 1)
    torch.testing.assert_close(ev(node, acc), ((cols % 128) // 2 + rows % 5).float().expand_as(acc))
    with pytest.raises(N.EpilogueError, match="int32 operands"):
        E.acc() // 2


def test_row_sum_lookup_segment_reduce(acc):
    m, n = acc.shape
    parts = torch.randn(m, 3)
    table = torch.randn(7, 9)
    x = E.acc() * E.rsqrt(E.row_sum("p") * E.row_sum("p") + 1.0)
    seg = E.segment_reduce(x, "sumsq", 8)
    node = seg + E.lookup("tab", E.row_index() % 7, E.col_index() % 9)
    r = torch.rsqrt(parts.sum(-1, keepdim=True) ** 2 + 1.0)
    xs = acc * r
    segs = torch.nn.functional.pad(xs * xs, (0, -n % 8)).reshape(m, -1, 8).sum(-1).repeat_interleave(8, -1)[:, :n]
    want = segs + table[torch.arange(m).reshape(-1, 1) % 7, torch.arange(n).reshape(1, -1) % 9]
    torch.testing.assert_close(ev(node, acc, p=parts, tab=table), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(N.EpilogueError, match="tile inputs"):
        E.segment_reduce(E.acc() + E.tile("t"), "sum", 64)
    with pytest.raises(N.EpilogueError, match="int32"):
        E.lookup("tab", E.acc(), E.col_index())


@pytest.mark.parametrize("op", ["sum", "sumsq"])
def test_segment_reduce_takes_row_factors_out(op, acc):
    m, n = acc.shape
    r, pos, c = torch.rand(m) + 0.5, torch.randint(1, 5, (m,), dtype=I32), torch.randn(n)
    x = E.acc() * E.row_vec("r") * (E.col_vec("c") * E.row_vec("pos", "int32")) * E.scalar("s")
    seg = E.segment_reduce(x, op, 8)
    inner = [k for k in N.walk(seg) if isinstance(k, N.SegmentReduce)]
    assert len(inner) == 1 and isinstance(inner[0].children[0], N.Binary)
    assert {type(k) for k in N.walk(inner[0].children[0])} == {N.Binary, N.Acc, N.ColVec}
    xs = acc * r[:, None] * c * pos[:, None] * 1.5
    xs = xs * xs if op == "sumsq" else xs
    want = torch.nn.functional.pad(xs, (0, -n % 8)).reshape(m, -1, 8).sum(-1).repeat_interleave(8, -1)[:, :n]
    torch.testing.assert_close(ev(seg, acc, r=r, pos=pos, c=c, s=1.5), want, rtol=1e-5, atol=1e-5)
    plain = E.segment_reduce(E.acc() * E.col_vec("c"), op, 8)  # nothing to take out
    assert isinstance(plain, N.SegmentReduce)
    with pytest.raises(N.EpilogueError, match="full-width"):
        E.segment_reduce(E.row_vec("r") * 2.0, op, 8)


def test_segment_max(acc):
    """The max over each row's segment, the columns past N left out; a row factor that is never
    negative (an rsqrt) is taken out of it, one of unknown sign (a row vector) stays inside."""
    m, n = acc.shape
    parts, r = torch.rand(m, 3), torch.randn(m)

    def seg_max(xs, w):
        return torch.nn.functional.pad(xs, (0, -n % w), value=-math.inf).reshape(m, -1, w).amax(-1) \
            .repeat_interleave(w, -1)[:, :n]

    rstd = E.rsqrt(E.row_sum("p") + 1.0)
    taken = E.segment_reduce(E.acc() * rstd, "max", 8)
    inner = [k for k in N.walk(taken) if isinstance(k, N.SegmentReduce)]
    assert len(inner) == 1 and isinstance(inner[0].children[0], N.Acc)
    want = seg_max(acc * torch.rsqrt(parts.sum(-1, keepdim=True) + 1.0), 8)
    torch.testing.assert_close(ev(taken, acc, p=parts), want, rtol=1e-6, atol=1e-6)
    kept = E.segment_reduce(E.acc() * E.row_vec("r"), "max", 8)
    assert isinstance(kept, N.SegmentReduce)  # max(-x) is not -max(x): r stays inside
    torch.testing.assert_close(ev(kept, acc, r=r), seg_max(acc * r[:, None], 8), rtol=1e-6, atol=1e-6)
    shifted = E.exp(E.acc() - E.segment_reduce(E.acc(), "max", 16))  # one whole segment, N = 10
    torch.testing.assert_close(ev(shifted, acc), torch.exp(acc - seg_max(acc, 16)), rtol=1e-6, atol=1e-6)
    with pytest.raises(N.EpilogueError, match="op must be one of"):
        E.segment_reduce(E.acc(), "min", 8)


@pytest.mark.parametrize("op", N.COMPARE_OPS)
def test_compare_and_where(op, acc):
    c = torch.randn(NN)
    c[::3] = acc[0, ::3]  # some ties, for eq / ne
    x, y = E.acc(), E.col_vec("c")
    cond = {"lt": x < y, "le": x <= y, "gt": x > y, "ge": x >= y, "eq": x.eq(y), "ne": x.ne(y)}[op]
    want = getattr(torch, op)(acc, c)
    assert ev(E.where(cond, x, -1.0), acc, c=c).equal(torch.where(want, acc, -1.0))
    assert ev(E.where(cond, 1.0, 0.0) + 0 * x, acc, c=c).equal(want.float())


def test_where_on_indices(acc):
    # A causal mask: int32 comparison of the tile's indices.
    got = ev(E.where(E.col_index() <= E.row_index(), E.acc(), -math.inf), acc)
    assert got.equal(acc.masked_fill(torch.ones(M, NN, dtype=torch.bool).triu(1), -math.inf))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_cast_rounds_and_returns_fp32(dtype, acc):
    want = acc.to(getattr(torch, dtype)).float()
    got = ev(E.cast(E.acc() * 3, dtype) / 3, acc)
    assert got.dtype == F32 and got.equal((acc * 3).to(getattr(torch, dtype)).float() / 3)
    assert ev(E.cast(E.acc(), dtype), acc).equal(want)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_store_rounds_once_to_its_dtype(dtype, acc):
    got = ev(E.acc() * 1.5, acc, dtype)
    assert got.dtype == getattr(torch, dtype) and got.equal((acc * 1.5).to(got.dtype))


def test_pairwise_one_value_has_half_the_columns(acc):
    r = torch.randn(M)
    tree = E.Epilogue(E.store(E.pairwise(lambda g, u: E.silu(g) * u * E.row_vec("r"), E.acc()), "h", "float32"))
    assert tree.outputs[0].half
    got = E.evaluate(tree, acc, {"r": r})["h"]
    g, u = acc[:, 0::2], acc[:, 1::2]
    assert got.shape == (M, NN // 2)
    torch.testing.assert_close(got, g / (1 + torch.exp(-g)) * u * r[:, None], rtol=1e-6, atol=1e-6)
    # Indices inside the body are the pair's even column.
    got = ev(E.pairwise(lambda g, u: g + E.to_float(E.col_index()), E.acc()), acc)
    assert got.equal(acc[:, 0::2] + torch.arange(0, NN, 2).float())


def test_pairwise_two_values_are_interleaved_back(acc):
    # A RoPE rotation of each (2j, 2j+1) pair by an angle that depends on the row.
    def rot(x, y):
        th = E.to_float(E.row_index()) * 0.5
        return x * E.cos(th) - y * E.sin(th), x * E.sin(th) + y * E.cos(th)

    node = E.pairwise(rot, E.acc())
    assert node.domain == N.FULL
    got = ev(node, acc)
    th = torch.arange(M).float()[:, None] * 0.5
    x, y = acc[:, 0::2], acc[:, 1::2]
    want = torch.empty_like(acc)
    want[:, 0::2] = x * torch.cos(th) - y * torch.sin(th)
    want[:, 1::2] = x * torch.sin(th) + y * torch.cos(th)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert ev(E.pairwise(lambda a, b: (b, a), E.acc()), acc).equal(acc.view(M, NN // 2, 2).flip(-1).reshape(M, NN))


def _tiles_of(x, tile, dim):
    return [x.narrow(dim, s, min(tile, x.shape[dim] - s)) for s in range(0, x.shape[dim], tile)]


# -- double-width values: the 1 -> 2 node (interleave) and the wide tile input ---------------------
def test_interleave_puts_even_and_odd_at_columns_2n_and_2n_plus_1(acc):
    c, r = torch.randn(NN), torch.randn(M)
    node = E.interleave(E.acc() * E.col_vec("c"), E.acc() + E.row_vec("r"))
    assert node.domain == N.DOUBLE
    got = ev(node, acc, "bfloat16", c=c, r=r)
    want = torch.empty(M, 2 * NN)
    want[:, 0::2] = acc * c
    want[:, 1::2] = acc + r[:, None]
    assert got.shape == (M, 2 * NN) and got.equal(want.to(BF16))
    # a row-uniform or constant half is broadcast over the row's columns
    got = ev(E.interleave(E.row_vec("r"), E.acc()), acc, "float16", r=r)
    assert got.equal(torch.stack((r[:, None].expand(M, NN), acc), -1).reshape(M, 2 * NN).to(F16))
    got = ev(E.interleave(E.acc(), 2.5), acc, "bfloat16")
    assert got.equal(torch.stack((acc, torch.full_like(acc, 2.5)), -1).reshape(M, 2 * NN).to(BF16))
    # a factor after the node applies to both halves; batched accumulators keep L
    got = ev(E.interleave(E.acc(), -E.acc()) * E.row_vec("r"), acc, "bfloat16", r=r)
    assert got.equal((torch.stack((acc, -acc), -1).reshape(M, 2 * NN) * r[:, None]).to(BF16))
    acc3 = torch.randn(L, M, NN)
    got = ev(E.interleave(E.acc(), E.acc() * 3), acc3, "bfloat16")
    assert got.shape == (L, M, 2 * NN) and got.equal(torch.stack((acc3, acc3 * 3), -1).reshape(L, M, 2 * NN).to(BF16))


def test_wide_tile_pairs_are_read_at_each_output_column(acc):
    """A wide tile z (M, 2N): pairwise with one value gives a full-width value from the pair
    (z[:, 2n], z[:, 2n + 1]) at column n (its col_index is n), with two values it stays double
    width; interleave of the two halves gives z back."""
    z = torch.randn(M, 2 * NN).to(BF16)
    zf = z.float()
    assert ev(E.wide_tile("z"), acc, "bfloat16", z=z).equal(z)
    got = ev(E.pairwise(lambda a, b: a * b, E.wide_tile("z")) + E.acc(), acc, z=z)
    assert got.shape == (M, NN) and got.equal(zf[:, 0::2] * zf[:, 1::2] + acc)
    got = ev(E.pairwise(lambda a, b: b + E.to_float(E.col_index()), E.wide_tile("z")), acc, z=z)
    assert got.equal(zf[:, 1::2] + torch.arange(NN).float())
    swapped = ev(E.pairwise(lambda a, b: (b, a), E.wide_tile("z")), acc, "bfloat16", z=z)
    assert swapped.equal(z.view(M, NN, 2).flip(-1).reshape(M, 2 * NN))
    w = E.wide_tile("z")
    round_trip = E.interleave(E.pairwise(lambda a, b: a, w), E.pairwise(lambda a, b: b, w))
    assert ev(round_trip, acc, "bfloat16", z=z).equal(z)
    z3 = torch.randn(L, M, 2 * NN).to(BF16)
    got = ev(E.pairwise(lambda a, b: a - b, E.wide_tile("z")), torch.randn(L, M, NN), z=z3)
    assert got.equal(z3.float()[..., 0::2] - z3.float()[..., 1::2])


def test_row_reduce_partials(acc):
    tn = 4  # N = 10: tiles of 4, 4 and 2 columns
    x = E.acc() * E.col_vec("c")
    tree = E.Epilogue(*(E.row_reduce(x, op, op) for op in N.ROW_REDUCE_OPS))
    c = torch.randn(NN)
    out = E.evaluate(tree, acc, {"c": c}, (128, tn))
    xt = acc * c
    parts = _tiles_of(xt.double(), tn, 1)
    assert out["sum"].shape == out["sumsq"].shape == out["max"].shape == (M, 3)
    assert out["sum"].dtype == F32
    torch.testing.assert_close(out["sum"], torch.stack([p.sum(1) for p in parts], 1).float())
    torch.testing.assert_close(out["sumsq"], torch.stack([(p * p).sum(1) for p in parts], 1).float())
    assert out["max"].equal(torch.stack([p.amax(1) for p in parts], 1).float())
    mx, se = out["lse"]
    assert mx.equal(out["max"])
    torch.testing.assert_close(se, torch.stack([torch.exp(p - p.amax(1, keepdim=True)).sum(1) for p in parts], 1).float())
    torch.testing.assert_close(E.finalize_lse(mx, se), torch.logsumexp(xt, 1))
    torch.testing.assert_close(E.finalize_sum(out["sum"]), xt.sum(1))
    torch.testing.assert_close(E.finalize_sum(out["sumsq"]), (xt * xt).sum(1))
    assert E.finalize_max(out["max"]).equal(xt.amax(1))


def test_row_reduce_of_half_values_uses_half_tiles(acc):
    tree = E.Epilogue(E.row_reduce(swiglu(E.acc()), "sum", "s"))
    out = E.evaluate(tree, acc, {}, (128, 4))["s"]  # 2 half-columns per tile of 4 columns
    h = E.evaluate(E.Epilogue(E.store(swiglu(E.acc()), "h", "float32")), acc, {})["h"]
    assert out.shape == (M, 3)
    torch.testing.assert_close(out, torch.stack([p.sum(1) for p in _tiles_of(h, 2, 1)], 1))


def test_lse_of_masked_rows_is_finite_where_defined():
    x = torch.full((3, 8), -math.inf)
    x[1, 5] = 2.0
    x[2] = torch.arange(8.0)
    mx, se = E.evaluate(E.Epilogue(E.row_reduce(E.acc(), "lse", "l")), x, {}, (128, 4))["l"]
    lse = E.finalize_lse(mx, se)
    assert lse[0] == -math.inf and lse[1] == 2.0
    torch.testing.assert_close(lse[2], torch.logsumexp(x[2], 0))


def test_col_reduce_partials(acc):
    tm = 4  # M = 6: tiles of 4 and 2 rows
    tree = E.Epilogue(*(E.col_reduce(E.acc() + 1, op, op) for op in N.COL_REDUCE_OPS))
    out = E.evaluate(tree, acc, {}, (tm, 256))
    parts = _tiles_of((acc + 1).double(), tm, 0)
    for op, f in (("sum", lambda p: p.sum(0)), ("sumsq", lambda p: (p * p).sum(0)), ("max", lambda p: p.amax(0))):
        assert out[op].shape == (NN, 2) and out[op].is_contiguous()
        torch.testing.assert_close(out[op], torch.stack([f(p) for p in parts], 1).float())
    torch.testing.assert_close(E.finalize_sum(out["sum"]), (acc + 1).sum(0))
    assert E.finalize_max(out["max"]).equal((acc + 1).amax(0))


def test_gather_picks_one_column_per_row(acc):
    idx = torch.tensor([3, -1, NN, 0, NN - 1, NN + 7], dtype=I32)
    tree = E.Epilogue(E.gather(E.acc() * E.scalar("t"), E.row_vec("target", "int32"), "g"))
    got = E.evaluate(tree, acc, {"t": 2.0, "target": idx})["g"]
    want = torch.tensor([acc[0, 3] * 2, 0.0, 0.0, acc[3, 0] * 2, acc[4, NN - 1] * 2, 0.0])
    assert got.dtype == F32 and got.equal(want)


def test_batched_inputs():
    acc3 = torch.randn(L, M, NN)
    ins = dict(r=torch.randn(L, M), c=torch.randn(NN), t=torch.randn(L, M, NN).to(BF16),
               idx=torch.randint(0, NN, (M,), dtype=I32))
    x = (E.acc() * E.row_vec("r") + E.col_vec("c")) * E.tile("t")
    tree = E.Epilogue(E.store(x, "y", "float32"), E.row_reduce(x, "sum", "rs"), E.col_reduce(x, "max", "cm"),
                      E.gather(x, E.row_vec("idx", "int32"), "g"))
    out = E.evaluate(tree, acc3, ins, (4, 4))
    xt = (acc3 * ins["r"][..., None] + ins["c"]) * ins["t"].float()
    assert out["y"].equal(xt)
    assert out["rs"].shape == (L, M, 3) and out["cm"].shape == (L, NN, 2) and out["g"].shape == (L, M)
    torch.testing.assert_close(E.finalize_sum(out["rs"]), xt.sum(-1))
    assert E.finalize_max(out["cm"]).equal(xt.amax(-2))
    assert out["g"].equal(xt.gather(-1, ins["idx"].long().expand(L, M)[..., None])[..., 0])


def test_values_are_broadcast_over_the_whole_output(acc):
    # Parts of a tree may not depend on every index; the kernel still evaluates every element.
    c, r = torch.randn(NN), torch.randn(M)
    assert ev(E.col_vec("c") * 2, acc, c=c).equal((c * 2).expand(M, NN))
    tree = E.Epilogue(E.row_reduce(E.row_vec("r"), "sum", "s"), E.col_reduce(E.col_vec("c"), "max", "m"))
    out = E.evaluate(tree, acc, {"r": r, "c": c}, (4, 4))
    torch.testing.assert_close(out["s"], r[:, None] * torch.tensor([4.0, 4.0, 2.0]))
    assert out["m"].equal(c[:, None].expand(NN, 2))
    h = ev(E.pairwise(lambda g, u: g * E.row_vec("r"), E.col_vec("c")), acc, c=c, r=r)
    assert h.equal(c[0::2] * r[:, None])
    acc3 = torch.randn(L, M, NN)
    idx = torch.tensor([1, 2, 3, 4, 5, 6], dtype=I32)
    g = E.evaluate(E.Epilogue(E.gather(E.acc(), E.row_vec("i", "int32"), "g")), acc3, {"i": idx})["g"]
    assert g.shape == (L, M) and g.equal(acc3.gather(-1, idx.long().expand(L, M)[..., None])[..., 0])


def test_stores_are_fresh_tensors():
    t = torch.randn(M, NN)
    out = E.evaluate(E.Epilogue(E.store(E.tile("t", "float32"), "o", "float32")), torch.zeros(M, NN), {"t": t})["o"]
    assert out.equal(t) and out.data_ptr() != t.data_ptr()


def test_shared_subexpressions_are_evaluated_once_per_tree(acc):
    x = E.exp(E.acc())
    tree = E.Epilogue(E.store(x * x, "a", "float32"), E.store(x + 1, "b", "float32"))
    out = E.evaluate(tree, acc, {})
    assert out["a"].equal(torch.exp(acc) ** 2) and out["b"].equal(torch.exp(acc) + 1)


# -- sm_90a compiles (each tree once per module) -----------------------------------------------------
COMPILED_TREES = {
    "bias_gelu_residual": lambda: bias_gelu_residual(),
    "swiglu_half": lambda: E.Epilogue(E.store(swiglu(E.acc()), "out")),
    "reductions": lambda: E.Epilogue(
        E.row_reduce(E.acc() * E.scalar("t"), "sum", "rs"), E.col_reduce(E.acc(), "sumsq", "cs"),
        E.gather(E.acc() * E.scalar("t"), E.row_vec("target", "int32"), "tgt")),
}


@functools.lru_cache(maxsize=None)
def compiled(name):
    tree = COMPILED_TREES[name]()
    kernel = compile_gemm(spec(tree), keep_artifacts=True)
    return tree, kernel, scan_ptx(kernel.ptx)


@pytest.mark.parametrize("name", list(COMPILED_TREES))
def test_compiled_tree_ptx(name):
    tree, kernel, census = compiled(name)
    assert census.target == "sm_90a" and ".target sm_90a" in kernel.ptx
    assert census.wgmma == ("m64n256k16.f32.bf16.bf16",)
    assert census.tma_loads >= 2 and census.multicast_loads >= 1  # A and B; B multicast in the c2x1 cluster
    has_store = any(o.kind == "store" for o in tree.outputs)
    assert (census.tma_stores > 0) == has_store
    stats = kernel.stats
    assert stats["spill_stores"] == 0 and stats["spill_loads"] == 0, stats
    assert stats["registers"] <= 255


def test_tile_input_is_loaded_by_tma():
    _, kernel, census = compiled("bias_gelu_residual")
    _, _, plain = compiled("swiglu_half")  # same mainloop, no tile input
    assert census.tma_loads > plain.tma_loads
    assert census.multicast_loads == plain.multicast_loads  # tile sub-tiles are per CTA


def test_reductions_are_deterministic():
    _, kernel, _ = compiled("reductions")
    assert "atom." not in kernel.ptx and "red.global" not in kernel.ptx


def _random_inputs(tree, m, n):
    """Fresh random values for every input of ``tree`` (row sums as 4 per-tile partials)."""
    out = {}
    for i in tree.inputs:
        if i.kind == "row_vec":
            out[i.name] = torch.rand(m) + 0.5
        elif i.kind == "col_vec":
            out[i.name] = torch.rand(n) + 0.5
        elif i.kind == "tile":
            out[i.name] = torch.randn(m, 2 * n if i.wide else n).to(getattr(torch, i.dtype))
        elif i.kind == "row_sum":
            out[i.name] = torch.rand(m, 4) + 0.5  # sums of squares among them
        elif i.kind == "scalar":
            out[i.name] = 0.75
        else:
            raise AssertionError(f"no random input for {i.kind}")
    return out


def _scaled_trees():
    from coda_cute.ops.residual import residual_norm_stats_tree
    from coda_cute.ops.rmsnorm import norm_backward_tree
    from coda_cute.ops.swiglu import norm_swiglu_tree, swiglu_backward_tree
    seg = E.acc() * E.row_vec("r")
    head = E.Epilogue(E.store(seg * E.rsqrt(E.segment_reduce(seg, "sumsq", 8) + 1.0), "o"))
    return {"norm_swiglu": norm_swiglu_tree(), "swiglu_backward": swiglu_backward_tree(),
            "norm_backward": norm_backward_tree(True), "residual": residual_norm_stats_tree(True),
            "segment norm": head}


@pytest.mark.parametrize("name", list(_scaled_trees()))
def test_scale_acc_is_the_tree_on_the_scaled_accumulator(name):
    """scale_acc(tree) on acc equals tree on acc * scale_b[n] * scale_a[m] (the row-wise FP8
    recipe's epilogues), with the two scales as new inputs and the original tree untouched."""
    tree = _scaled_trees()[name]
    scaled = E.scale_acc(tree, "sa", "sb")
    assert set(scaled.input_order()) == set(tree.input_order()) | {"sa", "sb"}
    assert scaled.key != tree.key and E.scale_acc(tree, "sa", "sb").key == scaled.key
    assert [o.name for o in scaled.outputs] == [o.name for o in tree.outputs]
    assert not any(isinstance(n, N.ColVec) and n.name == "sb" for s in tree.sinks for n in N.walk(s.x))
    m, n = 37, 48
    acc = torch.randn(m, n)
    inputs = _random_inputs(tree, m, n)
    sa, sb = torch.rand(m) + 0.5, torch.rand(n) + 0.5
    got = E.evaluate(scaled, acc, dict(inputs, sa=sa, sb=sb), (16, 16))
    want = E.evaluate(tree, acc * sb * sa[:, None], inputs, (16, 16))  # the tree's order of products
    assert got.keys() == want.keys()
    for k in got:
        g, w = (got[k], want[k]) if isinstance(got[k], torch.Tensor) else (got[k][0], want[k][0])
        if g.dtype == torch.bfloat16:
            # the scales multiply in another order than the tree's products: where the fp32 values
            # differ in their last bits, a bf16 store may round the other way, one bf16 ulp
            ulp = torch.ldexp(torch.ones_like(w.float()), torch.frexp(w.float()).exponent - 8)
            assert ((g.float() - w.float()).abs() <= ulp).all(), (k, (g.float() - w.float()).abs().max())
        else:
            torch.testing.assert_close(g.float(), w.float(), rtol=2e-5, atol=2e-5)
    for sr in (x for s in scaled.sinks for x in N.walk(s.x) if isinstance(x, N.SegmentReduce)):
        assert not any(isinstance(x, N.RowVec) for x in N.walk(sr.children[0]))  # row scale outside


# -- the SwiGLU backward tree against its float64 reference ----------------------------------------
def _swiglu_backward_mismatches(tree, m, f, tile_n, seed=0):
    """The evaluator's outputs of ``tree`` (the down-proj dgrad's epilogue, acc = dy @ w_down)
    against ``reference.swiglu_backward_ref`` in float64, on fresh random inputs: {sink: why} for
    each output outside its dtype's bound. dz' and h are bf16 stores of fp32 math: within the
    round-to-nearest bound 2^-8 |x| of the exact value, and the correctly rounded value almost
    everywhere (fp32 error moves a value across a rounding boundary about once in 10^5). zdz are
    fp32 per-tile partials (summed in float64): within 16 fp32 ulps of the tile's sum of term
    magnitudes (dg's 1 + g (1 - sigma) may cancel, so its magnitude counts unfolded)."""
    from coda_cute import reference as R
    from coda_cute.ops.rmsnorm import norm_inputs

    g = generator(seed)
    d, eps = 96, 1e-5
    dy = torch.randn(m, d, generator=g).to(BF16)
    w_down = (torch.randn(d, f, generator=g) * d ** -0.5).to(BF16)
    z = (2 * torch.randn(m, 2 * f, generator=g)).to(BF16)  # gates well into silu's curved range
    ss = R.norm_stats_partials_ref((torch.randn(m, d, generator=g) * 3).to(BF16), 64)
    dh = dy.double() @ w_down.double()
    # the kernel's accumulator: the exact product rounded once to fp32
    out = E.evaluate(tree, dh.float(), dict(norm_inputs(d, ss, eps), z=z), (128, tile_n))
    want_dz, want_h, want_zdz = R.swiglu_backward_ref(dy.double(), w_down.double(), z.double(), ss.double(), eps, tile_n)
    bad = {}
    for name, want in (("dz", want_dz), ("h", want_h)):
        got = out[name]
        if got.shape != want.shape or got.dtype != BF16:
            bad[name] = f"{tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} bfloat16"
            continue
        err = (got.double() - want).abs()
        over = err > want.abs() * (2 ** -8 + 2 ** -20)
        exact = (got == want.to(BF16)).double().mean().item()
        if over.any() or exact < 0.999:
            bad[name] = f"{int(over.sum())} beyond 2^-8 |x| (max {(err / want.abs()).max().item():.3g}), exact {exact:.4f}"
    gg, u = z.double()[:, 0::2], z.double()[:, 1::2]
    sg = torch.sigmoid(gg)
    mag = (gg * dh * u * sg).abs() * (1 + (gg * (1 - sg)).abs()) + (u * dh * gg * sg).abs()
    bound = 16 * 2 ** -24 * R.tile_partials_ref(mag, tile_n).double()
    got = out["zdz"]
    if got.shape != want_zdz.shape or got.dtype != F32:
        bad["zdz"] = f"{tuple(got.shape)} {got.dtype}, want {tuple(want_zdz.shape)} float32"
    elif ((got.double() - want_zdz).abs() > bound).any():
        bad["zdz"] = f"max error {((got.double() - want_zdz).abs() / bound).max().item() * 16:.3g} ulps of the tile's magnitude"
    return bad


@pytest.mark.parametrize("m, f, tile_n", [(77, 200, 64), (77, 200, 128), (77, 1352, 128)])
def test_swiglu_backward_tree_is_the_swiglu_backward(m, f, tile_n):
    """The op's own tree (``ops.swiglu.swiglu_backward_tree``: the wide tile z, pairwise splits of
    it, the 1 -> 2 interleave of (dg, du), the rstd row factor, the zdz row reduction) evaluated by
    the oracle is the SwiGLU backward, at a ragged M and widths whose last column tile is partial."""
    from coda_cute.ops.swiglu import swiglu_backward_tree

    bad = _swiglu_backward_mismatches(swiglu_backward_tree(), m, f, tile_n)
    assert not bad, bad


def _swiglu_backward_mutant(mutation):
    """The SwiGLU backward tree with one plausible bug."""
    from coda_cute.ops.rmsnorm import rstd_node

    z = E.wide_tile("z")
    g = E.pairwise(lambda a, b: b if mutation == "g, u swapped" else a, z)
    u = E.pairwise(lambda a, b: a if mutation == "g, u swapped" else b, z)
    dh = E.acc()
    sg = E.sigmoid(g)
    silu = g * sg
    dg = dh * u * sg * (g * (1 - sg) if mutation == "no 1 + in sigma'" else 1 + g * (1 - sg))
    du = dh * silu
    pair = E.interleave(du, dg) if mutation == "dg, du swapped" else E.interleave(dg, du)
    dz = pair if mutation == "no rstd" else pair * rstd_node()
    h = E.silu(u) * g if mutation == "h = silu(u) g" else silu * u
    zdz = g * dg if mutation == "zdz without u du" else g * dg + u * du
    return E.Epilogue(E.store(dz, "dz", "bfloat16"), E.store(h, "h", "bfloat16"), E.row_reduce(zdz, "sum", "zdz"))


#: each mutation of :func:`_swiglu_backward_mutant` and the outputs it touches
SWIGLU_MUTANTS = {"g, u swapped": {"dz", "h", "zdz"}, "no 1 + in sigma'": {"dz", "zdz"}, "dg, du swapped": {"dz"},
                  "no rstd": {"dz"}, "h = silu(u) g": {"h"}, "zdz without u du": {"zdz"}}


@pytest.mark.parametrize("mutation", list(SWIGLU_MUTANTS))
def test_swiglu_backward_check_catches_a_wrong_tree(mutation):
    """The comparison above can fail: each of these bugs puts exactly the outputs it touches
    outside their bounds (the unmutated copy is the op's tree, node for node)."""
    from coda_cute.ops.swiglu import swiglu_backward_tree

    assert _swiglu_backward_mutant(None).key == swiglu_backward_tree().key
    bad = _swiglu_backward_mismatches(_swiglu_backward_mutant(mutation), 77, 200, 64)
    assert set(bad) == SWIGLU_MUTANTS[mutation], bad
