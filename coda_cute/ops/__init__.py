"""torch.ops.coda.* custom ops, one module per op family (importing registers them)."""

from . import gemm  # noqa: F401
from . import coda_block, fold, lm_head_ce  # noqa: F401  (the CODA Llama-block ops)
