"""Eager calls of the CODA ops without the dispatcher's Python layers.

A ``torch.library.custom_op`` call from Python passes the dispatcher, the custom-op autograd
wrapper, the autocast rule, the backend wrapper (which also disables dynamo) and an aliasing check
before the implementation runs: about 40 us per call without autograd and 100 us with it on the
H200's host (``scripts/bench_host.py``), against 17 us for the kernel launch itself. A training
step of a small model makes a hundred such calls per micro-batch, forward and backward, and its
GPU then waits for the host.

:func:`direct` wraps an op so that a plain eager call runs what the dispatcher would have run,
with the same semantics, from Python:

* the implementation of the tensors' device (the op's CUDA body; on the CPU its reference
  kernel, which itself refuses to run outside ``reference_on_cpu``);
* under ``torch.autocast`` the op's bf16 rule (:mod:`.autocast`), then the body with autocast
  off;
* with a gradient needed, an ``autograd.Function`` that calls the op's own ``setup_context`` and
  backward formula (the custom-op wrapper's conventions: every input's gradient, defaults filled).

Anything that needs the dispatcher takes the op: tracing (``torch.compile``, FakeTensor, make_fx),
tensor subclasses other than ``nn.Parameter`` (DTensor, functorch wrappers), dispatch or function
modes (e.g. ``coda_cute.sol.profile``), and mutating ops, which are never wrapped.
``enabled(False)`` sends every call through the op (benchmarks compare the two).
"""

from __future__ import annotations

import contextlib
import inspect
import numbers

import torch
from torch._functorch.utils import unwrap_dead_wrappers

from .. import dispatch
from .autocast import bf16_arg, cast_indices

_state = {"on": True}


@contextlib.contextmanager
def enabled(on: bool):
    """Within the block, :func:`direct` ops skip the dispatcher only if ``on``."""
    prev, _state["on"] = _state["on"], on
    try:
        yield
    finally:
        _state["on"] = prev


#: what a direct call takes for a number, as torch's argument parser does (0-d tensors included)
_NUMBER = (float, int, numbers.Real, torch.SymInt, torch.SymFloat, torch.Tensor)

#: tensor types the direct path takes as they are: ``nn.Parameter`` disables torch functions and
#: dispatches as a plain tensor (a model's weights reach every op as Parameters; FSDP2's sharded
#: DTensor parameters keep their own type and take the op)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain_eager(args) -> str | None:
    """The device type ("cuda" / "cpu") of the call's tensors when nothing asks for the
    dispatcher, else None."""
    if (torch.compiler.is_compiling() or not _state["on"] or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled()
            or torch._C._functorch.peek_interpreter_stack() is not None):
        return None
    device = None
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) not in _PLAIN:
                return None
            kind = a.device.type
            if device is None:
                device = kind
            elif kind != device:
                return None  # the op's device check names the arguments
    if device == "cpu" and not dispatch.reference_on_cpu_enabled():
        return None  # the op raises its "reference_on_cpu" error
    return device if device in ("cuda", "cpu") else None


class DirectOp:
    """An op called from Python: the dispatcher-free path where :func:`_plain_eager` allows it,
    the registered op otherwise. Attribute access reaches the op (``register_fake`` ...)."""

    def __init__(self, op):
        self.op = op
        self.qualname = op._qualname
        params = list(inspect.signature(op._init_fn).parameters.values())
        if any(p.kind is not p.POSITIONAL_OR_KEYWORD for p in params):
            raise TypeError(f"direct: {self.qualname} has keyword-only or variadic arguments")
        self.names = [p.name for p in params]
        self.defaults = [p.default for p in params]
        self.impls = {d: op._backend_fns.get(d, op._init_fn) for d in ("cuda", "cpu")}
        self.function = _function_for(op)
        # torch's argument parser reads True as 1 for a float or int argument (eps=True ran as
        # eps 1.0), and a direct call skips the parser: a string for a flag read as True
        # (row_scaling="False" ran the row-wise recipe), one for a number failed inside a check
        # without its name. Refused here, on every path a Python call takes
        # (``torch.ops.coda.*`` called directly converts, as every torch op does)
        schema = list(enumerate(op._opoverload._schema.arguments))
        self.numbers = tuple((i, a.name) for i, a in schema
                             if str(a.real_type) in ("float", "int", "SymInt", "SymFloat"))
        self.flags = tuple((i, a.name) for i, a in schema if str(a.real_type) == "bool")

    def __getattr__(self, name):
        return getattr(self.op, name)

    def _filled(self, args, kwargs) -> tuple:
        if len(args) > len(self.names):
            raise TypeError(f"{self.qualname}: takes {len(self.names)} arguments, got {len(args)}")
        full = list(args) + self.defaults[len(args):]
        for name, value in kwargs.items():
            if name not in self.names:
                raise TypeError(f"{self.qualname}: unexpected argument {name!r}")
            full[self.names.index(name)] = value
        if any(v is inspect.Parameter.empty for v in full):
            missing = [n for n, v in zip(self.names, full) if v is inspect.Parameter.empty]
            raise TypeError(f"{self.qualname}: missing arguments {missing}")
        return tuple(full)

    def _check_scalars(self, args, kwargs):
        for i, name in self.numbers:
            v = args[i] if i < len(args) else kwargs.get(name, 0)  # not given: its default
            if isinstance(v, bool) or not isinstance(v, _NUMBER):
                got = f"the bool {v}" if isinstance(v, bool) else f"{type(v).__name__} {v!r}"
                raise TypeError(f"{self.qualname}: {name} must be a number, got {got}")
        for i, name in self.flags:
            v = args[i] if i < len(args) else kwargs.get(name)
            if v is not None and not isinstance(v, bool):  # None: the default, as torch reads it
                raise TypeError(f"{self.qualname}: {name} must be a bool, got {type(v).__name__} {v!r}")

    def __call__(self, *args, **kwargs):
        self._check_scalars(args, kwargs)
        device = _plain_eager(args + tuple(kwargs.values()))
        if device is None:
            return self.op(*args, **kwargs)
        args = self._filled(args, kwargs)
        impl = self.impls[device]
        guard = contextlib.nullcontext()
        cast = cast_indices(self.qualname)  # registered after the op: read per call
        if cast is not None and torch.is_autocast_enabled(device):
            args = tuple(bf16_arg(a, device) if i in cast else a for i, a in enumerate(args))
            guard = torch.autocast(device, enabled=False)
        with guard:
            if self.function is not None and torch.is_grad_enabled() and any(
                    isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                return self.function.apply(*args, impl)
            return impl(*args)


def direct(op) -> DirectOp:
    """``op`` (a ``torch.library.custom_op`` without mutated arguments) as a :class:`DirectOp`."""
    if op._opoverload._schema.is_mutable:
        raise TypeError(f"direct: {op._qualname} mutates its arguments; call it through the dispatcher")
    return DirectOp(op)


def _function_for(op):
    """The op's backward as an ``autograd.Function`` (None without a registered formula). The
    implementation rides as the last argument, as the custom-op wrapper's metadata does."""
    setup, backward = op._setup_context_fn, op._backward_fn
    if backward is None:
        return None

    def forward(*args):
        return args[-1](*args[:-1])

    def setup_context(ctx, inputs, output):
        if setup is not None:
            setup(ctx=ctx, inputs=inputs[:-1], output=output)

    def run_backward(ctx, *grads):
        prev = ctx.needs_input_grad
        ctx.needs_input_grad = prev[:-1]
        try:
            result = backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = prev
        return (*result, None) if isinstance(result, tuple) else (result, None)

    def apply(cls, *args):
        # Function.apply binds every call's arguments to forward's signature through inspect
        # when a setup_context is defined (about 0.1 ms of host time per call on the H200's host,
        # four of them before a step's first GEMM); forward(*args) has nothing to bind.
        # DirectOp never gets here under functorch transforms, the one case Function.apply adds.
        return super(torch.autograd.Function, cls).apply(*unwrap_dead_wrappers(args))

    name = "Direct_" + op._qualname.replace("::", "_")
    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(run_backward), "apply": classmethod(apply)})
