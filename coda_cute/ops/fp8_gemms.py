"""The FP8 sublayers' GEMMs (``coda.mlp_block_fp8``, ``coda.attention_block_fp8``), block-scaled as in
``coda_cute.precision.Fp8Recipe``:

* a weight W (N, K) in 128 x 128 blocks, quantized once per forward together with its FP8
  transpose (one pass, ``quantize_weight(transposed=True)``), which the backward keeps: the
  dgrad's K-major operand, with the same scales (QW(W)^T = QW(W^T) exactly: square blocks);
* an activation or gradient in 1 x 128 blocks along K, for the forward and dgrad GEMMs, which run
  the ops' epilogue trees on the block-scaled kernel (:func:`project`);
* a gradient dY and the activation X of a weight gradient dW = dY^T X in 1 x 128 blocks along the
  tokens M (the wgrad form of ``coda.gemm_blockwise``). A gradient feeding both a dgrad and a wgrad
  is quantized once for both (``coda.quantize_fp8_dual``); where M is no multiple of 16 (the rows
  of a transposed FP8 copy start on 16-byte boundaries) the weight gradients are bf16 GEMMs.

With ``row`` (the second recipe, ``Fp8Recipe(scaling="row")``) every operand has one scale per
whole row along K (``coda.quantize_fp8_rowwise``): activations and gradients per token, a
weight W (N, K) per row for the forward and, transposed, per column for the dgrad. A weight
gradient dW = G^T X sums over the tokens, along which G's per-token scales vary: it takes G's
FP8 bytes transposed and folds each token's scale into X's row, then quantizes X's columns (one
scale per feature over all the tokens) (:func:`wgrad`). G is read once for both its GEMMs,
where scales per column of G need G's column amaxes first, a second read of the (M, 2f) gate/up
gradient. Where X is the wider operand and its rows were quantized for a forward GEMM (the MLP's
h, f wide, against dy2's d), the fold goes the other way (:func:`wgrad_kept`): X's kept FP8 bytes
transposed, X's token scales folded into G, G's columns quantized. The GEMMs run on the plain
FP8 kernel with the scales in the epilogue, ``acc * scale_b[n] * scale_a[m]`` read wherever the
tree reads acc (``E.scale_acc``). A weight's two scale vectors travel as one (N + K, 1) tensor,
its row scales then its column scales, where the block recipe has its 128 x 128 grid.

``fast_accum`` (row-wise only, ``Fp8Recipe.fast_accum``): which GEMMs keep their FP8 products in
the tensor core's accumulator for the whole k-loop instead of promoting each k-tile's partial sum
into fp32 (:func:`fast_for`): "none", "forward" (the forward GEMMs: torchao's float8 default) or
"all". The tensor core adds FP8 products at reduced precision (DeepSeek-V3 reports about 2^-14
relative per addition, up to 2 % at K = 4096 in the worst case); promotion costs CUDA-core adds
and a second accumulator's registers. The block recipe always promotes: its scales change per
k-block.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from .. import epilogue as E
from .beside import beside
from .gemm import gemm_impl, gemm_op
from .gemm_blockwise import gemm_blockwise
from .. import dispatch
from ..elementwise_fp8 import quantize_weight
from ..operands import check_pointer_aligned
from ..precision import FAST_ACCUM
from .quantize import (OP as QUANTIZE_OP, check_quantize, quantize_dual_fp8, quantize_fp8, quantize_grad_rowwise_fp8,
                       quantize_rowwise_fp8, transpose_bytes)
from .residual import residual_norm_stats_tree
from .rmsnorm import tile_n_of

FP8 = torch.float8_e4m3fn


def grad_format(e5m2_grads: bool) -> torch.dtype:
    """The gradients' FP8 dtype. The ops take a bool, not a dtype: torch.library hands a dtype
    argument's default to setup_context as its ScalarType number."""
    return torch.float8_e5m2 if e5m2_grads else FP8


def check_fp8_widths(op: str, **widths) -> None:
    """Every named width (a GEMM's K or N) a multiple of 16: the FP8 operands' rows start on
    16-byte boundaries (TMA)."""
    for name, width in widths.items():
        if width % 16:
            raise ValueError(f"{op}: {name} must be a multiple of 16 for FP8 operands, got {width}")


def check_fast_accum(op: str, fast_accum, row: bool) -> None:
    """``fast_accum`` one of :data:`FAST_ACCUM`, and "none" unless ``row`` (block scales are
    promoted per k-block)."""
    if fast_accum not in FAST_ACCUM:
        raise ValueError(f"{op}: fast_accum must be one of {FAST_ACCUM}, got {fast_accum!r}")
    if fast_accum != "none" and not row:
        raise ValueError(f"{op}: fast_accum must be 'none' with block scaling (row_scaling=False): block "
                         f"scales are promoted per k-block, got {fast_accum!r}")


def fast_for(fast_accum: str, role: str) -> bool:
    """Whether a GEMM of ``role`` ("forward", "dgrad" or "wgrad") accumulates in the tensor core."""
    return fast_accum == "all" or (fast_accum == "forward" and role == "forward")


def weight(w: torch.Tensor, pow2: bool = False, row: bool = False):
    """W (N, K) in FP8 128 x 128 blocks: (q, scales, qt = q^T (K, N)); N a multiple of 16
    (:func:`check_fp8_widths`); ``pow2``: power-of-two scales; ``row``: the row-wise recipe, q with
    one scale per row of W, qt with one per column, scales (N + K, 1) those two (fp32 masters
    rounded to bf16 first: 2^-9 relative, far inside FP8's 2^-4). The kernel on CUDA, the
    reference inside ``reference_on_cpu``."""
    check_weight(w)
    if row:
        q, s, qt, st = quantize_rowwise_fp8(as_16_bits(w), FP8, pow2_scales=pow2)
        return q, torch.cat([s, st]), qt
    if w.device.type == "cuda":
        return quantize_weight(w, None, FP8, transposed=True, pow2=pow2)
    dispatch.require_reference("coda.quantize_fp8")
    q, s = quantize_fp8(w, "128x128", None, FP8, pow2)
    return q, s, q.t().contiguous()


def check_weight(w: torch.Tensor) -> None:
    """The rules on every path, before any launch (the CUDA branches check nothing; N: the rows of
    qt, N values each, start on 16-byte boundaries)."""
    check_quantize(w, "128x128", None, FP8, QUANTIZE_OP)
    check_fp8_widths(QUANTIZE_OP, **{"N (rows of the weight, the row width of its FP8 transpose)": w.shape[0]})


def as_16_bits(w: torch.Tensor) -> torch.Tensor:
    """W as the row-wise quantizer reads it: fp32 masters rounded to bf16 first (2^-9 relative, far
    inside FP8's 2^-4)."""
    return w if w.dtype in (torch.bfloat16, torch.float16) else w.to(torch.bfloat16)


def first_projection(op: str, gemm: Callable, given: list, pow2: bool, row: bool, device: torch.device,
                     side_sms: int, **ws) -> tuple:
    """(``gemm``'s output, [(q, scales, qt) of each named weight, as :func:`quantized_weights`]): a
    sublayer's first projection ``gemm(q, scales, sms)`` on the first weight, with every weight
    quantized. In the row-wise recipe, where the op quantizes its weights itself, only the first
    weight's rows come before that GEMM (one read: a row's amax and its cast in one CTA); its
    columns (the dgrad's transpose) and the later weights are read by passes beside it on
    ``side_sms`` SMs (``ops.beside``), since no launch before the join reads them; with 0 (or off
    CUDA) they run in series after it. Every weight is checked before the first launch."""
    if not row or any(t is not None for t in given):
        weights = quantized_weights(op, given, pow2, row, **ws)
        return gemm(*weights[0][:2], None), weights
    first, *later = ws.values()
    for w in ws.values():
        check_weight(w)
    w16 = as_16_bits(first)
    q, s, _, _ = quantize_rowwise_fp8(w16, FP8, cols=False, pow2_scales=pow2)

    def passes():
        _, _, qt, st = quantize_rowwise_fp8(w16, FP8, rows=False, pow2_scales=pow2)
        return [(q, torch.cat([s, st]), qt)] + [weight(w, pow2, row) for w in later]
    return beside(lambda sms: gemm(q, s, sms), passes, device, side_sms)


def quantized_weights(op: str, given: list, pow2: bool, row: bool = False, **ws) -> list:
    """(q, scales, qt) of each named weight W (N, K): the caller's copies ``given`` (flat, in that
    order, as :func:`weight` returns them; e.g. kept once per version of the weights by
    ``coda_cute.nn.fold.WeightQuantCache``), checked against W; or, all None, quantized now."""
    if all(t is None for t in given):
        return [weight(w, pow2, row) for w in ws.values()]
    if any(t is None for t in given):
        raise ValueError(f"{op}: pass every quantized weight (q, scales, qt of {', '.join(ws)}) or none")
    out = []
    for i, (name, w) in enumerate(ws.items()):
        q, s, qt = given[3 * i: 3 * i + 3]
        qt_want, s_want = weight_fake(w, row)
        for what, t, dtype, shape in (("q", q, FP8, tuple(w.shape)), ("scales", s, torch.float32, tuple(s_want.shape)),
                                      ("qt", qt, FP8, tuple(qt_want.shape))):
            if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or t.device != w.device:
                form = "row-wise" if row else "in 128 x 128 blocks"
                raise ValueError(f"{op}: {name}'s quantized {what} must be a contiguous {dtype} {shape} "
                                 f"tensor on {w.device} ({name} {form}), got {t.dtype} {tuple(t.shape)} on {t.device}")
            if what != "scales" and t.numel():  # the GEMMs' operands, which TMA reads
                check_pointer_aligned(t, f"{name}'s quantized {what}", op)
        out.append((q, s, qt))
    return out


def kept_weights(w: torch.Tensor, cached: bool, row: bool = False):
    """The (qt, scales) outputs an FP8 sublayer returns for weight W: W's, or with ``cached``
    (the caller passed its quantized weights and keeps them) empty tensors, since a custom op
    may not return its inputs."""
    if cached:
        return w.new_empty((0,), dtype=FP8), w.new_empty((0,), dtype=torch.float32)
    return weight_fake(w, row)


def weight_fake(w: torch.Tensor, row: bool = False):
    """What the FP8 sublayers keep of a weight for the backward, for their fake implementations:
    qt (K, N) e4m3 and the scales (ceil(N / 128), ceil(K / 128)) fp32; ``row``: (N + K, 1)."""
    n, k = w.shape
    grid = (n + k, 1) if row else (-(-n // 128), -(-k // 128))
    return w.new_empty((k, n), dtype=FP8), w.new_empty(grid, dtype=torch.float32)


def activation(x: torch.Tensor, pow2: bool = False, row: bool = False):
    """(q, scales) of an activation x (M, K) for a forward GEMM: 1 x 128 blocks, or with ``row``
    one scale per token, (M, 1)."""
    if row:
        return quantize_rowwise_fp8(x, FP8, cols=False, pow2_scales=pow2)[:2]
    return quantize_fp8(x, "1x128", None, FP8, pow2)


@functools.lru_cache(maxsize=None)
def row_scaled(tree: E.Epilogue) -> E.Epilogue:
    """``tree`` on the row-wise recipe's accumulator (one tree object per tree: plans are cached by
    it)."""
    return E.scale_acc(tree, "scale_a", "scale_b")


def residual_stats_tiles(m: int, d: int, k: int, device, row: bool = False, fast: bool = False) -> int:
    """The column tiles of the norm-statistics partials the FP8 residual tree (out-proj or
    down-proj, (M, d) from K) writes: those of the config it runs on, block-scaled or with
    ``row`` the plain FP8 kernel's (``fast``: with fast accumulation) (the fake implementations
    size their ``ss`` output by it)."""
    tree = row_scaled(residual_norm_stats_tree()) if row else residual_norm_stats_tree()
    return -(-d // tile_n_of(tree, m, d, k, device, block_scaled=not row, fp8=True, fast_accum=fast))


def project(op: str, tree, a_q, a_s, w_q, w_s, inputs: dict, transposed: bool = False,
            outputs: dict | None = None, row: bool = False, fast: bool = False, sms: int | None = None) -> dict:
    """``tree`` on the quantized a (1 x 128) @ B with the scales: B the quantized weight W (N, K)
    given as ``w_q`` (x @ W.T), or with ``transposed`` dY @ W, ``w_q`` then W's FP8 transpose qt
    (K, N); either way the GEMM's K-major operand is a view. ``outputs``: preallocated, by name.
    ``row``: the row-wise recipe, a's scales (M, 1) and W's (N + K, 1) (:func:`weight`): its row
    scales for x @ W.T, its column scales for dY @ W; ``fast``: its GEMM with fast accumulation;
    ``sms``: the SMs its grid may hold (``ops.beside``)."""
    if row:
        n = w_q.shape[1] if transposed else w_q.shape[0]
        b_s = w_s[n:, 0] if transposed else w_s[:n, 0]
        return E.run(row_scaled(tree), a_q, w_q.t(), dict(inputs, scale_a=a_s[:, 0], scale_b=b_s), op=op,
                     outputs=outputs, use_fast_accum=fast, sms=sms)
    b, b_s = (w_q.t(), w_s.t()) if transposed else (w_q.t(), w_s)
    return E.run(tree, a_q, b, inputs, op=op, block_scales=(a_s, b_s), outputs=outputs, sms=sms)


def grad_operands(g: torch.Tensor, grad_dtype, pow2: bool = False, row: bool = False, wgrad_form: bool = True):
    """(q, s, qt, st) of a gradient g (M, N): 1 x 128 along N for its dgrad and, where M is a
    multiple of 16, along M transposed for its wgrad (else qt, st None: the wgrad in bf16;
    with ``row`` N a multiple of 16 too); ``pow2``: power-of-two
    scales; ``row``: one scale per row of g, qt = q^T the same bytes transposed and st the rows'
    fold factors (M,) (``quantize.quantize_grad_rowwise_fp8``: the wgrad folds the rows' scales
    into its other operand, :func:`wgrad`); without ``wgrad_form`` (row-wise: the wgrad quantizes
    g's columns itself, :func:`wgrad_kept`) qt None."""
    if row:
        return quantize_grad_rowwise_fp8(g, grad_dtype, pow2, transposed=wgrad_form and transposable(g))
    if g.shape[0] % 16 == 0:
        return quantize_dual_fp8(g, grad_dtype, pow2_scales=pow2)
    return (*quantize_fp8(g, "1x128", None, grad_dtype, pow2), None, None)


def transposable(g: torch.Tensor) -> bool:
    """Whether g (M, N) has an FP8 transpose: 16-byte rows both ways (TMA)."""
    return g.shape[0] % 16 == 0 and g.shape[1] % 16 == 0


def wgrad(dy: torch.Tensor, dyt_q, dyt_s, x: torch.Tensor, pow2: bool = False, row: bool = False,
          fast: bool = False) -> torch.Tensor:
    """dW = dy^T @ x over the tokens: FP8 with both operands in 1 x 128 blocks along M (dy's
    transposed quantization given, :func:`grad_operands`; x's scales powers of two with
    ``pow2``), or bf16 where there is none; ``row``: dy^T's bytes with its rows' fold factors
    ``dyt_s`` (M,), x's columns quantized with one scale per feature after the factors scale its
    rows, on the plain FP8 GEMM (``fast``: with fast accumulation):

        dW = q_dy^T @ (fold[:, None] * x)    scale_a = 1, scale_b = the folded columns' scales

    No tokens: dW = 0, a sum over none."""
    return wgrad_prepared(dy, dyt_q, dyt_s, x, pow2, row, fast)()


def _row_gemm(a, b, scale_a, scale_b, out_dtype, fast: bool) -> Callable:
    """A function ``f(sms=None)`` of the row-wise FP8 GEMM ``a @ b`` (``coda.gemm``; with ``sms``
    on that many SMs, beside passes on another stream: ``ops.beside``)."""
    def gemm(sms=None):
        if sms is None:
            return gemm_op(a, b, scale_a, scale_b, out_dtype, fast)
        return gemm_impl(a, b, scale_a, scale_b, out_dtype, fast, sms=sms)
    return gemm


def wgrad_prepared(dy: torch.Tensor, dyt_q, dyt_s, x: torch.Tensor, pow2: bool = False, row: bool = False,
                   fast: bool = False) -> Callable:
    """:func:`wgrad` in two halves: x's quantization now, and a function ``f(sms=None)`` that runs
    the GEMM (a caller runs the memory-bound half beside another GEMM, or passes beside this one on
    all SMs but ``sms`` where the row-wise GEMM runs: ``ops.beside``). With ``dyt_q`` given, dy's
    bytes are not read (dy may be a meta tensor of its shape and dtype) nor held by the function."""
    if dy.shape[0] == 0:
        return lambda sms=None: dy.new_zeros((dy.shape[1], x.shape[1]))
    if dyt_q is None:
        return lambda sms=None: gemm_op(dy.t(), x)
    dtype = dy.dtype
    if row:
        _, _, xt_q, xt_s = quantize_rowwise_fp8(x, FP8, rows=False, pow2_scales=pow2, fold=dyt_s)
        return _row_gemm(dyt_q, xt_q.t(), dyt_s.new_ones(1), xt_s[:, 0], dtype, fast)
    _, _, xt_q, xt_s = quantize_dual_fp8(x, FP8, rows=False, pow2_scales=pow2)
    return lambda sms=None: gemm_blockwise(dyt_q, dyt_s, xt_q, xt_s, dtype, "1x128")


def wgrad_kept(dy: torch.Tensor, x_q: torch.Tensor, x_fold: torch.Tensor, grad_dtype, pow2: bool = False,
               fast: bool = False) -> torch.Tensor:
    """dW = dy^T @ x over the tokens in the row-wise recipe, x kept from the forward as its
    row-wise FP8 bytes ``x_q`` (M, K) with its rows' fold factors ``x_fold`` (M,)
    (``quantize.quantize_grad_rowwise_fp8``): x's bytes transposed, dy's rows scaled by the
    factors and its columns quantized in ``grad_dtype`` (one scale per column of dy over all the
    tokens; ``pow2``: a power of two), on the plain FP8 GEMM (``fast``: fast accumulation):

        dW = sum_m dy[m, :]^T (fold_m q[m, :]) = Qcol(fold[:, None] * dy)^T @ q
             scale_a = dy's folded columns' scales, scale_b = 1

    :func:`wgrad`'s form mirrored, for an x wider than dy (the down-proj's h, f wide, against
    dy2's d): the wide operand moves as FP8 bytes once, the narrow one takes the amax read. Tokens
    not a multiple of 16 (no FP8 transpose): the bf16 GEMM on x dequantized (fold_m = s_m where q's
    row is not zero), so the FP8 rounding of x stays in dW. No tokens: dW = 0. NaN or inf in x
    makes its row's factor NaN, and with it every column scale of dy: dW is all NaN (the forward's
    output row is NaN already)."""
    return wgrad_kept_prepared(dy, x_q, x_fold, grad_dtype, pow2, fast)()


def wgrad_kept_prepared(dy: torch.Tensor, x_q: torch.Tensor, x_fold: torch.Tensor, grad_dtype, pow2: bool = False,
                        fast: bool = False) -> Callable:
    """:func:`wgrad_kept` in two halves: dy's column quantization and x's FP8 transpose now, and a
    function ``f(sms=None)`` that runs the GEMM (:func:`wgrad_prepared`)."""
    if dy.shape[0] == 0:
        return lambda sms=None: dy.new_zeros((dy.shape[1], x_q.shape[1]))
    if dy.shape[0] % 16:
        return lambda sms=None: gemm_op(dy.t(), (x_q.float() * x_fold[:, None]).to(dy.dtype))
    _, _, dyt_q, dyt_s = quantize_rowwise_fp8(dy, grad_dtype, rows=False, pow2_scales=pow2, fold=x_fold)
    xt_q = transpose_bytes(x_q)
    return _row_gemm(dyt_q, xt_q.t(), dyt_s[:, 0], dyt_s.new_ones(1), dy.dtype, fast)
