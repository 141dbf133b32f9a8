"""``torch.ops.coda.mlp_block_fp8``: ``coda.mlp_block`` with its six GEMMs in FP8, block-scaled as
in ``coda_cute.precision.Fp8Recipe`` (1 x 128 activation / gradient blocks along K, 128 x 128
weight blocks, 1 x 128 blocks along the tokens for the weight gradients), on the same epilogue
trees.

Forward (Q1: 1 x 128 blocks along the row; QW: 128 x 128 blocks; each GEMM promotes every
128-deep k-block with its activation-block x weight-block scale):

    z, h    = norm_swiglu tree on  Q1(y) @ QW(W_gu)^T            r applied in the epilogue
    y2, ss2 = residual tree on     Q1(h) @ QW(W_down)^T + y

Backward, from dy2:

    dz', h, zdz = swiglu_backward tree on  Q1(dy2) @ QW(W_down)     (QW(W)^T is QW(W^T) exactly:
    dy          = norm_backward tree on    Q1(dz') @ QW(W_gu) + dy2  the blocks are square)
    dw_down = Q1(dy2^T) @ Q1(h^T)^T,  dw_gu = Q1(dz'^T) @ Q1(y^T)^T  the wgrad form: both operands
                                                                     in 1 x 128 blocks along M

The weight gradients quantize bf16 transposes (separate passes); with a token count M that is no
multiple of 16 (the FP8 rows of a transpose must start on 16-byte boundaries) they are bf16 GEMMs.

The gradients are quantized to ``grad_dtype`` (E4M3, or E5M2 for range). The weights are
quantized once per forward and kept for the backward. The quantizations are separate
bandwidth-bound passes (``coda.quantize_fp8``) for now. Numerics: the dequantized operands'
products summed in fp32, so the error against an fp32 reference is FP8's rounding of each operand
(about 2^-4 relative per element for E4M3), not the GEMM's.
"""

from __future__ import annotations

import torch

from .. import dispatch
from .. import epilogue as E
from .autocast import bf16_under_autocast
from .checks import F32
from .eager import direct
from .gemm import gemm_op
from .gemm_blockwise import gemm_blockwise
from .mlp import check_mlp
from .quantize import quantize_fp8
from .residual import residual_norm_stats_tree
from .rmsnorm import norm_backward_tree, norm_inputs, tile_n_of
from .swiglu import norm_swiglu_tree, swiglu_backward_tree

OP = "coda.mlp_block_fp8"
GRAD_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_mlp_fp8(y, ss, w_gu, w_down, eps, grad_dtype):
    m, f = check_mlp(y, ss, w_gu, w_down, eps)
    for name, width in (("the model width d (columns of y)", y.shape[1]), ("the SwiGLU width f", f)):
        if width % 16:  # the FP8 operands' rows start on 16-byte boundaries (TMA)
            raise ValueError(f"{OP}: {name} must be a multiple of 16 for FP8 operands, got {width}")
    if grad_dtype not in GRAD_DTYPES:
        raise ValueError(f"{OP}: grad_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {grad_dtype}")
    return m, f


def _weight(w):
    """W (N, K) in FP8 128 x 128 blocks: (q, scales)."""
    return quantize_fp8(w, "128x128")


def _operand(q, s, transposed: bool = False):
    """A quantized weight (N, K) as the GEMM's K-major B: (K, N) and its (N / 128, K / 128)
    scales; ``transposed``: W^T's (the dgrad's B), the FP8 values transposed, the same scales."""
    if transposed:
        return q.t().contiguous().t(), s.t()
    return q.t(), s


def _gemm(tree, a, w_q, w_s, inputs, transposed=False, grad_dtype=torch.float8_e4m3fn):
    """``tree`` on Q1(a) @ B, B the quantized weight (or its transpose)."""
    a_q, a_s = quantize_fp8(a, "1x128", None, grad_dtype)
    b, b_s = _operand(w_q, w_s, transposed)
    return E.run(tree, a_q, b, inputs, op=OP, block_scales=(a_s, b_s))


@torch.library.custom_op("coda::mlp_block_fp8", mutates_args=())
def mlp_block_fp8(y: torch.Tensor, ss: torch.Tensor, w_gu: torch.Tensor, w_down: torch.Tensor, eps: float,
                  grad_dtype: torch.dtype = torch.float8_e4m3fn
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """y2 = y + SwiGLU(RMSNorm(y; gamma) @ W_gu.T) @ W_down.T with FP8 GEMMs (module docstring).

    Arguments as ``coda.mlp_block``'s (y (M, d) bf16, ss its norm statistics, w_gu (2f, d) bf16
    interleaved with gamma folded in, w_down (d, f) bf16), and ``grad_dtype``, the FP8 format of
    the gradients in the backward. Returns (y2, ss2, z, then the quantized weights kept for the
    backward: W_gu's values and scales, W_down's); only y2 carries a gradient."""
    if y.device.type == "cpu":
        dispatch.require_reference(OP)
    check_mlp_fp8(y, ss, w_gu, w_down, eps, grad_dtype)
    gu_q, gu_s = _weight(w_gu)
    down_q, down_s = _weight(w_down)
    out = _gemm(norm_swiglu_tree(), y, gu_q, gu_s, norm_inputs(y.shape[1], ss, eps))
    res = _gemm(residual_norm_stats_tree(), out["h"], down_q, down_s, {"residual": y})
    return res["y"], res["ss"], out["z"], gu_q, gu_s, down_q, down_s


@mlp_block_fp8.register_fake
def _fake(y, ss, w_gu, w_down, eps, grad_dtype=torch.float8_e4m3fn):
    m, f = check_mlp_fp8(y, ss, w_gu, w_down, eps, grad_dtype)
    d = y.shape[1]
    sms = dispatch.num_sms_or_default(y.device)
    t = -(-d // tile_n_of(residual_norm_stats_tree(), m, d, f, sms, y.device.type, block_scaled=True))
    fp8 = torch.float8_e4m3fn
    blocks = lambda rows, cols: y.new_empty((-(-rows // 128), -(-cols // 128)), dtype=F32)  # noqa: E731
    return (y.new_empty(y.shape), y.new_empty((m, t), dtype=F32), y.new_empty((m, 2 * f)),
            w_gu.new_empty(w_gu.shape, dtype=fp8), blocks(2 * f, d),
            w_down.new_empty(w_down.shape, dtype=fp8), blocks(d, f))


def mlp_fp8_backward(y, ss, w_gu_q, w_gu_s, w_down_q, w_down_s, eps, z, dy2, grad_dtype,
                     needs=(True, True, True)):
    """(dy, dw_gu, dw_down), the module docstring's backward (each skipped if not needed)."""
    d = y.shape[1]
    bwd = _gemm(swiglu_backward_tree(), dy2, w_down_q, w_down_s, dict(norm_inputs(d, ss, eps), z=z),
                transposed=True, grad_dtype=grad_dtype)
    dzp, h, zdz = bwd["dz"], bwd["h"], bwd["zdz"]
    dw_down = _wgrad(dy2, h, grad_dtype) if needs[2] else None
    dw_gu = _wgrad(dzp, y, grad_dtype) if needs[1] else None
    dy = None
    if needs[0]:
        inputs = dict(norm_inputs(d, ss, eps), zdz=zdz, y=y, dres=dy2)
        dy = _gemm(norm_backward_tree(True), dzp, w_gu_q, w_gu_s, inputs, transposed=True,
                   grad_dtype=grad_dtype)["dy"]
    return dy, dw_gu, dw_down


def _wgrad(dy, x, grad_dtype):
    """dy^T @ x over the tokens (M): FP8 with both operands in 1 x 128 blocks along M
    (``coda.gemm_blockwise``'s wgrad form), or bf16 where M is no multiple of 16."""
    if dy.shape[0] % 16:
        return gemm_op(dy.t(), x)
    a_q, a_s = quantize_fp8(dy.t().contiguous(), "1x128", None, grad_dtype)
    b_q, b_s = quantize_fp8(x.t().contiguous(), "1x128")
    return gemm_blockwise(a_q, a_s, b_q, b_s, dy.dtype, "1x128")


def _setup(ctx, inputs, output):
    y, ss, _w_gu, _w_down, eps, grad_dtype = inputs
    _y2, ss2, z, gu_q, gu_s, down_q, down_s = output
    ctx.save_for_backward(y, ss, z, gu_q, gu_s, down_q, down_s)
    ctx.eps, ctx.grad_dtype = eps, grad_dtype
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward(ctx, dy2, *_):
    y, ss, z, gu_q, gu_s, down_q, down_s = ctx.saved_tensors
    if dy2 is None:
        return (None,) * 6
    n = ctx.needs_input_grad
    dy, dw_gu, dw_down = mlp_fp8_backward(y, ss, gu_q, gu_s, down_q, down_s, ctx.eps, z, dy2.contiguous(),
                                          ctx.grad_dtype, (n[0], n[2], n[3]))
    return dy, None, dw_gu, dw_down, None, None


mlp_block_fp8.register_autograd(_backward, setup_context=_setup)


# torch.autocast: activations and weights in bf16 (ops.autocast), then quantized
bf16_under_autocast("coda::mlp_block_fp8", (0, 2, 3))


# Python callers skip the dispatcher where nothing needs it (ops.eager)
mlp_block_fp8 = direct(mlp_block_fp8)
