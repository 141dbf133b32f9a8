"""Small coda.gemm cases for compute-sanitizer (memcheck / racecheck / synccheck).

    compute-sanitizer --tool memcheck --report-api-errors no python3 scripts/sanitize_gemm.py

Covers both schedules, a 2-CTA cluster, FP8 two-level and fast accumulation, a batched call, a
split-K call, a split tail (on 132 SMs: 2 tail tiles in 2 K slices and their fixup), ragged edges (M, N, K not
tile multiples) and both block-scaled forms (``coda.gemm_blockwise``; the weight-gradient form's
column scales read in place from their padded layout and from a copy), each checked against the
fp32 reference so a sanitizer-clean run is also a correct one; and the epilogue's quantize sink.
"""

from __future__ import annotations

import sys

import torch

from coda_cute import reference as R
from coda_cute.kernels.common.config import GemmConfig
from coda_cute.ops.gemm import gemm_impl
from coda_cute.precision import block_scales_m_major
from coda_cute.reference import gemm_ref

CASES16 = [
    GemmConfig(128, 256, 64, "cooperative", 1, 1),
    GemmConfig(128, 256, 64, "cooperative", 2, 1),
    GemmConfig(128, 128, 64, "pingpong", 1, 2),
    GemmConfig(64, 64, 64, "pingpong", 1, 1),
]
CASES8 = [
    GemmConfig(128, 192, 128, "cooperative", 2, 1),
    GemmConfig(128, 128, 128, "cooperative", 1, 1),  # two-level promotion in pairs (K = 272: a pair, a single)
    GemmConfig(128, 128, 128, "pingpong", 1, 1, fp8_fast_accum=True),
]


def rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def block_scaled() -> float:
    """The block-scaled forms on ragged shapes: (1000 x 776) @ 1040, a weight block and k-block cut
    short; the wgrad form at N = 200 (its last tile's columns past N read the padding)."""
    a_q, sa = R.quantize_blocks_ref(torch.randn(1000, 1040, device="cuda"), (1, 128))
    w_q, sw = R.quantize_blocks_ref(torch.randn(776, 1040, device="cuda"), (128, 128))
    out = torch.ops.coda.gemm_blockwise(a_q, sa.t().contiguous().t(), w_q, sw)
    worst = rel(out, R.block_scaled_gemm_ref(a_q, sa, (1, 128), w_q, sw, (128, 128), torch.float64))
    b_q, sb = R.quantize_blocks_ref(torch.randn(200, 1040, device="cuda"), (1, 128))
    for cols in (sb, block_scales_m_major(200, 1040, "cuda").copy_(sb)):  # copied / in place
        out = torch.ops.coda.gemm_blockwise(a_q, sa, b_q, cols, torch.float32, "1x128")
        worst = max(worst, rel(out, R.block_scaled_gemm_ref(a_q, sa, (1, 128), b_q, sb, (1, 128), torch.float64)))
    return worst


def quantized() -> float:
    """The epilogue's quantize sink on ragged tiles (1000 x 1040: a last row tile and a partial
    last block), bf16 128 x 128 and 128 x 256 and block-scaled FP8: the dequantized values against
    the reference quantization of the value the same launch stores in fp32 (128 x 256, which has
    no room for that store: of torch's product)."""
    from coda_cute import epilogue as E

    tree = E.Epilogue(E.store(E.acc(), "x", "float32"), E.quantize(E.acc(), "x_q"))
    alone = E.Epilogue(E.quantize(E.acc(), "x_q"))  # 128 x 256: an fp32 store beside it leaves 1 stage
    both = E.Epilogue(E.store(E.acc(), "x", "float32"), E.quantize(E.acc(), "x_q"),
                      E.quantize(E.acc(), "x_t", transposed=True))
    a = torch.randn(1000, 264, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(264, 1040, device="cuda", dtype=torch.bfloat16)
    x = gemm_ref(a, b, round_output=False)
    runs = [(E.run(tree, a, b, {}, config=GemmConfig(128, 128, 64, "cooperative", 1, 1)), None),
            (E.run(alone, a, b, {}, config=GemmConfig(128, 256, 64, "cooperative", 1, 1)), x)]
    a_q, sa = R.quantize_blocks_ref(torch.randn(1000, 272, device="cuda"), (1, 128))  # a partial k-block
    w_q, sw = R.quantize_blocks_ref(torch.randn(1040, 272, device="cuda"), (128, 128))
    runs.append((E.run(tree, a_q, w_q.t(), {}, block_scales=(sa, sw)), None))
    # both layouts in one pass (M = 1008: a partial last row block of the transposed blocks)
    out = E.run(both, torch.randn(1008, 264, device="cuda", dtype=torch.bfloat16), b, {})
    q, s = out["x_t"]
    want_q, want_s = R.quantize_blocks_ref(out["x"].t(), (1, 128))
    worst = rel(q.float() * s.repeat_interleave(128, 1)[:, :1008],
                want_q.float() * want_s.repeat_interleave(128, 1)[:, :1008])
    runs.append((out, None))
    for out, value in runs:
        q, s = out["x_q"]
        want_q, want_s = R.quantize_blocks_ref(out["x"] if value is None else value, (1, 128))
        worst = max(worst, rel(q.float() * s.repeat_interleave(128, 1)[:, :1040],
                               want_q.float() * want_s.repeat_interleave(128, 1)[:, :1040]))
    return worst


def main() -> int:
    torch.manual_seed(0)
    worst = 0.0
    for cfg in CASES16:
        a = torch.randn(300, 200, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(264, 200, device="cuda", dtype=torch.bfloat16).t()
        worst = max(worst, rel(gemm_impl(a, b, config=cfg), gemm_ref(a, b, round_output=False)))
        a3 = torch.randn(2, 130, 72, device="cuda", dtype=torch.bfloat16)
        b3 = torch.randn(2, 72, 40, device="cuda", dtype=torch.bfloat16)
        worst = max(worst, rel(gemm_impl(a3, b3, config=cfg), gemm_ref(a3, b3, round_output=False)))
    for cfg in CASES8:
        a = torch.randn(257, 272, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(136, 272, device="cuda").to(torch.float8_e4m3fn).t()
        sa = torch.rand(257, 1, device="cuda") + 0.5
        sb = torch.rand(1, 136, device="cuda") + 0.5
        out = gemm_impl(a, b, sa, sb, use_fast_accum=cfg.fp8_fast_accum, config=cfg)
        worst = max(worst, rel(out, gemm_ref(a, b, sa, sb, round_output=False)))
    # split tail: 4 x 17 = 68 cluster tiles on 66 slots (132 SMs), the last 2 in 2 K slices each
    a = torch.randn(1000, 2608, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(2136, 2608, device="cuda").to(torch.float8_e4m3fn).t()
    sa, sb = torch.rand(1000, 1, device="cuda") + 0.5, torch.rand(1, 2136, device="cuda") + 0.5
    out = gemm_impl(a, b, sa, sb, config=GemmConfig(128, 128, 128, "cooperative", 2, 1, split_tail=True))
    worst = max(worst, rel(out, gemm_ref(a, b, sa, sb, round_output=False)))
    # split-K: the K slices are strided views of one operand, launched as a batch
    a = torch.randn(72, 384, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(200, 384, device="cuda", dtype=torch.bfloat16).t()
    worst = max(worst, rel(gemm_impl(a, b, split_k=3), gemm_ref(a, b, round_output=False)))
    worst = max(worst, block_scaled())
    worst = max(worst, quantized())
    torch.cuda.synchronize()
    print(f"sanitize_gemm: {len(CASES16) * 2 + len(CASES8) + 9} launches, worst relative error {worst:.2e}")
    return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
