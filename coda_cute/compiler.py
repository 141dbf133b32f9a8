"""Compiling CuTe DSL kernels: specs, fake-tensor signatures, the in-process cache, artifacts.

A :class:`GemmSpec` is everything a compiled GEMM binary depends on: target arch, operand dtypes
and majors, output dtype, scale modes and the kernel config. Problem sizes are *not* part of it:
kernels are compiled against symbolic extents (``cute.sym_int``) through TVM-FFI, so one binary
serves every M, N, K and batch count with the same dtypes and layouts. Compilation needs no GPU
(``--gpu-arch`` cross-compiles), which is how CI and ``coda-cute report`` inspect every config.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field

from .kernels.common.config import GemmConfig

# torch dtype name -> element bytes; the DSL types are looked up lazily (importing the DSL is slow).
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
_CUTLASS_NAMES = {
    "bfloat16": "BFloat16",
    "float16": "Float16",
    "float32": "Float32",
    "float8_e4m3fn": "Float8E4M3FN",
    "float8_e5m2": "Float8E5M2",
}
SUPPORTED_ARCHS = ("sm_90a",)


@dataclass(frozen=True)
class GemmSpec:
    """Compile-time identity of one GEMM kernel binary."""

    a_dtype: str
    b_dtype: str
    d_dtype: str
    a_major: str  # "k" or "m"
    b_major: str  # "k" or "n"
    config: GemmConfig
    scale_a: str = "none"  # "none" | "tensor" | "row"
    scale_b: str = "none"
    arch: str = "sm_90a"
    num_sms: int = 132

    @property
    def name(self) -> str:
        scales = "" if self.scale_a == self.scale_b == "none" else f"_s{self.scale_a[0]}{self.scale_b[0]}"
        return (
            f"gemm_{self.arch}_{_short(self.a_dtype)}{_short(self.b_dtype)}{_short(self.d_dtype)}"
            f"_{self.a_major}{self.b_major}{scales}_{self.config.name}"
        )


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float16": "f16", "float32": "f32",
            "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}[dtype]


@dataclass
class CompiledKernel:
    spec: GemmSpec
    fn: object
    compile_seconds: float
    ptx: str | None = None
    cubin: bytes | None = None
    stats: dict = field(default_factory=dict)


def cutlass_dtype(name: str):
    import cutlass

    return getattr(cutlass, _CUTLASS_NAMES[name])


def _fake_signature(spec: GemmSpec):
    """Fake tensors standing for (A, B, D, scale_a, scale_b) with symbolic extents and strides.

    Shared symbols make TVM-FFI check at call time that the extents agree (A and D share M, ...).
    Leading strides are declared 16-byte divisible, which TMA requires.
    """
    import cutlass
    import cutlass.cute as cute

    m, n, k, l = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()

    def stride16(dtype: str):
        return cute.sym_int64(divisibility=16 // DTYPE_BYTES[dtype])

    def operand(dtype, rows, major_is_k):
        stride = (stride16(dtype), 1, stride16(dtype)) if major_is_k else (1, stride16(dtype), stride16(dtype))
        return cute.runtime.make_fake_tensor(cutlass_dtype(dtype), (rows, k, l), stride=stride, assumed_align=16)

    a = operand(spec.a_dtype, m, spec.a_major == "k")
    b = operand(spec.b_dtype, n, spec.b_major == "k")
    d = cute.runtime.make_fake_tensor(
        cutlass_dtype(spec.d_dtype), (m, n, l),
        stride=(stride16(spec.d_dtype), 1, stride16(spec.d_dtype)), assumed_align=16,
    )

    def scale(mode, extent):
        if mode == "none":
            return None
        if mode == "tensor":
            return cute.runtime.make_fake_tensor(cutlass.Float32, (1,), stride=(1,), assumed_align=4)
        return cute.runtime.make_fake_tensor(
            cutlass.Float32, (extent, l), stride=(1, cute.sym_int64()), assumed_align=4
        )

    return a, b, d, scale(spec.scale_a, m), scale(spec.scale_b, n)


_PTXAS_RE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack_frame": re.compile(r"(\d+) bytes stack frame"),
}


def parse_ptxas_remarks(text: str) -> dict:
    """Registers / spills / stack reported by ptxas (summed spills, max registers over kernels)."""
    out = {}
    for key, rx in _PTXAS_RE.items():
        vals = [int(v) for v in rx.findall(text)]
        if vals:
            out[key] = max(vals) if key == "registers" else sum(vals)
    return out


_compile_lock = threading.Lock()


def compile_gemm(spec: GemmSpec, keep_artifacts: bool = False) -> CompiledKernel:
    """Compile one GEMM spec (no GPU needed). ``keep_artifacts`` also returns PTX, cubin and
    ptxas statistics."""
    if spec.arch not in SUPPORTED_ARCHS:
        raise NotImplementedError(f"no GEMM kernel for arch {spec.arch!r} (have {SUPPORTED_ARCHS})")
    import cutlass.cute as cute

    from .kernels.epilogue.scale import ScaleVisitor
    from .kernels.sm90.gemm import Sm90Gemm

    kernel = Sm90Gemm(
        spec.config, cutlass_dtype(spec.a_dtype), cutlass_dtype(spec.b_dtype),
        cutlass_dtype(spec.d_dtype), spec.a_major, spec.b_major,
        ScaleVisitor(spec.scale_a, spec.scale_b), spec.num_sms,
    )
    args = _fake_signature(spec)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    opts = f"--gpu-arch {spec.arch} --enable-tvm-ffi"
    with _compile_lock, tempfile.TemporaryDirectory(prefix="coda_cute_") as tmp:
        remarks = os.path.join(tmp, "remarks.yaml")
        if keep_artifacts:
            opts += f" --keep-ptx --keep-cubin --dump-dir {tmp} remarks{{ptx}} --remark-output {remarks}"
        _pin_runtime_arch(spec.arch)
        t0 = time.perf_counter()
        fn = cute.compile(kernel, *args, stream, options=opts)
        seconds = time.perf_counter() - t0
        out = CompiledKernel(spec, fn, seconds)
        if keep_artifacts:
            out.ptx = fn.__ptx__
            out.cubin = fn.__cubin__
            if os.path.exists(remarks):
                with open(remarks) as fh:
                    out.stats = parse_ptxas_remarks(fh.read())
    return out


def _pin_runtime_arch(arch: str) -> None:
    # Without a GPU the DSL assumes sm_100a; a differing --gpu-arch would be treated as a
    # cross-compile with no host JIT engine. Make the DSL's notion of the target match.
    os.environ.setdefault("CUTE_DSL_ARCH", arch)


_cache: dict[GemmSpec, CompiledKernel] = {}


def get_gemm(spec: GemmSpec) -> CompiledKernel:
    """The compiled kernel for ``spec``, compiling it on first use (cached for the process)."""
    hit = _cache.get(spec)
    if hit is None:
        hit = _cache[spec] = compile_gemm(spec)
    return hit


def compiled_kernels() -> list[CompiledKernel]:
    """Kernels compiled so far in this process, in compile order."""
    return list(_cache.values())
