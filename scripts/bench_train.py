"""Training-step benchmark: CodaLlama against HF Llama (eager, torch.compile, Liger-Kernel) on one GPU.

One training step = forward + backward of the loss, no optimizer (gradients set to None at the
start of every step), of a random-init ``--layers``-layer Llama (default 2) with the Llama-3 vocab
(128256), on ``--batch`` x ``--seq`` (default 4 x 4096) random token ids (fixed seed), labels =
the input ids (HF convention: the model shifts them). Configs (``--configs``):

  1b: hidden 2048, 32 heads / 8 KV heads, head_dim 64,  ffn 8192,  rope_theta 500000, rms eps 1e-5
  8b: hidden 4096, 32 heads / 8 KV heads, head_dim 128, ffn 14336, rope_theta 500000, rms eps 1e-5

The HF model is a transformers ``LlamaForCausalLM`` (tie_word_embeddings=False, sdpa attention,
use_cache=False) built in bf16 on the GPU with its rotary ``inv_freq`` kept in fp32 (checked);
every variant runs on the same weights:

  coda        coda_cute.nn.CodaLlama.from_hf(...)(tokens, targets).backward(), eager; targets are
              the labels shifted (targets[:, :-1] = labels[:, 1:], targets[:, -1] = -100), so it
              computes the same loss as HF (checked at start-up: both printed, ~1e-2 relative)
  hf_eager    LlamaForCausalLM(input_ids, labels=labels).loss.backward()
  hf_compile  torch.compile(hf_model) (default mode) of the same; compiled before timing
  liger       a second HF instance (a deep copy, same weights) patched by Liger-Kernel's
              apply_liger_kernel_to_llama(model=...), default options (RMSNorm, SwiGLU, RoPE, fused
              linear cross-entropy); only where ``import liger_kernel`` works, else null. Liger
              also patches module globals of transformers' modeling_llama (RoPE, the RMSNorm and
              MLP classes); the script undoes that right away and re-applies it only around the
              Liger model's own forward, so the HF baselines stay unpatched.

Timing: every variant's step is a function; all of a config's steps are timed IN TURNS in one
``coda_cute.sol.timing.interleaved_medians`` call (CUDA events around each step, L2 flushed
before each, a fresh random order per round, warm-up calls and a settle period first): the
medians share the GPU's clock drift. A variant that fails (build, first step, timing) prints its
error and is recorded as null; the others go on.

The shadow: what the step would cost if it were only its GEMMs on cuBLAS plus attention. Each
GEMM of the step with its training layout (torch.mm, bf16), M = batch x seq tokens:
  per layer, for W in qkv (fused, (H + 2 Hkv) hd x d), o (d x H hd), gate/up (fused, 2f x d),
  down (d x f):  fwd x @ W.T (M x out x in), dgrad dY @ W (M x in x out), wgrad dY.T @ X
  (out x in x M); and the LM head's three (V x d): 12 x layers + 3 GEMMs. Plus attention forward
  + backward (F.scaled_dot_product_attention, causal, enable_gqa, on (B, H, S, hd) q and
  (B, Hkv, S, hd) k, v; torch.autograd.grad through it) once per layer. Each distinct piece is
  timed in turns with the others; shadow_ms = sum of count x piece + layers x attention, and the
  step's target is coda / shadow <= 1. "chain" times the same sequence back to back as one launch.

Block: CodaLlamaBlock (layer 0 of the CODA model) forward + backward on a random residual stream
x (B, S, d) bf16 (grad w.r.t. x, its norm stats ss = embedding_norm_stats(x) as a leaf that needs
grad, and the block's weights; loss = (out.float() * cotangent).sum()), timed in the shadow's
group: block_ratio = (block - attention) / (that layer's 12 cuBLAS GEMMs).

Peak memory: per variant, max_memory_allocated during one step (after reset_peak_memory_stats,
every model's gradients None), minus what was allocated before the step (the resident models'
parameters, the inputs) and minus the bytes of the variant's own gradients: activations and
temporaries beyond parameters + gradients, in GiB.

Profile: torch.profiler (CUDA activity) over one CODA step: kernel time grouped by kernel name,
top 15 with their share of all GPU time and their call counts.

JSON (``--json``): a list, one record per config: config, tokens, batch, seq, layers;
{coda,hf_eager,hf_compile,liger}_ms and _peak_gib (null when not run or failed); ratio_to_coda
(baseline ms / coda ms); losses, loss_rel_diff, loss_ok; shadow_ms, shadow_gemm_ms,
shadow_attention_ms, shadow_chain_ms, coda_over_shadow, gemm_flops, shadow_pieces (name, layout,
m, n, k, count, ms, tflops), attention_ms (one layer); block_ms, block_gemm_ms, block_ratio;
profile (total_ms, kernels, rows: name, ms, share, calls); errors (what failed, why); env.

Running it on the GPU machine (torch >= 2.11 with CUDA, triton, transformers, coda_cute importable):
Liger-Kernel 0.8.x is a pure-Python wheel. Fetch it on a machine with PyPI access into .wheels/
(git-ignored: never committed, so copy that folder along with the tree), install it there into a
folder of its own and put that on PYTHONPATH:

    .venv/bin/pip download --no-deps liger-kernel==0.8.5 -d .wheels/       # with PyPI access, once
    pip install --no-deps --target /tmp/liger .wheels/liger_kernel-*.whl     # on the GPU machine
    PYTHONPATH=/tmp/liger:$PYTHONPATH python scripts/bench_train.py --json bench_train.json

Without it the liger variant is recorded as null (``--no-liger`` skips it outright). The first
steps compile (torch.compile of the HF model, coda_cute's kernels on first use): a few minutes per
config cold; ``--configs 1b`` and ``--configs 8b`` may run as separate commands, and ``--json`` is
rewritten after every config.

    python scripts/bench_train.py [--configs 1b 8b] [--rounds 20] [--warmup 3] [--layers 2]
        [--batch 4 --seq 4096] [--no-compile] [--no-liger] [--json out.json]
    python scripts/bench_train.py --smoke     # every variant once on a tiny config on CPU
                                              # (CODA through coda_cute.reference_on_cpu())

``--smoke`` runs no timing worth the name (one wall-clock call per function), no compile, no Liger
and no memory numbers: it only checks that every code path of the benchmark executes.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import json
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from rich.text import Text

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

try:
    from coda_cute.sol.timing import interleaved_medians
except Exception:  # noqa: BLE001  (timing.py needs only torch: load it from the tree)
    _spec = importlib.util.spec_from_file_location(
        "_coda_timing", os.path.join(os.path.dirname(__file__), "..", "coda_cute", "sol", "timing.py"))
    _timing = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_timing)
    interleaved_medians = _timing.interleaved_medians

BF16 = torch.bfloat16
GIB = 2 ** 30
IGNORE = -100
SEED = 0
#: warm-up of each timing group, ms: run its functions in turns this long first, so that timing
#: starts at the clocks a sustained sequence settles at (scripts/bench_block.py)
SETTLE_MS = 2000
SHADOW_KEYS = ("shadow_ms", "shadow_gemm_ms", "shadow_attention_ms", "shadow_chain_ms", "attention_ms",
               "coda_over_shadow", "block_ms", "block_gemm_ms", "block_ratio", "gemm_flops")
TOP_KERNELS = 15
VARIANTS = ("coda", "hf_eager", "hf_compile", "liger")
BASELINES = VARIANTS[1:]

out_console = Console(width=180)
err_console = Console(stderr=True, width=180)


def say(msg: str):
    err_console.print(msg)


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


# -- the shadow's GEMMs ---------------------------------------------------------------------------
LAYOUTS = {"fwd": "x @ W.T", "dgrad": "dY @ W", "wgrad": "dY.T @ X"}


@dataclass(frozen=True)
class Gemm:
    """One GEMM of the training step, (m, n, k) as torch.mm's (m, k) @ (k, n); ``count`` times per step."""
    linear: str
    kind: str  # fwd / dgrad / wgrad
    m: int
    n: int
    k: int
    count: int

    @property
    def name(self) -> str:
        return f"{self.linear}.{self.kind}"

    @property
    def layout(self) -> str:
        return LAYOUTS[self.kind]

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    @property
    def per_layer(self) -> bool:
        return self.linear != "lm_head"


def linears(c: dict) -> list:
    """(name, out_features, in_features, count per step) of every weight, as the CODA model holds
    them (fused QKV, fused gate/up)."""
    h, hkv, hd, d, f = c["n_heads"], c["n_kv_heads"], c["head_dim"], c["dim"], c["ffn_dim"]
    n = c["n_layers"]
    return [("qkv", (h + 2 * hkv) * hd, d, n), ("o", d, h * hd, n), ("gate_up", 2 * f, d, n),
            ("down", d, f, n), ("lm_head", c["vocab_size"], d, 1)]


def step_gemms(c: dict, tokens: int) -> list:
    """The GEMMs of one training step of the model ``c`` (coda LlamaConfig fields) on ``tokens``
    rows: per weight W (out, in): fwd x @ W.T (tokens x out x in), dgrad dY @ W (tokens x in x
    out), wgrad dY.T @ X (out x in x tokens)."""
    out = []
    for name, n_out, n_in, count in linears(c):
        out += [Gemm(name, "fwd", tokens, n_out, n_in, count), Gemm(name, "dgrad", tokens, n_in, n_out, count),
                Gemm(name, "wgrad", n_out, n_in, tokens, count)]
    return out


def gemm_fns(gemms: list, device, dtype=BF16) -> dict:
    """name -> a function running that GEMM with torch.mm in its training layout, on random
    operands shared by the three GEMMs of one weight: X (M, in), W (out, in), dY (M, out)."""
    ops = {}
    fns = {}
    for g in gemms:
        if g.linear not in ops:
            fwd = next(x for x in gemms if x.linear == g.linear and x.kind == "fwd")
            m, n_out, n_in = fwd.m, fwd.n, fwd.k
            ops[g.linear] = (torch.randn(m, n_in, device=device, dtype=dtype),
                             torch.randn(n_out, n_in, device=device, dtype=dtype) * n_in ** -0.5,
                             torch.randn(m, n_out, device=device, dtype=dtype))
        x, w, dy = ops[g.linear]
        fns[g.name] = {"fwd": lambda x=x, w=w: torch.mm(x, w.t()),
                       "dgrad": lambda dy=dy, w=w: torch.mm(dy, w),
                       "wgrad": lambda dy=dy, x=x: torch.mm(dy.t(), x)}[g.kind]
    return fns


def attention_fn(c: dict, batch: int, seq: int, device, dtype=BF16) -> Callable:
    """SDPA forward + backward (causal, GQA) on (B, H, S, hd) q and (B, Hkv, S, hd) k, v."""
    hd = c["head_dim"]
    q = torch.randn(batch, c["n_heads"], seq, hd, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, c["n_kv_heads"], seq, hd, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, c["n_kv_heads"], seq, hd, device=device, dtype=dtype, requires_grad=True)
    do = torch.randn(batch, c["n_heads"], seq, hd, device=device, dtype=dtype)

    def attention():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(o, (q, k, v), do)
    return attention


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


# -- measurement helpers ----------------------------------------------------------------------------
def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:500]


def report_failure(what: str, exc: BaseException, errors: dict, key: str):
    errors[key] = _err(exc)
    say(f"[bold red]{what} failed[/]: {errors[key]}")
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    err_console.print("".join(tb[-12:]).rstrip(), style="dim", markup=False, highlight=False)


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_fns(fns: dict, rounds: int, warmup: int, smoke: bool, errors: dict, group: str) -> dict:
    """Medians in ms of ``fns`` timed in turns (interleaved_medians); on failure, each fn alone, so
    that one broken fn costs only its own number. ``smoke``: one wall-clock call each (CPU)."""
    if not fns:
        return {}
    if smoke:
        out = {}
        for name, fn in fns.items():
            try:
                t0 = time.perf_counter()
                fn()
                out[name] = (time.perf_counter() - t0) * 1e3
            except Exception as exc:  # noqa: BLE001
                report_failure(f"{group}: {name}", exc, errors, name)
                out[name] = None
        return out
    try:
        return interleaved_medians(fns, rounds=rounds, warmup=warmup, settle_ms=SETTLE_MS)
    except Exception as exc:  # noqa: BLE001
        report_failure(f"{group}: timing in turns", exc, errors, f"{group}_timing")
    out = {}
    for name, fn in fns.items():
        try:
            out[name] = interleaved_medians({name: fn}, rounds=rounds, warmup=warmup)[name]
        except Exception as exc:  # noqa: BLE001
            report_failure(f"{group}: {name} timed alone", exc, errors, name)
            out[name] = None
    return out


def peak_gib(step: Callable, own_params: list, all_params: list, device) -> Optional[float]:
    """Peak bytes allocated during one ``step`` beyond what was allocated before it and beyond its
    own gradients, GiB (None off CUDA)."""
    if torch.device(device).type != "cuda":
        return None
    zero_grads(all_params)
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    grads = sum(p.numel() * p.element_size() for p in own_params)
    zero_grads(all_params)
    return (peak - base - grads) / GIB


def kernel_rows(events, device_type: str = "cuda", top: int = TOP_KERNELS) -> dict:
    """Group profiler events by name: {"total_ms", "rows": [{"name", "ms", "share", "calls"}]},
    top ``top`` by time. ``device_type`` "cuda": the GPU's events (kernels, memcpy, memset) with
    their device durations; "cpu": the ops' self CPU time (the --smoke run)."""
    from torch.autograd import DeviceType

    want = DeviceType.CUDA if device_type == "cuda" else DeviceType.CPU
    groups: dict = {}
    for e in events:
        if e.device_type != want:
            continue
        us = e.time_range.elapsed_us() if device_type == "cuda" else e.self_cpu_time_total
        t, n = groups.get(e.name, (0.0, 0))
        groups[e.name] = (t + us, n + 1)
    total = sum(t for t, _ in groups.values())
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return {"total_ms": total / 1e3, "kernels": len(groups),
            "rows": [{"name": name, "ms": t / 1e3, "share": t / total if total else 0.0, "calls": n}
                     for name, (t, n) in rows]}


def profile_step(step: Callable, device) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        step()
        sync(device)
    out = kernel_rows(prof.events(), "cuda" if cuda else "cpu")
    if cuda and not out["rows"]:  # a profiler build that needs the CPU activity to keep kernels
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            sync(device)
        out = kernel_rows(prof.events(), "cuda")
    return out


def _free(device):
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def run_shadow(rec: dict, c: dict, coda, args, device, errors: dict):
    """Time the shadow pieces, the chain of all of them and the CODA block in turns; fill ``rec``."""
    b, s, layers, smoke = args.batch, args.seq, args.layers, args.smoke
    say("timing the shadow (cuBLAS GEMMs, SDPA) and the CODA block " + ("once each (smoke)" if smoke else "in turns"))
    gemms = step_gemms(c, b * s)
    rec["gemm_flops"] = sum(g.flops * g.count for g in gemms)
    rec["shadow_pieces"] = [dict(name=g.name, linear=g.linear, kind=g.kind, layout=g.layout, m=g.m, n=g.n,
                                 k=g.k, count=g.count, ms=None, tflops=None) for g in gemms]
    fns = gemm_fns(gemms, device)
    attention = attention_fn(c, b, s, device)
    fns["attention"] = attention

    def chain():
        for g in gemms:
            for _ in range(g.count):
                fns[g.name]()
        for _ in range(layers):
            attention()
    fns["chain"] = chain
    if coda is not None:
        try:
            fns["block"] = block_fn(coda, b, s, device)
        except Exception as exc:  # noqa: BLE001
            report_failure("coda block: setup", exc, errors, "block")
    st = time_fns(fns, args.rounds, args.warmup, smoke, errors, "shadow")
    fns.clear()
    for p, g in zip(rec["shadow_pieces"], gemms):
        p["ms"] = st.get(g.name)
        p["tflops"] = g.flops / p["ms"] / 1e9 if p["ms"] else None
    rec["attention_ms"] = st.get("attention")
    rec["shadow_chain_ms"] = st.get("chain")
    rec["block_ms"] = st.get("block")
    if any(st.get(g.name) is None for g in gemms) or rec["attention_ms"] is None:
        return
    rec["shadow_gemm_ms"] = sum(st[g.name] * g.count for g in gemms)
    rec["shadow_attention_ms"] = layers * rec["attention_ms"]
    rec["shadow_ms"] = rec["shadow_gemm_ms"] + rec["shadow_attention_ms"]
    if rec["coda_ms"]:
        rec["coda_over_shadow"] = rec["coda_ms"] / rec["shadow_ms"]
    rec["block_gemm_ms"] = sum(st[g.name] for g in gemms if g.per_layer)
    if rec["block_ms"] is not None:
        rec["block_ratio"] = (rec["block_ms"] - rec["attention_ms"]) / rec["block_gemm_ms"]


# -- one config ---------------------------------------------------------------------------------------
def run_config(spec: ModelSpec, args, device) -> dict:
    smoke = args.smoke
    b, s, layers = args.batch, args.seq, args.layers
    m = b * s
    errors: dict = {}
    rec = {"config": spec.name, "mode": "smoke" if smoke else "gpu", "tokens": m, "batch": b, "seq": s,
           "layers": layers, "spec": asdict(spec), "rounds": args.rounds, "warmup": args.warmup,
           **{f"{v}_ms": None for v in VARIANTS}, **{f"{v}_peak_gib": None for v in VARIANTS},
           "losses": {}, "loss_rel_diff": None, "loss_ok": None, "ratio_to_coda": {}, "profile": None,
           **{k: None for k in SHADOW_KEYS}, "shadow_pieces": [], "errors": errors}
    say(f"[bold]== {spec.name}[/]: {layers} layers, {b} x {s} tokens, dim {spec.dim}, "
        f"{spec.n_heads}/{spec.n_kv_heads} heads x {spec.head_dim}, ffn {spec.ffn_dim}, vocab {spec.vocab_size}")

    hf_cfg = hf_config(spec, layers, s)
    c = coda_kwargs_from_hf(hf_cfg)
    rec["coda_config"] = c
    say("building the HF model")
    hf_model = build_hf_model(hf_cfg, device)
    rec["hf_attn_implementation"] = getattr(hf_model.config, "_attn_implementation", None)
    rec["hf_inv_freq_dtype"] = str(hf_model.model.rotary_emb.inv_freq.dtype)
    say(f"  attention {rec['hf_attn_implementation']}, rotary inv_freq {rec['hf_inv_freq_dtype']}, "
        f"{sum(p.numel() for p in hf_model.parameters()) / 1e9:.3f} B parameters")
    ids = random_tokens(b, s, spec.vocab_size).to(device)
    labels = ids
    targets = shift_labels(labels)
    hf_params = list(hf_model.parameters())
    rec["param_bytes"] = sum(p.numel() * p.element_size() for p in hf_params)

    steps: dict = {}    # name -> (step fn, its params)
    models: dict = {"hf": hf_model}
    steps["hf_eager"] = (hf_step(hf_model, ids, labels, hf_params), hf_params)

    say("building the CODA model")
    try:
        if CODA_IMPORT_ERROR:
            raise RuntimeError(CODA_IMPORT_ERROR)
        coda = CodaLlama.from_hf(CodaLlamaConfig(**c), hf_model.state_dict(), device=device)
        coda.train()
        models["coda"] = coda
        coda_params = list(coda.parameters())
        steps["coda"] = (coda_step(coda, ids, targets, coda_params), coda_params)
    except Exception as exc:  # noqa: BLE001
        report_failure("coda: build", exc, errors, "coda")

    if not args.no_compile and not smoke:
        say("torch.compile(hf_model)")
        try:
            compiled = torch.compile(hf_model)
            models["hf_compile"] = compiled
            steps["hf_compile"] = (hf_step(compiled, ids, labels, hf_params), hf_params)
        except Exception as exc:  # noqa: BLE001
            report_failure("hf_compile: torch.compile", exc, errors, "hf_compile")

    rec["liger_version"] = None
    if not args.no_liger and not smoke:
        rec["liger_version"] = liger_version()
        if rec["liger_version"] is None:
            say("[yellow]liger: `import liger_kernel` failed; recorded as null[/] (see the docstring for "
                "PYTHONPATH=/tmp/liger)")
            errors["liger"] = "liger_kernel not importable"
        else:
            say(f"liger-kernel {rec['liger_version']}: patching a copy of the HF model")
            try:
                liger_model, patches = build_liger_model(hf_model)
                liger_params = list(liger_model.parameters())
                models["liger"] = liger_model
                rec["liger_patches"] = sorted({f"{getattr(o, '__name__', o)}.{n}" for o, n, _ in patches})
                steps["liger"] = (hf_step(liger_model, ids, labels, liger_params, patches), liger_params)
            except Exception as exc:  # noqa: BLE001
                report_failure("liger: patch", exc, errors, "liger")

    # First steps: compile / JIT warm-up, and the losses for the start-up check.
    losses = {}
    for name in VARIANTS:
        if name not in steps:
            continue
        say(f"first steps: {name}")
        try:
            t0 = time.perf_counter()
            losses[name] = float(steps[name][0]())
            if not smoke:
                steps[name][0]()
            sync(device)
            say(f"  {name}: loss {losses[name]:.5f} ({time.perf_counter() - t0:.1f} s)")
        except Exception as exc:  # noqa: BLE001
            report_failure(f"{name}: first step", exc, errors, name)
            del steps[name]
    all_params = [p for _, ps in steps.values() for p in ps]
    zero_grads(all_params)
    rec["losses"] = losses
    rec["loss_rel_diff"] = None
    rec["loss_ok"] = None
    if "coda" in losses and "hf_eager" in losses:
        rel = abs(losses["coda"] - losses["hf_eager"]) / abs(losses["hf_eager"])
        rec["loss_rel_diff"], rec["loss_ok"] = rel, bool(rel <= 1e-2)
        style = "green" if rec["loss_ok"] else "bold red"
        say(f"[{style}]loss check: coda {losses['coda']:.5f}, hf_eager {losses['hf_eager']:.5f}, "
            f"relative difference {rel:.2e} ({'ok' if rec['loss_ok'] else 'MISMATCH, want <= 1e-2'})[/]")
        if not math.isfinite(losses["coda"]):
            say("[bold red]coda loss is not finite[/]")
    for name in BASELINES:
        if name in losses and name != "hf_eager" and "hf_eager" in losses:
            say(f"  {name} loss {losses[name]:.5f} (hf_eager {losses['hf_eager']:.5f})")

    # Peak memory, one step each.
    for name, (step, params) in list(steps.items()):
        try:
            rec[f"{name}_peak_gib"] = peak_gib(step, params, all_params, device)
        except Exception as exc:  # noqa: BLE001
            report_failure(f"{name}: peak memory step", exc, errors, f"{name}_peak")

    # The steps, in turns.
    say(f"timing {', '.join(steps)} " + ("once each (smoke)" if smoke else f"in turns ({args.rounds} rounds)"))
    times = time_fns({n: st for n, (st, _) in steps.items()}, args.rounds, args.warmup, smoke, errors, "step")
    for name in VARIANTS:
        if times.get(name) is not None:
            rec[f"{name}_ms"] = times[name]
    coda_ms = rec["coda_ms"]
    rec["ratio_to_coda"] = {n: (rec[f"{n}_ms"] / coda_ms if coda_ms and rec[f"{n}_ms"] else None)
                            for n in BASELINES}
    zero_grads(all_params)

    # Per-kernel profile of the CODA step.
    rec["profile"] = None
    if "coda" in steps:
        say("profiling one coda step")
        try:
            rec["profile"] = profile_step(steps["coda"][0], device)
        except Exception as exc:  # noqa: BLE001
            report_failure("coda: profile", exc, errors, "coda_profile")
        zero_grads(all_params)

    # Shadow pieces and the block, in turns among themselves; the variants' models stay resident
    # (weights only, gradients None).
    del steps
    _free(device)
    try:
        run_shadow(rec, c, models.get("coda"), args, device, errors)
    except Exception as exc:  # noqa: BLE001
        report_failure("shadow", exc, errors, "shadow")
    _free(device)

    del models, hf_model, hf_params, all_params
    if not smoke and not args.no_compile:
        torch._dynamo.reset()
    _free(device)
    return rec


# -- report -----------------------------------------------------------------------------------------------
def _ms(v):
    return "-" if v is None else f"{v:.3f}"


def _gib(v):
    return "-" if v is None else f"{v:.2f}"


def report(rec: dict, console: Console = out_console):
    smoke = rec["mode"] == "smoke"
    note = " (SMOKE: one CPU wall-clock call each, not a benchmark)" if smoke else ""
    t = Table(title=f"{rec['config']}: training step (fwd + bwd), {rec['layers']} layers, "
                    f"{rec['batch']} x {rec['seq']} tokens{note}")
    for col in ("variant", "step ms", "variant / coda", "variant / shadow", "peak GiB (beyond params + grads)",
                "loss", "status"):
        t.add_column(col, justify="left" if col in ("variant", "status") else "right")
    coda_ms, shadow_ms = rec["coda_ms"], rec["shadow_ms"]
    for v in VARIANTS:
        ms = rec[f"{v}_ms"]
        loss = rec["losses"].get(v)
        status = rec["errors"].get(v, "ok" if ms is not None else "not run")
        if v == "coda" and rec.get("loss_ok") is False:
            status = f"LOSS MISMATCH ({rec['loss_rel_diff']:.1e})"
        t.add_row(v, _ms(ms), f"{ms / coda_ms:.2f}x" if ms and coda_ms else "-",
                  f"{ms / shadow_ms:.2f}x" if ms and shadow_ms else "-", _gib(rec[f"{v}_peak_gib"]),
                  "-" if loss is None else f"{loss:.4f}", Text(status[:80]))
    console.print(t)

    if not rec["shadow_pieces"]:
        console.print("shadow: -")
    pieces = Table(title=f"{rec['config']}: the shadow (cuBLAS torch.mm, bf16; SDPA fwd + bwd)")
    for col in ("piece", "layout", "M x N x K", "count", "ms", "TFLOP/s"):
        pieces.add_column(col, justify="left" if col in ("piece", "layout", "M x N x K") else "right")
    for p in rec["shadow_pieces"]:
        pieces.add_row(p["name"], p["layout"], f"{p['m']}x{p['n']}x{p['k']}", str(p["count"]), _ms(p["ms"]),
                       "-" if p["tflops"] is None else f"{p['tflops']:.4g}")
    pieces.add_row("attention", "sdpa causal gqa", f"B{rec['batch']} S{rec['seq']}", str(rec["layers"]),
                   _ms(rec["attention_ms"]), "")
    if rec["shadow_pieces"]:
        console.print(pieces)
    line = (f"shadow {_ms(rec['shadow_ms'])} ms = GEMMs {_ms(rec['shadow_gemm_ms'])} + attention "
            f"{_ms(rec['shadow_attention_ms'])} (back to back as one launch: {_ms(rec['shadow_chain_ms'])} ms); "
            f"coda / shadow = {'-' if rec['coda_over_shadow'] is None else format(rec['coda_over_shadow'], '.3f')}")
    console.print(line)
    if rec["block_ratio"] is not None:
        console.print(f"block (layer 0) fwd + bwd {rec['block_ms']:.3f} ms, attention {rec['attention_ms']:.3f} "
                      f"ms, its 12 GEMMs on cuBLAS {rec['block_gemm_ms']:.3f} ms: (block - attention) / GEMMs "
                      f"= {rec['block_ratio']:.3f}")
    else:
        console.print("block ratio: -")
    prof = rec.get("profile")
    if prof:
        what = "CPU self time per op (smoke)" if smoke else "GPU time per kernel"
        pt = Table(title=f"{rec['config']}: coda step, {what}: top {len(prof['rows'])} of {prof['kernels']}, "
                         f"total {prof['total_ms']:.3f} ms")
        pt.add_column("kernel", overflow="fold")
        for col in ("ms", "share", "calls"):
            pt.add_column(col, justify="right")
        for r in prof["rows"]:
            name = r["name"] if len(r["name"]) <= 120 else r["name"][:117] + "..."
            pt.add_row(Text(name), f"{r['ms']:.3f}", f"{100 * r['share']:.1f}%", str(r["calls"]))
        console.print(pt)
    if rec["errors"]:
        console.print(f"[red]{rec['config']} errors:[/]")
        for k, v in rec["errors"].items():
            console.print(f"  {k}: {v}", markup=False)


# -- main -------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", choices=sorted(SPECS), default=["1b", "8b"])
    ap.add_argument("--rounds", type=int, default=20, help="timing rounds (each runs every variant once)")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up calls of each function before timing")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=None, help="default 4 (--smoke: 2)")
    ap.add_argument("--seq", type=int, default=None, help="default 4096 (--smoke: 32)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--no-liger", action="store_true", help="skip the Liger-Kernel baseline")
    ap.add_argument("--json", help="write the records (one per config) to this path")
    ap.add_argument("--smoke", action="store_true",
                    help="run every variant once on a tiny config on CPU (no timing, compile, Liger)")
    args = ap.parse_args(argv)
    if args.batch is None:
        args.batch = SMOKE_BATCH if args.smoke else 4
    if args.seq is None:
        args.seq = SMOKE_SEQ if args.smoke else 4096
    for flag in ("rounds", "layers", "batch", "seq"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be >= 1")
    if args.smoke:
        args.configs = [SMOKE_SPEC.name]
    return args


def environment(device) -> dict:
    env = {"torch": torch.__version__, "device": str(device)}
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        env["transformers"] = None
    if torch.device(device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    env["coda_cute_import_error"] = CODA_IMPORT_ERROR
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        device = "cpu"
        if coda_cute is None:
            say(f"[bold red]{CODA_IMPORT_ERROR}[/]")
        ctx = coda_cute.reference_on_cpu() if coda_cute is not None else contextlib.nullcontext()
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_train needs a CUDA GPU (or --smoke)")
        device = "cuda"
        ctx = contextlib.nullcontext()
    env = environment(device)
    say(f"torch {env['torch']}, transformers {env['transformers']}, {env.get('gpu', device)}")
    if CODA_IMPORT_ERROR:
        say(f"[bold red]{CODA_IMPORT_ERROR}[/]: the coda variant is recorded as null")
    specs = [SMOKE_SPEC] if args.smoke else [SPECS[name] for name in args.configs]
    records = []
    with ctx:
        for spec in specs:
            try:
                rec = run_config(spec, args, device)
            except Exception as exc:  # noqa: BLE001
                errs: dict = {}
                report_failure(f"config {spec.name}", exc, errs, "config")
                rec = {"config": spec.name, "tokens": args.batch * args.seq, "errors": errs,
                       **{f"{v}_ms": None for v in VARIANTS}, "shadow_ms": None}
                _free(device)
            rec["env"] = env
            records.append(rec)
            _free(device)
            if args.json:  # after every config: a later failure keeps the earlier records
                with open(args.json, "w") as f:
                    json.dump(records, f, indent=1)
            if "losses" in rec:
                report(rec)
    if args.json:
        say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
