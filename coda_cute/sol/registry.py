"""The ops the reporter knows: how to cost each on a shape and, once it has a kernel, how to run it.

An :class:`OpSpec` couples a cost (``cost(shape, dtype) -> OpCost``, from :mod:`.model`) with an
optional ``build(shape, dtype, device) -> launch`` that allocates random inputs (never zeros) and
returns a zero-argument callable launching the op once. Ops without ``build`` are reported from
the model alone. Each op is timed next to its ``shadow``, another build: by default the plain
``coda.gemm`` of the op's (m, n, k), so ``time / shadow`` is what the epilogue costs; the plain
GEMM layouts themselves are shadowed by the library GEMM (cuBLAS ``torch.mm`` or
``torch._scaled_mm``).

When a fused op lands, making it measurable is one line in its module, e.g.

    register_op("scaled_swiglu", build=_bench_scaled_swiglu)

(the cost is already here; a brand-new op passes ``cost=`` too).

Which ops run on which shapes (:func:`select`): an op named explicitly runs on every shape it
applies to (the plain GEMM layouts on all; a fused op on its preset layers, and on bare M,N,K
shapes when its cost needs no model config). Groups expand to their members on preset layers
only: ``coda`` pairs each layer with its fused op (RoPE on qkv, residual + norm stats on o and
down, SwiGLU on gate_up, CE on lm_head); ``layouts`` is the three training products of a layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from . import model
from .shapes import Shape

Launch = Callable[[], object]
Build = Callable[[Shape, str, torch.device], Launch]

_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class OpSpec:
    name: str
    cost: Callable[[Shape, str], model.OpCost]
    build: Optional[Build] = None
    shadow: Optional[Build] = None  # None: plain coda.gemm forward of the cost's (m, n, k)
    shadow_impl: str = "coda.gemm"
    group: Optional[str] = None  # "coda", "layouts", or None (only when named)
    layers: Optional[tuple[str, ...]] = None  # preset layers it applies to; None: all
    needs_model: bool = False  # the cost needs a Llama config (head counts)

    def applies(self, shape: Shape) -> bool:
        if shape.layer is not None and self.layers is not None:
            return shape.layer in self.layers
        return shape.model is not None or not self.needs_model

    def shadow_build(self) -> Build:
        return self.shadow or _build_plain_shadow(self)


OPS: dict[str, OpSpec] = {}


def register_op(name: str, *, cost: Optional[Callable[[Shape, str], model.OpCost]] = None,
                build: Optional[Build] = None, **fields) -> OpSpec:
    """Add an op, or complete a known one (typically with its ``build`` once the kernel exists).

    ``fields`` are the other :class:`OpSpec` fields (shadow, shadow_impl, group, layers,
    needs_model).
    """
    if name in OPS:
        changes = dict(fields)
        if cost is not None:
            changes["cost"] = cost
        if build is not None:
            changes["build"] = build
        spec = dataclasses.replace(OPS[name], **changes)
    else:
        if cost is None:
            raise ValueError(f"register_op({name!r}): a new op needs cost=")
        spec = OpSpec(name, cost, build, **fields)
    OPS[name] = spec
    return spec


def groups() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for spec in OPS.values():
        if spec.group:
            out.setdefault(spec.group, []).append(spec.name)
    return out


def select(names: Iterable[str], shapes: Iterable[Shape]) -> list[tuple[OpSpec, Shape]]:
    """(op, shape) pairs to report, shape-major, ops in the order named (see the module doc)."""
    picked: list[tuple[OpSpec, bool]] = []
    grp = groups()
    for name in names:
        if name in grp:
            picked += [(OPS[n], False) for n in grp[name]]
        elif name in OPS:
            picked.append((OPS[name], True))
        else:
            raise KeyError(f"unknown op {name!r}; known: {', '.join(list(grp) + list(OPS))}")
    seen, pairs = set(), []
    for shape in shapes:
        for spec, explicit in picked:
            ok = spec.applies(shape) if explicit else (
                spec.layers is None or shape.layer in spec.layers)
            if ok and (spec.name, shape) not in seen:
                seen.add((spec.name, shape))
                pairs.append((spec, shape))
    return pairs


# -- random operands ------------------------------------------------------------------------------------
def fp8_operands(m: int, n: int, k: int, device):
    """e4m3 ``a`` (m, k) row-major and ``b`` (k, n) column-major with row-wise fp32 scales
    ((m, 1) and (1, n)) that map each row's amax to 448, from standard-normal data."""
    a32 = torch.randn(m, k, device=device)
    w32 = torch.randn(n, k, device=device)
    sa = a32.abs().amax(-1, keepdim=True) / 448.0
    sw = w32.abs().amax(-1, keepdim=True) / 448.0
    a = (a32 / sa).to(torch.float8_e4m3fn)
    b = (w32 / sw).to(torch.float8_e4m3fn).t()
    return a, b, sa.contiguous(), sw.t().contiguous()


def _randn(*shape, dtype: str, device):
    return torch.randn(*shape, dtype=_TORCH_DTYPES[dtype], device=device)


def _gemm_operands(layout: str, shape: Shape, dtype: str, device):
    """(a, b) of one training product of a layer, as views (no copies):
    fwd y = x @ W.T, dgrad dX = dY @ W, wgrad dW = dY.T @ X."""
    m, n, k = shape.mnk
    if layout == "fwd":
        return _randn(m, k, dtype=dtype, device=device), _randn(n, k, dtype=dtype, device=device).t()
    if layout == "dgrad":
        return _randn(m, n, dtype=dtype, device=device), _randn(n, k, dtype=dtype, device=device)
    return _randn(m, n, dtype=dtype, device=device).t(), _randn(m, k, dtype=dtype, device=device)


_GEMM_OF_LAYOUT = {  # layer (M, N, K) -> the product's (m, n, k)
    "fwd": lambda s: (s.m, s.n, s.k),
    "dgrad": lambda s: (s.m, s.k, s.n),
    "wgrad": lambda s: (s.n, s.k, s.m),
}


def _plain_build(layout: str, library: bool) -> Build:
    """Launch of one layout on coda.gemm, or (``library``) on torch.mm / torch._scaled_mm.
    FP8 operands must be K-major, so every FP8 layout is an (m, n, k) product of fresh K-major
    operands (in FP8 training the transposed copy is made when quantizing)."""

    def build(shape: Shape, dtype: str, device) -> Launch:
        if dtype == "fp8":
            a, b, sa, sb = fp8_operands(*_GEMM_OF_LAYOUT[layout](shape), device)
            if library:
                return lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            return lambda: torch.ops.coda.gemm(a, b, sa, sb, None, False)
        a, b = _gemm_operands(layout, shape, dtype, device)
        if library:
            return lambda: torch.mm(a, b)
        return lambda: torch.ops.coda.gemm(a, b, None, None, None, False)

    return build


def _build_plain_shadow(spec: OpSpec) -> Build:
    def build(shape: Shape, dtype: str, device) -> Launch:
        c = spec.cost(shape, dtype)
        return _plain_build("fwd", library=False)(Shape(c.m, c.n, c.k), dtype, device)

    return build


# -- the known ops ------------------------------------------------------------------------------------
def _register_plain(name: str, layout: str) -> None:
    register_op(
        name,
        cost=lambda s, dt: model.gemm(*_GEMM_OF_LAYOUT[layout](s), dt, op=name),
        build=_plain_build(layout, library=False),
        shadow=_plain_build(layout, library=True),
        shadow_impl="torch (cuBLAS)",
        group="layouts",
    )


_register_plain("gemm", "fwd")
_register_plain("gemm_dgrad", "dgrad")
_register_plain("gemm_wgrad", "wgrad")

register_op("residual_norm_stats", cost=lambda s, dt: model.residual_norm_stats(s.m, s.n, s.k, dt),
            group="coda", layers=("o", "down"))
register_op("scaled_swiglu", cost=lambda s, dt: model.scaled_swiglu(s.m, s.n // 2, s.k, dt),
            group="coda", layers=("gate_up",))


def _rope_cost(qk_norm: bool):
    def cost(s: Shape, dt: str) -> model.OpCost:
        c = s.model
        return model.scaled_rope(s.m, s.k, c.n_heads, c.n_kv_heads, c.head_dim, dt, qk_norm=qk_norm)

    return cost


register_op("scaled_rope", cost=_rope_cost(False), group="coda", layers=("qkv",), needs_model=True)
register_op("scaled_rope_qknorm", cost=_rope_cost(True), layers=("qkv",), needs_model=True)
register_op("scaled_proj", cost=lambda s, dt: model.scaled_proj(s.m, s.n, s.k, dt))
# the FP8 recipe's block-scaled GEMMs (their shadow: our row-wise FP8 GEMM of the same product)
register_op("gemm_blockwise", cost=lambda s, dt: model.gemm_blockwise(s.m, s.n, s.k), group="fp8")
register_op("gemm_blockwise_wgrad", group="fp8",
            cost=lambda s, dt: model.gemm_blockwise(*_GEMM_OF_LAYOUT["wgrad"](s), "1x128", op="gemm_blockwise_wgrad"))
register_op("lm_head_ce", cost=lambda s, dt: model.lm_head_ce(s.m, s.n, s.k, dt),
            group="coda", layers=("lm_head",))
