"""torch.ops.coda.* custom ops, one module per op family (importing registers them).

* ``gemm``: the plain GEMM; ``gemm_blockwise``: the block-scaled FP8 GEMM; ``quantize``: FP8
  block quantization; ``fold``: the RMSNorm weight fold; ``embedding``: the token embedding with
  our deterministic one-pass backward.
* The CODA ops of a Llama block: ``residual`` (out-proj / down-proj + norm statistics),
  ``swiglu`` (gate/up + SwiGLU, and its backward in the down-proj dgrad), ``qkv`` (QKV + RoPE,
  and its backward), ``proj`` (a norm-scaled projection), ``lm_head_ce`` (final norm + LM head +
  cross-entropy), ``rmsnorm`` (the norm's backward in the consumers' dgrad).
* The sublayers as single autograd ops: ``attention`` and ``mlp``; ``attention_fp8`` and
  ``mlp_fp8``: the same with their GEMMs in block-scaled FP8 (``fp8_gemms``), and
  ``lm_head_ce_fp8`` the LM head's training op in FP8 (the recipe's ``lm_head_fp8``).
* ``checks``: the argument rules they share.
"""

from . import gemm, gemm_blockwise, quantize, embedding  # noqa: F401
from . import fold, rmsnorm, residual, swiglu, qkv, proj, lm_head_ce, mlp, attention  # noqa: F401
from . import mlp_fp8, attention_fp8, lm_head_ce_fp8  # noqa: F401
