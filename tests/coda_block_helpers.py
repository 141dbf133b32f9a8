"""Random standard-layout Llama weights and the fused-vs-plain block comparison (CPU and GPU tests)."""

import torch

import coda_cute
from coda_cute import reference as R
from coda_cute.nn import CodaLlamaBlock, LlamaConfig, embedding_norm_stats
from coda_cute.nn import convert as C
from helpers import rel_err


def rand(*shape, dtype=torch.bfloat16, scale=1.0, device="cpu"):
    return (torch.randn(*shape, dtype=torch.float64, device=device) * scale).to(dtype)


def hf_block(cfg: LlamaConfig, dtype=torch.bfloat16, device="cpu"):
    """One random HF-layout layer (rotate-half Q/K, separate gate/up), names relative to the layer."""
    d, hd, f, h, hkv = cfg.dim, cfg.head_dim, cfg.ffn_dim, cfg.n_heads, cfg.n_kv_heads

    def w(rows, cols):
        return rand(rows, cols, dtype=dtype, scale=cols ** -0.5, device=device)

    def norm(n):
        return 1 + rand(n, dtype=dtype, scale=0.1, device=device)

    p = {"input_layernorm.weight": norm(d), "self_attn.q_proj.weight": w(h * hd, d),
         "self_attn.k_proj.weight": w(hkv * hd, d), "self_attn.v_proj.weight": w(hkv * hd, d),
         "self_attn.o_proj.weight": w(d, h * hd), "post_attention_layernorm.weight": norm(d),
         "mlp.gate_proj.weight": w(f, d), "mlp.up_proj.weight": w(f, d), "mlp.down_proj.weight": w(d, f)}
    if cfg.qk_norm:
        p["self_attn.q_norm.weight"] = norm(hd)
        p["self_attn.k_norm.weight"] = norm(hd)
    return p


def block_errors(cfg: LlamaConfig, bsz: int, seq: int, ref_dtype, device="cpu"):
    """Relative errors of (output, dx, every HF weight gradient) against the plain block in
    ``ref_dtype``, for the fused CodaLlamaBlock and for the plain bf16 block, on the same bf16
    weights and input: {"fused": {...}, "unfused": {...}}. Fused gradients are converted back to
    the HF layout (the conversions are permutations, so they commute with the gradient)."""
    p = hf_block(cfg, device=device)
    inv_freq = R.rope_inv_freq(cfg.head_dim, cfg.rope_theta, device)
    x = rand(bsz, seq, cfg.dim, device=device)
    pos = torch.arange(seq, dtype=torch.int32, device=device)
    cot = rand(bsz, seq, cfg.dim, dtype=torch.float32, device=device)
    eps, qk_eps = cfg.norm_eps, cfg.qk_norm_eps

    def plain(dtype):
        pp = {k: v.to(dtype).requires_grad_() for k, v in p.items()}
        xx = x.to(dtype).requires_grad_()
        out = R.llama_block_ref(xx, pp, pos, inv_freq, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, eps, qk_eps)
        (out.float() * cot).sum().backward()
        return out.detach(), xx.grad, {k: v.grad for k, v in pp.items()}

    def fused():
        blk = CodaLlamaBlock(cfg, device=device)
        blk.load_hf(p)
        xx = x.clone().requires_grad_()
        with coda_cute.reference_on_cpu():
            out, _ = blk(xx, embedding_norm_stats(xx.reshape(-1, cfg.dim)), pos, inv_freq)
            (out.float() * cot).sum().backward()
        grads = C.block_to_hf({n: t.grad for n, t in blk.named_parameters()}, cfg.n_heads,
                              cfg.n_kv_heads, cfg.head_dim)
        return out.detach(), xx.grad, grads

    ref = plain(ref_dtype)
    errs = {}
    for name, (out, dx, grads) in (("fused", fused()), ("unfused", plain(torch.bfloat16))):
        e = {"out": rel_err(out, ref[0]), "dx": rel_err(dx, ref[1])}
        e.update({k: rel_err(g, ref[2][k]) for k, g in grads.items()})
        errs[name] = e
    return errs


def print_ratios(errs):
    for key in errs["fused"]:
        f, u = errs["fused"][key], errs["unfused"][key]
        print(f"{key:34s} fused {f:.2e}  unfused bf16 {u:.2e}  ratio {f / u:.2f}")


def plain_model_loss(cfg: LlamaConfig, sd: dict, tokens, targets, dtype):
    """The HF-convention Llama (embedding, blocks, final norm + LM head + CE) in ``dtype``."""
    inv_freq = R.rope_inv_freq(cfg.head_dim, cfg.rope_theta, tokens.device)
    x = sd["model.embed_tokens.weight"].to(dtype)[tokens]
    pos = torch.arange(tokens.shape[1], device=tokens.device)
    for i in range(cfg.n_layers):
        pre = f"model.layers.{i}."
        p = {k[len(pre):]: v.to(dtype) for k, v in sd.items() if k.startswith(pre)}
        x = R.llama_block_ref(x, p, pos, inv_freq, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                              cfg.norm_eps, cfg.qk_norm_eps)
    return R.llama_head_ce_ref(x, sd["model.norm.weight"].to(dtype), sd["lm_head.weight"].to(dtype),
                               targets, cfg.norm_eps)


def model_state_dict(cfg: LlamaConfig, device="cpu"):
    """A random HF LlamaForCausalLM state dict."""
    d, v = cfg.dim, cfg.vocab_size
    sd = {"model.embed_tokens.weight": rand(v, d, device=device),
          "model.norm.weight": 1 + rand(d, scale=0.1, device=device),
          "lm_head.weight": rand(v, d, scale=d ** -0.5, device=device)}
    for i in range(cfg.n_layers):
        sd.update({f"model.layers.{i}.{k}": t for k, t in hf_block(cfg, device=device).items()})
    return sd


def coda_grads_as_hf(model) -> dict:
    """A CodaLlama's parameter gradients under their HF state-dict names and layouts (the
    conversions are permutations, so they commute with the gradient)."""
    c = model.cfg
    out = {"model.embed_tokens.weight": model.embed.weight.grad,
           "model.norm.weight": model.head.norm.grad, "lm_head.weight": model.head.weight.grad}
    for i, layer in enumerate(model.layers):
        grads = C.block_to_hf({n: t.grad for n, t in layer.named_parameters()}, c.n_heads,
                              c.n_kv_heads, c.head_dim)
        out.update({f"model.layers.{i}.{k}": g for k, g in grads.items()})
    return out
