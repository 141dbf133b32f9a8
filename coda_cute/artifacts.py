"""What a compiled kernel contains: locating ``nvdisasm``, disassembling a cubin, and counting
the instructions that show a GEMM took the intended hardware paths.

    PTX                                                   SASS (sm_90a)
    wgmma.mma_async.sync.aligned.m64nNkK.f32.T.T          HGMMA (16-bit inputs) / QGMMA (FP8)
    cp.async.bulk.tensor.Nd.shared::{cta,cluster}.global  UTMALDG             TMA load
    cp.async.bulk.tensor.Nd.global.shared::cta            UTMASTG             TMA store
    TMA load with .multicast::cluster                     UTMALDG....MULTICAST  cluster multicast

Counts are static (instructions in the binary), not executed instructions. ``vector_descriptors``
counts WGMMAs whose descriptors an ``R2UR`` moved in from vector registers: ptxas keeps them there
when it cannot prove the code around the k-loop warp-uniform, and each WGMMA then waits on its
moves (the first dynamic-tile builds: up to 7 % slower on H100).
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
# an instruction: optional predicate, opcode, and its first operand when that is a uniform register
_INSTR = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)\s+(?:UR(\d+)\b)?[^;\n]*;")
_GDESC = re.compile(r"gdesc\[UR(\d+)\]")


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
    vector_descriptors: int = 0


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
        vector_descriptors=_wgmmas_fed_from_vector_registers(sass),
    )


def _wgmmas_fed_from_vector_registers(sass: str) -> int:
    """WGMMAs whose descriptor registers (``gdesc[URn]``: URn to URn+3) an ``R2UR`` wrote last."""
    from_vector: set[int] = set()
    fed = 0
    for m in _INSTR.finditer(sass):
        op, dest = m.group(1), m.group(2)
        if op.startswith(("HGMMA", "QGMMA")):
            desc = _GDESC.search(m.group(0))
            fed += desc is not None and bool(from_vector & set(range(int(desc.group(1)), int(desc.group(1)) + 4)))
        elif op == "R2UR" and dest is not None:
            from_vector.add(int(dest))
        elif dest is not None:  # any other writer of URn (UMOV, ULEA, S2UR, ...)
            width = 2 if op.endswith(".64") else 1
            from_vector -= set(range(int(dest), int(dest) + width))
    return fed


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
