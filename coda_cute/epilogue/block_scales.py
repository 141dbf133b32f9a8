"""Block scales on their way into the block-scaled FP8 kernel (``kernels.sm90.block_scales``):
the rules a launch checks on them and the layouts its TMA reads, for the epilogue runner."""

from __future__ import annotations

import torch

from .. import dispatch
from ..precision import BLOCK, block_scales_m_major

#: How B is scaled in a block-scaled GEMM: 128 x 128 blocks (a weight), or 1 x 128 along K (wgrad)
B_BLOCKS = ("128x128", "1x128")


def pad4(x: int) -> int:
    return -(-x // 4) * 4


def scale_view(t: torch.Tensor, rows_major: bool) -> torch.Tensor:
    """A 2-D scale tensor in a :func:`tma_block_scales` layout as the kernel's (rows, k-blocks,
    L = 1), with the strides its signature declares (stride 1 along the contiguous mode, the
    others multiples of 4) also where a mode of one element leaves a stride free."""
    inner = 0 if rows_major else 1
    strides = [1, 1]
    strides[1 - inner] = t.stride(1 - inner) if t.shape[1 - inner] > 1 else pad4(t.shape[inner])
    return t.as_strided((*t.shape, 1), (*strides, pad4(t.shape[0] * t.shape[1])))


def tma_block_scales(t: torch.Tensor, rows_major: bool) -> torch.Tensor:
    """Block scales (rows, k-blocks) in a layout the block-scaled kernel's TMA reads
    (``kernels.sm90.block_scales``). ``rows_major`` (1 x 128 scales: A's, and B's in the
    weight-gradient form): stride 1 along the rows; else (the weight's 128 x 128 scales) stride
    1 along the k-blocks; the other stride a multiple of 4 (16 bytes) and the data 16-byte
    aligned. Our quantizers' layouts pass as they are (``precision.block_scales_m_major``; the
    weight's contiguous (N / 128, K / 128) where K / 128 is a multiple of 4); others are copied
    (a few hundred KB at most)."""
    inner = 0 if rows_major else 1
    if ((t.stride(inner) == 1 or t.shape[inner] == 1) and t.data_ptr() % 16 == 0
            and (t.shape[1 - inner] == 1 or t.stride(1 - inner) % 4 == 0)):
        return t
    rows, kb = t.shape
    if rows_major:
        return block_scales_m_major(rows, kb * BLOCK, t.device).copy_(t)
    return torch.empty((rows, pad4(kb)), dtype=torch.float32, device=t.device)[:, :kb].copy_(t)


def check_block_scales(a, b, scales, op, b_rows: bool = False):
    """The block scales of FP8 ``a`` (M, K) and ``b`` (K, N): (a's (M, ceil(K / 128)), b's
    (ceil(N / 128), ceil(K / 128)), ``b_rows``: (N, ceil(K / 128))) fp32 on the operands' device,
    any strides."""
    if not (isinstance(scales, tuple) and len(scales) == 2):
        raise ValueError(f"{op}: block_scales must be (a_scales, b_scales)")
    (m, k), n = a.shape, b.shape[1]
    kb = -(-k // BLOCK)
    for name, t, rows in (("a_scales", scales[0], m), ("b_scales", scales[1], n if b_rows else -(-n // BLOCK))):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 2:
            raise ValueError(f"{op}: {name} must be a 2-D float32 tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)}")
        if tuple(t.shape) != (rows, kb):
            raise ValueError(f"{op}: {name} must be {(rows, kb)} (one scale per "
                             f"{'row and 128 columns' if name == 'a_scales' or b_rows else '128 x 128 block'}), "
                             f"got {tuple(t.shape)}")
        if t.device != a.device:
            raise ValueError(f"{op}: {name} is on {t.device}, the operands on {a.device}")


def check_block_scaled(a, b, scales, fp8: bool, fast_accum: bool, config, op, b_rows: bool = False):
    """:func:`check_block_scales`, and what the launch needs besides: 2-D FP8 operands, two-level
    accumulation and a config the kernel can scale."""
    if not fp8 or a.dim() != 2:
        raise ValueError(f"{op}: block scales apply to 2-D FP8 operands, got {a.dim()}-D {a.dtype}")
    if fast_accum:
        raise ValueError(f"{op}: block scales are promoted per k-block: use_fast_accum must be False")
    # stages, rasterization, the cluster (multicast A/B; each CTA loads its own scales), how the
    # consumers wait and tail_carry (a rule of its own: ``runner._check_tail_carry``) do not touch the
    # scales: an explicit config may set any of them
    def free(c):
        return c.with_(stages=0, raster_group=8, cluster_m=1, cluster_n=1, poll_full=False, tail_carry=False)
    if config is not None and free(config) not in [free(c) for c in dispatch.block_scaled_config_space()]:
        raise ValueError(f"{op}: config {config.name} cannot apply block scales (it needs two-level "
                         "accumulation, tile_k 128, tile_n dividing 128 and no split_tail)")
    check_block_scales(a, b, scales, op, b_rows)
