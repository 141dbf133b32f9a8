"""CPU (CI) compile tests of the CODA block ops' kernels.

Each op's epilogue tree is compiled for sm_90a with the config the heuristic picks for its
Llama-3-8B shape (16384 tokens, bf16, x @ W^T), then checked: WGMMA and TMA in the PTX, a TMA
store exactly when the tree stores a tile, and no register spills (the QK-norm tree used to
spill: its segment reduction shared ``acc * r`` with the main pass, see ``segment_reduce``).
"""

import pytest

from coda_cute.artifacts import scan_ptx
from coda_cute.compiler import KernelSpec, compile_gemm
from coda_cute.epilogue.runner import choose_config
from coda_cute.ops import coda_block as CB
from coda_cute.ops import lm_head_ce as LM

M, D, F, H, HKV, HD, V = 16384, 4096, 14336, 32, 8, 128, 128256
SMS = 132  # H100 SXM / H200

# op -> (tree, (N, K) of its GEMM)
TREES = {
    "residual_gemm_norm_stats": (CB.residual_norm_stats_tree, (D, F)),
    "norm_swiglu": (CB.norm_swiglu_tree, (2 * F, D)),
    "norm_rope_qkv": (lambda: CB.norm_rope_qkv_tree((H + HKV) * HD, HD, False), ((H + 2 * HKV) * HD, D)),
    "norm_rope_qkv_qk_norm": (lambda: CB.norm_rope_qkv_tree((H + HKV) * HD, HD, True), ((H + 2 * HKV) * HD, D)),
    "norm_proj": (CB.norm_proj_tree, (D, D)),
    "lm_head_ce": (LM.lm_head_ce_tree, (V, D)),
}


@pytest.mark.parametrize("op", list(TREES))
def test_block_op_kernel_compiles_without_spills(op):
    make, (n, k) = TREES[op]
    tree = make()
    cfg = choose_config(tree, M, n, k, 1, False, False, SMS)
    kernel = compile_gemm(KernelSpec.of("bfloat16", "bfloat16", "k", "k", cfg, tree), keep_artifacts=True)
    census = scan_ptx(kernel.ptx)
    assert census.target == "sm_90a"
    assert census.wgmma and all(w.endswith(".f32.bf16.bf16") for w in census.wgmma), census.wgmma
    assert census.tma_loads >= 2
    assert (census.tma_stores > 0) == any(o.kind == "store" for o in tree.outputs)
    stats = kernel.stats
    assert stats["spill_stores"] == 0 and stats["spill_loads"] == 0, (cfg, stats)
