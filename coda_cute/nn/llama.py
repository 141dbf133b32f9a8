"""A Llama decoder block, the final norm + LM head + loss, and a small Llama, on the CODA ops.

One block (x: the residual stream, ss: its norm-stat partials from the GEMM that produced it),
as two autograd ops whose backward fuses across their GEMMs (coda-math 3.3):

    y1, ss1 = coda.attention_block(x, ss, W_qkv * gamma_attn, W_o, ...)
              RMSNorm + QKV + RoPE, causal GQA attention (the SDPA kernel), out-proj + residual
    y2, ss2 = coda.mlp_block(y1, ss1, W_gu * gamma_ffn, W_down)
              RMSNorm + gate/up + SwiGLU, down-proj + residual

The final norm + LM head + loss is ``coda.lm_head_ce_train`` (gradients computed in the
forward, in row chunks) or ``coda.lm_head_ce`` (loss only). The ss partials are statistics of
the residual stream: they carry no gradient (each op's backward includes the norm's).

The block's RMSNorm weights are folded into the consumer weights on every forward (a
differentiable multiply: d gamma = sum_n dW' * W), or with ``cache_folds=True`` once per version
of the weights (``coda_cute.nn.fold.FoldCache``: reused by every micro-batch between two
optimizer steps and by every inference forward; read its caveat on writes through ``.data``).
With ``precision="fp8"`` the same switch keeps each layer weight's FP8 quantization once per
version (``coda_cute.nn.fold.WeightQuantCache``), which the FP8 sublayers then take as given;
see ``coda_cute.ops.residual.residual_gemm_norm_stats`` for why gamma is not stored with y. The
final norm's weight is applied to the activations instead (``coda_cute.ops.lm_head_ce``).
Parameters live in the CODA layouts (fused, adjacent-pair QKV; interleaved gate/up);
``from_hf`` / ``hf_state_dict`` convert from and to standard HF weights. Keep the model's
parameters in bf16 (the ops' dtype) and the RoPE frequencies (``rope_inv_freq``) in fp32: move
it with ``.to(device)``, not ``.to(dtype)``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from ..ops.attention import attention_block
from ..ops.attention_fp8 import attention_block_fp8
from ..ops.checks import with_deferred_checks
from ..ops.embedding import embedding
from ..ops.lm_head_ce import cross_entropy
from ..ops.lm_head_ce_fp8 import cross_entropy_fp8
from ..ops.mlp import mlp_block
from ..ops.mlp_fp8 import mlp_block_fp8
from ..ops.proj import norm_proj
from ..ops.qkv import segment_widths as qk_norm_head_dims
from ..precision import Fp8Recipe, recipe_for
from ..reference import rope_inv_freq
from .convert import block_from_hf, block_to_hf, check_hf_keys
from .fold import FoldCache, WeightQuantCache
from .fsdp import check_layer_inputs, under_fsdp


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    head_dim: Optional[int] = None  # default dim // n_heads
    norm_eps: float = 1e-5
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3-style)
    qk_norm_eps: float = 1e-6
    rope_theta: float = 500000.0
    max_seq_len: int = 8192
    #: "bf16", or "fp8" / a :class:`~coda_cute.precision.Fp8Recipe`: the sublayers' GEMMs in FP8
    #: (``coda.attention_block_fp8``, ``coda.mlp_block_fp8``); stored as the recipe
    precision: Union[str, Fp8Recipe] = "bf16"

    def __post_init__(self):
        """Validate now, naming the field: a config the kernels cannot run fails here, not in
        the first forward."""
        def bad(field, rule):
            raise ValueError(f"LlamaConfig.{field} = {getattr(self, field)!r}: {rule}")

        for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(field, "must be a positive integer")
        if self.n_heads % self.n_kv_heads:
            bad("n_kv_heads", f"must divide n_heads ({self.n_heads}) for grouped-query attention")
        for field in ("dim", "ffn_dim"):
            if getattr(self, field) % 8:
                bad(field, "must be a multiple of 8 (rows of bf16 values start on 16-byte boundaries for TMA)")
        if self.head_dim is None:
            if self.dim % self.n_heads:
                bad("dim", f"must be a multiple of n_heads ({self.n_heads}) when head_dim is not given")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        hd = self.head_dim
        if isinstance(hd, bool) or not isinstance(hd, int) or hd < 8 or hd > 256 or hd % 8:
            bad("head_dim", "must be a multiple of 8 in [8, 256] (the RoPE and attention kernels' rule)")
        if not isinstance(self.qk_norm, bool):  # "no" or 1 would read as true
            bad("qk_norm", "must be True or False")
        if self.qk_norm and hd not in qk_norm_head_dims():
            bad("head_dim", f"with qk_norm must divide a GEMM tile width: one of {sorted(qk_norm_head_dims())}")
        for field in ("norm_eps", "qk_norm_eps"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 and math.isfinite(v)):
                bad(field, "must be a finite number >= 0")
        theta = self.rope_theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (theta > 0 and math.isfinite(theta)):
            bad("rope_theta", "must be a finite number > 0")
        try:
            recipe = recipe_for(self.precision)
        except ValueError as e:
            bad("precision", str(e))
        if recipe is not None:
            if recipe.lm_head_fp8 and self.vocab_size % 16:
                bad("vocab_size", "must be a multiple of 16 with the LM head in FP8 (lm_head_fp8)")
            for field in ("dim", "ffn_dim"):
                if getattr(self, field) % 16:
                    bad(field, "must be a multiple of 16 with FP8 (rows of FP8 values start on 16-byte boundaries)")
            if self.n_heads * self.head_dim % 16:
                bad("head_dim", "times n_heads must be a multiple of 16 with FP8")
            object.__setattr__(self, "precision", recipe)


def head_loss(cfg: LlamaConfig, y, w_lm, ss, targets, ignore_index: int, reduction: str, gamma):
    """The cross-entropy of the final norm + LM head: ``coda.lm_head_ce_train`` /
    ``coda.lm_head_ce``, or with the recipe's ``lm_head_fp8`` the FP8 training op
    (``ops.lm_head_ce_fp8``, evaluation still bf16)."""
    recipe = cfg.precision
    if recipe != "bf16" and recipe.lm_head_fp8:
        return cross_entropy_fp8(y, w_lm, ss, cfg.norm_eps, targets, ignore_index, reduction, gamma,
                                 recipe.grad_format == "e5m2", recipe.pow2_scales)
    return cross_entropy(y, w_lm, ss, cfg.norm_eps, targets, ignore_index, reduction, gamma=gamma)


def embedding_norm_stats(x: torch.Tensor) -> torch.Tensor:
    """(M, 1) fp32 sums of squares of the rows of x (M, d): the norm statistics of the embedding
    output, which no GEMM produces. One torch reduction: the rows' fp32 2-norms, the 16-bit values
    widened as they are read (no fp32 copy of x: torch's ``x.float().square().sum(-1)`` took three
    passes, 0.23 ms at 16384 x 2048 on the H200), then squared (M floats; within 2 ulp of the
    direct sum). Like every ss it carries no gradient: the first block's backward returns the
    norm's gradient through x itself."""
    return torch.linalg.vector_norm(x.detach(), dim=-1, keepdim=True, dtype=torch.float32).square_()


def _weight(*shape, device, dtype, std=0.02):
    return nn.Parameter(torch.randn(*shape, device=device, dtype=torch.float32).mul_(std).to(dtype))


def _norm(d, device, dtype):
    return nn.Parameter(torch.ones(d, device=device, dtype=dtype))


def block_forward(c: LlamaConfig, x, ss, positions, inv_freq, weights, q_norm=None, k_norm=None):
    """One decoder layer on the two sublayer ops: x (B, S, d) bf16 and its partials ss,
    positions (B*S,) int32 (per token: packed sequences restart them), inv_freq (hd/2,) fp32.
    ``weights(i)``: sublayer i's (w_in, w_out, quantized), 0 the attention (w_qkv, w_o), 1 the MLP
    (w_gu, w_down), in the CODA layouts with the RMSNorm weight folded into w_in; ``quantized``
    for FP8 the two weights' [q, scales, qt] (each None: the op quantizes it), else None. Each
    sublayer asks for its weights just before it runs: the MLP's fold then launches behind the
    attention's GEMMs, and a step's first GEMM waits on the host for one fold instead of two.
    Returns the next residual stream (B, S, d) and its partials."""
    b, s, d = x.shape
    w_qkv, w_o, quantized = weights(0)
    args = (x.contiguous(), ss, w_qkv, w_o, positions, inv_freq, c.norm_eps, c.n_heads, c.n_kv_heads,
            c.head_dim, q_norm, k_norm, c.qk_norm_eps)
    if c.precision == "bf16":
        y1, ss1 = attention_block(*args)[:2]
        w_gu, w_down, _ = weights(1)
        y2, ss2, _ = mlp_block(y1.view(b * s, d), ss1, w_gu, w_down, c.norm_eps)
    else:  # the projections' GEMMs in FP8; the attention core and the LM head stay bf16
        e5m2, pow2 = c.precision.grad_format == "e5m2", c.precision.pow2_scales
        row, fast = c.precision.scaling == "row", c.precision.fast_accum
        qkv_q, o_q = _quantized_pair(quantized)
        y1, ss1 = attention_block_fp8(*args, e5m2, pow2, *qkv_q, *o_q, row_scaling=row, fast_accum=fast)[:2]
        w_gu, w_down, quantized = weights(1)
        gu_q, down_q = _quantized_pair(quantized)
        y2, ss2 = mlp_block_fp8(y1.view(b * s, d), ss1, w_gu, w_down, c.norm_eps, e5m2, pow2, *gu_q, *down_q,
                                row_scaling=row, fast_accum=fast)[:2]
    return y2.view(b, s, d), ss2


def _quantized_pair(quantized):
    return tuple(q or [None] * 3 for q in (quantized or (None, None)))


def row_positions(positions: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """Per-token positions (B*S,): positions shared by every sequence (S,) repeated, or the
    positions as given when they already have one per token (the two agree at B = 1)."""
    return positions if positions.dim() == 1 and positions.shape[0] == batch * seq else positions.repeat(batch)


class CodaLlamaBlock(nn.Module):
    """A pre-norm Llama decoder layer (GQA attention, SwiGLU MLP, optional QK-norm).

    Parameters: attn_norm (d), wqkv ((H + 2 Hkv) hd, d), wo (d, H hd), ffn_norm (d),
    w_gu (2f, d) interleaved, w_down (d, f), and with ``cfg.qk_norm`` q_norm, k_norm (hd,)
    (adjacent-pair order, like the Q/K rows).
    """

    def __init__(self, cfg: LlamaConfig, device=None, dtype=torch.bfloat16, cache_folds: bool = False):
        super().__init__()
        self.cfg = cfg
        d, hd, f = cfg.dim, cfg.head_dim, cfg.ffn_dim
        kw = dict(device=device, dtype=dtype)
        self.attn_norm = _norm(d, **kw)
        self.wqkv = _weight((cfg.n_heads + 2 * cfg.n_kv_heads) * hd, d, **kw)
        self.wo = _weight(d, cfg.n_heads * hd, **kw)
        self.ffn_norm = _norm(d, **kw)
        self.w_gu = _weight(2 * f, d, **kw)
        self.w_down = _weight(d, f, **kw)
        self.q_norm = _norm(hd, **kw) if cfg.qk_norm else None
        self.k_norm = _norm(hd, **kw) if cfg.qk_norm else None
        self._folds = (FoldCache(cache_folds), FoldCache(cache_folds))  # W_qkv * attn_norm, W_gu * ffn_norm
        # FP8: W_qkv', W_o, W_gu', W_down quantized once per version (with the folds)
        self._quants = tuple(WeightQuantCache(cache_folds) for _ in range(4))

    def clear_folds(self):
        """Drop cached gamma folds and FP8 weights (``cache_folds``): needed after writes the
        version counter does not see, such as ``p.data.copy_(...)``."""
        for cache in self._folds + self._quants:
            cache.clear()

    def forward(self, x: torch.Tensor, ss: torch.Tensor, positions: torch.Tensor,
                inv_freq: torch.Tensor):
        """x: (B, S, d) bf16 residual stream; ss: (B*S, T) fp32 its norm-stat partials;
        positions: (S,) int32, or (B*S,) one per token; inv_freq: (hd/2,) fp32 rotary
        frequencies (angle = position * inv_freq). Returns the next residual stream (B, S, d)
        and its partials."""
        check_layer_inputs(ss, inv_freq)
        return block_forward(self.cfg, x, ss, row_positions(positions, *x.shape[:2]), inv_freq,
                             self.sublayer_weights, self.q_norm, self.k_norm)

    def sublayer_weights(self, i: int):
        """(w_in, w_out, quantized) of sublayer i (0 attention, 1 MLP) as :func:`block_forward`
        takes them: w_in with its RMSNorm weight folded in; for FP8 the cached quantizations."""
        w_in = self._folds[i](*((self.wqkv, self.attn_norm), (self.w_gu, self.ffn_norm))[i])
        w_out = (self.wo, self.w_down)[i]
        if self.cfg.precision == "bf16":
            return w_in, w_out, None
        pow2, row = self.cfg.precision.pow2_scales, self.cfg.precision.scaling == "row"
        return w_in, w_out, tuple(cache(w, pow2, row) for cache, w in zip(self._quants[2 * i:2 * i + 2], (w_in, w_out)))

    def load_hf(self, p: dict, rope: str = "rotate_half"):
        """Copy in one layer's HF tensors (names relative to the layer)."""
        c = self.cfg
        with torch.no_grad():
            for name, t in block_from_hf(p, c.n_heads, c.n_kv_heads, c.head_dim, rope).items():
                getattr(self, name).copy_(t)

    def hf_state_dict(self, rope: str = "rotate_half") -> dict:
        c = self.cfg
        params = {n: t.detach() for n, t in self.named_parameters()}
        return block_to_hf(params, c.n_heads, c.n_kv_heads, c.head_dim, rope)


def rows_to_multiple_of_8(w: torch.Tensor) -> torch.Tensor:
    """The LM head with zero rows up to a multiple of 8: the logits' rows must start on 16-byte
    boundaries (TMA), so a ragged vocabulary (e.g. 32003 or 50257) computes padded logits and
    slices them."""
    pad = -w.shape[0] % 8
    return torch.nn.functional.pad(w, (0, 0, 0, pad)) if pad else w


class CodaLlamaHead(nn.Module):
    """Final RMSNorm + LM head: the loss through ``coda.lm_head_ce`` (logits never stored), or
    the logits through ``coda.norm_proj``. Parameters: norm (d), weight (V, d)."""

    def __init__(self, cfg: LlamaConfig, device=None, dtype=torch.bfloat16, cache_folds: bool = False):
        super().__init__()
        self.cfg = cfg
        self.norm = _norm(cfg.dim, device, dtype)
        self.weight = _weight(cfg.vocab_size, cfg.dim, device=device, dtype=dtype)
        self._fold = FoldCache(cache_folds)

    def clear_folds(self):
        self._fold.clear()

    def forward(self, y, ss, targets, ignore_index: int = -100, reduction: str = "mean"):
        """y: (..., d) bf16, ss: its (M, T) partials, targets: (...) int. Returns the loss."""
        return head_loss(self.cfg, y.reshape(-1, self.cfg.dim), self.weight, ss, targets.reshape(-1),
                         ignore_index, reduction, self.norm)

    def logits(self, y, ss):
        v = self.cfg.vocab_size
        w = rows_to_multiple_of_8(self._fold(self.weight, self.norm))
        out = norm_proj(y.reshape(-1, self.cfg.dim), w, ss, self.cfg.norm_eps)[:, :v]
        return out.view(*y.shape[:-1], v)


class CodaLlama(nn.Module):
    """Embedding, ``n_layers`` :class:`CodaLlamaBlock`, :class:`CodaLlamaHead`."""

    def __init__(self, cfg: LlamaConfig, device=None, dtype=torch.bfloat16, cache_folds: bool = False,
                 precision: Union[str, Fp8Recipe, None] = None):
        """``cache_folds``: fold each RMSNorm weight into its consumer's weight once per version of
        the weights instead of every forward (``coda_cute.nn.fold``). ``precision``: overrides
        ``cfg.precision`` ("bf16", "fp8" or an :class:`~coda_cute.precision.Fp8Recipe`)."""
        super().__init__()
        if precision is not None:
            cfg = dataclasses.replace(cfg, precision=precision)
        self.cfg, self.cache_folds = cfg, cache_folds
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, device=device, dtype=dtype)
        self.layers = nn.ModuleList(CodaLlamaBlock(cfg, device, dtype, cache_folds)
                                    for _ in range(cfg.n_layers))
        self.head = CodaLlamaHead(cfg, device, dtype, cache_folds)
        self.register_buffer("rope_inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, device),
                             persistent=False)

    def clear_folds(self):
        """Drop every cached gamma fold (see ``cache_folds``)."""
        for layer in self.layers:
            layer.clear_folds()
        self.head.clear_folds()

    def _fold_caches(self):
        for layer in self.layers:
            yield from layer._folds + layer._quants
        yield self.head._fold

    def _follow_fsdp(self):
        """Under FSDP2 every all-gather rewrites the unsharded weights without bumping their version
        counters (``coda_cute.nn.fsdp``): a cached fold would go stale, so fold every forward."""
        caching = self.cache_folds and not under_fsdp(self)
        for cache in self._fold_caches():
            if cache.enabled and not caching:
                cache.clear()
            cache.enabled = caching

    @with_deferred_checks
    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None,
                ignore_index: int = -100, reduction: str = "mean"):
        """tokens: (B, S). With targets (B, S): the cross-entropy loss; without: logits (B, S, V).
        The ids and targets are checked on the GPU and read back once, at the end
        (``ops.checks.deferred_checks``)."""
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or 0 in tokens.shape:
            raise ValueError(f"CodaLlama: tokens must be a (B, S) tensor, neither of them 0, got "
                             f"{tuple(getattr(tokens, 'shape', ())) or type(tokens).__name__}")
        if targets is not None and tuple(targets.shape) != tuple(tokens.shape):  # one per token
            raise ValueError(f"CodaLlama: targets must have the tokens' shape {tuple(tokens.shape)}, "
                             f"got {tuple(targets.shape)}")
        b, s = tokens.shape
        if self.cache_folds:
            self._follow_fsdp()
        x = embedding(self.embed.weight, tokens)
        ss = embedding_norm_stats(x.reshape(b * s, -1))
        # per token, made once per forward rather than by every layer
        positions = torch.arange(s, device=tokens.device, dtype=torch.int32).repeat(b)
        for layer in self.layers:
            x, ss = layer(x, ss, positions, self.rope_inv_freq)
        if targets is None:
            return self.head.logits(x, ss)
        return self.head(x, ss, targets, ignore_index, reduction)

    @classmethod
    def from_hf(cls, cfg: LlamaConfig, state_dict: dict, rope: str = "rotate_half", device=None,
                dtype=torch.bfloat16, cache_folds: bool = False) -> "CodaLlama":
        """Build from an HF ``LlamaForCausalLM`` state dict ("model.embed_tokens.weight",
        "model.layers.{i}.…", "model.norm.weight", "lm_head.weight"; a missing lm_head means
        tied embeddings, copied here - the two are trained separately afterwards)."""
        sd = state_dict
        check_hf_keys(cfg, sd)
        model = cls(cfg, device, dtype, cache_folds)
        with torch.no_grad():
            model.embed.weight.copy_(sd["model.embed_tokens.weight"])
            model.head.norm.copy_(sd["model.norm.weight"])
            model.head.weight.copy_(sd.get("lm_head.weight", sd["model.embed_tokens.weight"]))
        for i, layer in enumerate(model.layers):
            prefix = f"model.layers.{i}."
            layer.load_hf({k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}, rope)
        return model

    def hf_state_dict(self, rope: str = "rotate_half") -> dict:
        """The parameters as an HF ``LlamaForCausalLM`` state dict (gate/up separate)."""
        sd = {"model.embed_tokens.weight": self.embed.weight.detach(),
              "model.norm.weight": self.head.norm.detach(),
              "lm_head.weight": self.head.weight.detach()}
        for i, layer in enumerate(self.layers):
            sd.update({f"model.layers.{i}.{k}": v for k, v in layer.hf_state_dict(rope).items()})
        return sd
