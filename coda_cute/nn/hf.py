"""One line on an HF model: ``apply_coda(model)`` runs a transformers causal LM on the CODA ops.

    from coda_cute.nn import apply_coda
    model = apply_coda(LlamaForCausalLM.from_pretrained(...))   # in place; returns the model
    loss = model(input_ids=ids, labels=labels).loss             # HF's forward contract

Supported: ``LlamaForCausalLM``, ``Qwen3ForCausalLM`` (QK-norm) and ``MistralForCausalLM``
without a sliding window. Every config the CODA path cannot compute exactly is refused before
anything changes: biases, attention dropout, an activation other than SiLU, a sliding window, a RoPE type that
rescales attention or changes with the sequence length (``default``, ``linear`` and ``llama3``
are supported), head sizes the kernels reject.

The model keeps its own parameters and modules: ``state_dict``, ``save_pretrained`` and
``load_state_dict`` speak standard HF tensors, tied embeddings stay tied; each decoder layer runs
through its own module (so FSDP2's ``fully_shard`` per layer unshards it in time). Each forward builds the
layouts the ops take from them, differentiably: Q/K rows permuted to adjacent RoPE pairs and
fused with V, gate/up rows interleaved, the RMSNorm weights folded in (``coda.fold_gamma``, the
weight-sized pass the fold costs anyway). Parameters may be bf16, or fp32 master weights (the
usual mixed-precision setup, with or without ``torch.autocast``): the ops compute in bf16 and the
gradients flow back to the parameters in their own dtype.

The RoPE frequencies come from the model's own rotary embedding rules (transformers'
``ROPE_INIT_FUNCTIONS``), computed in fp32 once and kept outside the module's buffers, so
``model.to(torch.bfloat16)`` cannot round them.

The forward takes ``input_ids``, ``labels`` (HF's shift: position t predicts ``labels[t + 1]``;
``ignore_index`` -100), ``position_ids`` (packed sequences: positions that restart; attention
stays causal over the whole row, as in HF's default attention), ``attention_mask`` only all ones
(a padding mask is refused), ``num_items_in_batch`` (HF Trainer's gradient-accumulation
normalization) and ``shift_labels``. It returns a ``CausalLMOutputWithPast`` with ``.loss``, and
``.logits`` when no labels are given. KV caches, ``inputs_embeds``, attentions or hidden states
as outputs are refused: the CODA path is for training.
"""

from __future__ import annotations

import functools
import types
from typing import Optional

import torch

from ..ops.checks import PendingCheck, with_deferred_checks
from ..ops.embedding import embedding
from ..ops.fold import fold_gamma
from ..ops.proj import norm_proj
from .convert import fuse_qkv, head_norm_weight, interleave_gate_up
from .fsdp import check_layer_inputs
from .llama import LlamaConfig, block_forward, embedding_norm_stats, head_loss, rows_to_multiple_of_8

BF16 = torch.bfloat16
IGNORE_INDEX = -100
#: model classes and whether their attention has per-head QK-norm
FAMILIES = {"LlamaForCausalLM": False, "MistralForCausalLM": False, "Qwen3ForCausalLM": True}
#: RoPE types whose rotation is a fixed frequency table (no attention rescale, no length rule)
ROPE_TYPES = ("default", "linear", "llama3")


def _refuse(field: str, value, why: str):
    raise ValueError(f"apply_coda: config.{field} = {value!r}: {why}; nothing was changed")


def coda_config(hf_config, family: str, precision="bf16") -> LlamaConfig:
    """The :class:`LlamaConfig` of an HF config of ``family``, or a ValueError naming the field
    the CODA path does not support."""
    c = hf_config
    for field in ("attention_bias", "mlp_bias"):
        if getattr(c, field, False):
            _refuse(field, getattr(c, field), "the CODA ops have no bias terms")
    if getattr(c, "attention_dropout", 0.0):
        _refuse("attention_dropout", c.attention_dropout, "the CODA attention has no dropout")
    act = getattr(c, "hidden_act", "silu")
    if act != "silu":
        _refuse("hidden_act", act, "the CODA MLP is SwiGLU (silu)")
    if getattr(c, "use_sliding_window", False) or getattr(c, "sliding_window", None) is not None:
        field = "use_sliding_window" if getattr(c, "use_sliding_window", False) else "sliding_window"
        _refuse(field, getattr(c, field), "the CODA attention is full causal attention; "
                "set it to None / False for models trained without a window")
    rope = rope_parameters(c)
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        _refuse("rope_parameters", rope, f"rope_type {rope_type!r} is not one of {ROPE_TYPES} (the others "
                "rescale attention or change with the sequence length)")
    qk_norm = FAMILIES[family]
    try:
        return LlamaConfig(
            dim=c.hidden_size, n_layers=c.num_hidden_layers, n_heads=c.num_attention_heads,
            n_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            ffn_dim=c.intermediate_size, vocab_size=c.vocab_size,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            norm_eps=c.rms_norm_eps, qk_norm=qk_norm, qk_norm_eps=c.rms_norm_eps if qk_norm else 1e-6,
            rope_theta=float(rope["rope_theta"]), max_seq_len=c.max_position_embeddings, precision=precision)
    except ValueError as e:
        raise ValueError(f"apply_coda: the model's config does not fit the CODA kernels: {e}; "
                         "nothing was changed") from None


def rope_parameters(hf_config) -> dict:
    """transformers' RoPE settings of a config: ``rope_parameters`` (transformers 5), else the
    older ``rope_scaling`` + ``rope_theta``."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return dict(params)
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.get("type", "default"))
    return {**scaling, "rope_theta": getattr(hf_config, "rope_theta", 10000.0)}


def rope_inv_freq(model) -> torch.Tensor:
    """(head_dim / 2,) fp32 frequencies of the model's rotary embedding, from transformers' own
    rules for its RoPE type (Llama-3 scaling included), on the CPU."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rotary = model.model.rotary_emb
    rope_type = getattr(rotary, "rope_type", "default")
    init = ROPE_INIT_FUNCTIONS.get(rope_type) if rope_type != "default" else None
    init = init or type(rotary).compute_default_rope_parameters
    inv_freq, scaling = init(model.config)  # newer transformers deprecate its device argument
    if scaling != 1.0:
        _refuse("rope_parameters", rope_parameters(model.config), f"its attention scaling {scaling} != 1")
    return inv_freq.float().cpu()


def apply_coda(model, precision="bf16"):
    """Make ``model`` (an HF causal LM of a supported family) run its forward and backward on
    the CODA ops, in place, and return it (module docstring). ``precision``: "bf16", or "fp8" /
    an :class:`~coda_cute.precision.Fp8Recipe` for every decoder layer's GEMMs in FP8, block-scaled
    or row-wise (``coda.attention_block_fp8``, ``coda.mlp_block_fp8``; the LM head stays bf16
    unless the block recipe says otherwise). Raises
    ValueError, before any change, for what the CODA path does not compute."""
    family = type(model).__name__
    if family not in FAMILIES:
        raise TypeError(f"apply_coda: {family} is not supported; supported: {sorted(FAMILIES)}")
    cfg = coda_config(model.config, family, precision)
    inv_freq = rope_inv_freq(model)
    layers = model.model.layers
    if len(layers) != cfg.n_layers:
        raise ValueError(f"apply_coda: the model has {len(layers)} layers, its config says {cfg.n_layers}")
    model._coda = types.SimpleNamespace(cfg=cfg, inv_freq={torch.device("cpu"): inv_freq})
    model.forward = types.MethodType(coda_forward, model)
    for layer in layers:
        layer._coda_cfg = cfg
        layer.forward = types.MethodType(coda_layer_forward, layer)
    return model


def coda_layer_forward(self, x, ss, positions, inv_freq):
    """One decoder layer on the CODA ops: (x, ss) -> the next residual stream and its norm
    statistics. Called through the layer module (``layer(...)``), so that module hooks run around
    it: FSDP2 unshards the layer's parameters in its pre-forward hook (and again before its
    backward), which a loop reading the parameters from outside the module would skip."""
    check_layer_inputs(ss, inv_freq)
    c = self._coda_cfg
    return block_forward(c, x, ss, positions, inv_freq, functools.partial(sublayer_weights, self, c),
                         *qk_norm_weights(self, c))


def _frequencies(state, device) -> torch.Tensor:
    table = state.inv_freq.get(device)
    if table is None:
        table = state.inv_freq[device] = state.inv_freq[torch.device("cpu")].to(device)
    return table


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == BF16 else t.to(BF16)


def sublayer_weights(layer, c: LlamaConfig, i: int):
    """Sublayer i's weights of one HF decoder layer as ``block_forward`` takes them: 0 the
    attention's (w_qkv, w_o), 1 the MLP's (w_gu, w_down), in the CODA layouts, bf16, the RMSNorm
    weight folded into the first; differentiable into the HF parameters. No cached FP8
    quantization (None): the FP8 ops quantize."""
    if i == 0:
        att = layer.self_attn
        w_qkv = fuse_qkv(att.q_proj.weight, att.k_proj.weight, att.v_proj.weight, c.n_heads, c.n_kv_heads,
                         c.head_dim)
        return _bf16(fold_gamma(w_qkv, layer.input_layernorm.weight)), _bf16(att.o_proj.weight), None
    mlp = layer.mlp
    w_gu = interleave_gate_up(mlp.gate_proj.weight, mlp.up_proj.weight)
    return _bf16(fold_gamma(w_gu, layer.post_attention_layernorm.weight)), _bf16(mlp.down_proj.weight), None


def qk_norm_weights(layer, c: LlamaConfig):
    """(q_norm, k_norm) in the CODA pair order, bf16, or (None, None) without QK-norm."""
    if not c.qk_norm:
        return None, None
    att = layer.self_attn
    return tuple(_bf16(head_norm_weight(n.weight, c.head_dim, "rotate_half", to_pairs=True))
                 for n in (att.q_norm, att.k_norm))


def _positions(position_ids: Optional[torch.Tensor], b: int, s: int, device) -> torch.Tensor:
    if position_ids is None:
        return torch.arange(s, device=device, dtype=torch.int32).repeat(b)
    if position_ids.dim() != 2 or position_ids.shape[-1] != s or position_ids.shape[0] not in (1, b):
        raise ValueError(f"apply_coda forward: position_ids must be (batch, seq) = ({b}, {s}) or (1, {s}), "
                         f"got {tuple(position_ids.shape)}")
    return position_ids.expand(b, s).reshape(-1).to(torch.int32)


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """HF's causal shift: position t is trained on labels[t + 1]; the last position is ignored."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


@with_deferred_checks
def coda_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                 inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, cache=None,
                 num_items_in_batch=None, shift_labels=None, **kwargs):
    """The HF causal-LM forward on the CODA ops (module docstring)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    refused = {"past_key_values": past_key_values is not None, "cache": cache is not None,
               "use_cache": bool(use_cache), "inputs_embeds": inputs_embeds is not None,
               "logits_to_keep": not (isinstance(logits_to_keep, int) and logits_to_keep == 0),
               "output_attentions": bool(kwargs.pop("output_attentions", False)),
               "output_hidden_states": bool(kwargs.pop("output_hidden_states", False))}
    kwargs.pop("return_dict", None)
    for name, bad in refused.items():
        if bad:
            raise ValueError(f"apply_coda forward: {name} is not supported on the CODA path (it trains: no "
                             "KV cache, generation or intermediate outputs)")
    if kwargs:
        raise ValueError(f"apply_coda forward: unsupported arguments {sorted(kwargs)}")
    if input_ids is None or input_ids.dim() != 2 or 0 in input_ids.shape:
        raise ValueError("apply_coda forward: input_ids (batch, seq), neither of them 0, is required, got "
                         f"{None if input_ids is None else tuple(input_ids.shape)}")
    state, c = self._coda, self._coda.cfg
    b, s = input_ids.shape
    for name, t in (("labels", labels), ("shift_labels", shift_labels)):
        if t is not None and tuple(t.shape) != (b, s):  # reshaped alike they would train on other tokens
            raise ValueError(f"apply_coda forward: {name} must be (batch, seq) = ({b}, {s}) like input_ids, "
                             f"got {tuple(t.shape)}")
    mask_check = None
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (b, s):
            raise ValueError(f"apply_coda forward: attention_mask must be (batch, seq) = ({b}, {s}), "
                             f"got {tuple(attention_mask.shape)}")
        mask_check = PendingCheck((attention_mask == 0).any(), lambda: ValueError(
            "apply_coda forward: attention_mask has zeros (padding); the CODA path takes only "
            "unpadded (all-ones) batches: pack sequences instead"))
    m = self.model
    pad = m.embed_tokens.padding_idx
    x = _bf16(embedding(m.embed_tokens.weight, input_ids, -1 if pad is None else pad))
    ss = embedding_norm_stats(x.reshape(b * s, -1))
    positions = _positions(position_ids, b, s, input_ids.device)
    inv_freq = _frequencies(state, input_ids.device)
    for layer in m.layers:
        x, ss = layer(x, ss, positions, inv_freq)
    y = x.reshape(b * s, -1)
    loss = logits = None
    if labels is not None or shift_labels is not None:
        targets = (shift_labels if shift_labels is not None else _shifted(labels)).reshape(-1)
        # HF Trainer's gradient accumulation divides the sum by the tokens of the whole batch
        reduction = "mean" if num_items_in_batch is None else "sum"
        loss = head_loss(c, y, _bf16(self.lm_head.weight), ss, targets, IGNORE_INDEX, reduction,
                         _bf16(m.norm.weight))
        if num_items_in_batch is not None:
            loss = loss / num_items_in_batch
    else:
        v = self.lm_head.weight.shape[0]
        w = _bf16(fold_gamma(rows_to_multiple_of_8(self.lm_head.weight), m.norm.weight))
        logits = norm_proj(y, w, ss, c.norm_eps)[:, :v].view(b, s, v)
    if mask_check is not None:
        mask_check.wait()
    return CausalLMOutputWithPast(loss=loss, logits=logits)
