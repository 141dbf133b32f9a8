"""Speed-of-light records: model each op, and on a GPU time it next to its shadow GEMM.

For an op with cost (flops, bytes) and measured median time t:

    sol_ms        = max(flops / peak(dtype), bytes / bandwidth)   with datasheet ceilings
    sol_ms_measured                                                with measured ceilings
    pct_sol       = 100 · sol_ms / t       (pct_sol_measured likewise)
    tflops, gbps  = flops / t, bytes / t
    shadow_ratio  = t / t_shadow, the shadow timed in the same run (see :mod:`.registry`)
    shadow_sol_ms = the shadow's sol_ms: sol_ms / shadow_sol_ms is the least the epilogue costs

:func:`estimate` fills the model fields only (any named device, no GPU needed); :func:`measure`
also times every op that has a kernel, on the current CUDA device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence, Union

import torch

from . import devices
from .registry import OpSpec, select
from .shapes import DEFAULT_TOKENS, Shape, ShapeSpec, parse_shapes
from .timing import bench_ms

DEFAULT_OPS = ("gemm", "coda")
Progress = Callable[[int, int, str], None]  # (done, total, what is being done)


@dataclass
class Record:
    op: str
    model: Optional[str]  # preset (llama3-8b) of the shape, if any
    layer: Optional[str]  # its layer (qkv, o, gate_up, down, lm_head)
    shape: list[int]  # the layer's forward (M, N, K)
    gemm: list[int]  # the product this op computes (m, n, k)
    dtype: str
    device: str
    flops: int
    bytes: int
    intensity: float
    bound: str
    sol_ms: float
    shadow_sol_ms: float
    unfused_bytes: Optional[int] = None  # the same math as GEMM + one memory-bound pass (model)
    unfused_sol_ms: Optional[float] = None
    sol_ms_measured: Optional[float] = None
    time_ms: Optional[float] = None
    tflops: Optional[float] = None
    gbps: Optional[float] = None
    pct_sol: Optional[float] = None
    pct_sol_measured: Optional[float] = None
    shadow_ms: Optional[float] = None
    shadow_ratio: Optional[float] = None
    shadow_impl: Optional[str] = None

    @property
    def label(self) -> str:
        """``llama3-8b.qkv`` for preset shapes, ``MxNxK`` otherwise."""
        return f"{self.model}.{self.layer}" if self.model else "x".join(map(str, self.shape))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _dtypes(dtype: Union[str, Sequence[str]]) -> list[str]:
    return [dtype] if isinstance(dtype, str) else list(dtype)


def _plan(ops, shapes, dtype, tokens) -> list[tuple[OpSpec, Shape, str]]:
    pairs = select([ops] if isinstance(ops, str) else ops, parse_shapes(shapes, tokens))
    return [(spec, shape, dt) for dt in _dtypes(dtype) for spec, shape in pairs]


def _model_record(spec: OpSpec, shape: Shape, dtype: str, sheet: devices.Ceilings,
                  measured: Optional[devices.Ceilings]) -> Record:
    cost = spec.cost(shape, dtype)
    return Record(
        op=spec.name, model=shape.model.name if shape.model else None, layer=shape.layer,
        shape=list(shape.mnk), gemm=[cost.m, cost.n, cost.k], dtype=dtype, device=sheet.name,
        flops=cost.flops, bytes=cost.bytes, intensity=cost.intensity, bound=cost.bound(sheet),
        sol_ms=cost.sol_ms(sheet), shadow_sol_ms=cost.shadow().sol_ms(sheet),
        unfused_bytes=cost.unfused_bytes() if cost.has_epilogue else None,
        unfused_sol_ms=cost.unfused_sol_ms(sheet) if cost.has_epilogue else None,
        sol_ms_measured=cost.sol_ms(measured) if measured else None,
    )


def estimate(ops: Union[str, Iterable[str]] = DEFAULT_OPS, shapes: ShapeSpec = "llama3-8b",
             dtype: Union[str, Sequence[str]] = "bf16", device: Union[str, devices.Ceilings] = "h200",
             tokens: int = DEFAULT_TOKENS) -> list[Record]:
    """Model-only records for a named device (datasheet ceilings); runs anywhere."""
    sheet = device if isinstance(device, devices.Ceilings) else devices.datasheet(device)
    plan = _plan(ops, shapes, dtype, tokens)
    return [_model_record(spec, shape, dt, sheet, None) for spec, shape, dt in plan]


def measure(ops: Union[str, Iterable[str]] = DEFAULT_OPS, shapes: ShapeSpec = "llama3-8b",
            dtype: Union[str, Sequence[str]] = "bf16", device: Union[None, str, devices.Ceilings] = None,
            tokens: int = DEFAULT_TOKENS, recalibrate: bool = False,
            progress: Optional[Progress] = None) -> list[Record]:
    """Time each op that has a kernel, and its shadow, on the current CUDA device.

    ``device`` names the datasheet to compare against, or is one (default: the GPU's own name).
    Ops with no kernel yet get model-only records. Ceilings are measured once per device and
    cached (``recalibrate=True`` measures again).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("sol.measure needs a CUDA GPU; use sol.estimate for the model alone")
    gpu = _current_gpu()
    if isinstance(device, devices.Ceilings):
        sheet = device
    else:
        sheet = devices.datasheet(device or torch.cuda.get_device_name(gpu))
    plan = _plan(ops, shapes, dtype, tokens)
    total = len(plan) + 1
    if progress:
        progress(0, total, "calibrating device ceilings")
    measured = devices.measured_ceilings(gpu.index, recalibrate=recalibrate)
    records = []
    for i, (spec, shape, dt) in enumerate(plan, start=1):
        if progress:
            progress(i, total, f"{spec.name} {shape.label} {dt}")
        rec = _model_record(spec, shape, dt, sheet, measured)
        if spec.build is not None:
            _time(rec, spec, shape, dt, gpu)
        records.append(rec)
    if progress:
        progress(total, total, "done")
    return records


def _current_gpu() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _time(rec: Record, spec: OpSpec, shape: Shape, dtype: str, gpu: torch.device) -> None:
    try:
        launch = spec.build(shape, dtype, gpu)
    except NotImplementedError:  # no kernel for this dtype: the record stays model-only
        return
    launch()  # compiles on first use; keep that out of the timing
    rec.time_ms = bench_ms(launch)
    del launch
    shadow = spec.shadow_build()(shape, dtype, gpu)
    shadow()
    rec.shadow_ms = bench_ms(shadow)
    del shadow
    torch.cuda.empty_cache()
    t = rec.time_ms * 1e-3
    rec.tflops = rec.flops / t / 1e12
    rec.gbps = rec.bytes / t / 1e9
    rec.pct_sol = 100 * rec.sol_ms / rec.time_ms
    rec.pct_sol_measured = 100 * rec.sol_ms_measured / rec.time_ms
    rec.shadow_ratio = rec.time_ms / rec.shadow_ms
    rec.shadow_impl = spec.shadow_impl
