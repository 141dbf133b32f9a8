"""GPU tests of the block-scaled FP8 GEMM kernel, launched directly and through
``coda.gemm_blockwise``: against float64 math on the dequantized operands (``reference.block_scaled_gemm_ref``), ragged M, N and K
(a partial last k-block and weight block), values over many binades so the scales differ per
block, NaN-poisoned output, cooperative and ping-pong schedules, E4M3 and E5M2 activations."""

import pytest
import torch

from coda_cute import reference as R
from coda_cute.compiler import KernelSpec, get_gemm
from coda_cute.epilogue.block_scales import scale_view, tma_block_scales
from coda_cute.kernels.common.config import GemmConfig
from coda_cute.kernels.epilogue.plain import gemm_tree
from coda_cute.precision import block_scales_m_major
from helpers import rel_err

pytestmark = pytest.mark.gpu


def spread(rows, cols):
    x = torch.randn(rows, cols, device="cuda")
    # a different magnitude per 128 x 128 region, so every block has its own scale
    mag = torch.exp2(torch.randint(-6, 6, (-(-rows // 128), -(-cols // 128)), device="cuda").float())
    return x * mag.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]


def launch(cfg, a_q, sa, b_q, sb, b_rows=False, out_dtype=torch.bfloat16):
    (m, k), n = a_q.shape, b_q.shape[0]
    spec = KernelSpec.of(str(a_q.dtype)[6:], str(b_q.dtype)[6:], "k", "k", cfg,
                         gemm_tree("none", "none", str(out_dtype)[6:]), block_scaled=True, b_rows=b_rows)
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
    # M-major activation scales, K-major weight scales (N-major 1 x 128 ones), as the kernel's TMA reads them
    scales = (scale_view(tma_block_scales(sa, True), True), scale_view(tma_block_scales(sb, b_rows), b_rows))
    get_gemm(spec).fn(a_q.as_strided((m, k, 1), (k, 1, m * k)), b_q.as_strided((n, k, 1), (k, 1, n * k)),
                      None, (out.as_strided((m, n, 1), (n, 1, m * n)),), None, None, scales)
    return out


@pytest.mark.parametrize("cfg", [GemmConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=2),
                                 GemmConfig(tile_m=128, tile_n=64, tile_k=128),
                                 GemmConfig(tile_m=64, tile_n=128, tile_k=128, schedule="pingpong"),
                                 GemmConfig(tile_m=256, tile_n=128, tile_k=128, cluster_m=2),
                                 # both operands multicast; each CTA still loads its own scales
                                 GemmConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=2, cluster_n=2),
                                 GemmConfig(tile_m=128, tile_n=128, tile_k=128, cluster_n=2),
                                 # the pick as the forward form runs it: polling its stage barriers
                                 GemmConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=2, poll_full=True)],
                         ids=["coop-128x128-c2x1", "coop-128x64", "pingpong-64x128", "coop-256x128-waves",
                              "coop-128x128-c2x2", "coop-128x128-c1x2", "coop-128x128-c2x1-poll"])
@pytest.mark.parametrize("m, n, k", [(1000, 776, 1040), (4096, 4096, 4096), (200, 136, 128)])
@pytest.mark.parametrize("a_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_block_scaled_gemm_is_the_dequantized_product(cfg, m, n, k, a_dtype):
    a_q, sa = R.quantize_blocks_ref(spread(m, k), (1, 128), a_dtype)
    b_q, sb = R.quantize_blocks_ref(spread(n, k), (128, 128), torch.float8_e4m3fn)
    out = launch(cfg, a_q, sa, b_q, sb)
    want = R.block_scaled_gemm_ref(a_q, sa, (1, 128), b_q, sb, (128, 128), out_dtype=torch.float64)
    assert not out.isnan().any()
    err = (out.double() - want).abs()
    # fp32 accumulation of exact FP8 products, promoted per 128-deep block, then one bf16 rounding
    assert bool((err <= 2.0 ** -8 * want.abs() + 1e-3 * want.abs().max()).all()), float(err.max())
    assert rel_err(out.double(), want) < 4e-3


@pytest.mark.parametrize("m, n, k", [(1000, 776, 1040), (16384, 4096, 4096)])
def test_polling_changes_no_bit(m, n, k):
    """The forward form polls its stage barriers (``dispatch.block_scaled_config_space``): how the
    consumers and the producer wait changes no arithmetic, so the output is the sleeping kernel's
    bit for bit."""
    a_q, sa = R.quantize_blocks_ref(spread(m, k), (1, 128), torch.float8_e4m3fn)
    b_q, sb = R.quantize_blocks_ref(spread(n, k), (128, 128), torch.float8_e4m3fn)
    cfg = GemmConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=2)
    polled = launch(cfg.with_(poll_full=True), a_q, sa, b_q, sb)
    assert not polled.isnan().any() and torch.equal(polled, launch(cfg, a_q, sa, b_q, sb))


@pytest.mark.parametrize("m, n, k", [(1000, 776, 1008), (4096, 4096, 4096), (2000, 1000, 512)])
@pytest.mark.parametrize("cluster", [(2, 1), (1, 2)], ids=["c2x1", "c1x2"])
def test_tail_carry_changes_no_bit(m, n, k, cluster):
    """``GemmConfig.tail_carry`` (K of whole promotion groups): each tile's last group issues the
    next tile's first k-tile instead of promoting its last three one at a time and issuing that
    k-tile alone. The promotions run in the same order, so the output is the kernel's without it
    bit for bit, and the dequantized product within the bound above (8 k-tiles with a partial
    last one and ragged M and N; several tiles per CTA at 4096 x 4096; one group per tile at
    K = 512)."""
    a_q, sa = R.quantize_blocks_ref(spread(m, k), (1, 128), torch.float8_e4m3fn)
    b_q, sb = R.quantize_blocks_ref(spread(n, k), (128, 128), torch.float8_e4m3fn)
    cfg = GemmConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=cluster[0], cluster_n=cluster[1],
                     poll_full=True)
    carried = launch(cfg.with_(tail_carry=True), a_q, sa, b_q, sb)
    assert not carried.isnan().any() and torch.equal(carried, launch(cfg, a_q, sa, b_q, sb))
    want = R.block_scaled_gemm_ref(a_q, sa, (1, 128), b_q, sb, (128, 128), out_dtype=torch.float64)
    err = (carried.double() - want).abs()
    assert bool((err <= 2.0 ** -8 * want.abs() + 1e-3 * want.abs().max()).all()), float(err.max())


@pytest.mark.parametrize("m, n, k", [(16384, 4096, 4096), (777, 1000, 1040)])
def test_op_is_the_dequantized_product(m, n, k):
    """``coda.gemm_blockwise`` (the runner's config choice, M-major activation scales)."""
    a_q, sa = R.quantize_blocks_ref(spread(m, k), (1, 128), torch.float8_e4m3fn)
    b_q, sb = R.quantize_blocks_ref(spread(n, k), (128, 128), torch.float8_e4m3fn)
    out = torch.ops.coda.gemm_blockwise(a_q, sa.t().contiguous().t(), b_q, sb)
    want = R.block_scaled_gemm_ref(a_q, sa, (1, 128), b_q, sb, (128, 128), out_dtype=torch.float64)
    assert out.dtype == torch.bfloat16 and rel_err(out.double(), want) < 4e-3


@pytest.mark.parametrize("m, n, k", [(4096, 14336, 16384), (1000, 776, 1040), (136, 200, 4112), (1536, 1024, 2000)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("a_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_wgrad_form_is_the_dequantized_product(m, n, k, out_dtype, a_dtype):
    """``b_block="1x128"``: dW (M = N_out, N = K_in) over K = the tokens, both operands scaled per
    row and 128 tokens (gradients E4M3 or E5M2), fp32 or bf16 out, every element finite and within
    the FP8 tensor cores' accumulation error of the float64 product. Their adder keeps fewer bits
    than fp32 within a 128-deep k-block (DeepSeek-V3 measured about 14), so each element is bounded
    by 2^-11 of its sum of |products| (the scale of that error, with 8x margin), plus the output's
    rounding. A wrong scale per row, column or k-block moves elements by whole binades."""
    a_q, sa = R.quantize_blocks_ref(spread(m, k), (1, 128), a_dtype)
    b_q, sb = R.quantize_blocks_ref(spread(n, k), (1, 128), torch.float8_e4m3fn)
    out = torch.ops.coda.gemm_blockwise(a_q, sa.t().contiguous().t(), b_q, sb, out_dtype, "1x128")
    want = R.block_scaled_gemm_ref(a_q, sa, (1, 128), b_q, sb, (1, 128), out_dtype=torch.float64)
    mag = R.block_scaled_gemm_ref(a_q.float().abs(), sa, (1, 128), b_q.float().abs(), sb, (1, 128),
                                  out_dtype=torch.float64)
    assert out.dtype == out_dtype and bool(out.isfinite().all())
    err = (out.double() - want).abs()
    rounding = want.abs() * (2.0 ** -8 if out_dtype == torch.bfloat16 else 2.0 ** -23)
    assert bool((err <= 2.0 ** -11 * mag + rounding).all()), float((err - rounding).div(mag).max())
    assert rel_err(out.double(), want) < (4e-3 if out_dtype == torch.bfloat16 else 5e-4)


@pytest.mark.parametrize("m, n, k", [(1000, 776, 1040), (4096, 1024, 4096)])
def test_wgrad_form_in_waves_is_the_dequantized_product(m, n, k):
    """The weight-gradient form on cooperative 256 x 128, which promotes each k-tile one 64-row
    wave at a time (``GemmConfig.promotion_waves``), launched directly: the same bound as the
    op's test above, fp32 out."""
    cfg = GemmConfig(tile_m=256, tile_n=128, tile_k=128)
    assert cfg.promotion_waves == 2
    a_q, sa = R.quantize_blocks_ref(spread(m, k), (1, 128))
    b_q, sb = R.quantize_blocks_ref(spread(n, k), (1, 128))
    out = launch(cfg, a_q, sa, b_q, sb, b_rows=True, out_dtype=torch.float32)
    want = R.block_scaled_gemm_ref(a_q, sa, (1, 128), b_q, sb, (1, 128), out_dtype=torch.float64)
    mag = R.block_scaled_gemm_ref(a_q.float().abs(), sa, (1, 128), b_q.float().abs(), sb, (1, 128),
                                  out_dtype=torch.float64)
    assert bool(out.isfinite().all())
    err = (out.double() - want).abs()
    assert bool((err <= 2.0 ** -11 * mag + want.abs() * 2.0 ** -23).all()), float(err.div(mag).max())
    assert rel_err(out.double(), want) < 5e-4


@pytest.mark.parametrize("m, n, k", [(1000, 776, 1040), (136, 200, 4112)])
def test_wgrad_form_reads_our_column_scales_in_place(m, n, k):
    """Column scales as our quantizers allocate them (``precision.block_scales_m_major``: N-major,
    padded to 128) are read in place; the padding past N, poisoned with NaN, is never read (TMA
    fills columns past N with zeros; a NaN taken would show in every column of its row); row-major
    A scales (copied by the launch)."""
    a_q, sa = R.quantize_blocks_ref(spread(m, k), (1, 128))
    b_q, sb = R.quantize_blocks_ref(spread(n, k), (1, 128))
    cols = block_scales_m_major(n, k, "cuda")
    cols.as_strided((cols.stride(1) * cols.shape[1],), (1,)).fill_(float("nan"))
    cols.copy_(sb)
    assert tma_block_scales(cols, True) is cols
    out = torch.ops.coda.gemm_blockwise(a_q, sa, b_q, cols, torch.float32, "1x128")
    want = R.block_scaled_gemm_ref(a_q, sa, (1, 128), b_q, sb, (1, 128), out_dtype=torch.float64)
    assert bool(out.isfinite().all()) and rel_err(out.double(), want) < 5e-4
