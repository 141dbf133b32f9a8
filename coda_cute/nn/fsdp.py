"""CODA models under FSDP2 (``torch.distributed.fsdp.fully_shard``).

What FSDP2 needs of a model, and how the CODA models meet it:

* A custom op must read unsharded parameters. FSDP2 all-gathers a unit's parameters in the pre-forward
  hook of the module it wraps, so every parameter has to be read inside the forward of the module that
  owns it. :class:`~coda_cute.nn.CodaLlama` and an :func:`~coda_cute.nn.apply_coda` model both run each
  decoder layer through its own module (the norm statistics that cross a layer boundary are
  activations, not parameters), and the embedding, final norm and LM head inside the root's forward.
* A γ fold cached across an all-gather is stale: FSDP2 writes each step's gathered weights into the
  same unsharded tensors and keeps their version counters (``_unsafe_preserve_version_counter``), so
  the fold cache (``CodaLlama(cache_folds=True)``) cannot see the new values. A ``CodaLlama`` with any
  FSDP2 module folds on every forward instead (:func:`under_fsdp`).
* A decoder layer's inputs include fp32 tensors that must stay fp32: the residual stream's norm
  statistics and the RoPE frequencies. A ``MixedPrecisionPolicy`` with ``cast_forward_inputs=True``
  (its default) casts them to bf16; :func:`shard` turns that off for the decoder layers (their
  hidden states are bf16 already), and a layer that receives them cast says so
  (:func:`check_layer_inputs`).
* ``torch.compile`` goes per decoder layer, before sharding, so FSDP2's hooks stay outside the
  compiled code (they are ``torch._dynamo.disable``'d and would break a full graph).

:func:`shard` does the usual wrapping: one FSDP2 unit per decoder layer, then the root (embedding,
final norm, LM head), with an optional ``MixedPrecisionPolicy`` (fp32 master weights, bf16 compute).
"""

from __future__ import annotations

import dataclasses

import torch


def decoder_layers(model: torch.nn.Module):
    """The decoder layers of a :class:`~coda_cute.nn.CodaLlama` (``model.layers``) or an HF causal LM
    (``model.model.layers``)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"coda_cute.nn.shard: model must be a CodaLlama or an HF causal LM with "
                        f"model.model.layers, got {type(model).__name__}")
    return layers


def under_fsdp(module: torch.nn.Module) -> bool:
    """Whether ``module`` or any module inside it was wrapped by FSDP2's ``fully_shard``."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def check_layer_inputs(ss: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """A decoder layer's fp32 inputs arrived as fp32 (not cast by a mixed-precision policy)."""
    for name, t in (("ss (the norm statistics)", ss), ("inv_freq (the RoPE frequencies)", inv_freq)):
        if t.dtype != torch.float32:
            raise TypeError(
                f"CODA decoder layer: {name} arrived as {t.dtype}, not torch.float32. FSDP2's "
                "MixedPrecisionPolicy casts a module's forward inputs by default: shard the decoder "
                "layers with MixedPrecisionPolicy(..., cast_forward_inputs=False), or use "
                "coda_cute.nn.shard(model, mp_policy), which does")


def shard(model: torch.nn.Module, mp_policy=None, compile_layers: bool | dict = False, **fully_shard_kwargs):
    """``fully_shard`` each decoder layer of ``model``, then ``model`` itself (in place; returns it).

    ``mp_policy``: a ``torch.distributed.fsdp.MixedPrecisionPolicy``, e.g.
    ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` over fp32
    master weights: the CODA ops then see bf16 parameters and the gradients reach the fp32 shards.
    ``compile_layers``: ``torch.compile`` each decoder layer first (per block, the pattern FSDP2
    supports); a dict gives ``torch.compile``'s keyword arguments. Other keyword arguments
    (``mesh``, ``reshard_after_forward``, ...) go to every ``fully_shard`` call."""
    from torch.distributed.fsdp import fully_shard

    root, layer_kwargs = dict(fully_shard_kwargs), dict(fully_shard_kwargs)
    if mp_policy is not None:
        root["mp_policy"] = mp_policy
        layer_kwargs["mp_policy"] = dataclasses.replace(mp_policy, cast_forward_inputs=False)
    for layer in decoder_layers(model):
        if compile_layers:
            layer.compile(**(compile_layers if isinstance(compile_layers, dict) else {}))
        fully_shard(layer, **layer_kwargs)
    fully_shard(model, **root)
    return model
