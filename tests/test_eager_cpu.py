"""CPU tests of ``coda_cute.ops.eager``: the dispatcher-free calls of the ops.

On the reference path (``reference_on_cpu``) a direct call must give what the registered op gives:
outputs, every gradient, the autocast rule (bf16 compute, fp32 gradients for fp32 arguments),
defaults and keyword arguments; whatever needs the dispatcher (a dispatch mode, a tensor
subclass other than ``nn.Parameter``, ``enabled(False)``, CPU tensors outside the reference path)
must reach the op. The autograd node's name tells which path ran.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import coda_cute
from coda_cute.ops import attention, eager, mlp, mlp_fp8
from coda_cute.ops.lm_head_ce import lm_head_ce_dw_
from helpers import generator

BF16, F32 = torch.bfloat16, torch.float32
EPS = 1e-5


def mlp_args(dtype=BF16, m=40, d=64, f=96, seed=0):
    g = generator(seed)
    y = torch.randn(m, d, generator=g).to(dtype).requires_grad_()
    ss = y.detach().float().square().sum(-1, keepdim=True)
    w_gu = (0.1 * torch.randn(2 * f, d, generator=g)).to(dtype).requires_grad_()
    w_down = (0.1 * torch.randn(d, f, generator=g)).to(dtype).requires_grad_()
    return y, ss, w_gu, w_down


def run(fn, args, autocast=False):
    with coda_cute.reference_on_cpu():
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            y2, ss2, z = fn(*args, EPS)
        g = generator(1)
        (y2.float() * torch.randn(y2.shape, generator=g)).sum().backward()
    grads = [a.grad.clone() for a in args if a.requires_grad]
    for a in args:
        a.grad = None
    return (y2, ss2, z), grads, y2.grad_fn.name()


@pytest.mark.parametrize("autocast", [False, True])
def test_direct_call_is_the_op(autocast):
    args = mlp_args(F32 if autocast else BF16)
    outs, grads, node = run(mlp.mlp_block, args, autocast)
    want_outs, want_grads, op_node = run(torch.ops.coda.mlp_block, args, autocast)
    assert node.startswith("Direct_coda_mlp_block") and "GeneratedBackwardFor" in op_node
    for a, b in zip(outs, want_outs):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b, arg in zip(grads, want_grads, [t for t in args if t.requires_grad]):
        assert a.dtype == arg.dtype == b.dtype and torch.equal(a, b)


def test_keywords_defaults_and_bad_arguments():
    y, ss, w_gu, w_down = (t.detach() for t in mlp_args())
    with coda_cute.reference_on_cpu():
        want = torch.ops.coda.mlp_block(y, ss, w_gu, w_down, EPS)
        got = mlp.mlp_block(y, ss, w_gu=w_gu, w_down=w_down, eps=EPS)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        with pytest.raises(TypeError, match="unexpected argument 'bias'"):
            mlp.mlp_block(y, ss, w_gu, w_down, EPS, bias=None)
        with pytest.raises(TypeError, match="missing arguments"):
            mlp.mlp_block(y, ss, w_gu, w_down)
        with pytest.raises(ValueError, match="eps"):  # the op's own checks still run
            mlp.mlp_block(y, ss, w_gu, w_down, -1.0)



@pytest.mark.parametrize("path", ["cpu", "fake", "compile"])
@pytest.mark.parametrize("fp8, kw, match", [
    (False, {"eps": True}, "eps must be a number, got the bool True"),
    (True, {"row_scaling": "False"}, r"row_scaling must be a bool, got str 'False'"),
    (True, {"pow2_scales": 1}, "pow2_scales must be a bool, got int 1"),
    (True, {"eps": "1e-5"}, "eps must be a number, got str '1e-5'"),
], ids=["bool-number", "str-flag", "int-flag", "str-number"])
def test_a_flag_or_number_of_another_type_is_refused_on_every_path(path, fp8, kw, match):
    """A direct call skips torch's argument parser, which reads True as 1 for a float or int
    argument (eps=True ran as eps 1.0): a bool for a number, a string for a flag (the FP8 MLP
    with row_scaling="False" ran the row-wise recipe on the reference path, where tracing
    refused it) and a string for a number (which failed inside a check without its name) are
    each refused by name on the reference path, the fake one and under torch.compile alike."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    y, ss, w_gu, w_down = (t.detach() for t in mlp_args())
    op = mlp_fp8.mlp_block_fp8 if fp8 else mlp.mlp_block
    call = lambda: op(y, ss, w_gu, w_down, **{"eps": EPS, **kw})  # noqa: E731
    if path == "compile":
        torch._dynamo.reset()
        call = torch.compile(call, backend="aot_eager", fullgraph=True)
    with coda_cute.reference_on_cpu(), (FakeTensorMode(allow_non_fake_inputs=True) if path == "fake"
                                         else torch.autograd.grad_mode.no_grad()):
        with pytest.raises(Exception, match=rf"{op.qualname}: {match}"):
            call()


def test_numbers_and_flags_are_read_from_the_schema():
    assert [n for _, n in mlp.mlp_block.numbers] == ["eps"]
    assert [n for _, n in attention.attention_block.numbers] == ["eps", "n_heads", "n_kv_heads", "head_dim", "qk_eps"]
    assert [n for _, n in mlp_fp8.mlp_block_fp8.numbers] == ["eps"]
    assert [n for _, n in mlp_fp8.mlp_block_fp8.flags] == ["e5m2_grads", "pow2_scales", "row_scaling"]


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_what_needs_the_dispatcher_reaches_the_op():
    args = mlp_args()
    with coda_cute.reference_on_cpu():
        with Recorder() as rec:  # e.g. coda_cute.sol.profile: it must see the op
            mlp.mlp_block(*(t.detach() for t in args), EPS)
        assert "coda.mlp_block.default" in rec.ops
        with eager.enabled(False):
            y2 = mlp.mlp_block(*args, EPS)[0]
        assert "GeneratedBackwardFor" in y2.grad_fn.name()
        with torch.inference_mode():  # direct, no autograd node
            assert mlp.mlp_block(*(t.detach() for t in args), EPS)[0].grad_fn is None
    with pytest.raises(ValueError, match="reference_on_cpu"):  # the op's error, not a silent run
        mlp.mlp_block(*(t.detach() for t in args), EPS)


class Tagged(torch.Tensor):
    """A tensor subclass: the dispatcher must see it (it could override dispatch)."""


def test_model_parameters_take_the_direct_path_and_subclasses_the_op():
    """A model hands its weights to the ops as ``nn.Parameter``s: those take the direct path (with
    the op's outputs and gradients); any other subclass still reaches the op."""
    y, ss, w_gu, w_down = mlp_args()
    params = [torch.nn.Parameter(w.detach().clone()) for w in (w_gu, w_down)]
    outs, grads, node = run(mlp.mlp_block, (y, ss, *params))
    want_outs, want_grads, op_node = run(torch.ops.coda.mlp_block, (y, ss, *params))
    assert node.startswith("Direct_coda_mlp_block") and "GeneratedBackwardFor" in op_node
    assert all(torch.equal(a, b) for a, b in zip(outs, want_outs))
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    tagged = w_down.detach().as_subclass(Tagged)
    with coda_cute.reference_on_cpu(), Recorder() as rec:
        mlp.mlp_block(y.detach(), ss, w_gu.detach(), tagged, EPS)
    assert "coda.mlp_block.default" in rec.ops


def test_mutating_ops_are_not_wrapped():
    with pytest.raises(TypeError, match="mutates"):
        eager.direct(lm_head_ce_dw_)


def test_traced_calls_take_the_op():
    """torch.compile traces the op (its fake implementation), not the direct path: same values and
    gradients as eager (aot_eager: no C++ compiler needed)."""
    args = mlp_args()
    want_outs, want_grads, _ = run(mlp.mlp_block, args)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: mlp.mlp_block(*a), backend="aot_eager", fullgraph=True)
    outs, grads, node = run(compiled, args)
    assert not node.startswith("Direct_")
    assert all(torch.equal(a, b) for a, b in zip(outs, want_outs))
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))


def test_fp8_helpers_called_between_gemms_are_direct():
    """The FP8 sublayers call ``quantize_fp8`` and ``gemm_blockwise`` between their GEMMs: direct
    calls, with the op's outputs on the reference path."""
    from coda_cute.ops import gemm_blockwise, quantize

    assert all(isinstance(f, eager.DirectOp) for f in (quantize.quantize_fp8, quantize.quantize_fp8_dual,
                                                          gemm_blockwise.gemm_blockwise))
    g = generator(2)
    x, w = torch.randn(64, 256, generator=g).to(BF16), torch.randn(128, 256, generator=g).to(BF16)
    with coda_cute.reference_on_cpu():
        xq = quantize.quantize_fp8(x)
        wq = quantize.quantize_fp8(w, "128x128")
        for got, want in ((xq, torch.ops.coda.quantize_fp8(x)),
                          (wq, torch.ops.coda.quantize_fp8(w, "128x128")),
                          (quantize.quantize_fp8_dual(x), torch.ops.coda.quantize_fp8_dual(x)),
                          ((gemm_blockwise.gemm_blockwise(xq[0], xq[1], wq[0], wq[1]),),
                           (torch.ops.coda.gemm_blockwise(xq[0], xq[1], wq[0], wq[1]),))):
            assert all(torch.equal(a.float(), b.float()) for a, b in zip(got, want))


def test_direct_autograd_calls_bind_no_signature(monkeypatch):
    """``autograd.Function.apply`` binds each call's arguments through ``inspect.signature``
    when a setup_context is defined (a tenth of a millisecond of host time per call on the H200's
    host); the direct path's Function skips that, with the same node and gradients."""
    import inspect
    import types

    import torch.autograd.function as AF

    def refuse(*args, **kwargs):
        raise AssertionError("inspect.signature called on the direct path")

    args = mlp_args()
    want_outs, want_grads, _ = run(mlp.mlp_block, args)
    # only torch.autograd.function's own reference to inspect refuses (not the module itself)
    monkeypatch.setattr(AF, "inspect", types.SimpleNamespace(**{**vars(inspect), "signature": refuse}))
    outs, grads, node = run(mlp.mlp_block, args)
    assert node.startswith("Direct_coda_mlp_block")
    assert all(torch.equal(a, b) for a, b in zip(outs, want_outs))
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
