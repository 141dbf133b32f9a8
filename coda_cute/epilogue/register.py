"""Registering an epilogue tree as a ``torch.ops.coda.<name>`` custom op.

The op's schema is ``name(Tensor a, Tensor b, <tensor inputs...>, <float scalars...>) ->
<outputs>`` (one Tensor, or a tuple when there are several) with inputs in ``tree.input_order()`` and outputs in sink order (an lse
reduction contributes two: max and sum-of-exp partials). The fake (meta) implementation derives
every output's shape and dtype from the tree and the config the heuristic picks, so the op works
under ``torch.compile``; on CPU tensors it raises unless ``coda_cute.reference_on_cpu()`` is
active, in which case it evaluates the torch reference.
"""

from __future__ import annotations

import torch

from .. import dispatch
from ..kernels.epilogue.nodes import Epilogue, EpilogueError
from .runner import check_launch, config_on, output_shapes, run

_libs: dict[str, torch.library.Library] = {}


def register_op(name: str, tree: Epilogue, namespace: str = "coda"):
    """Define ``torch.ops.<namespace>.<name>`` running ``a @ b`` with ``tree``; returns the op."""
    if not name.isidentifier():
        raise EpilogueError(f"op name must be an identifier, got {name!r}")
    qual = f"{namespace}::{name}"
    if qual in _libs:
        raise EpilogueError(f"{qual} is already registered")
    tensors = [i for i in tree.inputs if i.kind != "scalar"]
    scalars = [i for i in tree.inputs if i.kind == "scalar"]
    args = ["Tensor a", "Tensor b"] + [f"Tensor {i.name}" for i in tensors] + [f"float {i.name}" for i in scalars]
    n_out = sum(2 if (o.kind == "row_reduce" and o.op == "lse") or o.quantizes else 1 for o in tree.outputs)
    lib = torch.library.Library(namespace, "FRAGMENT")
    returns = "Tensor" if n_out == 1 else f"({', '.join(['Tensor'] * n_out)})"
    lib.define(f"{name}({', '.join(args)}) -> {returns}")
    order = [i.name for i in tensors] + [i.name for i in scalars]

    def bind(rest):
        return dict(zip(order, rest))

    def flat(outs: dict):
        res = []
        for o in tree.outputs:
            v = outs[o.name]
            res += list(v) if isinstance(v, tuple) else [v]
        return res[0] if n_out == 1 else tuple(res)

    def cuda_impl(a, b, *rest):
        return flat(run(tree, a, b, bind(rest), op=qual))

    def fake_impl(a, b, *rest):
        # the launch's argument rules (inputs' shapes, dtypes and layouts too), then the outputs
        # of the config the launch will take (tracing must size per-tile partials as it does)
        m, n, k, batch, fp8, _ = check_launch(tree, a, b, bind(rest), qual)
        cfg = config_on(a.device, tree, m, n, k, batch, fp8, False, dispatch.num_sms_or_default(a.device),
                        card=dispatch.card_of(a.device))
        res = [a.new_empty(shape, dtype=dtype)
               for _, shape, dtype, _ in output_shapes(tree, m, n, batch, a.dim() == 3, cfg)]
        return res[0] if n_out == 1 else tuple(res)

    def cpu_impl(a, b, *rest):
        dispatch.require_reference(qual)
        return flat(run(tree, a, b, bind(rest), op=qual))  # the reference path: the same rules

    lib.impl(name, cuda_impl, "CUDA")
    lib.impl(name, cpu_impl, "CPU")
    torch.library.register_fake(qual, fake_impl, lib=lib)
    _libs[qual] = lib
    return getattr(getattr(torch.ops, namespace), name)
