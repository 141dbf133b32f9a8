"""Compiling CuTe DSL kernels: specs, fake-tensor signatures, the in-process cache, artifacts.

A :class:`GemmSpec` is everything a compiled GEMM binary depends on: target arch, operand dtypes
and majors, output dtype, scale modes and the kernel config. Problem sizes are *not* part of it:
kernels are compiled against symbolic extents (``cute.sym_int``) through TVM-FFI, so one binary
serves every M, N, K and batch count with the same dtypes and layouts. Compilation needs no GPU
(``--gpu-arch`` cross-compiles), which is how CI and ``coda-cute report`` inspect every config.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field, fields

from .kernels.common.config import GemmConfig
from .kernels.epilogue.nodes import Epilogue
from .kernels.epilogue.plain import gemm_tree

# torch dtype name -> element bytes; the DSL types are looked up lazily (importing the DSL is slow).
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "int32": 4, "int16": 2}
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
_CUTLASS_NAMES = {
    "bfloat16": "BFloat16",
    "float16": "Float16",
    "float32": "Float32",
    "float8_e4m3fn": "Float8E4M3FN",
    "float8_e5m2": "Float8E5M2",
    "int32": "Int32",
    "int16": "Int16",  # a quantize sink's FP8 column pairs
    "uint8": "Uint8",  # any 1-byte matrix as bytes (the FP8 transpose)
}
SUPPORTED_ARCHS = ("sm_90a",)


@dataclass(frozen=True)
class KernelSpec:
    """Compile-time identity of one kernel binary: operands, config, epilogue tree, target.

    Equality and hashing use the tree's structural key, so two separately built but identical
    trees share a binary.
    """

    a_dtype: str
    b_dtype: str
    a_major: str  # "k" or "m"
    b_major: str  # "k" or "n"
    config: GemmConfig
    tree_key: tuple
    arch: str = "sm_90a"
    num_sms: int = 132
    tree: Epilogue = field(default=None, compare=False, hash=False, repr=False)
    label: str = field(default="tree", compare=False, hash=False)
    #: FP8 with 1 x 128 (A) and 128 x 128 (B) scales promoted per k-tile (``kernels.sm90.block_scales``)
    block_scaled: bool = False
    #: block-scaled with B's scales per row too (1 x 128): the weight-gradient form
    b_rows: bool = False

    @staticmethod
    def of(a_dtype, b_dtype, a_major, b_major, config, tree: Epilogue, arch="sm_90a", num_sms=132,
           label="tree", block_scaled: bool = False, b_rows: bool = False) -> "KernelSpec":
        return KernelSpec(a_dtype, b_dtype, a_major, b_major, config, tree.key, arch, num_sms, tree, label,
                          block_scaled, b_rows)

    @property
    def name(self) -> str:
        return (f"{self.label}_{self.arch}_{short_dtype(self.a_dtype)}{short_dtype(self.b_dtype)}"
                f"_{self.a_major}{self.b_major}{self._scaling}_{self.config.name}")

    @property
    def _scaling(self) -> str:
        return ("_blockscaled1d" if self.b_rows else "_blockscaled") if self.block_scaled else ""


@dataclass(frozen=True)
class GemmSpec:
    """A plain GEMM (``coda.gemm``): its epilogue is ``out = acc * scale_a * scale_b``."""

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
            f"gemm_{self.arch}_{short_dtype(self.a_dtype)}{short_dtype(self.b_dtype)}{short_dtype(self.d_dtype)}"
            f"_{self.a_major}{self.b_major}{scales}_{self.config.name}"
        )

    @property
    def kernel_spec(self) -> KernelSpec:
        tree = gemm_tree(self.scale_a, self.scale_b, self.d_dtype)
        return KernelSpec.of(self.a_dtype, self.b_dtype, self.a_major, self.b_major, self.config,
                             tree, self.arch, self.num_sms, label=self.name)


def short_dtype(dtype: str) -> str:
    return {"bfloat16": "bf16", "float16": "f16", "float32": "f32",
            "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}[dtype]


@dataclass
class CompiledKernel:
    spec: KernelSpec
    fn: object
    compile_seconds: float
    ptx: str | None = None
    cubin: bytes | None = None
    stats: dict = field(default_factory=dict)


def cutlass_dtype(name: str):
    import cutlass

    return getattr(cutlass, _CUTLASS_NAMES[name])


def _fake_signature(spec: KernelSpec):
    """Fake arguments (A, B, tree inputs, tree outputs, scalars, split-tail workspace, block
    scales) with symbolic extents/strides.

    Shared symbols make TVM-FFI check at call time that extents agree (A, every (M, N) tensor and
    every row vector share M, ...). Leading strides of TMA-accessed tensors are declared 16-byte
    divisible, which TMA requires.
    """
    import cutlass
    import cutlass.cute as cute

    m, n, k, l = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()

    def stride16(dtype: str):
        return cute.sym_int64(divisibility=16 // DTYPE_BYTES[dtype])

    def fake(dtype, shape, stride, align=16):
        return cute.runtime.make_fake_tensor(cutlass_dtype(dtype), shape, stride=stride, assumed_align=align)

    def operand(dtype, rows, major_is_k):
        stride = (stride16(dtype), 1, stride16(dtype)) if major_is_k else (1, stride16(dtype), stride16(dtype))
        return fake(dtype, (rows, k, l), stride)

    a = operand(spec.a_dtype, m, spec.a_major == "k")
    b = operand(spec.b_dtype, n, spec.b_major == "k")
    ins = []
    for i in spec.tree.inputs:
        if i.kind == "row_vec":
            ins.append(fake(i.dtype, (m, l), (1, cute.sym_int64()), 4))
        elif i.kind == "col_vec":  # padded to whole cluster tiles by the launch: its own extent
            ins.append(fake(i.dtype, (cute.sym_int(), l), (1, cute.sym_int64()), 4))
        elif i.kind == "tile":  # a wide tile as (M, N) 32-bit column pairs
            dt = i.kernel_dtype
            ins.append(fake(dt, (m, n, l), (stride16(dt), 1, stride16(dt))))
        elif i.kind == "scalar_tensor":
            ins.append(fake("float32", (1,), (1,), 4))
        elif i.kind == "row_sum":
            ins.append(fake("float32", (m, cute.sym_int(), l), (cute.sym_int64(), 1, cute.sym_int64()), 4))
        elif i.kind == "lookup":
            ins.append(fake("float32", (cute.sym_int(), cute.sym_int()), (cute.sym_int64(), 1), 4))
    outs = []
    for o in spec.tree.outputs:
        if o.kind == "store":  # a double-width store as (M, N) 32-bit column pairs
            cols = cute.sym_int() if o.half else n
            dt = o.kernel_dtype
            outs.append(fake(dt, (m, cols, l), (stride16(dt), 1, stride16(dt))))
        elif o.kind == "row_reduce":
            t = cute.sym_int()
            for _ in range(2 if o.op == "lse" else 1):
                outs.append(fake("float32", (m, t, l), (cute.sym_int64(), 1, cute.sym_int64()), 4))
        elif o.kind == "col_reduce":
            outs.append(fake("float32", (n, cute.sym_int(), l), (cute.sym_int64(), 1, cute.sym_int64()), 4))
        elif o.kind == "quantize":  # FP8 column pairs as (M, N / 2) 16-bit words, then the scales
            outs.append(fake("int16", (m, cute.sym_int(), l), (stride16("int16"), 1, stride16("int16"))))
            outs.append(fake("float32", (m, cute.sym_int(), l), (cute.sym_int64(), 1, cute.sym_int64()), 4))
        elif o.kind == "quantize_t":  # x^T (N, M) in FP8 (N / 2 or 2N rows: half, double), its scales
            rows = cute.sym_int() if (o.half or o.wide) else n
            outs.append(fake(o.dtype, (rows, m, l), (stride16(o.dtype), 1, stride16(o.dtype))))
            outs.append(fake("float32", (rows, cute.sym_int(), l), (cute.sym_int64(), 1, cute.sym_int64()), 4))
        else:  # gather
            outs.append(fake("float32", (m, l), (1, cute.sym_int64()), 4))
    scalars = tuple(cutlass.Float32(0.0) for i in spec.tree.inputs if i.kind == "scalar")
    workspace = None
    if spec.config.split_tail:  # the tail's fp32 partials and int32 arrival counters
        workspace = (fake("float32", (cute.sym_int(),), (1,), 4), fake("int32", (cute.sym_int(),), (1,), 4))
    block_scales = None
    if spec.block_scaled:  # A's (M, K/128, L) and B's (N/128 or N, K/128, L) fp32 scales as TMA reads
        kb = cute.sym_int()  # them: M-major, N-major (b_rows) or K-major (epilogue.block_scales.tma_block_scales)
        def s4():  # a stride of its own (shared symbols must agree at call time), 16-byte divisible
            return cute.sym_int64(divisibility=4)
        block_scales = (fake("float32", (m, kb, l), (1, s4(), s4())),
                        fake("float32", (cute.sym_int(), kb, l), (1, s4(), s4()) if spec.b_rows else (s4(), 1, s4())))
    # Empty tuples are no valid kernel arguments: an absent group is passed as None.
    return a, b, tuple(ins) or None, tuple(outs), scalars or None, workspace, block_scales


_PTXAS_RE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack_frame": re.compile(r"(\d+) bytes stack frame"),
}


def parse_ptxas_remarks(text: str) -> dict:
    """Registers / spills / stack reported by ptxas (summed spills, max registers over kernels),
    and whether ptxas serialized the kernel's WGMMAs (its C7514 performance warning: registers of
    an in-flight WGMMA touched by other instructions)."""
    out = {}
    for key, rx in _PTXAS_RE.items():
        vals = [int(v) for v in rx.findall(text)]
        if vals:
            out[key] = max(vals) if key == "registers" else sum(vals)
    if out:
        out["wgmma_serialized"] = "wgmma.mma_async instructions are serialized" in text
    return out


_compile_lock = threading.Lock()


@contextlib.contextmanager
def _without_source_locations():
    """Asking for ptxas's statistics (``remarks{ptx}``) also turns on the DSL's per-op source
    locations, found by walking the Python stack at every traced op: about 1 s of a 2.5 s FP8
    kernel compile, for locations that nothing reads (ptxas reports per kernel). Keep them off
    while tracing; with a DSL that lacks the hook, compiles are only slower."""
    from cutlass.base_dsl import dsl

    enable = getattr(dsl, "_set_enable_frame_filtering", None)
    if enable is None:
        yield
        return
    dsl._set_enable_frame_filtering = lambda _on: enable(False)
    try:
        yield
    finally:
        dsl._set_enable_frame_filtering = enable


def compile_gemm(spec: KernelSpec | GemmSpec, keep_artifacts: bool = False) -> CompiledKernel:
    """Compile one kernel (no GPU needed), with its ptxas statistics (registers, spills, stack).
    ``keep_artifacts`` also returns PTX and cubin."""
    if isinstance(spec, GemmSpec):
        spec = spec.kernel_spec
    if spec.arch not in SUPPORTED_ARCHS:
        raise NotImplementedError(f"no GEMM kernel for arch {spec.arch!r} (have {SUPPORTED_ARCHS})")
    from .kernels.sm90.gemm import Sm90Gemm

    kernel = Sm90Gemm(spec.config, cutlass_dtype(spec.a_dtype), cutlass_dtype(spec.b_dtype),
                      spec.a_major, spec.b_major, spec.tree, spec.num_sms, spec.block_scaled, spec.b_rows)
    return _cute_compile(spec, kernel, _fake_signature(spec), keep_artifacts)


def compile_elementwise(spec, keep_artifacts: bool = False) -> CompiledKernel:
    """Compile an element-wise kernel spec (``coda_cute.elementwise*``): anything with ``arch``,
    ``name`` and ``build() -> (kernel, fake arguments)``."""
    kernel, args = spec.build()
    return _cute_compile(spec, kernel, args, keep_artifacts)


def _cute_compile(spec, kernel, args, keep_artifacts: bool) -> CompiledKernel:
    import cutlass.cute as cute

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    opts = f"--gpu-arch {spec.arch} --enable-tvm-ffi"
    with _compile_lock, tempfile.TemporaryDirectory(prefix="coda_cute_") as tmp:
        remarks = os.path.join(tmp, "remarks.yaml")
        opts += f" remarks{{ptx}} --remark-output {remarks}"
        if keep_artifacts:
            opts += f" --keep-ptx --keep-cubin --dump-dir {tmp}"
        t0 = time.perf_counter()
        with _without_source_locations(), warnings.catch_warnings():
            # Our 64-step constexpr loops use the step as a Python int (register positions, trace-
            # time branches), which the DSL's suggested dynamic loop is not; their cost is measured
            # (compile_seconds), so the warning would only repeat on every kernel's first call.
            warnings.filterwarnings("ignore", message=r"This static loop has \d+ iterations")
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


def spill_bytes(kernel: CompiledKernel) -> int:
    """Bytes ptxas spilled (stores + loads) in ``kernel``; -1 where no statistics were reported."""
    s = kernel.stats
    if "spill_stores" not in s and "spill_loads" not in s:
        return -1
    return s.get("spill_stores", 0) + s.get("spill_loads", 0)


_cache: dict = {}


def get_gemm(spec: KernelSpec | GemmSpec) -> CompiledKernel:
    """The compiled kernel for ``spec``: from the process cache, else from the on-disk cache
    (GPU machines only, see :func:`disk_cache_dir`), else compiled now (and written there)."""
    if isinstance(spec, GemmSpec):
        spec = spec.kernel_spec
    return get_kernel(spec)


def get_kernel(spec) -> CompiledKernel:
    """:func:`get_gemm` for any kernel spec (a GEMM's or an element-wise kernel's)."""
    hit = _cache.get(spec)
    if hit is None:
        hit = _load_cached(spec) or _compile_and_store(spec)
        _cache[spec] = hit
    return hit


def compiled_kernels() -> list[CompiledKernel]:
    """Kernels compiled (or loaded) so far in this process, in first-use order."""
    return list(_cache.values())


# -- on-disk cache ----------------------------------------------------------------------------------
def disk_cache_dir() -> str | None:
    """Where compiled kernels are kept across processes (exported TVM-FFI objects, ~40 KB each),
    or None when disabled. ``CODA_CUTE_CACHE_DIR`` overrides the location; ``0`` disables it. Only
    used on a machine with a GPU of the kernel's arch: there the DSL's target matches the build,
    which exporting needs."""
    env = os.environ.get("CODA_CUTE_CACHE_DIR")
    if env == "0":
        return None
    base = env or os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                               "coda_cute", "kernels")
    return base


@functools.lru_cache(maxsize=None)
def _build_digest() -> str:
    """Everything a binary depends on besides its spec: :func:`digest_sources`, the DSL, Python."""
    import cutlass

    h = hashlib.sha256()
    for path in digest_sources():
        with open(path, "rb") as fh:
            h.update(os.path.basename(path).encode() + fh.read())
    h.update(f"{cutlass.__version__}|{sys.version_info[:2]}".encode())
    return h.hexdigest()


def digest_sources() -> list[str]:
    """The files a compiled binary is built from: this module, the modules that build the
    compile arguments (``elementwise*.py``: an element-wise kernel's signature is its spec's fake
    arguments there) and every kernel source."""
    from .kernels import __path__ as kernel_dirs

    here = os.path.dirname(os.path.abspath(__file__))
    builders = sorted(os.path.join(here, f) for f in os.listdir(here)
                      if f.startswith("elementwise") and f.endswith(".py"))
    return [os.path.abspath(__file__)] + builders + sorted(
        os.path.join(d, f) for d, _, fs in os.walk(kernel_dirs[0]) for f in fs if f.endswith(".py"))


def _disk_path(spec) -> tuple[str, str] | None:
    base = disk_cache_dir()
    if base is None or not _gpu_matches(spec.arch):
        return None
    digest = hashlib.sha256((disk_key(spec) + _build_digest()).encode()).hexdigest()[:32]
    return os.path.join(base, f"{digest}.o"), f"coda_{digest[:16]}"


def disk_key(spec) -> str:
    """What names a spec's binary on disk: its class and every field its equality compares (a
    KernelSpec's tree by its key, not the object), so two specs share an object only if they are
    one kernel (an element-wise spec of another class may have the same fields).
    A field left out here once let a block-scaled kernel load its weight-gradient form's binary."""
    compared = tuple((f.name, getattr(spec, f.name)) for f in fields(spec) if f.compare)
    return repr((type(spec).__qualname__,) + compared)


def _gpu_matches(arch: str) -> bool:
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        major, minor = torch.cuda.get_device_capability()
        return arch == f"sm_{major}{minor}a"
    except Exception:  # no usable CUDA runtime: nothing to load on
        return False


def _load_cached(spec) -> CompiledKernel | None:
    """The kernel and its ptxas statistics (a JSON file next to the object) from the disk cache."""
    where = _disk_path(spec)
    if where is None or not os.path.exists(where[0]):
        return None
    import cutlass.cute as cute

    try:
        with open(_stats_path(where[0])) as fh:
            stats = json.load(fh)
        fn = cute.runtime.load_module(where[0], enable_tvm_ffi=True)[where[1]]
    except Exception:  # stale, truncated or without statistics: drop it and rebuild
        os.remove(where[0])
        return None
    return CompiledKernel(spec, fn, 0.0, stats=stats)


def _stats_path(obj_path: str) -> str:
    return obj_path[:-2] + ".json"


def _compile_and_store(spec) -> CompiledKernel:
    out = compile_gemm(spec) if isinstance(spec, KernelSpec) else compile_elementwise(spec)
    where = _disk_path(spec)
    if where is not None:
        tmp = None
        try:
            os.makedirs(os.path.dirname(where[0]), exist_ok=True)
            # The statistics first: a reader that finds the object finds them too.
            fd, tmp = tempfile.mkstemp(suffix=".json", dir=os.path.dirname(where[0]))
            with os.fdopen(fd, "w") as fh:
                json.dump(out.stats, fh)
            os.replace(tmp, _stats_path(where[0]))
            fd, tmp = tempfile.mkstemp(suffix=".o", dir=os.path.dirname(where[0]))
            os.close(fd)
            out.fn.export_to_c(tmp, where[1])
            os.replace(tmp, where[0])  # atomic: a reader never sees a partial object
        except Exception:  # a read-only or full disk only costs the next process a compile
            if tmp is not None and os.path.exists(tmp):
                os.remove(tmp)
    return out
