"""Run every FP8 kernel once on small ragged shapes, for compute-sanitizer:

    compute-sanitizer --tool memcheck --report-api-errors no python3 scripts/sanitize_fp8.py

The quantizers (1 x 128 rows, the weight fold + 128 x 128 with its transpose, both 1 x 128
quantizations of a gradient in one pass, the row-wise recipe's whole rows and columns, E4M3 and
E5M2, fp32 and power-of-two scales), the block-scaled forward GEMM and the block recipe's MLP
with each tile's last promotion group carried into the next (``runner.TAIL_CARRY`` on, where
K allows: ``GemmConfig.tail_carry``), and a CodaLlama in FP8 forward and backward in each recipe:
the attention and MLP sublayers' block-scaled GEMMs (forward, dgrad, the weight-gradient form)
and the FP8 LM head, then their row-wise GEMMs (the scales on the accumulator), on a token count
that is no multiple of the tiles (the row-wise gradients' FP8 transposes and folded columns
among them), once with fast accumulation in every GEMM.
"""

import torch

from coda_cute.elementwise_fp8 import (quantize_dual, quantize_grad_rows, quantize_rows, quantize_rowwise,
                                       quantize_weight, transpose_fp8)


def main():
    torch.manual_seed(0)
    x = torch.randn(333, 520, device="cuda").bfloat16()
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for pow2 in (False, True):
            quantize_rows(x, dtype, pow2=pow2)
            quantize_dual(x[:320], dtype, pow2=pow2)
            quantize_dual(x[:320], dtype, rows=False, pow2=pow2)
            quantize_rowwise(x[:320], dtype, pow2=pow2)
            quantize_rowwise(x[:320], dtype, rows=False, pow2=pow2)
            quantize_rowwise(x, dtype, cols=False, pow2=pow2)
            q, _, fold = quantize_grad_rows(x[:320, :512], dtype, pow2=pow2)
            transpose_fp8(q)
            quantize_rowwise(x[:320, :264], dtype, rows=False, pow2=pow2, fold=fold)
    for pow2 in (False, True):
        quantize_weight(torch.randn(272, 520, device="cuda"), torch.rand(520, device="cuda").bfloat16(),
                        transposed=True, pow2=pow2)
    # the block-scaled forward form with the tail carry on (runner.TAIL_CARRY) where K makes
    # whole promotion groups: the plain GEMM on cooperative 128 x 128 (1008 ragged and 1024: 8
    # k-tiles) on one tile per CTA (10 x 8) and on several (16 x 17), then the block recipe's MLP
    # forward and backward, whose gate/up, down and gate/up dgrad trees carry at 2048 tokens
    from coda_cute import reference as R
    from coda_cute.epilogue import runner
    from coda_cute.nn.llama import embedding_norm_stats

    carry, runner.TAIL_CARRY = runner.TAIL_CARRY, True
    for m, n, k in ((1200, 1000, 1008), (2000, 2104, 1024)):
        a_q, sa = R.quantize_blocks_ref(torch.randn(m, k, device="cuda"), (1, 128), torch.float8_e4m3fn)
        b_q, sb = R.quantize_blocks_ref(torch.randn(n, k, device="cuda"), (128, 128), torch.float8_e4m3fn)
        torch.ops.coda.gemm_blockwise(a_q, sa.t().contiguous().t(), b_q, sb)
    y = torch.randn(2048, 1024, device="cuda").bfloat16().requires_grad_()
    w_gu = (torch.randn(3072, 1024, device="cuda") / 32).bfloat16().requires_grad_()
    w_down = (torch.randn(1024, 1536, device="cuda") / 40).bfloat16().requires_grad_()
    torch.ops.coda.mlp_block_fp8(y, embedding_norm_stats(y.detach()), w_gu, w_down, 1e-5)[0].sum().backward()
    runner.TAIL_CARRY = carry
    from coda_cute.nn import CodaLlama, LlamaConfig
    from coda_cute.precision import Fp8Recipe

    tokens = torch.randint(0, 1008, (3, 112), device="cuda")  # 336 tokens: a multiple of 16, not of 128
    for recipe in (Fp8Recipe(lm_head_fp8=True), Fp8Recipe(scaling="row"), Fp8Recipe(scaling="row", fast_accum="all")):
        cfg = LlamaConfig(256, 1, 4, 2, 384, 1008, head_dim=64, qk_norm=True, precision=recipe)
        model = CodaLlama(cfg, device="cuda")
        model(tokens, torch.roll(tokens, -1, 1)).backward()
    torch.cuda.synchronize()
    print("sanitize_fp8: every FP8 kernel ran")


if __name__ == "__main__":
    main()
