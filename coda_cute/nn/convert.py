"""Conversions between standard Llama weights and the layouts the CODA ops need.

Standard (HF ``transformers``) layout: separate q/k/v projections whose Q/K rows follow the
"rotate-half" RoPE convention (within a head, element k pairs with k + head_dim/2), and separate
gate/up projections (or one concatenated [gate; up] weight). The CODA ops want:

* ``w_qkv``: one ((n_heads + 2 n_kv_heads) head_dim, d) weight, rows [Q | K | V], with the Q and K
  rows of every head permuted so that the RoPE pairs are adjacent: new row 2k = old row k, new
  row 2k+1 = old row k + head_dim/2. Attention scores are unchanged (q and k get the same
  permutation), V is not permuted, so the attention output keeps its layout. Per-head QK-norm
  weights (head_dim,) get the same permutation. Meta / torchtitan checkpoints already use
  adjacent pairs (complex RoPE): pass ``rope="pairs"`` to skip the permutation.
* ``w_gu``: (2f, d) with gate and up rows interleaved [g0, u0, g1, u1, ...], so SwiGLU's pair
  lands in one thread's registers (coda-math 2.2).

Everything is a row permutation: conversions are exact, and every ``*_to_*`` has its inverse.
"""

from __future__ import annotations

import torch

ROPE_LAYOUTS = ("rotate_half", "pairs")

HF_BLOCK_KEYS = {
    "attn_norm": "input_layernorm.weight",
    "wo": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "w_down": "mlp.down_proj.weight",
}


def rotate_half_to_pairs(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Rows of each head (n_heads * head_dim leading rows, or a (head_dim,) vector with
    n_heads = 1) from rotate-half order to adjacent-pair order."""
    rest = w.shape[1:]
    return w.reshape(n_heads, 2, head_dim // 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


def pairs_to_rotate_half(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """The inverse of :func:`rotate_half_to_pairs`."""
    rest = w.shape[1:]
    return w.reshape(n_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


def _check_rope(rope: str):
    if rope not in ROPE_LAYOUTS:
        raise ValueError(f"rope must be one of {ROPE_LAYOUTS}, got {rope!r}")


def fuse_qkv(wq, wk, wv, n_heads: int, n_kv_heads: int, head_dim: int,
             rope: str = "rotate_half") -> torch.Tensor:
    """[Q | K | V] rows for ``coda.norm_rope_qkv``, Q/K permuted to adjacent pairs."""
    _check_rope(rope)
    for name, w, heads in (("wq", wq, n_heads), ("wk", wk, n_kv_heads), ("wv", wv, n_kv_heads)):
        if w.shape[0] != heads * head_dim:
            raise ValueError(f"{name} must have {heads} * {head_dim} rows, got {tuple(w.shape)}")
    if rope == "rotate_half":
        wq, wk = rotate_half_to_pairs(wq, n_heads, head_dim), rotate_half_to_pairs(wk, n_kv_heads, head_dim)
    return torch.cat([wq, wk, wv])


def split_qkv(w_qkv, n_heads: int, n_kv_heads: int, head_dim: int, rope: str = "rotate_half"):
    """The inverse of :func:`fuse_qkv`: (wq, wk, wv) in the ``rope`` layout."""
    _check_rope(rope)
    wq, wk, wv = w_qkv.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim])
    if rope == "rotate_half":
        wq, wk = pairs_to_rotate_half(wq, n_heads, head_dim), pairs_to_rotate_half(wk, n_kv_heads, head_dim)
    return wq.contiguous(), wk.contiguous(), wv.contiguous()


def interleave_gate_up(w_gate, w_up=None) -> torch.Tensor:
    """(2f, d) with rows [g0, u0, g1, u1, ...] from separate (f, d) gate and up weights, or from
    one concatenated [gate; up] (2f, d) weight when ``w_up`` is None."""
    if w_up is None:
        w_gate, w_up = w_gate.chunk(2)
    if w_gate.shape != w_up.shape:
        raise ValueError(f"gate {tuple(w_gate.shape)} and up {tuple(w_up.shape)} must match")
    return torch.stack([w_gate, w_up], dim=1).reshape(-1, *w_gate.shape[1:])


def split_gate_up(w_gu, concat: bool = False):
    """The inverse of :func:`interleave_gate_up`: (w_gate, w_up), or the concatenated [gate; up]."""
    gate, up = w_gu[0::2].contiguous(), w_gu[1::2].contiguous()
    return torch.cat([gate, up]) if concat else (gate, up)


#: state-dict entries HF keeps that carry no weight (rotary frequency buffers of older versions)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def check_hf_keys(cfg, sd: dict):
    """An HF Llama state dict holds exactly what a CodaLlama of ``cfg`` loads: raises naming the
    layer and key that is missing, or the keys it does not model (biases, QK-norm weights
    without ``cfg.qk_norm``, layers past ``cfg.n_layers``), so nothing is silently dropped."""
    want = {"model.embed_tokens.weight", "model.norm.weight"}
    optional = {"lm_head.weight"}  # absent: tied embeddings
    for i in range(cfg.n_layers):
        pre = f"model.layers.{i}."
        layer = [*HF_BLOCK_KEYS.values(), *(f"self_attn.{x}_proj.weight" for x in "qkv")]
        if cfg.qk_norm:
            layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        fused = pre + "mlp.gate_up_proj.weight" in sd
        layer += ["mlp.gate_up_proj.weight"] if fused else ["mlp.gate_proj.weight", "mlp.up_proj.weight"]
        for key in layer:
            if pre + key not in sd:
                raise ValueError(f"from_hf: layer {i} has no {key!r} (state-dict key {pre + key!r}); "
                                 f"the config has n_layers={cfg.n_layers}, qk_norm={cfg.qk_norm}")
        want |= {pre + key for key in layer}
    if "model.embed_tokens.weight" not in sd or "model.norm.weight" not in sd:
        raise ValueError("from_hf: the state dict needs 'model.embed_tokens.weight' and 'model.norm.weight'")
    extra = sorted(k for k in sd if k not in want | optional and not k.endswith(IGNORED_SUFFIXES))
    if extra:
        raise ValueError(f"from_hf: keys CodaLlama does not model (biases, QK-norm weights without "
                         f"qk_norm, layers past n_layers={cfg.n_layers}): {extra[:8]}"
                         + (f" and {len(extra) - 8} more" if len(extra) > 8 else ""))


def block_from_hf(p: dict, n_heads: int, n_kv_heads: int, head_dim: int,
                  rope: str = "rotate_half") -> dict:
    """One decoder layer's HF tensors (names relative to the layer, e.g. "self_attn.q_proj.weight";
    gate/up separate or as "mlp.gate_up_proj.weight") -> CODA tensors named like the parameters
    of :class:`coda_cute.nn.CodaLlamaBlock` (attn_norm, wqkv, wo, ffn_norm, w_gu, w_down and,
    with QK-norm, q_norm and k_norm)."""
    out = {k: p[v] for k, v in HF_BLOCK_KEYS.items()}
    out["wqkv"] = fuse_qkv(p["self_attn.q_proj.weight"], p["self_attn.k_proj.weight"],
                           p["self_attn.v_proj.weight"], n_heads, n_kv_heads, head_dim, rope)
    if "mlp.gate_up_proj.weight" in p:
        out["w_gu"] = interleave_gate_up(p["mlp.gate_up_proj.weight"])
    else:
        out["w_gu"] = interleave_gate_up(p["mlp.gate_proj.weight"], p["mlp.up_proj.weight"])
    if "self_attn.q_norm.weight" in p:
        out["q_norm"] = head_norm_weight(p["self_attn.q_norm.weight"], head_dim, rope, to_pairs=True)
        out["k_norm"] = head_norm_weight(p["self_attn.k_norm.weight"], head_dim, rope, to_pairs=True)
    return out


def block_to_hf(c: dict, n_heads: int, n_kv_heads: int, head_dim: int, rope: str = "rotate_half",
                concat_gate_up: bool = False) -> dict:
    """The inverse of :func:`block_from_hf` (gate/up separate unless ``concat_gate_up``)."""
    out = {v: c[k] for k, v in HF_BLOCK_KEYS.items()}
    wq, wk, wv = split_qkv(c["wqkv"], n_heads, n_kv_heads, head_dim, rope)
    out.update({"self_attn.q_proj.weight": wq, "self_attn.k_proj.weight": wk,
                "self_attn.v_proj.weight": wv})
    if concat_gate_up:
        out["mlp.gate_up_proj.weight"] = split_gate_up(c["w_gu"], concat=True)
    else:
        out["mlp.gate_proj.weight"], out["mlp.up_proj.weight"] = split_gate_up(c["w_gu"])
    if "q_norm" in c:
        out["self_attn.q_norm.weight"] = head_norm_weight(c["q_norm"], head_dim, rope, to_pairs=False)
        out["self_attn.k_norm.weight"] = head_norm_weight(c["k_norm"], head_dim, rope, to_pairs=False)
    return out


def head_norm_weight(w, head_dim: int, rope: str, to_pairs: bool):
    """A per-head QK-norm weight (head_dim,) follows its head's row permutation."""
    if rope == "pairs":
        return w
    return (rotate_half_to_pairs if to_pairs else pairs_to_rotate_half)(w, 1, head_dim)
