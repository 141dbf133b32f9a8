"""Run every backward kernel once on small ragged shapes, for compute-sanitizer:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --report-api-errors no \
        python3 scripts/sanitize_backward.py

(without the caching allocator every tensor is an allocation of its own, so an access just past
one is reported instead of landing in the same cached segment). ``--rope`` runs the RoPE
backward's launches alone, for ``--tool racecheck`` and ``--tool synccheck`` (its QK-norm kernel
reuses its stages' shared memory for the heads' dw sums at the end).

The SwiGLU-backward and RMSNorm-backward GEMMs, the RoPE backward (with and without QK-norm, and
two staged tunings of the QK-norm kernel and its unstaged path),
the LM head's training chunk (target logits, the exp-form logits GEMM, its row step, the dgrad
and its row finish, the wgrads, the deferred last-chunk wgrad; several chunks, a vocabulary that
is no multiple of 8), the loss-only op's recomputing backward (its dlogits tree and dgrad, several
chunks), the gradient times dloss (``coda.scale``, also on
its own at 333 x 40), the token embedding's backward (fp32, d 40, a table of 77 rows with a padding
row; and the model's own, bf16), and the two sublayer ops forward and backward.
"""

import sys

import torch

from coda_cute import reference as R
from coda_cute.elementwise import rope_backward_kernel
from coda_cute.ops import lm_head_ce as LH
from coda_cute.ops.attention import attention_backward, attention_forward, qkv_heads


def rand(*shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def rope_kernels(b, s, h, hkv):
    """The RoPE backward's launches (``--rope``: these alone, for racecheck and synccheck)."""
    for hd, qk in ((64, False), (128, True)):
        n = (h + 2 * hkv) * hd
        q, k, v = qkv_heads(rand(b * s, n), b, h, hkv, hd)
        o, lse = attention_forward(q, k, v)
        dq, dk, dv = attention_backward(rand(b, h, s, hd), q, k, v, o, lse)
        pos = torch.arange(s, device="cuda", dtype=torch.int32).repeat(b)
        extra = (rand(b * s, n), 1 + rand(hd, scale=0.1), 1 + rand(hd, scale=0.1), 1e-6) if qk else ()
        torch.ops.coda.rope_backward(dq, dk, dv, rand(b * s, n), torch.rand(b * s, device="cuda") + 0.5, pos,
                                     R.rope_inv_freq(hd, 10000.0, "cuda"), *extra)
    # the QK-norm kernel's tunings (two staged, one unstaged) in their own 32 / 8-head
    # layouts, on 700 sequences of 3 rows (~16 rows per CTA: several steps each, past the
    # prologue): the row cursor crosses batches inside a stage and passes the CTA's end
    bq, sq, hq, hkvq = 700, 3, 32, 8
    qn, kn = (1 + rand(64, scale=0.1)).float(), (1 + rand(64, scale=0.1)).float()
    n = (hq + 2 * hkvq) * 64
    for tuning in ((("stage_rows", 4),), (("min_vpt", 2), ("stage_rows", 2)), (("stages", 0),)):
        dq, dk, dv = rand(bq, hq, sq, 64), rand(bq, hkvq, sq, 64), rand(bq, hkvq, sq, 64)
        rope_backward_kernel(dq, dk, dv, rand(bq * sq, n), torch.rand(bq * sq, device="cuda") + 0.5,
                             torch.arange(sq, device="cuda", dtype=torch.int32).repeat(bq),
                             R.rope_inv_freq(64, 10000.0, "cuda"), rand(bq * sq, n), qn, kn, 1e-6, tuning)


def main(rope_only: bool = False):
    torch.manual_seed(0)
    b, s, h, hkv = 3, 111, 4, 2
    rope_kernels(b, s, h, hkv)
    if rope_only:
        torch.cuda.synchronize()
        print("sanitize_backward: the RoPE backward's kernels ran")
        return
    m, d, f, eps = 333, 256, 384, 1e-5
    y = rand(m, d)
    ss = R.norm_stats_partials_ref(y, 128)
    torch.ops.coda.swiglu_backward(rand(m, d), rand(d, f, scale=0.05), rand(m, 2 * f), ss, eps)
    torch.ops.coda.norm_backward(rand(m, 2 * f), rand(2 * f, d, scale=0.05), y, ss, rand(m, 3, dtype=torch.float32), eps, rand(m, d))
    v_ = 1003
    LH.CHUNK_BYTES = 128 * 2 * 1008  # 128-row chunks: three of them, dW accumulated in bf16
    w = rand(v_, d, scale=d ** -0.5).requires_grad_()
    yy = y.clone().requires_grad_()
    t = torch.randint(0, v_, (m,), device="cuda")
    t[::7] = -100
    LH.cross_entropy(yy, w, ss, eps, t, gamma=1 + rand(d, scale=0.1)).backward()
    # the loss-only op's recomputing backward (reduction "none", a gradient on LSE too)
    yy.grad = w.grad = None
    loss, lse = torch.ops.coda.lm_head_ce(yy, w, ss, eps, t, -100, "none", 1 + rand(d, scale=0.1))
    (loss.sum() + 0.1 * lse.sum()).backward()
    torch.ops.coda.scale(rand(m, 40), torch.rand((), device="cuda"))
    torch.ops.coda.embedding_backward(rand(b * s, 40, dtype=torch.float32),
                                      torch.randint(0, 77, (b * s,), device="cuda"), 77, 5)
    from coda_cute.nn import CodaLlama, LlamaConfig

    cfg = LlamaConfig(d, 1, h, hkv, f, v_, head_dim=64, qk_norm=True)
    model = CodaLlama(cfg, device="cuda")
    tokens = torch.randint(0, v_, (b, s), device="cuda")
    model(tokens, torch.roll(tokens, -1, 1)).backward()
    torch.cuda.synchronize()
    print("sanitize_backward: every backward kernel ran")


if __name__ == "__main__":
    main(rope_only="--rope" in sys.argv[1:])
