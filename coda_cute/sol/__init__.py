"""Speed of light: how close each coda op runs to the limits of the GPU.

Usage
-----
Command line (a GPU times every op that has a kernel; without one the model runs for a named
device)::

    coda-cute sol                                  # llama3-8b block + LM head, bf16: gemm + the fused ops
    coda-cute sol --shapes llama3-70b 8192,8192,8192 --dtype bf16 fp8 --ops layouts
    coda-cute sol --device h100-pcie --json sol.json --plot roofline.png
    coda-cute sol --recalibrate                    # measure the device ceilings again

Python::

    from coda_cute import sol
    recs = sol.measure(ops=["gemm"], shapes="llama3-8b", dtype="bf16")      # GPU
    recs = sol.estimate(ops=["coda"], shapes="llama3-70b", dtype="fp8", device="b200")  # anywhere
    recs = sol.estimate(["residual_norm_stats"], [(16384, 4096, 14336)])   # a bare M,N,K
    with sol.profile() as prof:                      # time per torch.ops.coda.* op in a step
        model(batch).sum().backward()
    prof.print()

The model
---------
Each op is one GEMM plus an epilogue: flops = 2·m·n·k + epilogue FLOPs, bytes = each input read
once and each output written once, SoL = max(flops / peak(dtype), bytes / bandwidth)
(:mod:`.model`). Ceilings come from the datasheet and from a measured device-to-device copy and
library GEMM, cached per device (:mod:`.devices`). Every measured op is timed next to its shadow
in the same run, ``shadow_ratio`` = time / shadow time: for a fused op the plain coda.gemm of the
same shape (what the epilogue costs), for the plain GEMM layouts cuBLAS (how far from the library)
(:mod:`.measure`, :mod:`.registry`). A fused op becomes measurable with one
``register_op(name, build=...)`` in its module.
"""

from __future__ import annotations

from . import coda_ops, model  # noqa: F401  (coda_ops: launches of the CODA block ops)
from .devices import Ceilings, calibrate, datasheet, measured_ceilings
from .measure import Record, estimate, measure
from .model import OpCost
from .op_profile import profile
from .registry import OPS, register_op
from .shapes import LLAMA3, Shape, llama_block, parse_shapes

__all__ = [
    "model", "OpCost", "Ceilings", "datasheet", "measured_ceilings", "calibrate", "Record", "estimate",
    "measure", "profile", "register_op", "OPS", "Shape", "LLAMA3", "llama_block", "parse_shapes",
]
