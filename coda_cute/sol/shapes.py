"""Problem shapes: the GEMMs of one Llama-3 block forward plus its LM head, or a bare M,N,K.

A :class:`Shape` is a layer's forward product ``y = x Wᵀ`` with x (M, K) and W (N, K): M token
rows, N output features, K input features. For a Llama config (hidden d, ffn f, H query heads,
Hkv key/value heads of width hd, vocab V) and T tokens:

    qkv      M=T  N=(H + 2·Hkv)·hd  K=d
    o        M=T  N=d               K=H·hd
    gate_up  M=T  N=2·f             K=d
    down     M=T  N=d               K=f
    lm_head  M=T  N=V               K=d
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional, Union

DEFAULT_TOKENS = 16384
LAYERS = ("qkv", "o", "gate_up", "down", "lm_head")


@dataclass(frozen=True)
class LlamaConfig:
    name: str
    d: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int


LLAMA3 = {
    c.name: c
    for c in (
        LlamaConfig("llama3-1b", 2048, 8192, 32, 8, 64, 128256),
        LlamaConfig("llama3-8b", 4096, 14336, 32, 8, 128, 128256),
        LlamaConfig("llama3-70b", 8192, 28672, 64, 8, 128, 128256),
    )
}


@dataclass(frozen=True)
class Shape:
    """One forward product (M, N, K); ``layer`` and ``model`` are set for preset shapes."""

    m: int
    n: int
    k: int
    layer: Optional[str] = None
    model: Optional[LlamaConfig] = None

    @property
    def label(self) -> str:
        return f"{self.model.name}.{self.layer}" if self.model else f"{self.m}x{self.n}x{self.k}"

    @property
    def mnk(self) -> tuple[int, int, int]:
        return self.m, self.n, self.k


def llama_block(cfg: LlamaConfig, tokens: int = DEFAULT_TOKENS) -> list[Shape]:
    """The forward GEMMs of one block of ``cfg`` plus the LM head, at ``tokens`` rows."""
    c = cfg
    nk = {
        "qkv": ((c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.d),
        "o": (c.d, c.n_heads * c.head_dim),
        "gate_up": (2 * c.ffn, c.d),
        "down": (c.d, c.ffn),
        "lm_head": (c.vocab, c.d),
    }
    return [Shape(tokens, n, k, layer, cfg) for layer, (n, k) in nk.items()]


ShapeSpec = Union[str, Shape, tuple, Iterable]


def parse_shapes(spec: ShapeSpec, tokens: int = DEFAULT_TOKENS) -> list[Shape]:
    """Shapes from a preset name (``llama3-8b``), ``"M,N,K"``, an (M, N, K) tuple, a Shape, or
    a list of any of these."""
    if isinstance(spec, Shape):
        return [spec]
    if isinstance(spec, str):
        if spec in LLAMA3:
            return llama_block(LLAMA3[spec], tokens)
        dims = re.fullmatch(r"\s*(\d+)\s*[,x]\s*(\d+)\s*[,x]\s*(\d+)\s*", spec)
        if not dims:
            raise ValueError(f"shape {spec!r} is neither a preset ({', '.join(LLAMA3)}) nor M,N,K")
        return [Shape(*(int(g) for g in dims.groups()))]
    if isinstance(spec, tuple) and len(spec) == 3 and all(isinstance(x, int) for x in spec):
        return [Shape(*spec)]
    return [s for item in spec for s in parse_shapes(item, tokens)]
