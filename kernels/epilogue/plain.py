"""The plain GEMM's epilogue tree, ``out = acc * scale_a * scale_b`` (``coda.gemm``).

Shared by the op (``coda_cute.ops.gemm``) and the compiler's ``GemmSpec``, which names a plain
GEMM binary by its scale modes and output dtype.
"""

from __future__ import annotations

import functools

from . import nodes as E


@functools.lru_cache(maxsize=None)
def gemm_tree(scale_a: str, scale_b: str, out_dtype: str) -> E.Epilogue:
    """``out = acc * scale_a * scale_b``: row-wise scales ("row") are a row / column vector,
    single numbers ("tensor") a 1-element device tensor (no host sync), "none" no factor."""
    x = E.acc()
    if scale_a != "none":
        x = x * (E.row_vec("scale_a") if scale_a == "row" else E.scalar_tensor("scale_a"))
    if scale_b != "none":
        x = x * (E.col_vec("scale_b") if scale_b == "row" else E.scalar_tensor("scale_b"))
    return E.Epilogue(E.store(x, "out", out_dtype))
