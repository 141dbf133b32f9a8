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

from typing import Optional

import torch

from .. import dispatch
from ..compiler import FP8_DTYPES, GemmSpec, get_gemm
from ..kernels.common.config import GemmConfig

_WIDE = (torch.bfloat16, torch.float16)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT = (torch.bfloat16, torch.float16, torch.float32)


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


# -- validation -----------------------------------------------------------------------------------
def check_shapes(a: torch.Tensor, b: torch.Tensor, scale_a, scale_b, out_dtype):
    """Dtype and shape rules (also run on fake tensors). Returns (M, N, K, L, out_dtype)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError("coda.gemm: a and b must be torch.Tensors")
    if a.dim() not in (2, 3) or b.dim() != a.dim():
        raise ValueError(
            f"coda.gemm: a and b must both be 2-D (torch.mm) or both 3-D (torch.bmm); "
            f"got a.dim()={a.dim()}, b.dim()={b.dim()}"
        )
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(
            f"coda.gemm: inner dimensions differ: a is {tuple(a.shape)} (K={a.shape[-1]}), "
            f"b is {tuple(b.shape)} (K={b.shape[-2]})"
        )
    batch = 1
    if a.dim() == 3:
        if a.shape[0] != b.shape[0]:
            raise ValueError(f"coda.gemm: batch sizes differ: a has {a.shape[0]}, b has {b.shape[0]}")
        batch = a.shape[0]
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]

    fp8 = a.dtype in _FP8
    if fp8 != (b.dtype in _FP8):
        raise TypeError(f"coda.gemm: cannot mix FP8 and 16-bit operands: a is {a.dtype}, b is {b.dtype}")
    if not fp8:
        if a.dtype not in _WIDE or b.dtype != a.dtype:
            raise TypeError(
                f"coda.gemm: a and b must be both bfloat16, both float16, or both FP8 "
                f"(float8_e4m3fn / float8_e5m2); got a={a.dtype}, b={b.dtype}"
            )
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


def _unit(dim_extent: int, stride: int) -> bool:
    return stride == 1 or dim_extent == 1


def _operand_view(t: torch.Tensor, name: str, transpose: bool, other_name: str):
    """View ``t`` as the kernel's (rows, K, L) operand; returns (view, major) with major "k" when
    K is the contiguous dimension. Strides of extent-1 dims are replaced by TMA-legal ones."""
    x = t.transpose(-1, -2) if transpose else t
    x = x.unsqueeze(0) if x.dim() == 2 else x
    x = x.permute(1, 2, 0)  # (rows, K, L)
    rows, kk, batch = x.shape
    s_rows, s_k, s_l = x.stride()
    # With K == 1 both dims look unit-stride; a contiguous (rows, 1) operand must then be
    # rows-major, since its row stride (1 element) is no legal K-major TMA stride.
    if _unit(kk, s_k) and not (kk == 1 and rows > 1 and s_rows == 1):
        major = "k"
    elif _unit(rows, s_rows):
        major = other_name
    else:
        raise ValueError(
            f"coda.gemm: {name} has strides {tuple(t.stride())}: one of its last two dimensions "
            f"must be contiguous (stride 1); call .contiguous() first"
        )
    return _tma_view(x, name, major == "k"), major


def _tma_view(x: torch.Tensor, name: str, k_major: bool, dims=("rows", "K", "batch")) -> torch.Tensor:
    """Check TMA's rules on a (rows, cols, L) view whose contiguous dim is 1 (``k_major``) or 0."""
    esize = x.element_size()
    align = 16 // esize
    if x.data_ptr() % 16:
        raise ValueError(f"coda.gemm: {name}'s data pointer must be 16-byte aligned (got offset "
                         f"{x.data_ptr() % 16} bytes); use a fresh or .contiguous() tensor")
    shape = list(x.shape)
    stride = list(x.stride())
    unit = 1 if k_major else 0
    stride[unit] = 1
    span = max(e * s for e, s in zip(shape, stride))
    safe = -(-span // align) * align
    for d in range(3):
        if d == unit:
            continue
        if shape[d] == 1:
            stride[d] = safe  # never stepped over; any aligned positive stride describes it
        elif stride[d] == 0:
            raise ValueError(
                f"coda.gemm: {name} is broadcast (stride 0) along {dims[d]}; TMA needs real "
                f"strides: materialize it with .contiguous()"
            )
        elif stride[d] % align:
            lead = dims[1 - unit] if d != 2 else dims[2]
            raise ValueError(
                f"coda.gemm: {name}'s strides must be multiples of 16 bytes ({align} elements of "
                f"{x.dtype}) except the contiguous one; got {tuple(x.stride())} in kernel order "
                f"({', '.join(dims)}): {dims[unit]} must be a multiple of {align} (or pad the "
                f"{lead} stride)"
            )
    return x.as_strided(shape, stride)


def check_device(a, b, scale_a, scale_b):
    if a.device != b.device:
        raise ValueError(f"coda.gemm: a is on {a.device} but b is on {b.device}")
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if s is not None and s.device != a.device:
            raise ValueError(f"coda.gemm: {name} is on {s.device} but a is on {a.device}")
    return dispatch.arch_of(a.device)


# -- the implementation ------------------------------------------------------------------------------
class _Plan:
    """Everything a call derives from its arguments' metadata (shapes, strides, dtypes, devices):
    built and validated once per signature, so repeated calls only re-check data pointers,
    make three views and launch (small GEMMs are otherwise host-bound)."""

    __slots__ = ("out_shape", "out_dtype", "fill", "a_view", "b_view", "d_view", "sa_view",
                 "sb_view", "kernel", "device")

    def launch(self, a, b, scale_a, scale_b, out):
        if out is None:
            if self.fill is not None:
                return self.fill(self.out_shape, dtype=self.out_dtype, device=self.device)
            out = torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)
        elif out.shape != self.out_shape or out.dtype != self.out_dtype or not out.is_contiguous():
            raise ValueError(f"coda.gemm: out must be a contiguous {self.out_dtype} tensor of "
                             f"shape {self.out_shape}")
        elif self.fill is not None:
            return out.zero_() if self.fill is torch.zeros else out
        for name, t in (("a", a), ("b", b), ("out", out)):
            if t.data_ptr() % 16:
                raise ValueError(f"coda.gemm: {name}'s data pointer must be 16-byte aligned (got "
                                 f"offset {t.data_ptr() % 16} bytes); use a fresh or .contiguous() tensor")
        self.kernel(
            a.as_strided(*self.a_view), b.as_strided(*self.b_view), out.as_strided(*self.d_view),
            None if scale_a is None else scale_a.as_strided(*self.sa_view),
            None if scale_b is None else scale_b.as_strided(*self.sb_view),
        )
        return out


def _meta(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


_plans: dict = {}
_MAX_PLANS = 4096


def gemm_impl(a, b, scale_a=None, scale_b=None, out_dtype=None, use_fast_accum=False,
              config: Optional[GemmConfig] = None, out: Optional[torch.Tensor] = None):
    """The op's CUDA implementation. ``config`` overrides the heuristic (benchmarks, tuner);
    ``out`` is a preallocated contiguous result (tests poison it to catch unwritten tiles)."""
    key = (_meta(a), _meta(b), _meta(scale_a), _meta(scale_b), out_dtype, use_fast_accum, config)
    plan = _plans.get(key)
    if plan is None:
        plan = _make_plan(a, b, scale_a, scale_b, out_dtype, use_fast_accum, config)
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    return plan.launch(a, b, scale_a, scale_b, out)


def _make_plan(a, b, scale_a, scale_b, out_dtype, use_fast_accum, config) -> _Plan:
    m, n, k, batch, out_dtype = check_shapes(a, b, scale_a, scale_b, out_dtype)
    arch = check_device(a, b, scale_a, scale_b)
    plan = _Plan()
    plan.device = a.device
    plan.out_dtype = out_dtype
    plan.out_shape = (batch, m, n) if a.dim() == 3 else (m, n)
    plan.fill = None
    if m == 0 or n == 0 or batch == 0:
        plan.fill = torch.empty
        return plan
    if k == 0:
        plan.fill = torch.zeros
        return plan
    fp8 = a.dtype in _FP8
    a_view, a_major = _operand_view(a, "a", False, "m")
    b_view, b_major = _operand_view(b, "b", True, "n")
    if fp8 and (a_major != "k" or b_major != "k"):
        raise ValueError(
            "coda.gemm: FP8 operands must be K-major (FP8 WGMMA reads K-contiguous tiles): a "
            "row-major (stride (K, 1)) and b column-major (b = w.t() of a row-major w), as for "
            f"torch._scaled_mm; got a strides {tuple(a.stride())}, b strides {tuple(b.stride())}"
        )
    out = torch.empty(plan.out_shape, dtype=out_dtype, device="meta")
    d_view = _tma_view(out.unsqueeze(0).permute(1, 2, 0) if out.dim() == 2 else out.permute(1, 2, 0),
                       "out", k_major=True, dims=("M", "N", "batch"))
    sms = dispatch.num_sms(a.device)
    if config is None:
        config = dispatch.select_config(m, n, k, batch, fp8, use_fast_accum, sms)
    elif fp8 and use_fast_accum != config.fp8_fast_accum:
        config = config.with_(fp8_fast_accum=use_fast_accum)
    plan.a_view = (tuple(a_view.shape), a_view.stride())
    plan.b_view = (tuple(b_view.shape), b_view.stride())
    plan.d_view = (tuple(d_view.shape), d_view.stride())
    plan.sa_view = _scale_view(scale_a, batch)
    plan.sb_view = _scale_view(scale_b, batch)
    spec = GemmSpec(
        _dtype_name(a.dtype), _dtype_name(b.dtype), _dtype_name(out_dtype), a_major, b_major,
        config if fp8 else config.with_(fp8_fast_accum=False),
        _scale_mode(scale_a), _scale_mode(scale_b), arch, sms,
    )
    plan.kernel = get_gemm(spec).fn
    return plan


def _scale_mode(s) -> str:
    if s is None:
        return "none"
    return "tensor" if s.numel() == 1 else "row"


def _scale_view(s, batch):
    """(shape, stride) of the kernel's view of a scale: (extent, L) fp32 for row-wise scales,
    (1,) for a single number."""
    if s is None:
        return None
    if s.numel() == 1:
        return ((1,), (1,))
    extent = s.numel() // batch
    batch_stride = s.stride(0) if s.dim() >= 2 and batch > 1 else extent
    return ((extent, batch), (1, batch_stride))


assert set(FP8_DTYPES) == {_dtype_name(d) for d in _FP8}


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
    m, n, _, batch, out_dtype = check_shapes(a, b, scale_a, scale_b, out_dtype)
    shape = (batch, m, n) if a.dim() == 3 else (m, n)
    return a.new_empty(shape, dtype=out_dtype)


def _gemm_setup_context(ctx, inputs, output):
    a, b, scale_a, scale_b, out_dtype, _ = inputs
    if a.dtype in _FP8 and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
        raise NotImplementedError("coda.gemm: FP8 inputs have no autograd; quantize a detached copy")
    ctx.save_for_backward(a, b)


def _gemm_backward(ctx, grad):
    """d(a @ b): grad_a = grad @ b^T (dgrad), grad_b = a^T @ grad (wgrad); both run on coda.gemm
    with transposed views, no copies."""
    a, b = ctx.saved_tensors
    grad = grad.to(a.dtype)
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = torch.ops.coda.gemm(grad, b.transpose(-1, -2))
    if ctx.needs_input_grad[1]:
        grad_b = torch.ops.coda.gemm(a.transpose(-1, -2), grad)
    return grad_a, grad_b, None, None, None, None


_gemm_op.register_autograd(_gemm_backward, setup_context=_gemm_setup_context)

_reference_on_cpu = [False]


def reference_on_cpu_enabled() -> bool:
    return _reference_on_cpu[0]


@_gemm_op.register_kernel("cpu")
def _gemm_cpu(a, b, scale_a=None, scale_b=None, out_dtype=None, use_fast_accum=False):
    if not reference_on_cpu_enabled():
        raise ValueError(
            "coda.gemm runs on CUDA tensors (Hopper, sm_90); got CPU tensors. Move them with "
            ".cuda(), or wrap the call in coda_cute.reference_on_cpu() to use the fp32 reference."
        )
    from ..reference import gemm_ref

    check_shapes(a, b, scale_a, scale_b, out_dtype)
    return gemm_ref(a, b, scale_a, scale_b, out_dtype)
