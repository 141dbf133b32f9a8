"""The torch evaluator of epilogue trees: the oracle every tree test compares against.

``evaluate(tree, acc, inputs, tile_mn)`` computes, in fp32 on ``acc``'s device, exactly what the
kernel's epilogue computes from the fp32 accumulator ``acc`` ((M, N) or (L, M, N)): every store
rounded once to its dtype, reductions as per-tile partials over the same tiles the kernel uses,
gathers with out-of-range indices left at 0. ``finalize_*`` finish reductions across tiles.
"""

from __future__ import annotations

import math

import torch

from ..kernels.epilogue import nodes as N
from ..reference import quantize_blocks_ref

_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int32": torch.int32, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH[name]


def evaluate(tree: N.Epilogue, acc: torch.Tensor, inputs: dict, tile_mn=(128, 256)) -> dict:
    """Outputs of ``tree`` for accumulator ``acc`` (fp32) and named ``inputs`` (tensors shaped as
    for the kernel call: row vectors (M,) / (L, M), column vectors (N,) / (L, N), tiles (M, N) /
    (L, M, N), scalars as numbers or 1-element tensors)."""
    batched = acc.dim() == 3
    acc3 = acc.float() if batched else acc.float().unsqueeze(0)
    ev = _Evaluator(acc3, inputs, batched)
    L, M, Nn = acc3.shape
    out = {}
    for s in tree.sinks:
        # Values that depend on fewer than all of (l, m, n) are broadcast over the output, as the
        # kernel evaluates them at every element.
        x = ev.value(s.x).expand(L, M, int(Nn * N.DOMAIN_WIDTH.get(s.x.domain, 1)))
        if isinstance(s, N.Store):
            # A fresh dense tensor, like the kernel's output (never a view of an input).
            res = x.to(_TORCH[s.dtype], memory_format=torch.contiguous_format, copy=True)
        elif isinstance(s, N.RowReduce):
            res = _row_partials(x, s.op, tile_mn[1] // (2 if s.x.domain == N.HALF else 1))
        elif isinstance(s, N.ColReduce):
            res = _col_partials(x, s.op, tile_mn[0])
        elif isinstance(s, N.Quantize):  # (values (L, M, N), scales (L, M, ceil(N / 128))), or of x^T
            parts = [quantize_blocks_ref(xl.t() if s.transposed else xl, (1, N.QUANT_BLOCK), _TORCH[s.dtype], s.pow2)
                     for xl in x]
            res = tuple(torch.stack(p) for p in zip(*parts))
        else:
            idx = ev.value(s.index).long().expand(L, M, 1)[..., 0]
            ok = (idx >= 0) & (idx < x.shape[-1])
            res = torch.where(ok, x.gather(-1, idx.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1), 0.0)
        if isinstance(res, tuple):
            out[s.name] = tuple(r if batched else r[0] for r in res)
        else:
            out[s.name] = res if batched else res[0]
    return out


class _Evaluator:
    def __init__(self, acc3, inputs, batched):
        self.acc = acc3
        self.inputs = inputs
        self.batched = batched
        self.memo = {}
        L, M, Nn = acc3.shape
        self.shape = (L, M, Nn)

    def value(self, node: N.Node, binding=None):
        key = id(node)
        if binding is None and key in self.memo:
            return self.memo[key]
        v = self._eval(node, binding)
        if binding is None:
            self.memo[key] = v
        return v

    def _input(self, name):
        t = self.inputs[name]
        return t

    def _eval(self, node, binding):
        L, M, Nn = self.shape
        dev = self.acc.device
        if isinstance(node, N.Acc):
            return self.acc
        if isinstance(node, N.Const):
            return torch.tensor(node.value, dtype=_TORCH[node.dtype], device=dev)
        if isinstance(node, (N.Scalar, N.ScalarTensor)):
            v = self._input(node.name)
            return torch.as_tensor(v, dtype=torch.float32, device=dev).reshape(())
        if isinstance(node, N.RowVec):
            v = self._input(node.name).to(dev)
            v = v.reshape(-1, M) if v.dim() == 2 else v.reshape(1, M)
            return (v.to(torch.int32) if node.dtype == "int32" else v.float()).unsqueeze(-1)
        if isinstance(node, N.ColVec):
            v = self._input(node.name).to(dev)
            v = v.reshape(-1, Nn) if v.dim() == 2 else v.reshape(1, Nn)
            return (v.to(torch.int32) if node.dtype == "int32" else v.float()).unsqueeze(-2)
        if isinstance(node, N.Tile):  # a wide tile is (L, M, 2N) as given
            v = self._input(node.name).to(dev)
            return (v if v.dim() == 3 else v.unsqueeze(0)).float()
        if isinstance(node, N.RowSum):
            v = self._input(node.name).to(dev).float()
            return (v if v.dim() == 3 else v.unsqueeze(0)).sum(-1, keepdim=True)
        if isinstance(node, N.RowIndex):
            return torch.arange(M, device=dev, dtype=torch.int32).reshape(1, M, 1)
        if isinstance(node, N.ColIndex):  # in a pairwise body: the pair's column
            cols = torch.arange(Nn, device=dev, dtype=torch.int32).reshape(1, 1, Nn)
            return cols if binding is None or binding[2] == N.DOUBLE else cols[..., 0::2]
        if isinstance(node, N.PairArg):
            return binding[node.which]
        kids = [self.value(c, binding) for c in node.children]
        if isinstance(node, N.Unary):
            return _unary(node.op, kids[0])
        if isinstance(node, N.Binary):
            x, y = kids
            if node.dtype != "int32":
                x, y = x.float(), y.float()
            return {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
                    "max": torch.maximum, "min": torch.minimum,
                    "floordiv": lambda p, q: torch.div(p, q, rounding_mode="floor"),
                    "mod": torch.remainder}[node.op](x, y)
        if isinstance(node, N.Compare):
            x, y = kids
            if x.dtype != y.dtype:
                x, y = x.float(), y.float()
            return {"lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
                    "eq": torch.eq, "ne": torch.ne}[node.op](x, y)
        if isinstance(node, N.Select):
            c, a, b = kids
            return torch.where(c, a.float(), b.float())
        if isinstance(node, N.Cast):
            return kids[0].float().to(_TORCH[node.to]).float()
        if isinstance(node, N.Lookup):
            table = self._input(node.name).to(dev).float()
            r, c = torch.broadcast_tensors(*kids)
            return table[r.long().clamp(0, table.shape[0] - 1), c.long().clamp(0, table.shape[1] - 1)]
        if isinstance(node, N.SegmentReduce):
            x = kids[0].float().expand(L, M, Nn)
            x = x * x if node.op == "sumsq" else x
            w = node.width
            if node.op == "max":  # the columns past N left out
                seg = _pad_to(x, -1, w, -math.inf).reshape(L, M, -1, w).amax(-1)
            else:
                seg = _pad_to(x, -1, w, 0.0).reshape(L, M, -1, w).sum(-1)
            return seg.repeat_interleave(w, dim=-1)[..., :Nn]
        if isinstance(node, N.Pairwise):
            x = kids[0].float()
            if node.children[0].domain == N.DOUBLE:
                x = x.expand(L, M, 2 * Nn)
            pair = (x[..., 0::2], x[..., 1::2], node.children[0].domain)
            outs = torch.broadcast_tensors(pair[0], *(self.value(b, pair).float() for b in node.body))[1:]
            if len(outs) == 1:
                return outs[0]
            return torch.stack(outs, dim=-1).flatten(-2)
        if isinstance(node, N.Interleave):
            even, odd = torch.broadcast_tensors(*(k.float().expand(L, M, Nn) for k in kids))
            return torch.stack((even, odd), dim=-1).flatten(-2)
        raise N.EpilogueError(f"no reference for node kind {node.kind!r}")


def _unary(op, x):
    if op == "to_float":
        return x.float()
    x = x.float()
    f = {
        "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "exp2": torch.exp2,
        "log": torch.log, "log2": torch.log2, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
        "recip": torch.reciprocal, "sin": torch.sin, "cos": torch.cos, "tanh": torch.tanh,
        "sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu, "relu": torch.relu,
        "square": torch.square,
        "gelu": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
    }[op]
    return f(x)


def _tiles(extent: int, tile: int) -> int:
    return -(-extent // tile)


def _pad_to(x, dim, multiple, value):
    n = x.shape[dim]
    pad = _tiles(n, multiple) * multiple - n
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def _row_partials(x, op, tile_n):
    """(L, M, n_tiles) partials over column tiles of width ``tile_n`` (lse: (max, sum exp))."""
    L, M, Nn = x.shape
    t = _tiles(Nn, tile_n)
    if op == "lse":
        xm = _pad_to(x, -1, tile_n, -math.inf).reshape(L, M, t, tile_n)
        mx = xm.amax(-1)
        safe = torch.where(torch.isinf(mx), 0.0, mx)
        return mx, torch.exp(xm - safe.unsqueeze(-1)).sum(-1)
    if op == "max":
        return _pad_to(x, -1, tile_n, -math.inf).reshape(L, M, t, tile_n).amax(-1)
    y = x * x if op == "sumsq" else x
    return _pad_to(y.double(), -1, tile_n, 0.0).reshape(L, M, t, tile_n).sum(-1).float()


def _col_partials(x, op, tile_m):
    """(L, N, m_tiles) partials over row tiles of height ``tile_m`` (contiguous, as the kernel
    writes them)."""
    L, M, Nn = x.shape
    t = _tiles(M, tile_m)
    if op == "max":
        p = _pad_to(x, -2, tile_m, -math.inf).reshape(L, t, tile_m, Nn).amax(-2)
    else:
        y = x * x if op == "sumsq" else x
        p = _pad_to(y.double(), -2, tile_m, 0.0).reshape(L, t, tile_m, Nn).sum(-2).float()
    return p.transpose(-1, -2).contiguous()


def finalize_sum(partials: torch.Tensor) -> torch.Tensor:
    """Σ over the tile axis (last) of sum / sumsq partials, in fp32."""
    return partials.sum(-1)


def finalize_max(partials: torch.Tensor) -> torch.Tensor:
    return partials.amax(-1)


def finalize_lse(max_partials: torch.Tensor, sumexp_partials: torch.Tensor) -> torch.Tensor:
    """log Σ_n exp(x_n) from per-tile (max, Σ exp(x - max)): M + log Σ_t s_t exp(m_t - M)."""
    m = max_partials.amax(-1, keepdim=True)
    safe = torch.where(torch.isinf(m), 0.0, m)
    return (safe + torch.log((sumexp_partials * torch.exp(max_partials - safe)).sum(-1, keepdim=True))).squeeze(-1)
