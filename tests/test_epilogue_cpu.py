"""CPU (CI) tests of epilogue visitor trees: the node vocabulary's rules, the structural key that
kernels are cached by, the torch evaluator (the oracle of every GPU test) against hand-written
torch math for every node kind, sm_90a compiles of representative trees, the runner's
validation up to the launch, and op registration (schema, fake tensors, CPU reference, opcheck).

The runner tests run on CPU tensors as if on an sm_90 device, with the compiled kernel replaced
by a recorder (``hopper``), so every rule is checked exactly as on the GPU, before any launch.
"""

import functools
import math
import types
import uuid

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import coda_cute
from coda_cute import dispatch
from coda_cute import epilogue as E
from coda_cute.artifacts import scan_ptx
from coda_cute.compiler import KernelSpec, compile_gemm
from coda_cute.epilogue import runner as run_mod
from coda_cute.kernels.common.config import GemmConfig
from coda_cute.kernels.epilogue import nodes as N

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
    torch.manual_seed(0)
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
    torch.manual_seed(1)
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


# -- the runner up to the launch (CPU tensors, kernel replaced by a recorder) --------------------------
@pytest.fixture
def hopper(monkeypatch):
    """Run the epilogue runner on CPU tensors as if on an sm_90 GPU. Yields a namespace with
    ``specs`` (kernel specs requested) and ``launches`` ((a, b, ins, outs, scalars) per launch)."""
    rec = types.SimpleNamespace(specs=[], launches=[])

    def get_gemm(spec):
        rec.specs.append(spec)
        return types.SimpleNamespace(fn=lambda *args: rec.launches.append(args), stats={})

    monkeypatch.setattr(dispatch, "arch_of", lambda device: "sm_90a")
    monkeypatch.setattr(dispatch, "num_sms", lambda device: 132)
    monkeypatch.setattr(run_mod, "get_gemm", get_gemm)
    monkeypatch.setattr(run_mod, "_plans", {})
    return rec


def _bf16(*shape):
    return torch.randn(*shape).to(BF16)


HOST_TREE = E.Epilogue(E.store(
    (E.gelu(E.acc() + E.col_vec("bias")) + E.tile("residual")) * E.row_vec("r") * E.scalar("alpha"), "out"))
HM, HN, HK = 96, 64, 48


def host_call(**changes):
    a, b = _bf16(HM, HK), _bf16(HN, HK).t()
    ins = dict(bias=torch.randn(HN), residual=_bf16(HM, HN), r=torch.randn(HM), alpha=0.5)
    ins.update(changes)
    return a, b, {k: v for k, v in ins.items() if v is not None}


BAD_INPUTS = {
    "missing input": (dict(bias=None), ValueError, r"missing epilogue input 'bias' \(col_vec, float32\)"),
    "unknown input": (dict(gamma=torch.randn(HN)), ValueError, r"unknown epilogue inputs \['gamma'\]; the tree reads"),
    "wrong dtype": (dict(residual=torch.randn(HM, HN)), TypeError,
                    r"epilogue input 'residual' \(tile\) must be torch.bfloat16, got torch.float32"),
    "col_vec length": (dict(bias=torch.randn(HN - 1)), ValueError,
                       r"col_vec 'bias' must have shape \(64,\) \(one per N \(columns of b\)\), got \(63,\)"),
    "row_vec length": (dict(r=torch.randn(HM + 1)), ValueError, r"row_vec 'r' must have shape \(96,\)"),
    "row_vec strided": (dict(r=torch.randn(HM, 2)[:, 0]), ValueError, r"'r' must be contiguous"),
    "tile shape": (dict(residual=_bf16(HM, HN + 8)), ValueError, r"tile 'residual' must have shape \(96, 64\)"),
    "tile not row-major": (dict(residual=_bf16(HN, HM).t()), ValueError,
                           r"tile 'residual' must be row-major \(stride 1 along N\), got strides \(1, 96\)"),
    "tile misaligned stride": (dict(residual=_bf16(HM, HN + 3)[:, :HN]), ValueError,
                               r"residual's strides must be multiples of 16 bytes \(8 elements of torch.bfloat16\)"),
    "tile misaligned pointer": (dict(residual=_bf16(HM * HN + 1)[1:].view(HM, HN)), ValueError,
                                r"residual's data pointer must be 16-byte aligned \(got offset 2 bytes\)"),
    "scalar as tensor": (dict(alpha=torch.tensor(0.5)), TypeError, r"scalar input 'alpha' must be a Python number"),
    "scalar as bool": (dict(alpha=True), TypeError, r"scalar input 'alpha' must be a Python number"),
    "vector as number": (dict(bias=1.0), TypeError, r"epilogue input 'bias' must be a tensor \(col_vec\)"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_rejected_before_launch(case, hopper):
    changes, exc, match = BAD_INPUTS[case]
    a, b, ins = host_call(**changes)
    with pytest.raises(exc, match=match):
        E.gemm_epilogue(HOST_TREE, a, b, **ins)
    assert not hopper.launches


def test_bad_inputs_rejected_after_a_good_call(hopper):
    a, b, ins = host_call()
    E.gemm_epilogue(HOST_TREE, a, b, **ins)
    with pytest.raises(ValueError, match=r"unknown epilogue inputs \['gamma'\]"):
        E.gemm_epilogue(HOST_TREE, a, b, **ins, gamma=torch.randn(HN))
    with pytest.raises(ValueError, match=r"missing epilogue input 'r'"):
        E.gemm_epilogue(HOST_TREE, a, b, **{k: v for k, v in ins.items() if k != "r"})
    assert len(hopper.launches) == 1


def test_cpu_tensors_rejected():
    a, b, ins = host_call()
    with pytest.raises(ValueError, match=r"run on CUDA tensors; got tensors on 'cpu'"):
        E.gemm_epilogue(HOST_TREE, a, b, **ins)


def test_operand_rules_apply(hopper):
    a, b, ins = host_call()
    with pytest.raises(ValueError, match=r"inner dimensions differ"):
        E.gemm_epilogue(HOST_TREE, a, b[:-1], **ins)
    with pytest.raises(TypeError, match=r"tree must be a coda_cute.epilogue.Epilogue"):
        E.run(HOST_TREE.sinks[0], a, b, ins)
    assert not hopper.launches


def test_half_store_needs_even_n(hopper):
    tree = E.Epilogue(E.store(swiglu(E.acc()), "out"))
    with pytest.raises(ValueError, match=r"pairwise \(half-width\) outputs need an even N, got N=63"):
        E.run(tree, _bf16(64, 32), _bf16(63, 32).t(), {})
    assert not hopper.launches


def test_inputs_are_bound_by_name(hopper):
    a, b, ins = host_call()
    shuffled = dict(reversed(list(ins.items())))
    E.run(HOST_TREE, a, b, shuffled)
    _, _, tensors, outs, scalars, _, _ = hopper.launches[0]
    # Tensor inputs in the tree's input order (bias, residual, r), then scalars; as views.
    assert [t.data_ptr() for t in tensors] == [ins[k].data_ptr() for k in ("bias", "residual", "r")]
    assert tensors[1].shape == (HM, HN, 1) and tensors[0].shape == (HN, 1)
    assert scalars == (0.5,)
    # A tree differing only in names shares the kernel spec, and binds its own names.
    renamed = E.Epilogue(E.store((E.gelu(E.acc() + E.col_vec("b2")) + E.tile("res2")) * E.row_vec("r2")
                                 * E.scalar("s2"), "out"))
    E.run(renamed, a, b, dict(r2=ins["r"], s2=2.0, res2=ins["residual"], b2=ins["bias"]))
    assert hopper.specs[0] == hopper.specs[1]
    _, _, tensors2, _, scalars2, _, _ = hopper.launches[1]
    assert [t.data_ptr() for t in tensors2] == [t.data_ptr() for t in tensors] and scalars2 == (2.0,)


def every_sink_tree():
    x = E.acc() + E.col_vec("c")
    return E.Epilogue(E.store(x, "y"), E.store(swiglu(x), "h", "float16"), E.row_reduce(x, "sum", "rs"),
                      E.row_reduce(x, "lse", "lse"), E.col_reduce(x, "max", "cm"),
                      E.gather(x, E.row_vec("target", "int32"), "g"))


@pytest.mark.parametrize("batch", [(), (3,)])
def test_output_shapes_of_every_sink(batch, hopper):
    m, n, k = 300, 272, 64  # 3 row tiles of 128, 2 column tiles of 256
    tree = every_sink_tree()
    a, b = _bf16(*batch, m, k), _bf16(*batch, n, k).transpose(-1, -2)
    ins = dict(c=torch.randn(*batch, n), target=torch.zeros(*batch, m, dtype=I32))
    out = E.gemm_epilogue(tree, a, b, config=COOP, **ins)
    assert set(out) == {"y", "h", "rs", "lse", "cm", "g"}
    want = {"y": ((m, n), BF16), "h": ((m, n // 2), F16), "rs": ((m, 2), F32), "cm": ((n, 3), F32),
            "g": ((m,), F32)}
    for name, (shape, dtype) in want.items():
        assert (out[name].shape, out[name].dtype) == (batch + shape, dtype), name
        assert out[name].is_contiguous()
    mx, se = out["lse"]
    assert mx.shape == se.shape == batch + (m, 2) and mx.dtype == se.dtype == F32
    assert not out["g"].any()  # gathers start at 0: rows whose index is out of range stay 0
    (spec_,) = hopper.specs
    assert spec_.config == COOP and spec_.tree is tree and spec_.arch == "sm_90a"
    (_, _, _, outs, scalars, _, _), = hopper.launches
    assert len(outs) == 7 and scalars is None  # the lse reduction writes two tensors
    assert outs[0].shape == (m, n, batch[0] if batch else 1)
    assert outs[0].data_ptr() == out["y"].data_ptr()


def test_plans_are_reused_per_signature(hopper):
    a, b, ins = host_call()
    for _ in range(3):
        E.gemm_epilogue(HOST_TREE, a, b, **ins)
    # one kernel (the heuristic's spill check asks for the same one first)
    assert len(run_mod._plans) == 1 and len(set(hopper.specs)) == 1 and len(hopper.launches) == 3
    E.gemm_epilogue(HOST_TREE, a, b, **dict(ins, alpha=2.0))  # scalar values are not part of it
    assert len(run_mod._plans) == 1 and hopper.launches[-1][4] == (2.0,)
    a2, b2, ins2 = host_call()
    E.gemm_epilogue(HOST_TREE, a2, b2, **ins2)  # fresh tensors, same metadata
    assert len(run_mod._plans) == 1
    E.gemm_epilogue(HOST_TREE, a, b, config=GemmConfig(128, 128, 64, "pingpong", 1, 1), **ins)
    assert len(run_mod._plans) == 2 and hopper.specs[-1].config.schedule == "pingpong"


def test_heuristic_config_leaves_room_for_the_tree(hopper):
    a, b, ins = host_call()
    E.gemm_epilogue(HOST_TREE, a, b, **ins)
    cfg = hopper.specs[0].config
    assert cfg in dispatch.config_space(False) and run_mod.fits(HOST_TREE, cfg, 2)


def test_preallocated_outputs(hopper):
    a, b, ins = host_call()
    y = torch.empty(HM, HN, dtype=BF16)
    assert E.run(HOST_TREE, a, b, ins, outputs={"out": y})["out"] is y
    with pytest.raises(ValueError, match=r"out must be a torch.bfloat16 tensor of shape \(96, 64\), got torch.float32"):
        E.run(HOST_TREE, a, b, ins, outputs={"out": torch.empty(HM, HN)})
    # a store may write a row-major view with a padded (16-byte aligned) row stride ...
    padded = torch.empty(HM, HN + 8, dtype=BF16)
    assert E.run(HOST_TREE, a, b, ins, outputs={"out": padded[:, :HN]})["out"].data_ptr() == padded.data_ptr()
    # ... but not a column-major one, nor one whose rows miss 16-byte boundaries
    with pytest.raises(ValueError, match=r"out must be contiguous or row-major \(stride 1 along N\)"):
        E.run(HOST_TREE, a, b, ins, outputs={"out": torch.empty(HN, HM, dtype=BF16).t()})
    with pytest.raises(ValueError, match=r"out's strides must be multiples of 16 bytes"):
        E.run(HOST_TREE, a, b, ins, outputs={"out": torch.empty(HM, HN + 3, dtype=BF16)[:, :HN]})


# -- op registration ----------------------------------------------------------------------------------
def unique(prefix):
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def op_tree():
    y = (E.gelu(E.acc() + E.col_vec("bias")) + E.tile("residual")) * E.scalar("alpha") * E.scalar_tensor("s")
    return E.Epilogue(E.store(y, "out"))


def multi_tree():
    x = E.acc() * E.row_vec("r")
    return E.Epilogue(E.store(x, "y"), E.row_reduce(x, "lse", "lse"), E.col_reduce(x, "sum", "cs"),
                      E.gather(x, E.row_vec("target", "int32"), "tgt"))


@functools.lru_cache(maxsize=None)
def registered(which):
    tree = {"single": op_tree, "multi": multi_tree}[which]()
    name = unique(f"test_{which}")
    return name, tree, E.register_op(name, tree)


def test_registered_schema():
    name, _, op = registered("single")
    assert op is getattr(torch.ops.coda, name)
    assert str(op.default._schema) == (
        f"coda::{name}(Tensor a, Tensor b, Tensor bias, Tensor residual, Tensor s, float alpha) -> Tensor")
    name, _, op = registered("multi")
    assert str(op.default._schema) == (
        f"coda::{name}(Tensor a, Tensor b, Tensor r, Tensor target) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")


def test_register_rejects_bad_names_and_duplicates():
    name, tree, _ = registered("single")
    with pytest.raises(E.EpilogueError, match=f"coda::{name} is already registered"):
        E.register_op(name, tree)
    with pytest.raises(E.EpilogueError, match=r"op name must be an identifier, got 'bias gelu'"):
        E.register_op("bias gelu", tree)


def _op_args(which, m, n, k, device, batch=()):
    a = torch.randn(*batch, m, k, device=device).to(BF16)
    b = torch.randn(*batch, n, k, device=device).to(BF16).transpose(-1, -2)
    if which == "single":
        return (a, b, torch.randn(*batch, n, device=device), torch.randn(*batch, m, n, device=device).to(BF16),
                torch.rand(1, device=device) + 0.5, 0.75)
    return (a, b, torch.randn(*batch, m, device=device),
            torch.randint(-1, n + 1, (*batch, m), device=device, dtype=I32))


@pytest.mark.parametrize("batch", [(), (2,)])
def test_fake_cuda_outputs(batch):
    m, n, k = 300, 520, 64
    _, tree, op = registered("single")
    with FakeTensorMode():
        out = op(*_op_args("single", m, n, k, "cuda", batch))
        assert isinstance(out, torch.Tensor)
        assert (out.shape, out.dtype, out.device.type) == (batch + (m, n), BF16, "cuda")
    _, tree, op = registered("multi")
    cfg = run_mod.choose_config(tree, m, n, k, batch[0] if batch else 1, False, False, 132)
    tn, tm = -(-n // cfg.tile_n), -(-m // cfg.tile_m)
    with FakeTensorMode():
        outs = op(*_op_args("multi", m, n, k, "cuda", batch))
        assert isinstance(outs, tuple)
        assert [(tuple(o.shape), o.dtype) for o in outs] == [
            (batch + (m, n), BF16), (batch + (m, tn), F32), (batch + (m, tn), F32), (batch + (n, tm), F32),
            (batch + (m,), F32)]
        assert all(o.device.type == "cuda" for o in outs)


def test_cpu_tensors_need_reference_mode():
    _, _, op = registered("single")
    with pytest.raises(ValueError, match=r"runs on CUDA tensors .*reference_on_cpu"):
        op(*_op_args("single", 16, 32, 16, "cpu"))


@pytest.mark.parametrize("which", ["single", "multi"])
def test_run_on_cpu_in_reference_mode_is_evaluate(which, monkeypatch):
    """E.gemm_epilogue / E.run on CPU tensors: outside reference_on_cpu() the CUDA-only error;
    inside, the torch evaluator of a @ b (no kernel), the launch's argument rules, and
    preallocated outputs filled in place."""
    monkeypatch.setattr(run_mod, "spills", lambda *a, **k: pytest.fail("a kernel build was asked"))
    torch.manual_seed(5)
    m, n, k = 40, 48, 32
    _, tree, _ = registered(which)
    args = _op_args(which, m, n, k, "cpu")
    names = [i.name for i in tree.inputs if i.kind != "scalar"] + [i.name for i in tree.inputs if i.kind == "scalar"]
    inputs = dict(zip(names, args[2:]))
    with pytest.raises(ValueError, match="reference_on_cpu"):
        E.gemm_epilogue(tree, args[0], args[1], **inputs)
    with coda_cute.reference_on_cpu():
        got = E.gemm_epilogue(tree, args[0], args[1], **inputs)
        cfg = run_mod.config_on("cpu", tree, m, n, k, 1, False, False, 132)
        want = E.evaluate(tree, args[0].float() @ args[1].float(), inputs, (cfg.tile_m, cfg.tile_n))
        assert got.keys() == want.keys()
        for name in want:
            for g, w in zip(*(x if isinstance(x, tuple) else (x,) for x in (got[name], want[name]))):
                assert g.equal(w)
        store = next(o.name for o in tree.outputs if o.kind == "store")
        buf = torch.full_like(want[store], float("nan"))
        out = E.run(tree, args[0], args[1], inputs, outputs={store: buf})
        assert out[store] is buf and buf.equal(want[store])
        with pytest.raises(ValueError, match="must be a .* tensor of shape"):
            E.run(tree, args[0], args[1], inputs, outputs={store: buf[:, :8]})
        with pytest.raises(ValueError, match="missing epilogue input"):
            E.run(tree, args[0], args[1], {})
        with pytest.raises(ValueError, match="inner dimensions differ"):
            E.run(tree, args[0][:, :16], args[1], inputs)


def test_reference_path_applies_the_launchs_output_layout_rules():
    """The CPU reference path refuses what the launch refuses about outputs: a store whose dense
    rows TMA cannot write (a half-width h of 20 bf16 columns: 40-byte rows) without a padded
    preallocated output, and a given output that is not row-major; a padded one it fills."""
    a, b = torch.randn(96, 64).bfloat16(), torch.randn(64, 40).bfloat16()
    tree = E.Epilogue(E.store(E.pairwise(lambda g, u: g * u, E.acc()), "h", "bfloat16"))
    with coda_cute.reference_on_cpu():
        with pytest.raises(ValueError, match=r"h's strides must be multiples of 16 bytes"):
            E.run(tree, a, b, {})
        padded = torch.full((96, 24), float("nan"), dtype=BF16)
        out = E.run(tree, a, b, {}, outputs={"h": padded[:, :20]})
        want = E.evaluate(tree, a.float() @ b.float(), {}, (128, 128))["h"]
        assert out["h"].data_ptr() == padded.data_ptr() and out["h"].equal(want)
        with pytest.raises(ValueError, match=r"h must be contiguous or row-major"):
            E.run(tree, a, b, {}, outputs={"h": torch.empty(20, 96, dtype=BF16).t()})


def test_reference_on_cpu_compiles_no_kernel(monkeypatch):
    """The CPU reference path runs no kernel, so it never compiles one to ask about spills."""
    def no_build(*a, **k):
        raise AssertionError("the CPU reference path asked a kernel build about spills")
    monkeypatch.setattr(run_mod, "spills", no_build)
    _, _, op = registered("multi")
    with coda_cute.reference_on_cpu():
        op(*_op_args("multi", 44, 56, 32, "cpu"))


@pytest.mark.parametrize("which", ["single", "multi"])
def test_reference_on_cpu_matches_evaluate(which):
    torch.manual_seed(2)
    m, n, k = 40, 48, 32
    _, tree, op = registered(which)
    args = _op_args(which, m, n, k, "cpu")
    with coda_cute.reference_on_cpu():
        got = op(*args)
    cfg = run_mod.config_on("cpu", tree, m, n, k, 1, False, False, 132)
    tensors = [i.name for i in tree.inputs if i.kind != "scalar"] + [i.name for i in tree.inputs if i.kind == "scalar"]
    want = E.evaluate(tree, args[0].float() @ args[1].float(), dict(zip(tensors, args[2:])), (cfg.tile_m, cfg.tile_n))
    flat = [t for o in tree.outputs for t in (want[o.name] if isinstance(want[o.name], tuple) else (want[o.name],))]
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(flat) and all(g.equal(w) for g, w in zip(got, flat))


@pytest.mark.parametrize("which", ["single", "multi"])
def test_opcheck(which):
    _, _, op = registered(which)
    torch.manual_seed(3)
    utils = ("test_schema", "test_faketensor")
    with coda_cute.reference_on_cpu():
        result = torch.library.opcheck(op.default, _op_args(which, 40, 48, 32, "cpu"), test_utils=utils)
    assert result == {u: "SUCCESS" for u in utils}
