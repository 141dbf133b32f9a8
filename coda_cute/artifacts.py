"""What a compiled kernel contains: locating ``nvdisasm``, disassembling a cubin, and counting
the instructions that show a GEMM took the intended hardware paths.

    PTX                                                   SASS (sm_90a)
    wgmma.mma_async.sync.aligned.m64nNkK.f32.T.T          HGMMA (16-bit inputs) / QGMMA (FP8)
    cp.async.bulk.tensor.Nd.shared::{cta,cluster}.global  UTMALDG             TMA load
    cp.async.bulk.tensor.Nd.global.shared::cta            UTMASTG             TMA store
    TMA load with .multicast::cluster                     UTMALDG....MULTICAST  cluster multicast

Counts are static (instructions in the binary), not executed instructions.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.([\w.]+)")
_TMA_LOAD = re.compile(r"cp\.async\.bulk\.tensor\.\dd\.shared::(?:cta|cluster)\.global[\w.:]*")
_TMA_STORE = re.compile(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta[\w.:]*")
_TARGET = re.compile(r"^\s*\.target\s+(\w+)", re.MULTILINE)
_GMMA = re.compile(r"\b([HQ]GMMA(?:\.\w+)+)")
_UTMALDG = re.compile(r"\bUTMALDG(?:\.\w+)*")
_UTMASTG = re.compile(r"\bUTMASTG\b")


@dataclass(frozen=True)
class PtxCensus:
    target: str | None
    wgmma: tuple[str, ...]  # distinct shape/type suffixes, e.g. "m64n256k16.f32.bf16.bf16"
    tma_loads: int
    tma_stores: int
    multicast_loads: int


@dataclass(frozen=True)
class SassCensus:
    gmma: tuple[str, ...]  # distinct opcodes, e.g. "HGMMA.64x256x16.F32.BF16"
    tma_loads: int
    tma_stores: int
    multicast_loads: int


def scan_ptx(ptx: str) -> PtxCensus:
    loads = _TMA_LOAD.findall(ptx)
    target = _TARGET.search(ptx)
    return PtxCensus(
        target=target.group(1) if target else None,
        wgmma=tuple(sorted(set(_WGMMA.findall(ptx)))),
        tma_loads=len(loads),
        tma_stores=len(_TMA_STORE.findall(ptx)),
        multicast_loads=sum(".multicast::cluster" in x for x in loads),
    )


def scan_sass(sass: str) -> SassCensus:
    loads = _UTMALDG.findall(sass)
    return SassCensus(
        gmma=tuple(sorted(set(_GMMA.findall(sass)))),
        tma_loads=len(loads),
        tma_stores=len(_UTMASTG.findall(sass)),
        multicast_loads=sum(".MULTICAST" in x for x in loads),
    )


@functools.lru_cache(maxsize=None)
def find_nvdisasm() -> str | None:
    """Path of an ``nvdisasm`` binary, or None.

    Looks in the ``nvidia-cuda-nvdisasm`` wheel (what ``nvidia-cutlass-dsl-libs-base[sass]`` pulls
    in), then on ``PATH``, then in ``$CUDA_HOME/bin``.
    """
    candidates = []
    try:
        files = importlib.metadata.distribution("nvidia-cuda-nvdisasm").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    candidates += [str(f.locate()) for f in files if f.name in ("nvdisasm", "nvdisasm.exe")]
    candidates.append(shutil.which("nvdisasm"))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvdisasm"))
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def disassemble(cubin: bytes) -> str | None:
    """SASS text of a cubin's code sections; None when no ``nvdisasm`` is installed.

    Raises RuntimeError when nvdisasm exists but cannot read the cubin (e.g. too old for it).
    """
    tool = find_nvdisasm()
    if tool is None:
        return None
    with tempfile.TemporaryDirectory(prefix="coda_cute_sass_") as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as fh:
            fh.write(cubin)
        proc = subprocess.run([tool, "-c", path], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{tool} -c failed ({proc.returncode}): {proc.stderr.strip()[:500]}")
    return proc.stdout
