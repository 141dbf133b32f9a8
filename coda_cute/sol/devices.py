"""Device ceilings: peak FLOP/s per dtype and memory bandwidth, from datasheets or measured.

Datasheet ceilings are the vendor's dense (no 2:4 sparsity) tensor-core rates and HBM bandwidth.
They are upper bounds no real kernel reaches; the *measured* ceilings are what the best library
code achieves on this very GPU, calibrated once and cached:

* bandwidth: a device-to-device copy of ``COPY_BYTES`` (far larger than any L2), counted as
  bytes read + bytes written over the median time;
* bf16 / fp16: ``torch.mm`` (cuBLAS) of ``x @ W.T`` at ``GEMM_SIZE``³ on random data;
* fp8 (compute capability ≥ 8.9): ``torch._scaled_mm`` e4m3 with row-wise fp32 scales, same size.

Dtypes not measured (fp32, or fp8 before Hopper/Ada) keep their datasheet value, marked in
``Ceilings.measured``. The cache is one JSON file, ``$XDG_CACHE_HOME/coda_cute/ceilings.json``
(default ``~/.cache/coda_cute``), keyed by device name, driver, torch and CUDA versions: a new
driver or torch recalibrates by itself; ``recalibrate=True`` forces it.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

import torch

TERA = 1e12
COPY_BYTES = 1 << 30
GEMM_SIZE = 8192


@dataclass(frozen=True)
class Ceilings:
    """Roofs of one device: ``peak`` FLOP/s per dtype (dense tensor-core rates for bf16, fp16,
    fp8; plain CUDA-core rate for fp32) and ``bandwidth`` bytes/s."""

    name: str
    bandwidth: float
    peak: Mapping[str, float]
    source: str  # "datasheet" or "measured"
    measured: tuple[str, ...] = field(default=())  # keys measured (bandwidth, dtypes); rest datasheet

    def peak_flops(self, dtype: str) -> float:
        rate = self.peak.get(dtype)
        if rate is None:
            raise ValueError(f"{self.name} has no {dtype} tensor-core rate")
        return rate

    def to_dict(self) -> dict:
        return {"name": self.name, "bandwidth": self.bandwidth, "peak": dict(self.peak),
                "source": self.source, "measured": list(self.measured)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Ceilings":
        return cls(d["name"], float(d["bandwidth"]), {k: float(v) for k, v in d["peak"].items()},
                   d["source"], tuple(d.get("measured", ())))


def _sheet(name: str, bf16: float, fp8: Optional[float], fp32: float, tb_s: float) -> Ceilings:
    peak = {"bf16": bf16 * TERA, "fp16": bf16 * TERA, "fp32": fp32 * TERA}
    if fp8 is not None:
        peak["fp8"] = fp8 * TERA
    return Ceilings(name, tb_s * TERA, peak, "datasheet")


# key -> (datasheet, regexes on the lower-cased torch.cuda.get_device_name(), tried in table order)
_DATASHEETS: dict[str, tuple[Ceilings, tuple[str, ...]]] = {
    "h100-pcie": (_sheet("NVIDIA H100 PCIe", 756.5, 1513.0, 51.2, 2.0), (r"h100.*pcie",)),
    "h100-nvl": (_sheet("NVIDIA H100 NVL", 835.5, 1670.5, 59.8, 3.9), (r"h100.*nvl",)),
    "h100-sxm": (_sheet("NVIDIA H100 SXM5", 989.4, 1978.9, 66.9, 3.35), (r"h100",)),
    "gh200-hbm3e": (_sheet("NVIDIA GH200 144GB HBM3e", 989.4, 1978.9, 66.9, 4.9), (r"gh200.*(hbm3e|144g)",)),
    "gh200": (_sheet("NVIDIA GH200 96GB HBM3", 989.4, 1978.9, 66.9, 4.0), (r"gh200",)),
    "h200-nvl": (_sheet("NVIDIA H200 NVL", 835.5, 1670.5, 59.8, 4.8), (r"h200.*nvl",)),
    "h200": (_sheet("NVIDIA H200 SXM", 989.4, 1978.9, 66.9, 4.8), (r"h200",)),
    # HGX B200 (1000 W): 8 GPUs give 36 PFLOP/s sparse bf16, 62 TB/s of HBM3e.
    "b200": (_sheet("NVIDIA B200", 2250.0, 4500.0, 75.0, 7.7), (r"b200",)),
    "a100-pcie-80gb": (_sheet("NVIDIA A100 80GB PCIe", 312.0, None, 19.5, 1.935), (r"a100.*80gb.*pcie",)),
    "a100-80gb": (_sheet("NVIDIA A100 SXM4 80GB", 312.0, None, 19.5, 2.039), (r"a100.*80gb",)),
    "a100-40gb": (_sheet("NVIDIA A100 40GB", 312.0, None, 19.5, 1.555), (r"a100",)),
}
_ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb", "h200-sxm": "h200"}


def known_devices() -> list[str]:
    return list(_DATASHEETS) + list(_ALIASES)


def datasheet(name: str) -> Ceilings:
    """Datasheet ceilings for a table key (``h200``, ``h100-pcie``, ``b200``, ...) or a device
    name as ``torch.cuda.get_device_name`` spells it (``NVIDIA H100 80GB HBM3``)."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key in _DATASHEETS:
        return _DATASHEETS[key][0]
    for sheet, patterns in _DATASHEETS.values():
        if any(re.search(p, key) for p in patterns):
            return sheet
    raise KeyError(f"no datasheet for device {name!r}; known: {', '.join(known_devices())}")


# -- measured ceilings ----------------------------------------------------------------------------------
def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "coda_cute" / "ceilings.json"


def _driver_version() -> str:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        text = ""
    found = re.search(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)\s", text)
    if found:
        return found.group(1)
    try:
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        return f"cuda-driver-api {version}" if int(err) == 0 else "unknown"
    except Exception:  # any failure only weakens the cache key
        return "unknown"


def device_key(index: Optional[int] = None) -> str:
    """Cache key of a CUDA device: its name, the driver, torch and CUDA versions."""
    index = torch.cuda.current_device() if index is None else index
    return (f"{torch.cuda.get_device_name(index)} | driver {_driver_version()} | "
            f"torch {torch.__version__} | cuda {torch.version.cuda}")


def measured_ceilings(index: Optional[int] = None, recalibrate: bool = False,
                      path: Optional[Path] = None) -> Ceilings:
    """Measured ceilings of a CUDA device: from the on-disk cache, else calibrated and cached."""
    path = path or cache_path()
    key = device_key(index)
    cache = _read_cache(path)
    if not recalibrate and key in cache:
        return Ceilings.from_dict(cache[key])
    found = calibrate(index)
    cache[key] = {**found.to_dict(), "calibrated_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=1))
    tmp.replace(path)  # atomic: concurrent runs never read half a file
    return found


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def calibrate(index: Optional[int] = None) -> Ceilings:
    """Measure copy bandwidth and library GEMM rates on a CUDA device now (a few seconds)."""
    from .timing import bench_ms

    index = torch.cuda.current_device() if index is None else index
    name = torch.cuda.get_device_name(index)
    try:
        base = datasheet(name)
    except KeyError:
        base = Ceilings(name, 0.0, {}, "datasheet")
    with torch.cuda.device(index):
        bandwidth = copy_bandwidth(bench_ms)
        peak = dict(base.peak)
        measured = ["bandwidth"]
        for dtype in ("bf16", "fp16"):
            peak[dtype] = gemm_rate(dtype, bench_ms)
            measured.append(dtype)
        if torch.cuda.get_device_capability(index) >= (8, 9) and hasattr(torch, "_scaled_mm"):
            peak["fp8"] = gemm_rate("fp8", bench_ms)
            measured.append("fp8")
    torch.cuda.empty_cache()
    return Ceilings(name, bandwidth, peak, "measured", tuple(measured))


def copy_bandwidth(bench_ms, nbytes: int = COPY_BYTES) -> float:
    """Bytes/s of ``dst.copy_(src)`` counting the read and the write (2·nbytes per copy)."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def gemm_rate(dtype: str, bench_ms, size: int = GEMM_SIZE) -> float:
    """FLOP/s of the library GEMM ``x @ W.T`` (size³) on random data: torch.mm for 16-bit,
    torch._scaled_mm with row-wise fp32 scales for fp8."""
    if dtype == "fp8":
        from .registry import fp8_operands

        a, b, sa, sb = fp8_operands(size, size, size, torch.device("cuda"))
        fn = lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)  # noqa: E731
    else:
        t = torch.bfloat16 if dtype == "bf16" else torch.float16
        x = torch.randn(size, size, dtype=t, device="cuda")
        w = torch.randn(size, size, dtype=t, device="cuda")
        fn = lambda: torch.mm(x, w.t())  # noqa: E731
    return 2 * size**3 / (bench_ms(fn) * 1e-3)
