"""Shared test helpers."""

import importlib.util
import os
import sys
from pathlib import Path

import torch

#: the running test's seed: conftest's ``fresh_seed`` draws it before each test (CODA_TEST_SEED pins it)
_TEST_SEED = [0]


def set_test_seed(seed: int) -> None:
    _TEST_SEED[0] = seed


def generator(stream: int = 0) -> torch.Generator:
    """A CPU generator for a test's random inputs: fresh in every run (seeded from the test's
    seed), and the same for the same ``stream`` within one test, so that two calls can draw
    identical inputs (two paths fed the same data)."""
    return torch.Generator().manual_seed((_TEST_SEED[0] * 1_000_003 + stream) % 2**63)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN/Inf anywhere in ``out`` counts as failure."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def loss_and_grads(model, ids, labels, **kw):
    """(loss, {name: fp32 gradient}) of one HF-contract forward + backward of ``model``."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    return out.loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


def autograd_tensors() -> dict:
    """{id: description} of the tensors that hold an autograd graph (a ``grad_fn``), after a
    garbage collection. A test compares the sets before and after a step: none should be new
    after its backward. A graph kept alive keeps its saved activations and its parameters'
    AccumulateGrad nodes, which keep the stream they were made on (torch >= 2.10 then syncs the
    next backward with that stream, which torch warns can break a CUDA-graph capture after an
    eager step on the default stream)."""
    import gc
    import warnings

    gc.collect()
    with warnings.catch_warnings():  # isinstance on deprecated torch module attributes warns
        warnings.simplefilter("ignore")
        return {id(o): f"{tuple(o.shape)} {o.dtype} {o.device} {type(o.grad_fn).__name__}"
                for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None}


def graphs_left_by(step) -> list:
    """The descriptions of the graph-holding tensors that ``step()`` left alive."""
    before = autograd_tensors()
    step()
    return [d for i, d in autograd_tensors().items() if i not in before]


def flat_grads(grads: dict, names) -> torch.Tensor:
    """All of ``names``' gradients as one vector (the error over every gradient together)."""
    return torch.cat([grads[n].flatten() for n in names])


def on_path(path: str):
    """The context an op call runs in for a bad-input test: "cpu" (the reference path) or "fake"
    (FakeTensorMode, real inputs allowed): its argument rules must raise on both."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import coda_cute

    if path == "cpu":
        return coda_cute.reference_on_cpu()
    if path == "fake":
        return FakeTensorMode(allow_non_fake_inputs=True)
    raise ValueError(f"on_path: path must be 'cpu' or 'fake', got {path!r}")


SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """``scripts/<name>.py`` as a module (the scripts are no package; their own imports of each
    other resolve from the scripts folder while it loads). The environment is restored after:
    an experiment that turns the disk cache off for its own runs must not turn it off for the
    tests that follow."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is built
    sys.path.insert(0, str(SCRIPTS))
    env = dict(os.environ)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(SCRIPTS))
        for key in set(os.environ) - set(env):
            del os.environ[key]
        os.environ.update(env)
    return mod
