"""torch.ops.coda.* custom ops, one module per op family (importing registers them)."""

from . import gemm  # noqa: F401
