"""The element-wise (bandwidth-bound) kernels: their specs, fake compile signatures and launchers
(the FP8 quantizers' in ``coda_cute.elementwise_fp8``, the LM head's in
``coda_cute.elementwise_lm_head``).

A spec names everything a binary depends on (dtype, compile-time constants, target arch) and
``build()`` returns the kernel object and fake arguments with symbolic extents, which is how
``coda_cute.compiler`` compiles it (no GPU needed) and caches it (in-process and on disk, like
the GEMMs). The launchers check nothing: the ops that call them validate first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .compiler import compile_elementwise, cutlass_dtype, get_kernel, short_dtype

__all__ = ["ScaleColumnsSpec", "FoldBackwardSpec", "CrossEntropyGradSpec", "LseCombineSpec", "RopeBackwardSpec",
           "EmbeddingBackwardSpec", "compile_elementwise", "fold_backward", "embedding_backward",
           "cross_entropy_grad_", "lse_combine", "rope_backward_kernel"]


def _fake(dtype: str, shape, stride, align: int = 4):
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(cutlass_dtype(dtype), shape, stride=stride, assumed_align=align)


def _rows16(dtype: str, n, k):
    """A fake (n, k) matrix whose row stride is a multiple of 8 elements (rows start on 16-byte
    boundaries for 16-bit types, 32-byte for fp32), unit column stride."""
    import cutlass.cute as cute

    return _fake(dtype, (n, k), (cute.sym_int64(divisibility=8), 1), 16)


@dataclass(frozen=True)
class ScaleColumnsSpec:
    """``out = w * gamma[None, :]`` (``kernels.elementwise.scale_columns``) for one 16-bit dtype;
    ``scalar``: ``out = w * s`` with ``s`` a (1,) fp32 tensor, and ``in_dtype`` w's dtype
    ("float32" or 16-bit; None: ``dtype``, out's). The kernel uses no architecture-specific
    instruction; it is built per target like the GEMMs."""

    dtype: str
    arch: str = "sm_90a"
    scalar: bool = False
    in_dtype: str | None = None

    def __post_init__(self):
        if self.in_dtype not in (None, self.dtype) and not self.scalar:
            raise ValueError("ScaleColumnsSpec: only the scalar form converts dtypes")

    @property
    def name(self) -> str:
        src = f"_from_{short_dtype(self.in_dtype)}" if self.in_dtype not in (None, self.dtype) else ""
        return f"scale_{'scalar' if self.scalar else 'columns'}_{self.arch}_{short_dtype(self.dtype)}{src}"

    def build(self):
        import cutlass.cute as cute

        from .kernels.elementwise.scale_columns import ScaleColumns

        n, k = cute.sym_int(), cute.sym_int()
        gamma = _fake("float32", (1,), (1,)) if self.scalar else _fake(self.dtype, (k,), (1,), 16)
        w = _rows16(self.in_dtype or self.dtype, n, k)
        return ScaleColumns(cutlass_dtype(self.dtype), self.scalar), (w, gamma, _rows16(self.dtype, n, k))


@dataclass(frozen=True)
class FoldBackwardSpec:
    """The fold's backward in one pass (``kernels.elementwise.fold_backward``), one 16-bit dtype."""

    dtype: str
    arch: str = "sm_90a"

    @property
    def name(self) -> str:
        return f"fold_backward_{self.arch}_{short_dtype(self.dtype)}"

    def build(self):
        import cutlass.cute as cute

        from .kernels.elementwise.fold_backward import FoldBackward

        n, k = cute.sym_int(), cute.sym_int()
        partial = _fake("float32", (cute.sym_int(), k), (cute.sym_int64(divisibility=8), 1), 16)
        dw, w, out = (_rows16(self.dtype, n, k) for _ in range(3))
        gamma = _fake(self.dtype, (k,), (1,), 16)
        return FoldBackward(cutlass_dtype(self.dtype)), (dw, w, gamma, out, partial)


def fold_backward(dw: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor):
    """(dW = dw * gamma, d gamma = sum_n dw * w) in one pass of our kernel, for 16-bit dw, w (N, K)
    and gamma (K,) of one dtype on a Hopper GPU (the caller checks that); d gamma in gamma's dtype."""
    from .kernels.elementwise.fold_backward import num_bands

    from . import dispatch

    n, k = w.shape
    out = torch.empty_like(w)
    partial = torch.empty((num_bands(n), k), dtype=torch.float32, device=w.device)
    get_kernel(FoldBackwardSpec(str(w.dtype).removeprefix("torch."), dispatch.arch_of(w.device))).fn(
        dw, w, gamma, out, partial)
    return out, partial.sum(0).to(gamma.dtype)


@dataclass(frozen=True)
class EmbeddingBackwardSpec:
    """The token embedding's backward in one deterministic pass over the table
    (``kernels.elementwise.embedding_backward``), for one dtype of the gradient and table."""

    dtype: str
    arch: str = "sm_90a"

    @property
    def name(self) -> str:
        return f"embedding_backward_{self.arch}_{short_dtype(self.dtype)}"

    def build(self):
        import cutlass.cute as cute

        from .kernels.elementwise.embedding_backward import EmbeddingBackward

        m, v, d = cute.sym_int(), cute.sym_int(), cute.sym_int()
        per16 = 16 // (torch.finfo(getattr(torch, self.dtype)).bits // 8)  # elements per 16 bytes

        def rows(n):
            return _fake(self.dtype, (n, d), (cute.sym_int64(divisibility=per16), 1), 16)

        return EmbeddingBackward(cutlass_dtype(self.dtype)), (
            rows(m), _fake("int32", (m,), (1,)), _fake("int32", (v,), (1,)), _fake("int32", (v,), (1,)),
            rows(v))


def embedding_backward(dx: torch.Tensor, order: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                       out: torch.Tensor) -> torch.Tensor:
    """Writes every row of ``out`` (V, d), dx's dtype, contiguous: row v the sum of dx[order[i]]
    over i in [starts[v], ends[v]) (fp32, in order), zeros for an empty range; dx (M, d) rows
    16-byte aligned, d a multiple of 8, order / starts / ends int32 (the caller checks that)."""
    from . import dispatch

    spec = EmbeddingBackwardSpec(str(dx.dtype).removeprefix("torch."), dispatch.arch_of(dx.device))
    get_kernel(spec).fn(dx, order, starts, ends, out)
    return out


@dataclass(frozen=True)
class CrossEntropyGradSpec:
    """The cross-entropy gradient in place (``kernels.elementwise.ce_grad``), bf16 logits."""

    arch: str = "sm_90a"

    @property
    def name(self) -> str:
        return f"ce_grad_{self.arch}_bf16"

    def build(self):
        import cutlass.cute as cute

        from .kernels.elementwise.ce_grad import CrossEntropyGrad

        m, v = cute.sym_int(), cute.sym_int()
        vec = (m,)
        return CrossEntropyGrad(), (
            _fake("bfloat16", (m, v), (cute.sym_int64(divisibility=8), 1), 16),
            _fake("float32", vec, (1,)), _fake("float32", vec, (1,)), _fake("float32", vec, (1,)),
            _fake("int32", vec, (1,)), _fake("float32", vec, (1,)),
            _fake("float32", (m, cute.sym_int()), (cute.sym_int64(), 1)),
        )


def cross_entropy_grad_(logits: torch.Tensor, lse, rstd, coef, targets, target_logit) -> torch.Tensor:
    """In place on ``logits`` (M, V) bf16 (rows 16-byte aligned): rstd coef (softmax - onehot),
    the target's probability from ``target_logit`` (M,) fp32 rather than its bf16 logit;
    returns the (M, T) fp32 partials of coef sum_v (softmax - onehot) logits per column chunk
    (``kernels.elementwise.ce_grad``)."""
    from .kernels.elementwise.ce_grad import num_chunks

    from . import dispatch

    m, v = logits.shape
    partials = torch.empty((m, num_chunks(v)), dtype=torch.float32, device=logits.device)
    get_kernel(CrossEntropyGradSpec(dispatch.arch_of(logits.device))).fn(
        logits, lse, rstd, coef, targets, target_logit, partials)
    return partials


@dataclass(frozen=True)
class LseCombineSpec:
    """A row's log-sum-exp from its per-tile (max, sum exp) partials (``kernels.elementwise.lse_combine``)."""

    arch: str = "sm_90a"

    @property
    def name(self) -> str:
        return f"lse_combine_{self.arch}"

    def build(self):
        import cutlass.cute as cute

        from .kernels.elementwise.lse_combine import LseCombine

        m, t = cute.sym_int(), cute.sym_int()
        parts = [_fake("float32", (m, t), (cute.sym_int64(), 1)) for _ in range(2)]
        return LseCombine(), (*parts, _fake("float32", (m,), (1,)))


def lse_combine(mx: torch.Tensor, se: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``epilogue.finalize_lse(mx, se)`` in one launch: mx, se (M, T) fp32 with unit stride along
    T (an ``lse`` reduction's partials), into ``out`` (M,) fp32 contiguous (allocated if None)."""
    from . import dispatch

    if out is None:
        out = torch.empty(mx.shape[0], dtype=torch.float32, device=mx.device)
    get_kernel(LseCombineSpec(dispatch.arch_of(mx.device))).fn(mx, se, out)
    return out


@dataclass(frozen=True)
class RopeBackwardSpec:
    """The RoPE (+ QK-norm) backward (``kernels.elementwise.rope_backward``) for one head layout;
    ``weight_dtype``: the QK-norm weights' ("float32" or "bfloat16", read as they are);
    ``tuning``: (option, value) pairs over the kernel's defaults (``RopeBackward.DEFAULTS``;
    ``scripts/bench_rope_backward.py --sweep``)."""

    qk_norm: bool
    head_dim: int
    n_heads: int
    n_kv_heads: int
    arch: str = "sm_90a"
    num_sms: int = 132
    tuning: tuple = ()
    weight_dtype: str = "float32"

    def __post_init__(self):
        if self.weight_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"RopeBackwardSpec: weight_dtype must be float32 or bfloat16, got {self.weight_dtype!r}")
        # one spec (and one compiled kernel) per distinct tuning: pairs sorted, a dict taken too
        if not self.tuning:
            object.__setattr__(self, "tuning", ())
            return
        pairs = tuple(sorted(dict(self.tuning).items()))
        from .kernels.elementwise.rope_backward import RopeBackward

        unknown = {k for k, _ in pairs} - set(RopeBackward.DEFAULTS[bool(self.qk_norm)])
        if unknown:
            raise ValueError(f"RopeBackwardSpec: unknown tuning options {sorted(unknown)}")
        object.__setattr__(self, "tuning", pairs)

    @property
    def name(self) -> str:
        qk = ("_qknorm" + ("_wbf16" if self.weight_dtype == "bfloat16" else "")) if self.qk_norm else ""
        tuned = "".join(f"_{k}{v}" for k, v in self.tuning)
        return f"rope_backward_{self.arch}_h{self.n_heads}x{self.n_kv_heads}_d{self.head_dim}{qk}{tuned}"

    def kernel(self):
        from .kernels.elementwise.rope_backward import RopeBackward

        return RopeBackward(self.qk_norm, self.head_dim, self.n_heads, self.n_kv_heads, self.num_sms,
                            **dict(self.tuning))

    def build(self):
        import cutlass
        import cutlass.cute as cute

        kernel = self.kernel()
        b, s, m = cute.sym_int(), cute.sym_int(), cute.sym_int()
        d, n = self.head_dim, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

        def d8():
            return cute.sym_int64(divisibility=8)

        def heads(h):
            return _fake("bfloat16", (b, h, s, d), (d8(), d8(), d8(), 1), 16)

        def rows():
            return _fake("bfloat16", (m, n), (d8(), 1), 16)

        args = [heads(self.n_heads), heads(self.n_kv_heads), heads(self.n_kv_heads), rows(),
                _fake("float32", (m,), (1,)), _fake("int32", (m,), (1,)),
                _fake("float32", (d // 2,), (1,), 16), rows(), _fake("float32", (m,), (1,))]
        if self.qk_norm:
            w_align = 4 if self.weight_dtype == "float32" else 2

            def weight():
                return _fake(self.weight_dtype, (d,), (1,), w_align)
            args += [rows(), weight(), weight(), _fake("float32", (cute.sym_int(), 2, d), (2 * d, d, 1), 16),
                     _fake("int32", (1,), (1,)), weight(), weight()]
        else:
            args += [None] * 7
        return kernel, (*args, cutlass.Float32(1e-6))


@functools.lru_cache(maxsize=None)
def _rope_layout(spec: RopeBackwardSpec):
    """The kernel object of ``spec`` (its grid for a row count), built once per spec."""
    return spec.kernel()


_COUNTERS: dict = {}


def _arrival_counter(device) -> torch.Tensor:
    """The int32 zero the QK-norm RoPE backward's CTAs count themselves on (its last CTA sets it
    back to 0): one per device and stream, so that launches that may run at the same time never
    share one; under CUDA-graph capture a new one each call (its zeroing captured with the
    kernel: memory of the graph's pool may not outlive the graph)."""
    with torch.cuda.device(device):  # the capture state and stream of the tensors' device
        capturing = torch.cuda.is_current_stream_capturing()
        stream = torch.cuda.current_stream(device).cuda_stream
    if capturing:
        return torch.zeros(1, dtype=torch.int32, device=device)
    key = (device, stream)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def rope_backward_kernel(dq, dk, dv, qkv, rstd, positions, inv_freq, pre, q_w, k_w, qk_eps: float,
                         tuning: tuple = ()):
    """(g, zdz (M, 1), (dq_w, dk_w) or None): one launch of the RoPE (+ QK-norm) backward kernel;
    with QK-norm dq_w, dk_w (head_dim,) the norm weights' gradients in their dtype. ``q_w``,
    ``k_w``: the QK-norm weights (head_dim,), contiguous, both fp32 or both bf16, with QK-norm,
    else None; ``tuning`` as in ``RopeBackwardSpec``. No rows: nothing launched, zero gradients."""
    from . import dispatch

    b, h, s, d = dq.shape
    if pre is not None and (q_w.dtype != k_w.dtype or q_w.dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError(f"rope_backward_kernel: q_w and k_w must both be float32 or both bfloat16, got "
                         f"{q_w.dtype} and {k_w.dtype}")
    wdt = "float32" if pre is None else {torch.float32: "float32", torch.bfloat16: "bfloat16"}[q_w.dtype]
    spec = RopeBackwardSpec(pre is not None, d, h, dk.shape[1], dispatch.arch_of(qkv.device),
                            dispatch.num_sms(qkv.device), tuple(tuning), wdt)
    m, n = qkv.shape
    g = torch.empty_like(qkv)
    zdz = torch.empty((m, 1), dtype=torch.float32, device=qkv.device)
    if m == 0:
        return g, zdz, (None if pre is None else (torch.zeros_like(q_w), torch.zeros_like(k_w)))
    partials = counter = dws = None
    if pre is not None:
        partials = torch.empty((_rope_layout(spec).num_row_blocks(m), 2, d), dtype=torch.float32, device=qkv.device)
        counter = _arrival_counter(qkv.device)
        dws = (torch.empty_like(q_w), torch.empty_like(k_w))
    get_kernel(spec).fn(dq, dk, dv, qkv, rstd, positions, inv_freq, g, zdz.view(m), pre, q_w, k_w, partials,
                        counter, *(dws or (None, None)), float(qk_eps))
    return g, zdz, dws
