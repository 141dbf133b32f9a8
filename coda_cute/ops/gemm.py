"""``torch.ops.coda.gemm``: the plain GEMM, with FP8 dequantization scales in its epilogue.

    out = (a @ b) * scale_a * scale_b            (fp32 accumulation, one rounding to out_dtype)

Shapes follow ``torch.mm`` / ``torch.bmm``: ``a`` is (M, K) or (L, M, K), ``b`` is (K, N) or
(L, K, N), the result (M, N) or (L, M, N), row-major.

* 16-bit inputs (bf16 or fp16, both the same): any operand layout where one of the last two dims
  is contiguous - the training products x @ W.T (forward), dY @ W (dgrad) and dY.T @ X (wgrad)
  all run without copies. ``out_dtype`` defaults to the input dtype.
* FP8 inputs (e4m3 / e5m2): ``a`` row-major and ``b`` column-major (both K-major, as WGMMA and
  ``torch._scaled_mm`` require), fp32 ``scale_a`` (a single number, or one per row of ``a``: shape
  (M, 1) or (M,), per batch (L, M, 1)) and fp32 ``scale_b`` (a single number or one per column of
  ``b``: (1, N), (N,), (L, 1, N)). ``out_dtype`` defaults to bf16. ``use_fast_accum`` keeps the
  products in the tensor core's accumulator for the whole K loop (faster, less accurate); by
  default each 128-deep k-tile is promoted into a separate fp32 accumulator.

Every rule is checked before launch, with an error naming the argument and the rule.
"""

from __future__ import annotations

from .autocast import bf16_under_autocast
from .eager import direct
from typing import Optional

import torch

from .. import dispatch
from ..compiler import FP8_DTYPES
from ..epilogue.runner import run
from ..kernels.common.config import GemmConfig
from ..kernels.epilogue.plain import gemm_tree
from ..operands import FP8, check_operands, dtype_name, mn_view, operand_view, tma_view

_OUT = (torch.bfloat16, torch.float16, torch.float32)


# -- validation -----------------------------------------------------------------------------------
def check_shapes(a: torch.Tensor, b: torch.Tensor, scale_a, scale_b, out_dtype, use_fast_accum: bool = False):
    """Dtype and shape rules (also run on fake tensors). Returns (M, N, K, L, out_dtype)."""
    m, n, k, batch, fp8 = check_operands(a, b, "coda.gemm")
    check_fast_accum(a, use_fast_accum)
    if not fp8:
        if scale_a is not None or scale_b is not None:
            raise ValueError("coda.gemm: scale_a / scale_b apply to FP8 inputs only")
    else:
        if scale_a is None or scale_b is None:
            raise ValueError(
                "coda.gemm: FP8 inputs need fp32 scale_a and scale_b (a single number, or one per "
                "row of a / column of b); pass torch.ones(1, device=...) for unscaled data"
            )
        _check_scale("scale_a", scale_a, batch, m, row=True)
        _check_scale("scale_b", scale_b, batch, n, row=False)
    if out_dtype is None:
        out_dtype = torch.bfloat16 if fp8 else a.dtype
    if out_dtype not in _OUT:
        raise TypeError(f"coda.gemm: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    return m, n, k, batch, out_dtype


def check_fast_accum(a, use_fast_accum) -> None:
    """Fast accumulation is an FP8 mode: asked of 16-bit inputs it would be silently ignored."""
    if use_fast_accum and a.dtype not in FP8:
        raise ValueError(f"coda.gemm: use_fast_accum applies to FP8 inputs only, got {a.dtype}")


def _check_scale(name, s, batch, extent, row: bool):
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
        got = s.dtype if isinstance(s, torch.Tensor) else type(s).__name__
        raise TypeError(f"coda.gemm: {name} must be a float32 tensor, got {got}")
    if s.numel() == 1:
        return
    what = "row of a" if row else "column of b"
    shapes = _scale_shapes(batch, extent, row)
    if tuple(s.shape) not in shapes:
        raise ValueError(
            f"coda.gemm: {name} must hold one number, or one per {what}: shape "
            f"{' or '.join(str(x) for x in shapes)}; got {tuple(s.shape)}"
        )
    if extent > 1 and s.stride(_scale_extent_dim(s, row)) != 1:
        raise ValueError(f"coda.gemm: {name} must be contiguous along its {extent} entries, "
                         f"got strides {tuple(s.stride())}")


def _scale_shapes(batch, extent, row):
    batched = [(batch, extent), (batch, extent, 1) if row else (batch, 1, extent)]
    if batch > 1:
        return batched
    return [(extent,), (extent, 1) if row else (1, extent), *batched]


def _scale_extent_dim(s, row):
    # (E,), (E, 1) / (1, E), (B, E), (B, E, 1) / (B, 1, E)
    if s.dim() == 1:
        return 0
    if s.dim() == 2:
        return 0 if (row and s.shape[1] == 1 and s.shape[0] != 1) else 1
    return 1 if row else 2


def check_same_devices(a, b, scale_a, scale_b):
    if a.device != b.device:
        raise ValueError(f"coda.gemm: a is on {a.device} but b is on {b.device}")
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if s is not None and s.device != a.device:
            raise ValueError(f"coda.gemm: {name} is on {s.device} but a is on {a.device}")


def check_device(a, b, scale_a, scale_b):
    check_same_devices(a, b, scale_a, scale_b)
    return dispatch.arch_of(a.device)


def check_layouts(a, b, m: int, n: int, batch: int, out_dtype, op: str = "coda.gemm"):
    """The kernel's layout rules on metadata alone (also for fake and CPU tensors): each operand
    has a contiguous last or second-to-last dim, TMA-aligned strides and a 16-byte aligned data
    pointer; FP8 operands are K-major; the result's rows are 16-byte aligned. An empty product
    (no rows, columns or K: zeros or an empty result, no launch) reads and writes nothing."""
    if a.numel() == 0 or b.numel() == 0:
        return
    _, a_major = operand_view(a, "a", False, "m", op)
    _, b_major = operand_view(b, "b", True, "n", op)
    if a.dtype in FP8 and (a_major != "k" or b_major != "k"):
        raise ValueError(f"{op}: FP8 operands must be K-major (a row-major, b column-major: "
                         f"b = w.t()); got a strides {tuple(a.stride())}, b strides {tuple(b.stride())}")
    out = torch.empty((batch, m, n) if a.dim() == 3 else (m, n), dtype=out_dtype, device="meta")
    tma_view(mn_view(out), "the result", True, ("M", "N", "batch"), op)


# -- the implementation ------------------------------------------------------------------------------
#: per call signature: (tree, batch, empty K); bounded like the runner's plans (a run with a new
#: token count each step adds one per step)
_prepared: dict = {}
_MAX_PREPARED = 4096


def _meta(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def gemm_impl(a, b, scale_a=None, scale_b=None, out_dtype=None, use_fast_accum=False,
              config: Optional[GemmConfig] = None, out: Optional[torch.Tensor] = None,
              split_k: int = 1, sms: Optional[int] = None):
    """The op's CUDA implementation: :func:`gemm_tree` on the epilogue-tree runner. ``config``
    overrides the heuristic (benchmarks, tuner); ``out`` is a preallocated contiguous result
    (tests poison it to catch unwritten tiles); ``split_k`` > 1 splits K (:func:`split_k_gemm`);
    ``sms``: the SMs its persistent grid may hold (``ops.beside``; not with ``split_k``)."""
    check_fast_accum(a, use_fast_accum)  # the prepared key does not hold it
    key = (_meta(a), _meta(b), _meta(scale_a), _meta(scale_b), out_dtype)
    prep = _prepared.get(key)
    if prep is None:
        m, n, k, batch, od = check_shapes(a, b, scale_a, scale_b, out_dtype)
        check_device(a, b, scale_a, scale_b)
        tree = gemm_tree(_scale_mode(scale_a), _scale_mode(scale_b), dtype_name(od))
        if len(_prepared) >= _MAX_PREPARED:
            _prepared.clear()
        prep = _prepared[key] = (tree, batch, k == 0 and m * n * batch > 0)
    tree, batch, zero_k = prep
    if zero_k:  # torch.mm semantics: an empty sum is zero
        shape = (batch, a.shape[-2], b.shape[-1]) if a.dim() == 3 else (a.shape[-2], b.shape[-1])
        od = tree.outputs[0].dtype
        return out.zero_() if out is not None else a.new_zeros(shape, dtype=getattr(torch, od))
    if split_k != 1:
        return split_k_gemm(a, b, split_k, getattr(torch, tree.outputs[0].dtype), config, out)
    inputs = {}
    if scale_a is not None:
        inputs = {"scale_a": _as_vector(scale_a, batch), "scale_b": _as_vector(scale_b, batch)}
    return run(tree, a, b, inputs, config=config, use_fast_accum=use_fast_accum,
               outputs=None if out is None else {"out": out}, op="coda.gemm", sms=sms)["out"]


def check_split_k(a, b, split_k: int, config: Optional[GemmConfig]):
    """Rules of :func:`split_k_gemm`, before any launch."""
    if not isinstance(split_k, int) or split_k < 1:
        raise ValueError(f"coda.gemm: split_k must be a positive int, got {split_k!r}")
    if a.dim() != 2 or a.dtype in FP8:
        raise ValueError("coda.gemm: split_k applies to 2-D 16-bit operands (torch.mm shapes, "
                         f"bf16 / fp16); got a {a.dim()}-D {a.dtype} operand")
    k = a.shape[1]
    step = split_k * (config.tile_k if config is not None else 64)
    if k % step:
        raise ValueError(f"coda.gemm: split_k={split_k} needs K to be a multiple of split_k x "
                         f"tile_k = {step} (every split a whole number of k-tiles); got K={k}")


def split_k_views(a, b, split_k: int):
    """(split_k, M, K / split_k) and (split_k, K / split_k, N) views of a (M, K) and b (K, N),
    any strides: slice s of each is its s-th K range (no copies)."""
    (m, k), n = a.shape, b.shape[1]
    kc = k // split_k
    return (a.as_strided((split_k, m, kc), (kc * a.stride(1), a.stride(0), a.stride(1))),
            b.as_strided((split_k, kc, n), (kc * b.stride(0), b.stride(0), b.stride(1))))


def split_k_gemm(a, b, split_k: int, out_dtype, config: Optional[GemmConfig] = None,
                 out: Optional[torch.Tensor] = None):
    """a @ b as ``split_k`` GEMMs over K slices, summed in fp32:

        out = sum_s a[:, K_s] @ b[K_s, :]      K_s = [s K / split_k, (s + 1) K / split_k)

    The slices are strided views that the kernel runs as the batch of one launch, writing fp32
    partials (split_k, M, N); one torch reduction sums them (deterministic: no atomics) and
    rounds once to ``out_dtype``. For small M, where too few output tiles exist to fill the GPU
    with long K loops (e.g. M = 128, N = 4096, K = 14336: 32 tiles of 128 x 128 on 132 SMs).
    """
    check_split_k(a, b, split_k, config)
    a_s, b_s = split_k_views(a, b, split_k)
    partials = run(gemm_tree("none", "none", "float32"), a_s, b_s, {}, config=config,
                   op="coda.gemm")["out"]
    total = partials.sum(0)
    return out.copy_(total) if out is not None else total.to(out_dtype)


def _as_vector(s, batch):
    """A row-wise scale as the tree's row/column vector ((E,) or (L, E)); single numbers as is."""
    if s.numel() == 1:
        return s
    return s.reshape(batch, -1) if batch > 1 else s.reshape(-1)


def _scale_mode(s) -> str:
    if s is None:
        return "none"
    return "tensor" if s.numel() == 1 else "row"


assert set(FP8_DTYPES) == {dtype_name(d) for d in FP8}


# -- torch.library registration --------------------------------------------------------------------
@torch.library.custom_op("coda::gemm", mutates_args=())
def _gemm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: Optional[torch.Tensor] = None,
    scale_b: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    return gemm_impl(a, b, scale_a, scale_b, out_dtype, use_fast_accum)


@_gemm_op.register_fake
def _gemm_fake(a, b, scale_a=None, scale_b=None, out_dtype=None, use_fast_accum=False):
    m, n, _, batch, out_dtype = check_shapes(a, b, scale_a, scale_b, out_dtype, use_fast_accum)
    check_same_devices(a, b, scale_a, scale_b)
    check_layouts(a, b, m, n, batch, out_dtype)
    shape = (batch, m, n) if a.dim() == 3 else (m, n)
    return a.new_empty(shape, dtype=out_dtype)


def _gemm_setup_context(ctx, inputs, output):
    a, b, scale_a, scale_b, out_dtype, _ = inputs
    if a.dtype in FP8 and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
        raise NotImplementedError("coda.gemm: FP8 inputs have no autograd; quantize a detached copy")
    ctx.save_for_backward(a, b)


def _gemm_backward(ctx, grad):
    """d(a @ b): grad_a = grad @ b^T (dgrad), grad_b = a^T @ grad (wgrad); both run on coda.gemm
    with transposed views, no copies."""
    a, b = ctx.saved_tensors
    grad = grad.to(a.dtype).contiguous()  # e.g. the expanded gradient of a sum: no TMA strides
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = gemm_op(grad, b.transpose(-1, -2))
    if ctx.needs_input_grad[1]:
        grad_b = gemm_op(a.transpose(-1, -2), grad)
    return grad_a, grad_b, None, None, None, None


_gemm_op.register_autograd(_gemm_backward, setup_context=_gemm_setup_context)

@_gemm_op.register_kernel("cpu")
def _gemm_cpu(a, b, scale_a=None, scale_b=None, out_dtype=None, use_fast_accum=False):
    dispatch.require_reference("coda.gemm")
    from ..reference import gemm_ref

    m, n, _, batch, od = check_shapes(a, b, scale_a, scale_b, out_dtype, use_fast_accum)
    check_same_devices(a, b, scale_a, scale_b)
    check_layouts(a, b, m, n, batch, od)
    return gemm_ref(a, b, scale_a, scale_b, out_dtype)


# torch.autocast: activations and weights in bf16 (ops.autocast)
bf16_under_autocast("coda::gemm", (0, 1))


# Python callers skip the dispatcher where nothing needs it (ops.eager)
gemm_op = direct(_gemm_op)
