"""The models of ``scripts/bench_train.py``: the two Llama configs, the HF model built from one
(and its Liger-patched copy), the CODA model's config mirrored from HF's, the tokens and shifted
labels, and the step functions each variant is timed by (forward + ``loss.backward()``).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# coda_cute is being rewritten under this benchmark: if it does not import, the coda variant is
# recorded as failed and the baselines and the shadow still run.
try:
    import coda_cute
    from coda_cute.nn import CodaLlama, embedding_norm_stats
    from coda_cute.nn import LlamaConfig as CodaLlamaConfig
    CODA_IMPORT_ERROR: Optional[str] = None
except Exception as exc:  # noqa: BLE001
    coda_cute = CodaLlama = embedding_norm_stats = CodaLlamaConfig = None
    CODA_IMPORT_ERROR = f"import coda_cute failed: {type(exc).__name__}: {exc}"

BF16 = torch.bfloat16
IGNORE = -100
SEED = 0


# -- configs --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """One benchmark model (n_layers comes from ``--layers``)."""
    name: str
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int = 128256
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5

    def coda_kwargs(self, n_layers: int, max_seq_len: int = 8192) -> dict:
        """The coda_cute.nn.LlamaConfig fields of this model."""
        return dict(dim=self.dim, n_layers=n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                    ffn_dim=self.ffn_dim, vocab_size=self.vocab_size, head_dim=self.head_dim,
                    norm_eps=self.norm_eps, qk_norm=False, rope_theta=self.rope_theta,
                    max_seq_len=max_seq_len)


SPECS = {
    "1b": ModelSpec("1b", dim=2048, n_heads=32, n_kv_heads=8, head_dim=64, ffn_dim=8192),
    "8b": ModelSpec("8b", dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336),
    # Llama-3.2-3B's widths: shapes no heuristic was fitted on (neither benchmark's default)
    "3b": ModelSpec("3b", dim=3072, n_heads=24, n_kv_heads=8, head_dim=128, ffn_dim=8192),
}
#: --smoke: small enough for the CPU references, same structure (GQA 2:1, head_dim != dim / heads)
SMOKE_SPEC = ModelSpec("tiny", dim=64, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=128, vocab_size=512)
SMOKE_BATCH, SMOKE_SEQ = 2, 32


def hf_config(spec: ModelSpec, n_layers: int, max_seq_len: int = 8192):
    """The transformers LlamaConfig of ``spec`` (tied embeddings off, sdpa, no KV cache)."""
    from transformers import LlamaConfig as HFLlamaConfig

    cfg = HFLlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.dim, intermediate_size=spec.ffn_dim,
        num_hidden_layers=n_layers, num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_kv_heads,
        head_dim=spec.head_dim, hidden_act="silu", max_position_embeddings=max(8192, max_seq_len),
        rms_norm_eps=spec.norm_eps, rope_theta=spec.rope_theta, attention_bias=False, mlp_bias=False,
        tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    if hf_rope(cfg) != ("default", spec.rope_theta) and isinstance(getattr(cfg, "rope_parameters", None), dict):
        cfg.rope_parameters = {**cfg.rope_parameters, "rope_type": "default", "rope_theta": spec.rope_theta}
    if hf_rope(cfg) != ("default", spec.rope_theta):
        raise RuntimeError(f"HF config kept rope {hf_rope(cfg)}, want ('default', {spec.rope_theta})")
    return cfg


def hf_rope(hf_cfg) -> tuple:
    """(rope_type, rope_theta) of an HF config: transformers 5 keeps them in ``rope_parameters``,
    4.x in ``rope_theta`` (+ ``rope_scaling``)."""
    params = getattr(hf_cfg, "rope_parameters", None) or {}
    scaling = getattr(hf_cfg, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    theta = params.get("rope_theta", getattr(hf_cfg, "rope_theta", None))
    if theta is None:
        raise ValueError("HF config has no rope_theta")
    return rope_type, float(theta)


def coda_kwargs_from_hf(hf_cfg) -> dict:
    """coda_cute.nn.LlamaConfig fields mirroring a transformers LlamaConfig; raises ValueError for
    what CodaLlama does not model (biases, tied embeddings, other activations, scaled RoPE)."""
    rope_type, theta = hf_rope(hf_cfg)
    if rope_type != "default":
        raise ValueError(f"CodaLlama has unscaled RoPE only, HF config has rope_type {rope_type!r}")
    if getattr(hf_cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"CodaLlama has SwiGLU only, HF config has hidden_act {hf_cfg.hidden_act!r}")
    for flag in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if getattr(hf_cfg, flag, False):
            raise ValueError(f"CodaLlama has no {flag}")
    heads = hf_cfg.num_attention_heads
    return dict(dim=hf_cfg.hidden_size, n_layers=hf_cfg.num_hidden_layers, n_heads=heads,
                n_kv_heads=getattr(hf_cfg, "num_key_value_heads", None) or heads,
                ffn_dim=hf_cfg.intermediate_size, vocab_size=hf_cfg.vocab_size,
                head_dim=getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // heads,
                norm_eps=float(hf_cfg.rms_norm_eps), qk_norm=False, rope_theta=theta,
                max_seq_len=hf_cfg.max_position_embeddings)


def coda_config(hf_cfg):
    if CodaLlamaConfig is None:
        raise RuntimeError(CODA_IMPORT_ERROR)
    return CodaLlamaConfig(**coda_kwargs_from_hf(hf_cfg))


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE) -> torch.Tensor:
    """HF labels (the model shifts them) -> CodaLlama targets (label of each position):
    targets[:, :-1] = labels[:, 1:], targets[:, -1] = ignore_index."""
    targets = torch.full_like(labels, ignore_index)
    targets[:, :-1] = labels[:, 1:]
    return targets


def random_tokens(batch: int, seq: int, vocab: int, seed: int = SEED) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


# -- models -----------------------------------------------------------------------------------------
@contextlib.contextmanager
def default_dtype(dtype):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def hf_inv_freq(head_dim: int, theta: float, device) -> torch.Tensor:
    """HF's default rotary frequencies, fp32, computed as transformers computes them."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def build_hf_model(hf_cfg, device, seed: int = SEED):
    """A random-init LlamaForCausalLM with bf16 parameters and an fp32 rotary ``inv_freq``: built
    with bf16 as the default dtype (``model.to(torch.bfloat16)`` would round the frequencies too);
    if a transformers version still hands out a non-fp32 ``inv_freq``, an fp32 copy is restored."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device), default_dtype(BF16):
        model = LlamaForCausalLM(hf_cfg)
    model.train()
    rot = model.model.rotary_emb
    rope_type, theta = hf_rope(hf_cfg)
    for name in ("inv_freq", "original_inv_freq"):
        t = getattr(rot, name, None)
        if isinstance(t, torch.Tensor) and t.dtype != torch.float32:
            if rope_type != "default":
                raise RuntimeError(f"rotary {name} is {t.dtype} and rope_type {rope_type!r} cannot be rebuilt")
            setattr(rot, name, hf_inv_freq(hf_cfg.head_dim, theta, t.device))
    if rot.inv_freq.dtype != torch.float32:
        raise RuntimeError(f"rotary inv_freq is {rot.inv_freq.dtype}, want float32")
    bad = {n: p.dtype for n, p in model.named_parameters() if p.dtype != BF16}
    if bad:
        raise RuntimeError(f"non-bf16 parameters: {bad}")
    return model


_MISSING = object()


def _patch_targets():
    """What Liger's apply_liger_kernel_to_llama may patch: transformers' modeling_llama module and
    the classes defined in it."""
    from transformers.models.llama import modeling_llama as ml

    return [ml] + [v for v in vars(ml).values() if isinstance(v, type) and v.__module__ == ml.__name__]


def _snapshot(targets) -> dict:
    return {id(t): (t, dict(vars(t))) for t in targets}


def _undo_patches(snap: dict) -> list:
    """Restore every attribute changed since ``snap``; returns the patches [(owner, name, value)]."""
    patches = []
    for owner, before in snap.values():
        now = dict(vars(owner))
        for name in set(now) | set(before):
            old, new = before.get(name, _MISSING), now.get(name, _MISSING)
            if old is new:
                continue
            patches.append((owner, name, new))
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
    return patches


@contextlib.contextmanager
def patched(patches: list):
    """Re-apply Liger's global patches (e.g. modeling_llama.apply_rotary_pos_emb) for a block."""
    saved = [(owner, name, vars(owner).get(name, _MISSING)) for owner, name, _ in patches]
    for owner, name, value in patches:
        if value is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            if value is _MISSING:
                if name in vars(owner):
                    delattr(owner, name)
            else:
                setattr(owner, name, value)


def liger_version() -> Optional[str]:
    try:
        import liger_kernel  # noqa: F401
    except Exception:  # noqa: BLE001
        return None
    from importlib import metadata
    for dist in ("liger_kernel", "liger-kernel"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return "unknown"


def build_liger_model(hf_model):
    """A deep copy of ``hf_model`` (same weights) patched by apply_liger_kernel_to_llama(model=...)
    with default options. Liger's module-level patches are undone at once and returned, to be
    re-applied (``patched``) around this model's forward only."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    model = copy.deepcopy(hf_model)
    snap = _snapshot(_patch_targets())
    try:
        apply_liger_kernel_to_llama(model=model)
    finally:
        patches = _undo_patches(snap)
    return model, patches


# -- step functions -----------------------------------------------------------------------------------
def zero_grads(params):
    for p in params:
        p.grad = None


def hf_step(model, ids, labels, params, patches=None) -> Callable:
    ctx = (lambda: patched(patches)) if patches else contextlib.nullcontext

    def step():
        zero_grads(params)
        with ctx():
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss.detach()
    return step


def coda_step(model, tokens, targets, params) -> Callable:
    def step():
        zero_grads(params)
        loss = model(tokens, targets)
        loss.backward()
        return loss.detach()
    return step


def block_fn(model, batch: int, seq: int, device, seed: int = SEED) -> Callable:
    """Layer 0 of the CODA model, forward + backward on a random residual stream (see the docstring)."""
    blk = model.layers[0]
    d = model.cfg.dim
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, seq, d, device=device, dtype=BF16, generator=g).requires_grad_()
    cot = torch.randn(batch, seq, d, device=device, dtype=BF16, generator=g)
    ss = embedding_norm_stats(x.detach().reshape(batch * seq, d)).requires_grad_()
    pos = torch.arange(seq, device=device, dtype=torch.int32)
    inv_freq = model.rope_inv_freq
    wrt = [x, ss] + list(blk.parameters())

    def block():
        out, _ = blk(x, ss, pos, inv_freq)
        torch.autograd.grad((out.float() * cot).sum(), wrt, allow_unused=True)
    return block
