"""``torch.ops.coda.gemm_blockwise``: the block-scaled FP8 GEMM of the FP8 recipe
(``coda_cute.precision``, DeepSeek-V3 / TE ``Float8BlockScaling``). The fprop / dgrad form
(``b_block="128x128"``) and the weight-gradient form (``b_block="1x128"``, both operands scaled
per row and 128-deep k-block, K being the tokens):

    out[m, n] = sum_kb  a_scales[m, kb] * b_scales[n // 128, kb] * sum_{k in block kb} a[m, k] b[n, k]
    out[m, n] = sum_kb  a_scales[m, kb] * b_scales[n, kb] * sum_{k in block kb} a[m, k] b[n, k]

a (M, K) FP8 with one scale per row and 128 columns (1 x 128), b (N, K) FP8 stored like an
nn.Linear weight with one scale per 128 x 128 block; out = dequant(a) @ dequant(b).T, accumulated
in fp32 with each 128-deep k-block promoted by its scales (``kernels.sm90.block_scales``). The
scales are ``coda_cute.reference.quantize_blocks_ref``'s, in any strides (DeepGEMM keeps the
activation scales M-major). No autograd: the FP8 training ops build their backward from this
op and its wgrad form.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import dispatch
from .. import epilogue as E
from ..epilogue.block_scales import B_BLOCKS, check_block_scales
from ..epilogue.runner import check_launch
from ..kernels.epilogue.plain import gemm_tree
from ..operands import FP8, dtype_name
from .checks import check_same_device
from .eager import direct

OP = "coda.gemm_blockwise"
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.lru_cache(maxsize=None)
def _tree(out_dtype: str) -> E.Epilogue:
    return gemm_tree("none", "none", out_dtype)


def check_blockwise(a, a_scales, b, b_scales, out_dtype, b_block="128x128"):
    """Operands, the scale grid and the output dtype, on every path (GPU, fake, CPU). Returns
    (M, N, the output dtype)."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in FP8:
            raise ValueError(f"{OP}: {name} must be a 2-D float8_e4m3fn / float8_e5m2 tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"{OP}: a is {tuple(a.shape)} and b {tuple(b.shape)}: b is stored like an "
                         "nn.Linear weight (N x K) and must share a's K")
    for name, t, rows in (("a", a, "M"), ("b", b, "N")):
        if t.stride(1) != 1 and t.shape[1] > 1:  # FP8 WGMMA reads K-contiguous tiles
            raise ValueError(f"{OP}: {name} must be stored ({rows}, K) with K contiguous (stride (K, 1), "
                             f"{'an nn.Linear weight' if name == 'b' else 'row-major'}); got strides "
                             f"{tuple(t.stride())}: call .contiguous() first")
    od = torch.bfloat16 if out_dtype is None else out_dtype
    if od not in OUT_DTYPES:
        raise ValueError(f"{OP}: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if b_block not in B_BLOCKS:
        raise ValueError(f"{OP}: b_block must be one of {B_BLOCKS}, got {b_block!r}")
    check_same_device(OP, a=a, a_scales=a_scales, b=b, b_scales=b_scales)
    check_block_scales(a, b.t(), (a_scales, b_scales), OP, b_block == "1x128")
    return a.shape[0], b.shape[0], od


@torch.library.custom_op("coda::gemm_blockwise", mutates_args=())
def gemm_blockwise(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                   out_dtype: Optional[torch.dtype] = None, b_block: str = "128x128") -> torch.Tensor:
    """dequant(a) @ dequant(b).T (module docstring); out_dtype bf16 (default), fp16 or fp32;
    b_block "128x128" (b a weight) or "1x128" (the weight-gradient form)."""
    return _run(a, a_scales, b, b_scales, out_dtype, b_block)


def _run(a, a_scales, b, b_scales, out_dtype, b_block):
    """The runner's launch (CUDA), or its reference evaluation inside ``reference_on_cpu``."""
    _, _, od = check_blockwise(a, a_scales, b, b_scales, out_dtype, b_block)
    return E.run(_tree(dtype_name(od)), a, b.t(), {}, block_scales=(a_scales, b_scales), op=OP,
                 b_block=b_block)["out"]


@gemm_blockwise.register_fake
def _fake(a, a_scales, b, b_scales, out_dtype=None, b_block="128x128"):
    m, n, od = check_blockwise(a, a_scales, b, b_scales, out_dtype, b_block)
    # the launch's own rules (K, TMA alignment, the output's row width), as on the other paths
    check_launch(_tree(dtype_name(od)), a, b.t(), {}, OP, block_scales=(a_scales, b_scales),
                 b_rows=b_block == "1x128")
    return a.new_empty((m, n), dtype=od)


@gemm_blockwise.register_kernel("cpu")
def _cpu(a, a_scales, b, b_scales, out_dtype=None, b_block="128x128"):
    dispatch.require_reference(OP)
    return _run(a, a_scales, b, b_scales, out_dtype, b_block)


# Python callers skip the dispatcher where nothing needs it (ops.eager): the FP8 sublayers' weight
# gradients
gemm_blockwise = direct(gemm_blockwise)
