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

The gradients dy2 and dz' are quantized once for both of their GEMMs (``coda.quantize_fp8_dual``:
along K and, transposed, along M); h and y, whose row quantization the forward had, are quantized
transposed only (``ops.fp8_gemms``).

With ``FUSED_QUANT`` the activation quantizations move into the GEMMs that produce the tensors
(``E.quantize``, both layouts of a tile in one pass): the gate/up GEMM also writes h^T in FP8 along
the tokens, which the backward keeps for the down-proj weight gradient instead of recomputing and
re-quantizing h, and the down-proj dgrad writes dz' in FP8 along its columns and along the tokens
instead of dz' in bf16 and its dual quantization pass; M must be a positive multiple of 16.
Off: its GPU tests pass (``tests/test_epilogue_quantize_gpu.py``, ``tests/test_mlp_fp8_gpu.py``), but on the
H200 (2026-12-02, ``scripts/bench_fp8.py``, d 4096, ffn 14336, 16384 tokens, in turns) it is
slower: 22.08 ms per forward + backward against 20.64 without. The sinks cost their GEMMs more
than the passes they replace: the gate/up GEMM 3.44 ms against 3.11 + the 0.31 ms h^T pass,
the down dgrad 3.41 ms against 2.51 + the 0.70 ms dz' pass (the transposed sinks' byte staging
and two barriers per sub-tile, in a cooperative epilogue the tensor cores wait for).

``row_scaling`` runs the second recipe, ``Fp8Recipe(scaling="row")`` (``ops.fp8_gemms``): every
operand with one scale per whole row along K, the six GEMMs on the plain FP8 kernel with the
scales applied to the accumulator in the same trees; ``FUSED_QUANT`` does not apply (its sinks
quantize 1 x 128 blocks). ``fast_accum`` ("none", "forward", "all"; row-wise only): the GEMMs of
those roles accumulate in the tensor core for the whole k-loop (``fp8_gemms.fast_for``); with "all"
every GEMM, the down dgrad included, fits ping-pong 128 x 128 (H200, 2026-12-04, d 4096, ffn 14336,
16384 tokens, in turns: 15.27-15.63 ms per forward + backward against 17.44-18.23 promoted, the
errors against float64 within 0.1 % of the promoted ones'). A whole row's scale needs the whole
row's amax, which no tile has, so each tensor is quantized in a pass after its GEMM, where a CTA
holds a whole row, finds its amax and quantizes it (``elementwise_fp8.QuantizeWholeRowsSpec``): one
read. The gradient dz' feeds its weight gradient as those FP8 bytes transposed
(``elementwise_fp8.transpose_fp8``), its per-token scales folded into y, whose columns are then
quantized over the tokens (``fp8_gemms.wgrad``). The down-proj's weight gradient mirrors that,
since h (f wide) is wider than dy2 (d): the forward keeps h's FP8 rows, the bytes the down-proj
read, with their per-token scales; the backward transposes those bytes and folds the scales into
dy2, whose columns are then quantized (``fp8_gemms.wgrad_kept``):

    dw_down = Qcol(s_h dy2)^T @ q(h),   dw_gu = q(dz')^T @ Qcol(s_dz' y)

So the wide tensors are never read for column amaxes: dz' (M, 2f), the largest tensor of the
step, takes one read and an FP8 transpose (5 bytes moved per element where the amax pass and the
dual quantization moved 6); h is neither recomputed and stored by the down dgrad's epilogue nor
read twice for its columns (7 bytes per element become the 2 of its FP8 transpose, for 1 byte per
element kept from forward to backward). The narrow y and dy2 take the amax pass and the column
quantizer: two reads. The four passes only the weight gradients read (h's and dz''s FP8
transposes, y's and dy2's folded columns) run on a side stream beside the down dgrad and the
gate/up dgrad, which leave them ``SIDE_SMS_DOWN_DGRAD`` and ``SIDE_SMS_GATE_UP_DGRAD`` SMs
(``ops.beside``); with ``SIDE_SMS_DOWN_WGRAD`` (an experiment, off) dz''s row quantization, which
the gate/up dgrad reads, runs beside the down weight gradient.
The gradients are quantized to E4M3 (``e5m2_grads``: E5M2, for range). The weights are
quantized once per forward (or given by the caller) and kept for the backward; in the row-wise
recipe only W_gu's rows come before the gate/up GEMM, and W_gu's columns and W_down are quantized
beside it on ``SIDE_SMS_GATE_UP_FORWARD`` SMs (``fp8_gemms.first_projection``). Without
``FUSED_QUANT`` the quantizations are bandwidth-bound passes of their own (``coda.quantize_fp8``,
``coda.quantize_fp8_dual``); y, h along K and dy2 stay so with it. Numerics: the dequantized
operands' products summed in fp32, so the error against an fp32 reference is FP8's rounding of each operand
(about 2^-4 relative per element for E4M3), not the GEMM's.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import dispatch
from .. import epilogue as E
from ..operands import dtype_name
from .autocast import bf16_under_autocast
from .checks import F32
from .eager import direct
from .beside import beside
from .fp8_gemms import (FP8, activation, check_fast_accum, check_fp8_widths, fast_for, first_projection, grad_format,
                        grad_operands, kept_weights, project, quantized_weights, residual_stats_tiles, transposable,
                        wgrad, wgrad_kept_prepared, wgrad_prepared)
from .gemm_blockwise import gemm_blockwise
from .mlp import check_mlp
from .quantize import quantize_dual_fp8, quantize_grad_rowwise_fp8, transpose_bytes
from .residual import residual_norm_stats_tree
from .rmsnorm import norm_backward_tree, norm_inputs
from .swiglu import norm_swiglu_tree, swiglu_backward_tree

OP = "coda.mlp_block_fp8"
#: quantize h^T and dz' in the GEMMs that produce them (module docstring)
FUSED_QUANT = False
#: SMs the row-wise recipe's down dgrad and gate/up dgrad leave to the weight gradients' passes
#: that run beside them (``ops.beside``; 0: the passes in series)
SIDE_SMS_DOWN_DGRAD = 8
SIDE_SMS_GATE_UP_DGRAD = 10
#: SMs the row-wise recipe's down weight gradient leaves to dz''s row quantization beside it (0: the
#: rows in series before it, dz' in bf16 dropped first). An experiment switch, off: built and tested
#: on the CPU (2026-12-07), not yet timed or tested on a GPU (``gpu_session.sh wgrad-side``). Beside,
#: dz' in bf16 (M x 2f x 2 bytes) lives through the down weight gradient.
SIDE_SMS_DOWN_WGRAD = 0
#: SMs the row-wise recipe's gate/up forward leaves to the weights' passes beside it (W_gu's
#: columns, W_down's rows and columns, where the op quantizes its weights: ``fp8_gemms.first_projection``;
#: 0: in series, after it). One H100 80GB HBM3, 2026-12-07, d 4096, ffn 14336, 16384 tokens, fast
#: accumulation, in turns, ms, in series -> 6 SMs: 16.128 -> 15.537 (4 / 8 / 10 SMs 15.542 / 15.666 /
#: 15.509), 15.166 -> 14.932, 15.251 -> 15.088, 15.530 -> 15.059; at 1b (d 2048, ffn 8192, not a shape it
#: was picked on) 5.349 -> 5.287.
SIDE_SMS_GATE_UP_FORWARD = 6


@functools.lru_cache(maxsize=None)
def norm_swiglu_fp8_tree(pow2: bool) -> E.Epilogue:
    """``norm_swiglu_tree`` plus h^T (the bf16 h, transposed) in E4M3 1 x 128 blocks along the
    tokens: the down-proj weight gradient's operand."""
    base = norm_swiglu_tree()
    h = next(s for s in base.sinks if s.name == "h").x
    return E.Epilogue(*base.sinks, E.quantize(E.cast(h, "bfloat16"), "h_t", "float8_e4m3fn", pow2, True))


@functools.lru_cache(maxsize=None)
def swiglu_backward_fp8_tree(grad_dtype: str, pow2: bool) -> E.Epilogue:
    """``swiglu_backward_tree`` with dz' (its bf16 rounding) quantized both ways instead of
    stored: along its columns for the gate/up dgrad, along the tokens for its weight gradient;
    zdz as before, h not recomputed (the forward's h^T is kept)."""
    base = swiglu_backward_tree()
    dz = E.cast(next(s for s in base.sinks if s.name == "dz").x, "bfloat16")
    zdz = next(s for s in base.sinks if s.name == "zdz")
    return E.Epilogue(zdz, E.quantize(dz, "dz_q", grad_dtype, pow2), E.quantize(dz, "dz_t", grad_dtype, pow2, True))


def check_mlp_fp8(y, ss, w_gu, w_down, eps, fast_accum="none", row=False):
    m, f = check_mlp(y, ss, w_gu, w_down, eps, OP)
    check_fast_accum(OP, fast_accum, row)
    check_fp8_widths(OP, **{"the model width d (columns of y)": y.shape[1], "the SwiGLU width f": f})
    return m, f


@torch.library.custom_op("coda::mlp_block_fp8", mutates_args=())
def mlp_block_fp8(y: torch.Tensor, ss: torch.Tensor, w_gu: torch.Tensor, w_down: torch.Tensor, eps: float,
                  e5m2_grads: bool = False, pow2_scales: bool = False,
                  gu_q: Optional[torch.Tensor] = None, gu_s: Optional[torch.Tensor] = None,
                  gu_qt: Optional[torch.Tensor] = None, down_q: Optional[torch.Tensor] = None,
                  down_s: Optional[torch.Tensor] = None, down_qt: Optional[torch.Tensor] = None,
                  row_scaling: bool = False, fast_accum: str = "none"
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                             torch.Tensor, torch.Tensor, torch.Tensor]:
    """y2 = y + SwiGLU(RMSNorm(y; gamma) @ W_gu.T) @ W_down.T with FP8 GEMMs (module docstring).

    Arguments as ``coda.mlp_block``'s (y (M, d) bf16, ss its norm statistics, w_gu (2f, d) bf16
    interleaved with gamma folded in, w_down (d, f) bf16), and ``e5m2_grads``: the backward's
    gradients in E5M2 rather than E4M3; ``pow2_scales``: every scale, forward and backward, rounded
    up to a power of two (``Fp8Recipe.pow2_scales``); ``gu_q, gu_s, gu_qt``, ``down_q, down_s,
    down_qt``: the weights quantized as ``fp8_gemms.weight(w, pow2_scales, row_scaling)`` returns
    them, kept by the caller once per version of the weights (``coda_cute.nn.fold.WeightQuantCache``),
    or none of them for the op to quantize; ``row_scaling``: the row-wise recipe; ``fast_accum``:
    which of its GEMMs accumulate in the tensor core (module docstring). Returns (y2, ss2,
    z, then the quantized weights kept for the backward: W_gu's FP8 transpose (d, 2f) and its
    scales (128 x 128, or row-wise (N + K, 1)), W_down's; empty when the caller passed them, which
    the backward then uses; then with ``FUSED_QUANT`` h^T (f, M) in FP8 and its scales (f, ceil(M
    / 128)), in the row-wise recipe h's FP8 rows (M, f) and their fold factors (M,), else two empty
    tensors); only y2 carries a gradient."""
    if y.device.type == "cpu":
        dispatch.require_reference(OP)
    check_mlp_fp8(y, ss, w_gu, w_down, eps, fast_accum, row_scaling)
    given = [gu_q, gu_s, gu_qt, down_q, down_s, down_qt]
    row, fast = row_scaling, fast_for(fast_accum, "forward")
    fused = _fused(y, row)
    tree = norm_swiglu_fp8_tree(pow2_scales) if fused else norm_swiglu_tree()
    y_q, y_s = activation(y, pow2_scales, row)
    inputs = norm_inputs(y.shape[1], ss, eps)
    out, ((gu_q, gu_s, gu_qt), (down_q, down_s, down_qt)) = first_projection(
        OP, lambda q, s, sms: project(OP, tree, y_q, y_s, q, s, inputs, row=row, fast=fast, sms=sms), given,
        pow2_scales, row, y.device, SIDE_SMS_GATE_UP_FORWARD, w_gu=w_gu, w_down=w_down)
    if row:  # h's rows with their fold factors, kept for the down-proj weight gradient
        h_q, h_s, _, h_fold = quantize_grad_rowwise_fp8(out["h"], FP8, pow2_scales, transposed=False)
        h_t = (h_q, h_fold)
    else:
        h_q, h_s = activation(out["h"], pow2_scales)
        h_t = out["h_t"] if fused else _no_h_t(y)
    res = project(OP, residual_norm_stats_tree(), h_q, h_s, down_q, down_s, {"residual": y}, row=row, fast=fast)
    if given[0] is not None:
        return res["y"], res["ss"], out["z"], *kept_weights(w_gu, True), *kept_weights(w_down, True), *h_t
    return res["y"], res["ss"], out["z"], gu_qt, gu_s, down_qt, down_s, *h_t


def _fused(y, row: bool) -> bool:
    """Whether this call quantizes h^T and dz' in their GEMMs: ``FUSED_QUANT``, the block recipe and
    M a positive multiple of 16 (the transposed FP8 rows; no tokens: no rows to quantize)."""
    return FUSED_QUANT and not row and y.shape[0] % 16 == 0 and y.shape[0] > 0


def _no_h_t(y):
    return y.new_empty((0,), dtype=FP8), y.new_empty((0,), dtype=F32)


@mlp_block_fp8.register_fake
def _fake(y, ss, w_gu, w_down, eps, e5m2_grads=False, pow2_scales=False, gu_q=None, gu_s=None, gu_qt=None,
          down_q=None, down_s=None, down_qt=None, row_scaling=False, fast_accum="none"):
    m, f = check_mlp_fp8(y, ss, w_gu, w_down, eps, fast_accum, row_scaling)
    row = row_scaling
    given = [gu_q, gu_s, gu_qt, down_q, down_s, down_qt]
    cached = gu_q is not None
    if cached or any(t is not None for t in given):
        quantized_weights(OP, given, pow2_scales, row, w_gu=w_gu, w_down=w_down)
    d = y.shape[1]
    t = residual_stats_tiles(m, d, f, y.device, row, fast_for(fast_accum, "forward"))
    if row:
        h_t = (y.new_empty((m, f), dtype=FP8), y.new_empty((m,), dtype=F32))
    elif _fused(y, row):
        h_t = (y.new_empty((f, m), dtype=FP8), y.new_empty((f, -(-m // 128)), dtype=F32))
    else:
        h_t = _no_h_t(y)
    return (y.new_empty(y.shape), y.new_empty((m, t), dtype=F32), y.new_empty((m, 2 * f)),
            *kept_weights(w_gu, cached, row), *kept_weights(w_down, cached, row), *h_t)


def mlp_fp8_backward(y, ss, w_gu_qt, w_gu_s, w_down_qt, w_down_s, eps, z, dy2, grad_dtype,
                     needs=(True, True, True), pow2: bool = False, h_t=None, row: bool = False,
                     fast_accum: str = "none"):
    """(dy, dw_gu, dw_down), the module docstring's backward (each skipped if not needed), from
    the weights' FP8 transposes and scales; ``pow2``: power-of-two scales; ``h_t``: the
    forward's (h^T, scales) with ``FUSED_QUANT`` (dz' then quantized in its own GEMM too), in
    the row-wise recipe (``row``) its (h rows in FP8, fold factors); ``fast_accum``: which GEMMs
    accumulate in the tensor core."""
    if row:
        return _row_backward(y, ss, w_gu_qt, w_gu_s, w_down_qt, w_down_s, eps, z, dy2, grad_dtype, needs, pow2, h_t,
                             fast_accum)
    d = y.shape[1]
    dy_q, dy_s, dyt_q, dyt_s = grad_operands(dy2, grad_dtype, pow2)
    inputs = dict(norm_inputs(d, ss, eps), z=z)
    if h_t is not None:
        bwd = project(OP, swiglu_backward_fp8_tree(dtype_name(grad_dtype), pow2), dy_q, dy_s, w_down_qt, w_down_s, inputs,
                      transposed=True)
        zdz, (dz_q, dz_s), (dzt_q, dzt_s) = bwd["zdz"], bwd["dz_q"], bwd["dz_t"]
        _, _, yt_q, yt_s = quantize_dual_fp8(y, FP8, rows=False, pow2_scales=pow2)
        dw_down = gemm_blockwise(dyt_q, dyt_s, *h_t, dy2.dtype, "1x128") if needs[2] else None
        dw_gu = gemm_blockwise(dzt_q, dzt_s, yt_q, yt_s, dy2.dtype, "1x128") if needs[1] else None
    else:
        bwd = project(OP, swiglu_backward_tree(), dy_q, dy_s, w_down_qt, w_down_s, inputs, transposed=True)
        dzp, h, zdz = bwd["dz"], bwd["h"], bwd["zdz"]
        dz_q, dz_s, dzt_q, dzt_s = grad_operands(dzp, grad_dtype, pow2)
        dw_down = wgrad(dy2, dyt_q, dyt_s, h, pow2) if needs[2] else None
        dw_gu = wgrad(dzp, dzt_q, dzt_s, y, pow2) if needs[1] else None
    dy = None
    if needs[0]:
        inputs = dict(norm_inputs(d, ss, eps), zdz=zdz, y=y, dres=dy2)
        dy = project(OP, norm_backward_tree(True), dz_q, dz_s, w_gu_qt, w_gu_s, inputs, transposed=True)["dy"]
    return dy, dw_gu, dw_down


def _row_backward(y, ss, w_gu_qt, w_gu_s, w_down_qt, w_down_s, eps, z, dy2, grad_dtype, needs, pow2, h_t,
                  fast_accum):
    """The row-wise recipe's backward (:func:`mlp_fp8_backward`'s arguments): the passes only the
    weight gradients read run beside the two dgrads (``ops.beside``), h's transpose and dy2's
    folded columns beside the down dgrad, dz''s transpose and y's folded columns beside the
    gate/up dgrad; each weight gradient as soon as its operands are joined (the down one, with
    ``SIDE_SMS_DOWN_WGRAD``, beside dz''s row quantization). The order keeps the live bytes
    down: dz' in bf16 (M x 2f x 2 bytes, the largest tensor of the step) is gone once its FP8 rows
    are, the down weight gradient's operands before the gate/up dgrad, dz''s FP8 rows after it."""
    fast_d, fast_w = fast_for(fast_accum, "dgrad"), fast_for(fast_accum, "wgrad")
    d = y.shape[1]
    dev = y.device
    dy_q, dy_s, _, _ = grad_operands(dy2, grad_dtype, pow2, True, wgrad_form=False)
    inputs = dict(norm_inputs(d, ss, eps), z=z)

    def down_dgrad(sms):
        return project(OP, swiglu_backward_tree(recompute_h=False), dy_q, dy_s, w_down_qt, w_down_s, inputs,
                       transposed=True, row=True, fast=fast_d, sms=sms)

    def down_operands():
        return wgrad_kept_prepared(dy2, *h_t, grad_dtype, pow2, fast_w) if needs[2] else None

    bwd, dw_down = beside(down_dgrad, down_operands, dev, SIDE_SMS_DOWN_DGRAD)
    zdz, dzp = bwd["zdz"], bwd.pop("dz")

    def dz_rows():
        return grad_operands(dzp, grad_dtype, pow2, True, wgrad_form=False)

    wgrad_beside = dw_down is not None and SIDE_SMS_DOWN_WGRAD > 0
    if wgrad_beside:  # dz''s rows, which the gate/up dgrad reads, beside the down weight gradient
        dw_down, (dz_q, dz_s, _, dz_fold) = beside(dw_down, dz_rows, dev, SIDE_SMS_DOWN_WGRAD)
    else:
        dz_q, dz_s, _, dz_fold = dz_rows()
    # dz' in bf16 is read again only by a weight gradient that has no FP8 transpose of it;
    # elsewhere its shape and dtype (a meta tensor) are all that goes on
    dz_like = dzp if not transposable(dzp) or not dzp.numel() else torch.empty_like(dzp, device="meta")
    del dzp
    if not wgrad_beside:  # in series, after dz' in bf16 is gone
        dw_down = dw_down() if dw_down else None

    def gate_up_dgrad(sms):
        return project(OP, norm_backward_tree(True), dz_q, dz_s, w_gu_qt, w_gu_s,
                       dict(norm_inputs(d, ss, eps), zdz=zdz, y=y, dres=dy2), transposed=True, row=True,
                       fast=fast_d, sms=sms)["dy"]

    def gate_up_operands():
        if not needs[1]:
            return None
        dzt_q = transpose_bytes(dz_q) if transposable(dz_like) else None
        return wgrad_prepared(dz_like, dzt_q, dz_fold, y, pow2, True, fast_w)

    dy, dw_gu = (beside(gate_up_dgrad, gate_up_operands, dev, SIDE_SMS_GATE_UP_DGRAD) if needs[0]
                 else (None, gate_up_operands()))
    del dz_q  # the closures are done with it
    return dy, dw_gu() if dw_gu else None, dw_down


def _setup(ctx, inputs, output):
    (y, ss, _w_gu, _w_down, eps, e5m2_grads, pow2_scales, _gu_q, gu_s_in, gu_qt_in, _down_q, down_s_in, down_qt_in,
     row_scaling, fast_accum) = inputs
    _y2, ss2, z, gu_qt, gu_s, down_qt, down_s, h_tq, h_ts = output
    if gu_qt_in is not None:  # the caller's copies
        gu_qt, gu_s, down_qt, down_s = gu_qt_in, gu_s_in, down_qt_in, down_s_in
    ctx.save_for_backward(y, ss, z, gu_qt, gu_s, down_qt, down_s, h_tq, h_ts)
    ctx.eps, ctx.grad_dtype, ctx.pow2, ctx.row = eps, grad_format(e5m2_grads), pow2_scales, row_scaling
    ctx.fast_accum = fast_accum
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward(ctx, dy2, *_):
    y, ss, z, gu_qt, gu_s, down_qt, down_s, h_tq, h_ts = ctx.saved_tensors
    if dy2 is None:
        return (None,) * 15
    n = ctx.needs_input_grad
    h_t = (h_tq, h_ts) if ctx.row or h_tq.numel() else None
    dy, dw_gu, dw_down = mlp_fp8_backward(y, ss, gu_qt, gu_s, down_qt, down_s, ctx.eps, z, dy2.contiguous(),
                                          ctx.grad_dtype, (n[0], n[2], n[3]), ctx.pow2, h_t, ctx.row, ctx.fast_accum)
    return (dy, None, dw_gu, dw_down) + (None,) * 11


mlp_block_fp8.register_autograd(_backward, setup_context=_setup)


# torch.autocast: activations and weights in bf16 (ops.autocast), then quantized
bf16_under_autocast("coda::mlp_block_fp8", (0, 2, 3))


# Python callers skip the dispatcher where nothing needs it (ops.eager)
mlp_block_fp8 = direct(mlp_block_fp8)
