"""coda_cute: CuTe-DSL GEMMs whose epilogues absorb a transformer's memory-bound ops (CODA).

Public API:
  * :func:`gemm` / ``torch.ops.coda.gemm`` - BF16/FP16/FP8 GEMM on Hopper (sm_90a).
  * :mod:`coda_cute.epilogue` - epilogue visitor trees: fused GEMM epilogues and the ops built
    from them (``gemm_epilogue``, ``register_op``).
  * :mod:`coda_cute.reference` - fp32 torch references of every op (CPU-runnable).
  * :func:`reference_on_cpu` - run coda ops on CPU tensors through their references.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import epilogue, ops  # noqa: F401  (registers torch.ops.coda.*)
from .dispatch import reference_on_cpu
from .kernels.common.config import GemmConfig
from .ops import gemm as _gemm_mod

__version__ = "0.1.0"
__all__ = ["gemm", "epilogue", "GemmConfig", "reference_on_cpu", "__version__"]


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    scale_a: Optional[torch.Tensor] = None,
    scale_b: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``a @ b`` on our Hopper GEMM, with ``torch.mm`` / ``torch.bmm`` shapes.

    out[m, n] = scale_a[m] * scale_b[n] * sum_k a[m, k] * b[k, n]   (fp32 accumulation)

    Args:
        a: (M, K) or (L, M, K); bf16, fp16, float8_e4m3fn or float8_e5m2.
        b: (K, N) or (L, K, N); same kind as ``a`` (FP8 types may differ).
        scale_a: FP8 only, fp32: one number, or one per row of ``a`` ((M, 1), (M,), (L, M, 1)).
        scale_b: FP8 only, fp32: one number, or one per column of ``b`` ((1, N), (N,), (L, 1, N)).
        out_dtype: bf16, fp16 or fp32; default: ``a.dtype`` for 16-bit inputs, bf16 for FP8.
        use_fast_accum: FP8 only: accumulate the whole K loop in the tensor core (faster, looser).

    16-bit operands may be row- or column-major (x @ W.T, dY @ W and dY.T @ X need no copies);
    FP8 operands must be K-major (``a`` row-major, ``b`` column-major). Strides other than the
    contiguous one and data pointers must be 16-byte aligned. Violations raise before launch.
    """
    # Plain eager calls skip the dispatcher (tens of microseconds per call): ops.eager
    return _gemm_mod.gemm_op(a, b, scale_a, scale_b, out_dtype, use_fast_accum)
