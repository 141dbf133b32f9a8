"""Epilogue visitor trees: fuse elementwise math, reductions and extra outputs into a GEMM.

Build a tree from the node vocabulary, then run it or register it as a torch op::

    from coda_cute import epilogue as E

    y = E.gelu(E.acc() + E.col_vec("bias")) + E.tile("residual")
    tree = E.Epilogue(E.store(y, "out"))
    out = E.gemm_epilogue(tree, x, w.t(), bias=b, residual=r)["out"]

    op = E.register_op("bias_gelu_residual", tree)       # torch.ops.coda.bias_gelu_residual
    out, = op(x, w.t(), b, r)                             # inputs in tree.input_order()

The node vocabulary and its math are documented in :mod:`coda_cute.kernels.epilogue.nodes`;
:func:`evaluate` is the torch oracle of any tree; reductions come back as per-tile partials that
the ``finalize_*`` helpers finish.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.common.config import GemmConfig
from ..kernels.epilogue.nodes import (  # noqa: F401  (the public vocabulary)
    Epilogue,
    EpilogueError,
    absolute,
    acc,
    cast,
    col_index,
    col_reduce,
    col_vec,
    const,
    cos,
    exp,
    exp2,
    gather,
    gelu,
    interleave,
    log,
    log2,
    lookup,
    maximum,
    minimum,
    neg,
    pairwise,
    quantize,
    recip,
    relu,
    row_index,
    row_reduce,
    row_sum,
    row_vec,
    rsqrt,
    scalar,
    scalar_tensor,
    sigmoid,
    silu,
    sin,
    sqrt,
    square,
    store,
    tanh,
    tile,
    to_float,
    where,
    wide_tile,
)
from ..kernels.epilogue.rewrites import scale_acc, segment_reduce  # noqa: F401  (the public vocabulary)
from .reference import evaluate, finalize_lse, finalize_max, finalize_sum  # noqa: F401
from .register import register_op  # noqa: F401
from .runner import run


def gemm_epilogue(tree: Epilogue, a: torch.Tensor, b: torch.Tensor, *,
                  config: Optional[GemmConfig] = None, use_fast_accum: bool = False,
                  **inputs) -> dict:
    """``a @ b`` (torch.mm / torch.bmm shapes) with ``tree`` applied to the fp32 accumulator.

    ``inputs`` binds the tree's named inputs: row vectors (M,) / (L, M), column vectors (N,) /
    (L, N), tiles (M, N) / (L, M, N) row-major, scalars as Python numbers, scalar tensors as
    1-element fp32 tensors. Returns every output by name: stores as (M, N) or (M, N/2) tensors,
    reductions as fp32 per-tile partials ((M, n_tiles) for rows, (N, m_tiles) for columns; an
    lse reduction gives (max, sum of exp)), gathers as (M,) fp32.
    """
    return run(tree, a, b, inputs, config=config, use_fast_accum=use_fast_accum)
