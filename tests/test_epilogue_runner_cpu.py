"""CPU (CI) tests of the epilogue runner and of op registration: the runner's validation up to the
launch (operands, inputs bound by name, output shapes of every sink, plan reuse, preallocated
outputs) and registered ops (schema, fake tensors, the CPU reference path, opcheck).

The runner tests run on CPU tensors as if on an sm_90 device, with the compiled kernel replaced
by a recorder (``hopper``), so every rule is checked exactly as on the GPU, before any launch.
The trees' own rules and the torch evaluator are ``test_epilogue_cpu.py``'s.
"""

import functools
import types
import uuid

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import coda_cute
from coda_cute import dispatch
from coda_cute import epilogue as E
from coda_cute.epilogue import runner as run_mod
from coda_cute.kernels.common.config import GemmConfig
from helpers import on_path

BF16, F16, F32, I32 = torch.bfloat16, torch.float16, torch.float32, torch.int32
COOP = GemmConfig(128, 256, 64, "cooperative", 2, 1)


def swiglu(x):
    return E.pairwise(lambda g, u: E.silu(g) * u, x)


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



def test_a_cached_plan_keeps_no_callers_frame_alive(hopper):
    """A plan for an output TMA cannot write densely (its rows miss 16-byte boundaries) keeps
    the reason as a message: an exception kept there held its traceback, whose frames held their
    callers', so the first call's caller (a model's first forward, its activations and, through
    them, its autograd graph) stayed alive as long as the plan (on the H200 that broke a CUDA-graph
    capture after an eager step)."""
    import gc
    import weakref

    tree, n = E.Epilogue(E.store(E.acc(), "out")), HN - 3  # 61 bf16 per row: no dense TMA store
    a, b = _bf16(HM, HK), _bf16(n, HK).t()

    def first_forward():
        activations = torch.ones(4)
        out = torch.empty(HM, n + 3, dtype=BF16)[:, :n]  # a padded output, so the launch runs
        E.run(tree, a, b, {}, outputs={"out": out})
        return weakref.ref(activations)

    alive = first_forward()
    gc.collect()
    assert len(run_mod._plans) == 1 and len(hopper.launches) == 1 and alive() is None
    with pytest.raises(ValueError, match=r"out's strides must be multiples of 16 bytes"):
        E.run(tree, a, b, {})  # without the padded output: the plan's message

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


@pytest.mark.parametrize("path", ["cpu", "fake"])
@pytest.mark.parametrize("bad, exc, match", [
    ("bias", ValueError, r"col_vec 'bias' must have shape \(32,\)"),
    ("residual", TypeError, r"epilogue input 'residual' \(tile\) must be torch.bfloat16"),
], ids=["bias-length", "residual-dtype"])
def test_a_registered_op_checks_its_inputs_on_every_path(path, bad, exc, match):
    """The launch's input rules on the fake and reference paths too (the fake path returned a
    result for both, the reference path a raw reshape error for the first)."""
    _, _, op = registered("single")
    a, b, bias, residual, s, alpha = _op_args("single", 64, 32, 64, "cpu")
    if bad == "bias":
        bias = torch.randn(33)
    else:
        residual = residual.float()
    with on_path(path), pytest.raises(exc, match=match):
        op(a, b, bias, residual, s, alpha)


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
    utils = ("test_schema", "test_faketensor")
    with coda_cute.reference_on_cpu():
        result = torch.library.opcheck(op.default, _op_args(which, 40, 48, 32, "cpu"), test_utils=utils)
    assert result == {u: "SUCCESS" for u in utils}


def test_a_grid_of_fewer_sms_is_its_own_kernel_and_bad_counts_are_refused(hopper):
    """``run(..., sms=)``: the persistent grid sized for that many SMs (the spec's SM count, a
    plan of its own beside the all-SM one); a count outside [2, the device's] or not an int is
    refused before any launch, on the reference path too."""
    a, b, ins = host_call()
    E.run(HOST_TREE, a, b, ins)
    E.run(HOST_TREE, a, b, ins, sms=116)
    specs = len(hopper.specs)
    E.run(HOST_TREE, a, b, ins, sms=116)  # the plan kept
    assert {s.num_sms for s in hopper.specs} == {132, 116} and hopper.specs[-1].num_sms == 116
    assert len(hopper.specs) == specs and len(hopper.launches) == 3
    for bad in (0, 1, 133, True, 100.0):
        with pytest.raises(ValueError, match=r"sms must be an int from 2 to the device's 132 SMs"):
            E.run(HOST_TREE, a, b, ins, sms=bad)
        with coda_cute.reference_on_cpu(), pytest.raises(ValueError, match=r"sms must be an int from 2"):
            E.run(HOST_TREE, a, b, ins, sms=bad)
    assert len(hopper.launches) == 3


def test_beside_runs_in_series_off_cuda():
    """``ops.beside`` off CUDA (or with no side SMs): the GEMM on every SM (``None``), then the
    passes, on the one stream."""
    from coda_cute.ops.beside import beside

    calls = []
    for side in (0, 16):
        out = beside(lambda sms: calls.append(("gemm", sms)) or "g", lambda: calls.append(("passes",)) or "p",
                     torch.device("cpu"), side)
        assert out == ("g", "p")
    assert calls == [("gemm", None), ("passes",)] * 2


def test_launching_on_is_this_threads_and_restored():
    """``runner.launching_on``: the stream is this thread's alone (autograd's backward thread sets
    its own), nested settings restore the outer one, an exception restores it too."""
    import threading

    from coda_cute.epilogue import runner

    seen = []
    with runner.launching_on("outer"):
        with runner.launching_on("inner"):
            t = threading.Thread(target=lambda: seen.append(getattr(runner._launch_stream, "stream", None)))
            t.start()
            t.join()
            assert runner._launch_stream.stream == "inner"
        assert runner._launch_stream.stream == "outer"
        with pytest.raises(RuntimeError), runner.launching_on(None):
            raise RuntimeError
        assert runner._launch_stream.stream == "outer"
    assert runner._launch_stream.stream is None and seen == [None]
