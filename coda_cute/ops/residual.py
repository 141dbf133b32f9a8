"""``torch.ops.coda.residual_gemm_norm_stats``: a projection into the residual stream plus the
RMSNorm statistics of the result, in one GEMM (the out-proj and the down-proj of a Llama block).

    y = residual + a @ w.T                                      (M, N) bf16, stored
    ss[m, t] = sum_{n in column tile t} cast(y, bf16)[m, n]^2    (M, ceil(N / tile_n)) fp32

Backward (a plain GEMM pair on our kernel, 16-bit operands, fp32 accumulation):
da = dy @ w, dw = dy^T @ a, d residual = dy. ``ss`` is a statistic of y for the consumers'
norms (:mod:`coda_cute.ops.rmsnorm`): their gradients reach y directly, so ss has none.
"""

from __future__ import annotations

import functools

import torch

from .eager import direct
from .gemm import gemm_op
from .autocast import bf16_under_autocast
from .. import dispatch
from .. import epilogue as E
from ..reference import residual_gemm_norm_stats_ref
from .checks import BF16, F32, check_aligned, check_linear, check_same_device, check_shape, check_tensor
from .rmsnorm import tile_n_of

OP = "coda.residual_gemm_norm_stats"


@functools.lru_cache(maxsize=None)
def residual_norm_stats_tree(quantize: bool = False) -> E.Epilogue:
    """y = acc + residual (stored bf16); ss = per-tile sum of cast(y, bf16)^2; ``quantize``: also
    y_q = the bf16 y in FP8 1 x 128 blocks (E4M3), the next layer's block-scaled operand, bit for
    bit a separate quantization of the stored y."""
    y = E.acc() + E.tile("residual")
    sinks = [E.store(y, "y", "bfloat16"), E.row_reduce(E.cast(y, "bfloat16"), "sumsq", "ss")]
    if quantize:
        sinks.append(E.quantize(E.cast(y, "bfloat16"), "y_q"))
    return E.Epilogue(*sinks)


def check_residual(a, w, residual):
    m, n, k = check_linear(OP, "a", a, w)
    check_tensor(OP, "residual", residual, 2, (BF16,), aligned=True)
    check_shape(OP, "residual", residual, (m, n), "(M, N) = ")
    check_aligned(OP, "the output width (rows of w)", n)
    check_same_device(OP, a=a, w=w, residual=residual)
    return m, n, k


def stats_tile_n(a, w) -> int:
    """The column-tile width of the ss partials: that of the config the runner will pick. The
    heuristic depends on (M, N, K), so symbolic shapes are specialized here (int())."""
    (m, k), n = a.shape, w.shape[0]
    return tile_n_of(residual_norm_stats_tree(), int(m), int(n), int(k), a.device)


def residual_impl(a, w, residual):
    """The op's CUDA forward (also used inside the block ops)."""
    out = E.run(residual_norm_stats_tree(), a, w.t(), {"residual": residual}, op=OP)
    return out["y"], out["ss"]


@torch.library.custom_op("coda::residual_gemm_norm_stats", mutates_args=())
def residual_gemm_norm_stats(a: torch.Tensor, w: torch.Tensor,
                             residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The new residual stream and its RMSNorm statistics, in one GEMM (out-proj, down-proj).

        y = residual + a @ w.T                                   (M, N) bf16, stored
        ss[m, t] = sum_{n in column tile t} cast(y, bf16)[m, n]^2   (M, ceil(N / tile_n)) fp32

    a: (M, K) bf16; w: (N, K) bf16; residual: (M, N) bf16; K and N multiples of 8. tile_n is
    the tile width of the GEMM config the heuristic picks (``stats_tile_n``). The squares are
    of the stored (rounded) y, so the consumer normalizes exactly the values it reads.

    Where gamma goes (coda-math 2.1) - option B, gamma folded into the consumer's weight:
    option A stores y and y*gamma, two (M, N) activation writes (as many as the unfused residual
    add + RMSNorm); option B stores only y, saving M*N*2 bytes of writes per norm (128 MiB at
    M = 16384, N = 4096) plus the activation that would stay alive until the consumer reads it.
    The cost moves to the weights: W' = W * gamma[None, :] reads and writes the consumer weight
    (and dgamma = sum_n dW' * W in the backward), a token-count-independent elementwise pass that
    is done once per optimizer step when micro-batches share the weights and once at load time
    for inference. Per forward at 16k tokens the fold traffic (2 * N_consumer * d * 2 bytes:
    96 MiB QKV, 448 MiB gate/up) is comparable to the saved write; for the LM head's V x d
    weight (1 GiB at V = 128256, d = 4096) it is 8x the activation, so the final norm's gamma is
    applied to the activations instead (``coda_cute.ops.lm_head_ce``).

    Measured on the H200 (bf16, Llama-3-8B, 16384 tokens): A's extra y*gamma store costs
    0.046 ms per norm (this op at 16384x4096x4096: 0.920 vs 0.874 ms, scripts/bench_epilogue.py
    --shape 16384 4096 4096, "residual + stats + y*gamma"), 0.09 ms per layer; B's folds cost
    0.069 ms (QKV) + 0.288 ms (gate/up) = 0.36 ms per layer and fold (scripts/bench_block.py).
    So at one forward per optimizer step A is cheaper by ~0.27 ms per layer, B from about four
    micro-batch forwards per step and at inference (no fold at all); B also keeps 128 MiB less
    activation alive per norm until the backward. B is the choice for the layers: training steps
    accumulate micro-batches and activation memory is the binding limit.
    """
    check_residual(a, w, residual)
    return residual_impl(a, w, residual)


@residual_gemm_norm_stats.register_fake
def _fake(a, w, residual):
    m, n, _ = check_residual(a, w, residual)
    t = -(-n // stats_tile_n(a, w))
    return a.new_empty((m, n)), a.new_empty((m, t), dtype=F32)


@residual_gemm_norm_stats.register_kernel("cpu")
def _cpu(a, w, residual):
    dispatch.require_reference(OP)
    check_residual(a, w, residual)
    return residual_gemm_norm_stats_ref(a, w, residual, stats_tile_n(a, w))


def residual_backward(a, w, dy, needs=(True, True, True)):
    """(da, dw, d residual) = (dy @ w, dy^T @ a, dy) on our GEMM, each None where not needed."""
    da = gemm_op(dy, w) if needs[0] else None
    dw = gemm_op(dy.t(), a) if needs[1] else None
    return da, dw, (dy if needs[2] else None)


def _setup(ctx, inputs, output):
    a, w, _ = inputs
    ctx.save_for_backward(a, w)
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # no zero tensors for the outputs without a gradient


def _backward(ctx, dy, _dss):
    a, w = ctx.saved_tensors
    if dy is None:
        return None, None, None
    return residual_backward(a, w, dy.contiguous(), ctx.needs_input_grad)


residual_gemm_norm_stats.register_autograd(_backward, setup_context=_setup)


# torch.autocast: activations and weights in bf16 (ops.autocast)
bf16_under_autocast("coda::residual_gemm_norm_stats", (0, 1, 2))


# Python callers skip the dispatcher where nothing needs it (ops.eager)
residual_gemm_norm_stats = direct(residual_gemm_norm_stats)
