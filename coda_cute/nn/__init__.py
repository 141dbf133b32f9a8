"""torch.nn modules on the CODA ops: a Llama block, the final norm + LM head + loss, a small Llama.

* :class:`CodaLlamaBlock`, :class:`CodaLlamaHead`, :class:`CodaLlama`, :class:`LlamaConfig`
  (:mod:`coda_cute.nn.llama`).
* :mod:`coda_cute.nn.convert`: standard (HF) Llama weights <-> the layouts the ops need.
* :func:`apply_coda` (:mod:`coda_cute.nn.hf`): an HF Llama / Qwen3 / Mistral causal LM on the
  CODA ops, in place.
* :func:`shard` (:mod:`coda_cute.nn.fsdp`): FSDP2 over either model, one unit per decoder layer.
"""

from . import convert  # noqa: F401
from .llama import CodaLlama, CodaLlamaBlock, CodaLlamaHead, LlamaConfig, embedding_norm_stats  # noqa: F401
from .hf import apply_coda  # noqa: F401,E402
from .fsdp import shard  # noqa: F401,E402
