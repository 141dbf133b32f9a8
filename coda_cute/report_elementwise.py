"""``coda-cute report``'s element-wise family: the bandwidth-bound kernels of a training step, each
built for sm_90a as a Llama-3-8B step launches it (d 4096, ffn 14336, 32 / 8 heads of 128), with
what the compiler made of it.

The kernels: the gamma fold (W * gamma) and its backward, the embedding backward, the LM head's
target logits, exp-form row step and row finish, the FP8 LM head's cross-entropy gradient, the
log-sum-exp combine, the RoPE backward (with and without
QK-norm), and the FP8 quantizers of both recipes (1 x 128 rows, both layouts, the weights' 128 x
128 blocks with their transpose; the row-wise recipe's one-read rows, a gradient's rows with their
fold factors, the amax passes, the columns, the folded columns) with the FP8 byte transpose.

Per kernel: ptxas registers, spill bytes, stack frame, compile seconds, and the count of each
instruction the kernel is meant to contain, found in its PTX: 16-byte global loads (into
registers, or into shared memory by cp.async where the loads are staged), 16- or 8-byte global
stores (the copy-bandwidth accesses), the saturating FP8 conversion, the IEEE scale
division, atomic maxima, warp shuffles, barriers, the exp2 of the softmax. A kernel is *ok* when
each of its intended instructions is there and nothing spills.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from rich.table import Table

from .elementwise import (CrossEntropyGradSpec, EmbeddingBackwardSpec, FoldBackwardSpec, LseCombineSpec,
                          RopeBackwardSpec, ScaleColumnsSpec, compile_elementwise)
from .elementwise_fp8 import (AbsMaxSpec, QuantizeDualSpec, QuantizeRowsSpec, QuantizeWeightSpec, QuantizeWholeRowsSpec,
                              TransposeBytesSpec, whole_row_groups)
from .elementwise_lm_head import ExpCombineSpec, LmHeadRowsSpec, TargetLogitsSpec

#: the intended instructions, by the PTX opcode prefix each is counted by
LD16, ST16, ST8 = "ld.global.v4", "st.global.v4", "st.global.v2"
#: 16-byte copies into shared memory (cp.async's .cg form copies 16 bytes only)
CP16 = "cp.async.cg.shared.global"
FP8, DIV, ATOM = "cvt.rn.satfinite.e4m3x2.f32", "div.rn.f32", "atom.global"
SHFL, BAR, EX2 = "shfl.sync", "bar.sync", "ex2.approx"


def kernels() -> list[tuple[str, object, tuple[str, ...]]]:
    """(what it does, its spec, its intended instructions) of every element-wise kernel of the
    Llama-3-8B training step, bf16 activations, E4M3."""
    d, f = 4096, 14336
    return [
        ("gamma fold, W * gamma", ScaleColumnsSpec("bfloat16"), (LD16, ST16)),
        ("gamma fold backward", FoldBackwardSpec("bfloat16"), (LD16, ST16)),
        ("embedding backward", EmbeddingBackwardSpec("bfloat16"), (LD16, ST16)),
        ("cross-entropy gradient (FP8 LM head)", CrossEntropyGradSpec(), (LD16, ST16, EX2)),
        ("LM head target logits", TargetLogitsSpec(), (LD16, SHFL)),
        ("LM head exp-form row step", ExpCombineSpec(), (LD16, SHFL, EX2)),
        ("LM head row finish", LmHeadRowsSpec(), (LD16, ST16)),
        ("log-sum-exp combine", LseCombineSpec(), (SHFL, EX2)),
        ("RoPE backward", RopeBackwardSpec(False, 128, 32, 8), (LD16, ST16, SHFL, BAR)),
        ("RoPE + QK-norm backward", RopeBackwardSpec(True, 128, 32, 8), (CP16, ST16, SHFL, BAR)),
        ("FP8 1 x 128 rows", QuantizeRowsSpec("bfloat16"), (LD16, ST8, FP8, DIV, SHFL)),
        ("FP8 1 x 128, both layouts", QuantizeDualSpec("bfloat16"), (LD16, ST16, ST8, FP8, DIV, BAR)),
        ("FP8 weight 128 x 128 + transpose", QuantizeWeightSpec("bfloat16", transposed=True),
         (LD16, ST16, ST8, FP8, DIV, BAR)),
        (f"row-wise rows in one read (K {d})", QuantizeWholeRowsSpec("bfloat16", groups=whole_row_groups(d)),
         (LD16, ST8, FP8, DIV, SHFL, BAR)),
        (f"row-wise rows in one read (K {f})", QuantizeWholeRowsSpec("bfloat16", groups=whole_row_groups(f)),
         (LD16, ST8, FP8, DIV, SHFL, BAR)),
        (f"gradient rows + fold factors (K {d})",
         QuantizeWholeRowsSpec("bfloat16", groups=whole_row_groups(d), fold=True), (LD16, ST8, FP8, DIV, SHFL, BAR)),
        (f"gradient rows + fold factors (K {2 * f})",
         QuantizeWholeRowsSpec("bfloat16", groups=whole_row_groups(2 * f), fold=True),
         (LD16, ST8, FP8, DIV, SHFL, BAR)),
        ("row-wise rows, amaxes given (K > 32768)", QuantizeRowsSpec("bfloat16", whole=True), (LD16, ST8, FP8, DIV)),
        ("amax of rows and columns", AbsMaxSpec("bfloat16"), (LD16, ATOM, SHFL, BAR)),
        ("amax of folded columns", AbsMaxSpec("bfloat16", rows=False, fold=True), (LD16, ATOM, BAR)),
        ("row-wise, both layouts (weights)", QuantizeDualSpec("bfloat16", whole=True), (LD16, ST16, ST8, FP8, DIV, BAR)),
        ("row-wise folded columns", QuantizeDualSpec("bfloat16", rows=False, whole=True, fold=True),
         (LD16, ST16, FP8, DIV, BAR)),
        ("FP8 byte transpose", TransposeBytesSpec(), (LD16, ST16, BAR)),
    ]


def count(ptx: str, op: str) -> int:
    """Instructions of ``ptx`` whose opcode starts with ``op`` (predicated or not)."""
    return len(re.findall(rf"^\s*(?:@!?%p\d+\s+)?{re.escape(op)}", ptx, re.MULTILINE))


@dataclass
class ElementwiseReport:
    label: str
    spec: object
    intended: tuple[str, ...]
    stats: dict
    counts: dict
    compile_seconds: float

    def problems(self) -> list[str]:
        out = [f"no {op}" for op in self.intended if not self.counts[op]]
        spill = self.stats.get("spill_stores", 0) + self.stats.get("spill_loads", 0)
        if spill:
            out.append(f"spills {spill} B")
        return out

    def record(self) -> dict:
        return {"kind": "elementwise", "name": self.spec.name, "label": self.label, "arch": self.spec.arch,
                "registers": self.stats.get("registers"),
                "spills": self.stats.get("spill_stores", 0) + self.stats.get("spill_loads", 0),
                "stack_frame": self.stats.get("stack_frame"), "compile_seconds": self.compile_seconds,
                "instructions": self.counts, "problems": self.problems(), "ok": not self.problems()}


def build(log=None) -> list[ElementwiseReport]:
    """Compile every kernel of :func:`kernels` (cached like the GEMMs) and census its PTX."""
    out = []
    for label, spec, intended in kernels():
        t0 = time.perf_counter()
        kernel = compile_elementwise(spec, keep_artifacts=True)
        seconds = time.perf_counter() - t0
        out.append(ElementwiseReport(label, spec, intended, dict(kernel.stats),
                                     {op: count(kernel.ptx, op) for op in intended}, seconds))
        if log is not None:
            log.print(f"  {spec.name}: {seconds:.1f} s", highlight=False)
    return out


def table(reports: list[ElementwiseReport]) -> Table:
    t = Table(title="elementwise: the training step's bandwidth-bound kernels, sm_90a (Llama-3-8B widths)")
    for col in ("kernel", "spec", "regs", "spill B", "stack", "compile s", "intended instructions (PTX count)", "ok"):
        t.add_column(col, justify="right" if col in ("regs", "spill B", "stack", "compile s") else "left",
                     overflow="fold")
    for r in reports:
        spill = r.stats.get("spill_stores", 0) + r.stats.get("spill_loads", 0)
        found = ", ".join(f"{op} {n}" for op, n in r.counts.items())
        t.add_row(r.label, r.spec.name, str(r.stats.get("registers", "?")), str(spill),
                  str(r.stats.get("stack_frame", "?")), f"{r.compile_seconds:.1f}", found,
                  "ok" if not r.problems() else "[red]" + "; ".join(r.problems()))
    return t
