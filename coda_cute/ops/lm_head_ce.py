"""The final RMSNorm + LM head + cross-entropy without the M x V logits in memory:
``coda.lm_head_ce`` (the loss alone: inference, evaluation, ``reduction="none"``) and
``coda.lm_head_ce_train`` (the loss and its gradients, for training).

    u = y * gamma  (the final norm's weight, on the activations),  r_m from ss
    logits = r * (u @ W.T);   LSE_m = log sum_v exp(logits_mv);  loss_m = LSE_m - logits[m, t_m]

Gradients (coda-math 3.1; c_m the per-row weight of the reduction, 0 on ignored rows):

    dl = c (softmax - onehot),  dl' = r dl (bf16, the GEMM operand),  G = dl' @ W
    dy = gamma * G - r^2 s y,   s_m = sum_v dl_mv logits_mv / d
    dW = dl'^T @ u,             dgamma = sum_m G * y

Where gamma goes. The layers fold their norm weights into the consumer weight (see
``coda.residual_gemm_norm_stats``); here the weight is V x d, 7.8x the 16k-token activation at
V = 128256, and folding it costs 2 V d x 2 bytes per forward (1 GiB at d = 4096) plus 3 V d x 2
in every backward (dW = dW' gamma, dgamma = sum dW' * W) against one M x d pass for u = y * gamma
(``coda.fold_gamma``'s kernel) and a column reduction in the dgrad epilogue. So gamma stays on
the activations.

Design: gradients in the forward, in row chunks (Liger's fused linear cross-entropy shape), or
the logits recomputed in the backward (CODA's, four GEMMs)? At vocab 128256 the LM head holds
most of a small model's FLOPs: a fourth GEMM of M V d costs a third more (12.5 ms at 16384 x
128256 x 2048 on the H200) while a chunk's operand traffic (one bf16 write of M V by the logits
GEMM, one read by each gradient GEMM) is far less. ``lm_head_ce_train`` therefore runs three
GEMMs per chunk in its forward; its backward only scales by dloss. Chunks hold ``CHUNK_BYTES``
of logits (the memory target: at most 1.5 GiB beyond inputs and outputs; power-of-two chunk
rows, so 4 chunks of 4096 rows at 16384 x 128256); dW accumulates in fp32 where that fits next
to the chunk, otherwise in the parameter's bf16 (one rounding per chunk), where the backward's
last-chunk wgrad turns the sum into the gradient in place (``coda.lm_head_ce_dw_``: no second
V x d buffer).

The exp form: the gradient operand straight from the logits GEMM. dl needs the row's LSE, which
no tile of the logits GEMM knows, so a pass over the stored logits used to turn them into dl'
(read and rewrite 2 M V bytes: 2.0 ms of the 8b step). Instead the GEMM stores what needs no
LSE, per ``EXP_TILE``-column tile j (its own tile: the row-scale and partials are per tile):

    e = exp(l - K_j) (bf16),  K_j = max(T, max_{v in j} l_v - EXP_GUARD),  T = l_t  (the target's
                               logit, from a gather-dot before the GEMM: ``target_logits``)
    partial sum_{v in j} e

so e <= e^EXP_GUARD stays finite in bf16 and in the GEMMs' fp32 sums, and K_j = T in every tile
unless a logit exceeds T + EXP_GUARD. K_j is not stored (a per-tile row reduction of it cost the
GEMM 2 %: 6.806 against 6.673 ms at d 4096, a max reduction of the tile's max): such tiles' sums reach e^EXP_GUARD, and every tile
whose sum reaches e^(EXP_GUARD - 1) (those, and tiles with a logit above about T + EXP_GUARD - 6)
has K_j recovered by the row step from the logit of its largest e, recomputed from u and W. Per row (``exp_combine_``,
bytes per row, not per logit): K' = max_j K_j; tiles with K_j < K' (rare) rescale by exp(K_j - K') in place; LSE = K' + log
sum_j exp(K_j - K') se_j; the target's entry becomes -(the others' sum), so that

    dl = s e',   s_m = c_m exp(K' - LSE_m)    (at the target: s (-others) = c (p_t - 1))

keeping 1 - p_t of a confident row at bf16's relative precision (forming it from p_t cancels;
``scripts/exp_lm_head_exp_form.py``). The row scale rs = r s goes where a GEMM can take it: the
dgrad's epilogue (G = rs (e' @ W)) and the wgrad's other operand (dW = e'^T @ (rs u)). The
RMSNorm statistic s_m d = sum_v dl logits = u . G sums over all d columns of G, which no dgrad
tile holds, so the dgrad epilogue stores dy0 = G gamma with its row partials u . G, and a row
finish (``lm_head_rows_``) subtracts r^2 (u . G / d) y in place and writes rs u for the wgrad.
Why not the statistic in the logits epilogue (sum e (l - T) per tile)? The logits GEMM runs its
epilogue on each 128 x 128 tile of the chunk's M x V (32064 tiles at 4096 x 128256), the dgrad
on each tile of M x d (512 at d 4096); an extra row reduction there cost 2 % of the logits GEMM
(H200, in turns: 6.954 ms with it, 6.806 without), the row finish far less.
Measured (H200, 16384 x 128256, bf16, in turns, one process), with K_j still stored: the chunk
loop 81.07 ms against 81.40 for the stored-logits form at d 4096, 40.45 against 42.24 at d 2048,
the row kernels per chunk 0.09 ms against 0.55. The logits GEMM alone (one 4096-row chunk, in
turns): with a per-tile max reduction 6.806 ms, without it (this tree) 6.673, the stored-logits tree
6.748 (d 4096); 3.383 against 3.346 for the stored-logits tree at d 2048. With K_j recovered by the
row step (this code; another H200, 2026-12-04): the chunk loop 79.93 ms against 80.62 for the
stored-logits form (d 4096), 40.07 against 41.81 (d 2048); the logits GEMM 6.613 ms against
6.528 for the stored-logits tree and 6.756 for cuBLAS (d 4096), 3.306 / 3.321 / 3.493 (d 2048);
the whole op (``scripts/bench_lm_head.py``, forward + backward) 77.88 ms against 79.30 for three
cuBLAS GEMMs of its shape (0.982x, d 4096) and 38.53 against 38.69 (0.996x, d 2048), peak 1.17
and 1.07 GiB beyond inputs and outputs.

The loss-only op keeps the one-GEMM forward and recomputes the logits chunk by chunk in its
backward (its dlogits come straight out of that GEMM's epilogue, the LSE being known), which
also serves per-row losses (``reduction="none"``) and a gradient of LSE.
"""

from __future__ import annotations

import functools
from .eager import direct
from .autocast import bf16_under_autocast
from typing import Optional

import torch

from .. import dispatch
from .. import epilogue as E
from ..elementwise import lse_combine
from ..elementwise_lm_head import exp_combine_, lm_head_rows_, target_logits
from ..kernels.common.config import GemmConfig
from ..kernels.epilogue.plain import gemm_tree
from ..reference import (ce_coef, ce_dlogits_ref, lm_head_ce_grad_ref, lm_head_ce_ref, reduce_loss,
                         rms_rstd_ref, scale_columns_ref)
from .checks import (BF16, F32, INDEX_DTYPES, PendingIndexCheck, check_aligned, check_index_range,
                     check_norm_input, check_pointer_aligned, check_same_device, check_shape,
                     check_tensor)
from .fold import fold_gamma_impl, scale
from .rmsnorm import norm_backward_tree, norm_inputs, rstd_node

OP = "coda.lm_head_ce"
OP_TRAIN = "coda.lm_head_ce_train"
OP_BWD = "coda.lm_head_ce_backward"
OP_DW, OP_DW_INPLACE = "coda.lm_head_ce_dw", "coda.lm_head_ce_dw_"
REDUCTIONS = ("mean", "sum", "none")
#: bytes of logits (bf16) one chunk holds, plus an fp32 dW accumulator where one is used
CHUNK_BYTES = 3 << 29  # 1.5 GiB
#: chunk rows are whole 128-row GEMM tiles
CHUNK_ROW_MULTIPLE = 128
#: the exp form (module docstring): e = exp(logit - K) per EXP_TILE-column tile, K the target's
#: logit or the tile's max - EXP_GUARD where larger (e <= e^EXP_GUARD: finite in bf16 and in the
#: GEMMs' fp32 sums), on a logits GEMM config whose tile is that wide
EXP_TILE, EXP_GUARD = 128, 60.0
#: the exp form's logits GEMM config per card (``dispatch.card_of``), fixed: its tile is the exp
#: form's tile, and of the tiles 128 columns wide only these two hold its tree without spilling.
#: The H200 runs it on ping-pong 128 x 128. On an H100 ping-pong's mainloop is slow at these
#: shapes (``dispatch.PINGPONG_16_SCALE``): cooperative 128 x 128 took 7.07 ms against 7.83 (cuBLAS
#: 6.61) at 4096 x 128256 x 4096, and 1.111 against 1.149 of cuBLAS's joules at the power cap
#: (2026-12-06, ``bench_step_gemms.py --cooperative``, ``exp_energy_tiles.py --fused``).
EXP_CONFIGS = {"h200": GemmConfig(128, EXP_TILE, 64, "pingpong", 2, 1),
               "h100": GemmConfig(128, EXP_TILE, 64, "cooperative", 2, 1)}


def exp_config(card: str = dispatch.DEFAULT_CARD) -> GemmConfig:
    """The exp form's logits GEMM config on ``card`` (:data:`EXP_CONFIGS`; the H200's on others)."""
    return EXP_CONFIGS.get(card, EXP_CONFIGS[dispatch.DEFAULT_CARD])


# -- trees ----------------------------------------------------------------------------------------
def _logits():
    return E.acc() * rstd_node()


@functools.lru_cache(maxsize=None)
def lm_head_ce_tree() -> E.Epilogue:
    """The loss-only forward: per-tile (max, sum exp) partials and the target logit."""
    logits = _logits()
    return E.Epilogue(E.row_reduce(logits, "lse", "lse"),
                      E.gather(logits, E.row_vec("targets", "int32"), "target_logit"))


@functools.lru_cache(maxsize=None)
def logits_tree() -> E.Epilogue:
    """The training forward's logits GEMM: :func:`lm_head_ce_tree` plus the logits stored bf16."""
    logits = _logits()
    return E.Epilogue(E.store(logits, "logits", "bfloat16"), E.row_reduce(logits, "lse", "lse"),
                      E.gather(logits, E.row_vec("targets", "int32"), "target_logit"))


@functools.lru_cache(maxsize=None)
def exp_logits_tree() -> E.Epilogue:
    """The training forward's logits GEMM on ``exp_config``: e = exp(logits - K) stored bf16,
    K = max(T, the tile's max - ``EXP_GUARD``) with T the target's logit (a row input), and per
    tile sum e (``reference.exp_logits_ref``). K itself is not stored: T but in the rare tiles
    holding a logit above T + EXP_GUARD, whose sums reach e^EXP_GUARD; the row step recovers it
    wherever a sum reaches e^(EXP_GUARD - 1) (a per-tile max reduction cost the GEMM 2 % on the
    H200)."""
    logits = _logits()
    k = E.maximum(E.row_vec("target_logit"), E.segment_reduce(logits, "max", EXP_TILE) - EXP_GUARD)
    e = E.exp(logits - k)
    return E.Epilogue(E.store(e, "e", "bfloat16"), E.row_reduce(e, "sum", "se"))


@functools.lru_cache(maxsize=None)
def exp_dgrad_tree(gamma: bool) -> E.Epilogue:
    """The exp form's dgrad, acc = e' @ W: G = rs * acc and dy0 = G [* gamma] stored bf16, the
    RMSNorm statistic's row partials zdz = sum dy0 * y (= u . G, u = y * gamma) and, with gamma,
    d gamma's column partials sum_m G * y. The projection r^2 (zdz / d) y is subtracted
    afterwards (``lm_head_rows_``): zdz sums over all d columns, more than a tile holds."""
    g = E.acc() * E.row_vec("rs")
    y = E.tile("y")
    dy0 = g * E.col_vec("gamma") if gamma else g
    sinks = [E.store(dy0, "dy", "bfloat16"), E.row_reduce(dy0 * y, "sum", "zdz")]
    if gamma:
        sinks.append(E.col_reduce(g * y, "sum", "dgamma"))
    return E.Epilogue(*sinks)


@functools.lru_cache(maxsize=None)
def dlogits_tree() -> E.Epilogue:
    """The recomputing backward's logits GEMM, the LSE known: dl' = r dl stored bf16 and the
    RMSNorm statistic's partials sum dl * logits, with
    dl = softmax (c + dlse) - onehot c."""
    logits = _logits()
    c = E.row_vec("coef")
    p = E.exp(logits - E.row_vec("lse"))
    dl = p * (c + E.row_vec("dlse")) - E.where(E.col_index().eq(E.row_vec("targets", "int32")), c, 0.0)
    return E.Epilogue(E.store(dl * rstd_node(), "dl", "bfloat16"), E.row_reduce(dl * logits, "sum", "zdz"))


@functools.lru_cache(maxsize=None)
def accumulate_tree(dtype: str) -> E.Epilogue:
    """out = acc + prev: a chunk's dW added to the running sum (in place: prev is out)."""
    return E.Epilogue(E.store(E.acc() + E.tile("prev", dtype), "out", dtype))


# -- checks ---------------------------------------------------------------------------------------
def check_lm_head(y, w_lm, ss, eps, targets, reduction, gamma, op=OP):
    # The logits are never stored whole, so the vocabulary size has no alignment rule.
    m, _, d = check_norm_input(op, y, w_lm, ss, eps, store_cols=False, w_name="w_lm")
    if m == 0:  # the row chunks of its GEMMs, and a mean, need a token
        raise ValueError(f"{op}: y has no rows: the loss needs at least one token")
    check_tensor(op, "targets", targets, 1, INDEX_DTYPES)
    if targets.shape[0] != m:
        raise ValueError(f"{op}: targets must have one entry per row of y ({m}), got {targets.shape[0]}")
    if gamma is not None:
        check_tensor(op, "gamma", gamma, 1, (BF16, F32))
        if gamma.shape[0] != d:
            raise ValueError(f"{op}: gamma must be (d,) = ({d},), one per column of y, got {tuple(gamma.shape)}")
    check_same_device(op, y=y, targets=targets, gamma=gamma)
    allowed = REDUCTIONS if op in (OP, OP_BWD) else ("mean", "sum")
    if reduction not in allowed:
        raise ValueError(f"{op}: reduction must be one of {allowed}, got {reduction!r}")
    return m


def check_lm_head_backward(y, w_lm, ss, eps, targets, lse, dloss, dlse, reduction, gamma):
    """The recomputing backward's arguments: those of the forward, and its saved lse (M,) fp32
    contiguous (read in place by the dlogits GEMM's epilogue), dloss fp32 (M,) for "none", ()
    otherwise, dlse (M,) fp32 (any strides). Returns M."""
    op = OP_BWD
    m = check_lm_head(y, w_lm, ss, eps, targets, reduction, gamma, op=op)
    check_tensor(op, "lse", lse, 1, (F32,))
    check_shape(op, "lse", lse, (m,), "the forward's log-sum-exp, one per row of y ")
    want = (m,) if reduction == "none" else ()
    for name, t, what in (("dloss", dloss, f"the loss's gradient (reduction {reduction!r}) "),
                          ("dlse", dlse, "the log-sum-exp's gradient, one per row of y ")):
        if not isinstance(t, torch.Tensor) or t.dtype != F32:
            raise TypeError(f"{op}: {name} must be a float32 tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
        check_shape(op, name, t, want if name == "dloss" else (m,), what)
    check_same_device(op, y=y, lse=lse, dloss=dloss, dlse=dlse)
    return m


def check_lm_head_dw(op, dl, y, gamma, dw, scale, in_place: bool):
    """The last-chunk wgrad's arguments: dl (rows, V) bf16 row-major (a column slice of the
    logits buffer: unit stride along V, rows and data pointer 16-byte aligned); y (rows, d) bf16;
    gamma (d,) or None; dw (V, d): the accumulator (bf16 in place; fp32, bf16 or empty
    otherwise); scale one fp32."""
    if not isinstance(dl, torch.Tensor) or dl.dtype != BF16 or dl.dim() != 2:
        raise TypeError(f"{op}: dl must be a 2-D bfloat16 tensor, got "
                        f"{getattr(dl, 'dtype', type(dl).__name__)} {tuple(getattr(dl, 'shape', ()))}")
    rows, v = dl.shape
    if dl.stride(1) != 1 or dl.stride(0) < v or dl.stride(0) % 8:
        raise ValueError(f"{op}: dl must be row-major with a row stride that is a multiple of 8 "
                         f"(16-byte rows for TMA), got strides {tuple(dl.stride())}")
    check_pointer_aligned(dl, "dl", op)  # TMA's global address: 16-byte aligned
    check_tensor(op, "y", y, 2, (BF16,), aligned=True)
    if y.shape[0] != rows:
        raise ValueError(f"{op}: y must have one row per row of dl ({rows}), got {tuple(y.shape)}")
    d = y.shape[1]
    check_aligned(op, "the model width d (columns of y)", d)
    if gamma is not None:
        check_tensor(op, "gamma", gamma, 1, (BF16, F32))
        check_shape(op, "gamma", gamma, (d,), "(d,) = ")
    if in_place or dw.numel():
        check_tensor(op, "dw", dw, 2, (BF16,) if in_place else (F32, BF16), aligned=True)
        check_shape(op, "dw", dw, (v, d), "the (V, d) accumulator ")
    if not isinstance(scale, torch.Tensor) or scale.dtype != F32 or scale.numel() != 1:
        raise ValueError(f"{op}: scale must be one float32 number (dloss) as a tensor, got "
                         f"{getattr(scale, 'dtype', type(scale).__name__)} {tuple(getattr(scale, 'shape', ()))}")
    check_same_device(op, dl=dl, y=y, gamma=gamma, dw=dw, scale=scale)


def finalize_ce(lse, target_logit, targets, ignore_index: int, reduction: str):
    valid = targets != ignore_index
    return reduce_loss(torch.where(valid, lse - target_logit, 0.0), valid, reduction)


def _scaled_input(y, gamma):
    """u = y * gamma rounded to bf16 (the GEMMs' A operand), y itself without gamma."""
    return y if gamma is None else fold_gamma_impl(y, gamma.to(y.dtype))


# -- the loss-only op -------------------------------------------------------------------------------
@torch.library.custom_op("coda::lm_head_ce", mutates_args=())
def lm_head_ce(y: torch.Tensor, w_lm: torch.Tensor, ss: torch.Tensor, eps: float,
               targets: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
               gamma: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of logits = r * ((y * gamma) @ w_lm.T), the logits never materialized.

        r_m = (sum_t ss[m, t] / d + eps)^(-1/2)
        LSE_m = log sum_v exp(logits[m, v]),  loss_m = LSE_m - logits[m, targets_m]

    y: (M, d) bf16 (the last residual stream); w_lm: (V, d) bf16; ss: (M, T) fp32 partials of
    y; targets: (M,) int64/int32 in [0, V) or ignore_index; gamma: (d,) the final norm's
    weight, or None (already folded into w_lm, or no norm weight). d a multiple of 8; V any.
    Returns (loss, LSE): loss fp32 () for "mean" (over rows whose target is not ignore_index;
    NaN if none, as torch) and "sum", (M,) for "none" (0 on ignored rows); LSE (M,) fp32.
    Targets out of range raise ValueError before the op returns: their check is queued ahead of
    the GEMM and read back while the GEMM runs (``PendingIndexCheck``), so the GPU never waits
    for the host; the wait rules out CUDA-graph capture of the op. Its backward recomputes the
    logits chunk by chunk (module docstring); for training prefer :func:`cross_entropy`, which
    takes ``coda.lm_head_ce_train``.
    """
    check_lm_head(y, w_lm, ss, eps, targets, reduction, gamma)
    target_check = PendingIndexCheck(OP, "targets", targets, w_lm.shape[0], ignore_index)
    inputs = dict(norm_inputs(y.shape[1], ss, eps), targets=targets.to(torch.int32))
    out = E.run(lm_head_ce_tree(), _scaled_input(y, gamma), w_lm.t(), inputs, op=OP)
    lse = lse_combine(*out["lse"])
    loss = finalize_ce(lse, out["target_logit"], targets, ignore_index, reduction)
    target_check.wait()
    return loss, lse


@lm_head_ce.register_fake
def _fake(y, w_lm, ss, eps, targets, ignore_index=-100, reduction="mean", gamma=None):
    m = check_lm_head(y, w_lm, ss, eps, targets, reduction, gamma)
    loss = y.new_empty((m,) if reduction == "none" else (), dtype=F32)
    return loss, y.new_empty((m,), dtype=F32)


@lm_head_ce.register_kernel("cpu")
def _cpu(y, w_lm, ss, eps, targets, ignore_index=-100, reduction="mean", gamma=None):
    dispatch.require_reference(OP)
    check_lm_head(y, w_lm, ss, eps, targets, reduction, gamma)
    check_index_range(OP, "targets", targets, w_lm.shape[0], ignore_index)
    return lm_head_ce_ref(y, w_lm, ss, eps, targets, ignore_index, reduction, gamma)


def _setup(ctx, inputs, output):
    y, w_lm, ss, eps, targets, ignore_index, reduction, gamma = inputs
    ctx.save_for_backward(y, w_lm, ss, targets, output[1], gamma)
    ctx.args = (eps, ignore_index, reduction)


def _backward(ctx, dloss, dlse):
    y, w_lm, ss, targets, lse, gamma = ctx.saved_tensors
    eps, ignore_index, reduction = ctx.args
    dlse = torch.zeros_like(lse) if dlse is None else dlse
    dy, dw, dgamma = lm_head_ce_backward(y, w_lm, ss, eps, targets, lse, dloss, dlse, ignore_index,
                                         reduction, gamma)
    return dy, dw, None, None, None, None, None, (dgamma if gamma is not None else None)


lm_head_ce.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("coda::lm_head_ce_backward", mutates_args=())
def lm_head_ce_backward(y: torch.Tensor, w_lm: torch.Tensor, ss: torch.Tensor, eps: float,
                        targets: torch.Tensor, lse: torch.Tensor, dloss: torch.Tensor,
                        dlse: torch.Tensor, ignore_index: int, reduction: str,
                        gamma: Optional[torch.Tensor] = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dy, dw_lm, dgamma) of ``coda.lm_head_ce``: the logits recomputed chunk by chunk with
    the forward's LSE (M,) fp32; dloss () or (M,) for "none", dlse (M,), both fp32. dgamma is
    empty without gamma."""
    check_lm_head_backward(y, w_lm, ss, eps, targets, lse, dloss, dlse, reduction, gamma)
    # the kernels compare columns with the targets and never index with them: one outside the
    # vocabulary would silently lose its -1 in dlogits
    target_check = PendingIndexCheck(OP_BWD, "targets", targets, w_lm.shape[0], ignore_index)
    dy, dw, dg, _, _, _, _ = _chunked(y, w_lm, ss, eps, targets, ignore_index, reduction, gamma,
                                      dloss=dloss, lse=lse, dlse=dlse)
    target_check.wait()
    return dy, dw, _gamma_grad(dg, gamma, y)


def _gamma_grad(dg, gamma, y):
    return dg.to(gamma.dtype) if gamma is not None else y.new_empty((0,), dtype=F32)


@lm_head_ce_backward.register_fake
def _bwd_fake(y, w_lm, ss, eps, targets, lse, dloss, dlse, ignore_index, reduction, gamma=None):
    check_lm_head_backward(y, w_lm, ss, eps, targets, lse, dloss, dlse, reduction, gamma)
    dg = gamma.new_empty(gamma.shape) if gamma is not None else y.new_empty((0,), dtype=F32)
    return y.new_empty(y.shape), w_lm.new_empty(w_lm.shape), dg


@lm_head_ce_backward.register_kernel("cpu")
def _bwd_cpu(y, w_lm, ss, eps, targets, lse, dloss, dlse, ignore_index, reduction, gamma=None):
    dispatch.require_reference(OP_BWD)
    check_lm_head_backward(y, w_lm, ss, eps, targets, lse, dloss, dlse, reduction, gamma)
    check_index_range(OP_BWD, "targets", targets, w_lm.shape[0], ignore_index)
    dy, dw, dg = lm_head_ce_grad_ref(y, w_lm, ss, eps, targets, ignore_index, reduction, gamma,
                                     dloss, dlse)
    return dy, dw, _gamma_grad(dg, gamma, y)


# -- the training op ---------------------------------------------------------------------------------
@torch.library.custom_op("coda::lm_head_ce_train", mutates_args=())
def lm_head_ce_train(y: torch.Tensor, w_lm: torch.Tensor, ss: torch.Tensor, eps: float,
                     targets: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
                     gamma: Optional[torch.Tensor] = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                torch.Tensor, torch.Tensor]:
    """:func:`lm_head_ce` (reduction "mean" or "sum") that also computes the gradients, in row
    chunks in the forward (module docstring). Returns (loss, LSE, dy, dgamma, dw_acc, dl_last,
    u_last): dy (y's dtype) and dgamma (fp32, empty without gamma) the gradients of loss (dloss = 1) with
    respect to y (through the norm: ss stands for y's statistic) and gamma; dw_acc the sum of the
    chunks' dW but the last one's (the accumulator, fp32 or bf16 as :func:`plan_chunks` says;
    empty with one chunk) and the last chunk's dW as dl_last^T @ u_last: on the GPU dl_last = e'
    and u_last = diag(rs) (y * gamma) (the exp form's row scale moved onto u), on the reference
    path dl_last = dl' = r dl and u_last = y * gamma (dl_last: the chunk's rows of the logits
    buffer, rows padded to 16 bytes). The backward runs that chunk's wgrad with dloss and the
    rest of the sum in its epilogue (``coda.lm_head_ce_dw``), so scaling dW by dloss costs no
    pass of its own. Only loss carries a gradient."""
    check_lm_head(y, w_lm, ss, eps, targets, reduction, gamma, op=OP_TRAIN)
    target_check = PendingIndexCheck(OP_TRAIN, "targets", targets, w_lm.shape[0], ignore_index)
    dy, dw_acc, dgamma, lse, target_logit, dl_last, u_last = _chunked(
        y, w_lm, ss, eps, targets, ignore_index, reduction, gamma, defer_last=True)
    loss = finalize_ce(lse, target_logit, targets, ignore_index, reduction)
    target_check.wait()
    return (loss, lse, dy, dgamma if dgamma is not None else y.new_empty((0,), dtype=F32),
            dw_acc if dw_acc is not None else w_lm.new_empty((0,)), dl_last, u_last)


def _last_chunk(m: int, v: int, d: int):
    """(first row of the last chunk, the accumulator dtype or None)."""
    rows, acc = plan_chunks(m, v, d)
    return (m - 1) // rows * rows, acc


@lm_head_ce_train.register_fake
def _train_fake(y, w_lm, ss, eps, targets, ignore_index=-100, reduction="mean", gamma=None):
    m = check_lm_head(y, w_lm, ss, eps, targets, reduction, gamma, op=OP_TRAIN)
    (v, d), vp = w_lm.shape, _padded_width(w_lm.shape[0])
    start, acc = _last_chunk(int(m), int(v), int(d))
    dg = y.new_empty((d if gamma is not None else 0,), dtype=F32)
    dw = w_lm.new_empty((v, d), dtype=acc) if acc is not None else w_lm.new_empty((0,))
    dl = y.new_empty_strided((m - start, v), (vp, 1))
    return (y.new_empty((), dtype=F32), y.new_empty((m,), dtype=F32), y.new_empty(y.shape), dg, dw, dl,
            y.new_empty((m - start, d)))


@lm_head_ce_train.register_kernel("cpu")
def _train_cpu(y, w_lm, ss, eps, targets, ignore_index=-100, reduction="mean", gamma=None):
    dispatch.require_reference(OP_TRAIN)
    check_lm_head(y, w_lm, ss, eps, targets, reduction, gamma, op=OP_TRAIN)
    check_index_range(OP_TRAIN, "targets", targets, w_lm.shape[0], ignore_index)
    (m, d), v = y.shape, w_lm.shape[0]
    loss, lse = lm_head_ce_ref(y, w_lm, ss, eps, targets, ignore_index, reduction, gamma)
    dy, _, dgamma = lm_head_ce_grad_ref(y, w_lm, ss, eps, targets, ignore_index, reduction, gamma)
    _, dl = ce_dlogits_ref(y, w_lm, ss, eps, targets, ignore_index, reduction, gamma)
    dl = (dl * rms_rstd_ref(ss, d, eps).unsqueeze(1)).to(y.dtype).float()  # dl', bf16 as the GEMMs see it
    start, acc = _last_chunk(m, v, d)
    u = scale_columns_ref(y, gamma).float()
    dw = (dl[:start].t() @ u[:start]).to(acc) if acc is not None else w_lm.new_empty((0,))
    last = torch.empty((m - start, _padded_width(v)), dtype=y.dtype)[:, :v]
    last.copy_(dl[start:])
    return (loss, lse, dy, dgamma if dgamma is not None else y.new_empty((0,), dtype=F32), dw, last,
            scale_columns_ref(y, gamma)[start:].clone())


def _train_setup(ctx, inputs, output):
    y, w_lm, ss, eps, targets, ignore_index, reduction, gamma = inputs
    ctx.save_for_backward(gamma, *output[2:])
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # no zero tensors for the outputs without a gradient


def _train_backward(ctx, dloss, *_):
    gamma, dy, dgamma, dw_acc, dl_last, u_last = ctx.saved_tensors
    if dloss is None:
        return (None,) * 8
    dloss = dloss.to(F32)
    if dw_acc.numel() and dw_acc.dtype == u_last.dtype:
        # the other chunks' bf16 sum becomes the gradient in place: no second (V, d) buffer
        lm_head_ce_dw_(dl_last, u_last, None, dw_acc, dloss)
        dw = dw_acc
    else:
        dw = lm_head_ce_dw(dl_last, u_last, None, dw_acc, dloss)
    dg = (dgamma * dloss).to(gamma.dtype) if gamma is not None else None
    return scale(dy, dloss), dw, None, None, None, None, None, dg


lm_head_ce_train.register_autograd(_train_backward, setup_context=_train_setup)


@functools.lru_cache(maxsize=None)
def finish_dw_tree(acc: Optional[str]) -> E.Epilogue:
    """dW = scale * (acc [+ prev]): the last chunk's wgrad, the other chunks' sum and dloss."""
    x = E.acc() if acc is None else E.acc() + E.tile("prev", acc)
    return E.Epilogue(E.store(x * E.scalar_tensor("scale"), "out", "bfloat16"))


@torch.library.custom_op("coda::lm_head_ce_dw", mutates_args=())
def lm_head_ce_dw(dl: torch.Tensor, y: torch.Tensor, gamma: Optional[torch.Tensor],
                  dw_acc: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """dW = scale * (dl^T @ (y * gamma) + dw_acc) (V, d) bf16: the training op's last chunk,
    in its backward. dl: (rows, V) bf16, rows 16-byte aligned; y: (rows, d) bf16; gamma (d,) or
    None; dw_acc: (V, d) fp32 or bf16, or empty (a single chunk); scale: () fp32 (dloss)."""
    check_lm_head_dw(OP_DW, dl, y, gamma, dw_acc, scale, in_place=False)
    u = _scaled_input(y, gamma)
    acc = str(dw_acc.dtype).removeprefix("torch.") if dw_acc.numel() else None
    inputs = {"scale": scale.reshape(1)}
    if acc is not None:
        inputs["prev"] = dw_acc
    return E.run(finish_dw_tree(acc), dl.t(), u, inputs, op=OP_DW)["out"]


@lm_head_ce_dw.register_fake
def _dw_fake(dl, y, gamma, dw_acc, scale):
    check_lm_head_dw(OP_DW, dl, y, gamma, dw_acc, scale, in_place=False)
    return y.new_empty((dl.shape[1], y.shape[1]))


@torch.library.custom_op("coda::lm_head_ce_dw_", mutates_args=("dw",))
def lm_head_ce_dw_(dl: torch.Tensor, y: torch.Tensor, gamma: Optional[torch.Tensor], dw: torch.Tensor,
                   scale: torch.Tensor) -> None:
    """:func:`lm_head_ce_dw` in place, for a bf16 accumulator: dw <- scale * (dl^T @ (y * gamma)
    + dw), (V, d) bf16. The epilogue reads each tile of dw before its CTA stores that tile, so the
    sum of the other chunks turns into the gradient without a second V x d buffer (1 GiB at
    128256 x 4096). A retained graph's second backward then finds its saved accumulator changed
    and raises (autograd's version check)."""
    check_lm_head_dw(OP_DW_INPLACE, dl, y, gamma, dw, scale, in_place=True)
    E.run(finish_dw_tree(str(dw.dtype).removeprefix("torch.")), dl.t(), _scaled_input(y, gamma),
          {"scale": scale.reshape(1), "prev": dw}, outputs={"out": dw}, op=OP_DW_INPLACE)


@lm_head_ce_dw_.register_fake
def _dw_inplace_fake(dl, y, gamma, dw, scale):
    check_lm_head_dw(OP_DW_INPLACE, dl, y, gamma, dw, scale, in_place=True)


@lm_head_ce_dw.register_kernel("cpu")
def _dw_cpu(dl, y, gamma, dw_acc, scale):
    dispatch.require_reference(OP_DW)
    check_lm_head_dw(OP_DW, dl, y, gamma, dw_acc, scale, in_place=False)
    dw = dl.float().t() @ scale_columns_ref(y, gamma).float()
    if dw_acc.numel():
        dw = dw + dw_acc.float()
    return (dw * scale.float()).to(y.dtype)


@lm_head_ce_dw_.register_kernel("cpu")
def _dw_inplace_cpu(dl, y, gamma, dw, scale):
    dispatch.require_reference(OP_DW_INPLACE)
    check_lm_head_dw(OP_DW_INPLACE, dl, y, gamma, dw, scale, in_place=True)
    dw.copy_(_dw_cpu(dl, y, gamma, dw, scale))


def _padded_width(v: int) -> int:
    """A row of the logits buffer: V bf16 values padded to 16 bytes (TMA's row alignment)."""
    return -(-v // 8) * 8


def cross_entropy(y, w_lm, ss, eps: float, targets, ignore_index: int = -100,
                  reduction: str = "mean", gamma=None):
    """The loss through ``coda.lm_head_ce_train`` where a gradient is wanted and the reduction
    is "mean" or "sum", else through ``coda.lm_head_ce`` (no gradient work in the forward)."""
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (y, w_lm, gamma))
    if wants_grad and reduction in ("mean", "sum"):
        return lm_head_ce_train(y, w_lm, ss, eps, targets, ignore_index, reduction, gamma)[0]
    return lm_head_ce(y, w_lm, ss, eps, targets, ignore_index, reduction, gamma)[0]


# -- the chunked gradient pass ------------------------------------------------------------------------
def plan_chunks(m: int, v: int, d: int, budget: Optional[int] = None):
    """(rows per chunk, dW accumulator dtype or None): one chunk when M rows of bf16 logits fit
    ``budget``, else the largest power-of-two multiple of ``CHUNK_ROW_MULTIPLE`` rows that fits.
    Power-of-two chunks are whole 2-CTA clusters of 128-row tiles and whole raster bands, which
    the heuristic's configs need to run at full speed (H200, bf16, in turns with cuBLAS at
    d = 4096: 4096-row chunks' logits and dgrad GEMMs 1.062x and 1.006x cuBLAS, 5504-row chunks
    0.965x and 0.969x). More than one chunk accumulates dW in fp32 where the V x d fp32 sum fits
    next to a chunk, else in bf16."""
    budget = CHUNK_BYTES if budget is None else budget
    row_bytes = 2 * _padded_width(v)
    if m * row_bytes <= budget:
        return m, None
    tiles = max(1, budget // row_bytes // CHUNK_ROW_MULTIPLE)
    rows = CHUNK_ROW_MULTIPLE << (tiles.bit_length() - 1)
    if rows >= m:  # a budget below one 128-row chunk: one chunk of all rows all the same
        return m, None
    if 4 * v * d + rows * row_bytes <= budget:
        return rows, torch.float32
    return rows, torch.bfloat16


def _chunked(y, w_lm, ss, eps, targets, ignore_index, reduction, gamma, dloss=None, lse=None,
             dlse=None, defer_last: bool = False):
    """(dy, dw_lm, dgamma or None, lse, target logit, the last chunk's dl operand and its wgrad
    operand, or None, None) over row chunks. Without ``lse`` (the training forward), per chunk:
    the target logits, the logits GEMM storing the exp form e, the row step making e the operand
    e' of dl' = diag(rs) e' in place (``exp_combine_``), the dgrad GEMM (``exp_dgrad_tree``)
    and the row finish (``lm_head_rows_``: dy's projection, the wgrad operand diag(rs) u). With
    it (the recomputing backward) one GEMM writes dl' directly and the dgrad takes the RMSNorm
    backward in its epilogue. Then per chunk dW += e'^T @ (rs u) (training) or dl'^T @ u,
    accumulated in chunk order (deterministic). ``defer_last``: the last chunk's dW is left out (dw_lm is then the
    accumulator of the others, None with one chunk) and its two operands returned."""
    m, d = y.shape
    v = w_lm.shape[0]
    u = _scaled_input(y, gamma)
    r = rms_rstd_ref(ss, d, eps)
    coef = ce_coef(targets, ignore_index, reduction, dloss)
    tgt = targets.to(torch.int32)
    rows, acc_dtype = plan_chunks(m, v, d)
    buf = torch.empty((rows, _padded_width(v)), dtype=y.dtype, device=y.device)
    dy = torch.empty_like(y)
    train = lse is None
    if train:
        lse = torch.empty(m, dtype=F32, device=y.device)
        target_logit = torch.empty(m, dtype=F32, device=y.device)
        gamma_row = gamma.to(y.dtype) if gamma is not None else torch.ones(d, dtype=y.dtype, device=y.device)
        if gamma_row.data_ptr() % 16:  # a view into a flat buffer: the row finish reads 16-byte vectors
            gamma_row = gamma_row.clone()
    else:
        target_logit = None
        # contiguous: the epilogue reads it as a row vector (autograd hands an expanded one
        # to a backward of lse.sum())
        dlse = torch.zeros_like(lse) if dlse is None else dlse.to(F32).contiguous()
    gamma_col = None if gamma is None else gamma.to(F32)
    dgamma = None if gamma is None else torch.zeros(d, dtype=F32, device=y.device)
    dw = None
    for i in range(0, m, rows):
        s = slice(i, min(i + rows, m))
        dl = buf[: s.stop - i, :v]
        stats = norm_inputs(d, ss[s], eps)
        inputs = {"y": y[s]} if gamma is None else {"y": y[s], "gamma": gamma_col}
        if train:
            tl = target_logits(u[s], w_lm, tgt[s], r[s], out=target_logit[s])
            out = E.run(exp_logits_tree(), u[s], w_lm.t(), dict(stats, target_logit=tl),
                        outputs={"e": dl}, config=exp_config(dispatch.card_of(y.device)), op=OP_TRAIN)
            rs = exp_combine_(dl, out["se"], u[s], w_lm, tl, tgt[s], coef[s], r[s], EXP_TILE, EXP_GUARD, lse[s])
            out = E.run(exp_dgrad_tree(gamma is not None), dl, w_lm, dict(inputs, rs=rs),
                        outputs={"dy": dy[s]}, op=OP_TRAIN)
            u_w = lm_head_rows_(dy[s], y[s], gamma_row, r[s], out["zdz"].sum(-1), rs)
        else:
            zdz = E.run(dlogits_tree(), u[s], w_lm.t(),
                        dict(stats, lse=lse[s], coef=coef[s], dlse=dlse[s], targets=tgt[s]),
                        outputs={"dl": dl}, op=OP)["zdz"]
            out = E.run(norm_backward_tree(False, gamma is not None), dl, w_lm, dict(stats, zdz=zdz, **inputs),
                        outputs={"dy": dy[s]}, op=OP)
            u_w = u[s]
        if gamma is not None:
            dgamma += out["dgamma"].sum(-1)
        if defer_last and s.stop == m:
            return dy, dw, dgamma, lse, target_logit, dl, u_w
        dw = _add_wgrad(dw, dl, u_w, acc_dtype or w_lm.dtype)
    return dy, dw.to(w_lm.dtype), dgamma, lse, target_logit, None, None


def _add_wgrad(dw, dl, u, dtype):
    """dw (+)= dl^T @ u in ``dtype``, in place after the first chunk."""
    name = str(dtype).removeprefix("torch.")
    if dw is None:
        return E.run(gemm_tree("none", "none", name), dl.t(), u, {}, op=OP)["out"]
    E.run(accumulate_tree(name), dl.t(), u, {"prev": dw}, outputs={"out": dw}, op=OP)
    return dw


# torch.autocast: activations and weights in bf16 (ops.autocast)
bf16_under_autocast("coda::lm_head_ce", (0, 1, 7))
bf16_under_autocast("coda::lm_head_ce_train", (0, 1, 7))


# Python callers skip the dispatcher where nothing needs it (ops.eager)
lm_head_ce = direct(lm_head_ce)
lm_head_ce_backward = direct(lm_head_ce_backward)
lm_head_ce_train = direct(lm_head_ce_train)
lm_head_ce_dw = direct(lm_head_ce_dw)
