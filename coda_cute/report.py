"""``coda-cute report``: build every GEMM kernel for sm_90a and show what the compiler made of it;
on a Hopper GPU, also run every op once against the fp32 reference and time it next to torch.

Kernel families compiled (no GPU needed):
  * ``bf16``     - bf16 A and B, both K-major (x @ W.T), bf16 out, every config of
    ``dispatch.config_space(fp8=False)``;
  * ``fp8``      - float8_e4m3fn A and B, K-major, row-wise fp32 scales, bf16 out, every config of
    ``dispatch.config_space(fp8=True)``;
  * ``training`` - bf16 with the other operand majors training needs, on the default bf16 config:
    ``kn`` (dY @ W, dgrad), ``mn`` (dY.T @ X, wgrad) and ``mk``;
  * ``coda``     - the fused CODA block ops (``torch.ops.coda.*``): each op's epilogue tree on the
    config its heuristic picks at the Llama-3-8B layer it fuses into (16384 tokens, bf16 x @ W.T);
  * ``coda_h100`` - those whose pick differs on an H100 (``dispatch.card_of``: its 16-bit ping-pong
    rates are lower; ``lm_head_ce.EXP_CONFIGS``), on that card's config;
  * ``coda_fp8`` - the FP8 sublayers' block-scaled kernels (``coda.attention_block_fp8``,
    ``coda.mlp_block_fp8``) and the FP8 LM head's (``coda.lm_head_ce_train_fp8``): forward, dgrad
    (W's FP8 transpose) and the wgrad form, E4M3, each on the block-scaled config its heuristic
    picks at that Llama-3-8B layer;
  * ``coda_fp8_row`` - the same sublayers' forward and dgrad trees in the row-wise recipe
    (``Fp8Recipe(scaling="row")``): the scales applied to the accumulator in the tree, on the
    plain FP8 kernel's config each picks (their weight gradients are ``fp8`` GEMMs);
  * ``coda_fp8_row_fast`` - the same with fast accumulation (``Fp8Recipe(fast_accum=...)``), on
    the configs the heuristic picks for it.
``--configs default`` keeps one config per GEMM family: the one the heuristic picks for a large
square problem on a 132-SM Hopper part. Then the ``elementwise`` family
(``coda_cute.report_elementwise``): the step's bandwidth-bound kernels (the gamma fold and its
backward, the embedding and RoPE backwards, the LM head's row kernels, the cross-entropy
gradient, the FP8 quantizers and transpose), each with its intended instructions counted in its
PTX.

Per kernel: ptxas registers, spill stores/loads and stack frame; shared memory (A/B stage ring +
epilogue ring + mbarriers, from ``kernels.common.config.smem_bytes``); compile seconds; and whether
the intended instructions are in the PTX and in the SASS (``nvdisasm``; shown as ``?`` if absent):
WGMMA of the expected shape (HGMMA / QGMMA in SASS), TMA loads and stores, and TMA multicast exactly
when the cluster has two CTAs. A kernel is *ok* when all of that holds, nothing spills and ptxas
kept the WGMMAs asynchronous.

With a GPU each op runs once on random data at ``--shape`` (bf16 x @ W.T, dgrad, wgrad; fp16;
fp8 with row-wise and per-tensor scales): relative Frobenius error against
``reference.gemm_ref`` in fp32, and the median of 20 CUDA-event timings after warm-up, next to
``torch.mm`` / ``torch._scaled_mm``.

``--json PATH`` writes a list of records: one per kernel (``"kind": "kernel"``: name, arch,
config, registers, spills, smem_bytes, has_wgmma, has_tma, has_tma_store, has_multicast, ...),
one per element-wise kernel (``"kind": "elementwise"``), then one per op run on a GPU
(``"kind": "run"``). Exit status 1 when a kernel is not ok or an op
exceeds its error bound.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from . import dispatch, report_elementwise
from .artifacts import PtxCensus, SassCensus, disassemble, find_nvdisasm, scan_ptx, scan_sass
from .compiler import DTYPE_BYTES, FP8_DTYPES, CompiledKernel, GemmSpec, KernelSpec, compile_gemm
from .epilogue.runner import choose_config, tree_smem_bytes
from .kernels.common.config import GemmConfig, block_scale_stage_bytes, pipeline_stages, smem_bytes

ARCH = "sm_90a"
FAMILIES = {
    "bf16": "bf16 x @ W.T: A and B K-major, bf16 out",
    "fp8": "fp8 e4m3 x @ W.T: A and B K-major, row-wise fp32 scales, bf16 out",
    "training": "bf16 training layouts (A major, B major): kn = dY @ W (dgrad), mn = dY.T @ X (wgrad), mk",
    "coda": "CODA block ops, bf16 x @ W.T, each at its Llama-3-8B layer (16384 tokens) on the heuristic's config",
    "coda_h100": "the CODA block ops whose config differs on an H100 (dispatch.card_of), on that card's pick",
    "coda_fp8": "FP8 sublayer ops, block-scaled e4m3 (1 x 128 activations, 128 x 128 weights; wgrad 1 x 128 both), "
                "each at its Llama-3-8B layer",
    "coda_fp8_row": "FP8 sublayer ops, row-wise recipe (one scale per row along K, applied to the accumulator), "
                    "e4m3, each at its Llama-3-8B layer",
    "coda_fp8_row_fast": "the same with fast accumulation (Fp8Recipe(scaling='row', fast_accum=...): the k-loop "
                         "in the tensor core's accumulator), on the heuristic's fast-accumulation configs",
}
TRAINING_LAYOUTS = (("k", "n"), ("m", "n"), ("m", "k"))
_PTX_TYPE = {"bfloat16": "bf16", "float16": "f16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
#: relative Frobenius error bound per op run (output rounding is ~2e-3)
RUN_ERROR_BOUND = 1e-2


def default_config(fp8: bool) -> GemmConfig:
    """The config the heuristic picks for a large square problem (8192^3) on 132 SMs."""
    return dispatch.select_config(8192, 8192, 8192, 1, fp8, False, 132)


def kernel_specs(configs: str = "all") -> list[tuple[str, GemmSpec | KernelSpec]]:
    """(family, spec) of every kernel the report builds; ``configs`` is ``"all"`` or ``"default"``."""
    if configs not in ("all", "default"):
        raise ValueError(f"configs must be 'all' or 'default', got {configs!r}")
    out = []
    for fp8 in (False, True):
        space = dispatch.config_space(fp8) if configs == "all" else [default_config(fp8)]
        dt = "float8_e4m3fn" if fp8 else "bfloat16"
        scale = "row" if fp8 else "none"
        out += [("fp8" if fp8 else "bf16", GemmSpec(dt, dt, "bfloat16", "k", "k", cfg, scale, scale, ARCH))
                for cfg in space]
    cfg = default_config(False)
    out += [("training", GemmSpec("bfloat16", "bfloat16", "bfloat16", am, bm, cfg, arch=ARCH))
            for am, bm in TRAINING_LAYOUTS]
    coda = coda_op_specs()
    h100 = [s for s, h200 in zip(coda_op_specs(card="h100"), coda) if s.config != h200.config]
    return (out + [("coda", spec) for spec in coda] + [("coda_h100", spec) for spec in h100]
            + [("coda_fp8", s) for s in coda_fp8_specs()]
            + [("coda_fp8_row", s) for s in coda_fp8_specs(row=True)]
            + [("coda_fp8_row_fast", s) for s in coda_fp8_specs(row=True, fast=True)])


def coda_op_specs(model: str = "llama3-8b", sms: int = 132, card: str = dispatch.DEFAULT_CARD) -> list[KernelSpec]:
    """One kernel per CODA op's GEMM (labelled with the op), forward and backward: its tree on
    the config the op's heuristic picks on ``card`` (``dispatch.card_of``) at the ``model`` layer
    it fuses into, with the operand majors it runs with (dgrad ``dY @ W``: B n-major; wgrad
    ``dY.T @ X``: A m-major)."""
    from .ops import lm_head_ce as lm
    from .ops import proj, qkv, residual, rmsnorm, swiglu
    from .sol.shapes import LLAMA3, llama_block

    c = LLAMA3[model]
    fwd = {s.layer: s.mnk for s in llama_block(c)}

    def dgrad(layer):  # dY @ W: (M, K, N) of the forward product
        m, n, k = fwd[layer]
        return m, k, n

    n_qk = (c.n_heads + c.n_kv_heads) * c.head_dim
    ops = (("residual_gemm_norm_stats", residual.residual_norm_stats_tree(), fwd["down"], "kk"),
           ("norm_swiglu", swiglu.norm_swiglu_tree(), fwd["gate_up"], "kk"),
           ("norm_rope_qkv", qkv.norm_rope_qkv_tree(n_qk, c.head_dim, False), fwd["qkv"], "kk"),
           ("norm_rope_qkv_qk_norm", qkv.norm_rope_qkv_tree(n_qk, c.head_dim, True, True), fwd["qkv"], "kk"),
           ("norm_proj", proj.norm_proj_tree(), fwd["qkv"], "kk"),
           ("lm_head_ce", lm.lm_head_ce_tree(), fwd["lm_head"], "kk"),
           ("lm_head_ce_train.logits", lm.exp_logits_tree(), fwd["lm_head"], "kk"),
           ("lm_head_ce_backward.dlogits", lm.dlogits_tree(), fwd["lm_head"], "kk"),
           ("swiglu_backward", swiglu.swiglu_backward_tree(), (fwd["down"][0], c.ffn, c.d), "kn"),
           ("norm_backward.gate_up", rmsnorm.norm_backward_tree(True), dgrad("gate_up"), "kn"),
           ("norm_backward.qkv", rmsnorm.norm_backward_tree(True), dgrad("qkv"), "kn"),
           ("norm_backward.lm_head", rmsnorm.norm_backward_tree(False, True), dgrad("lm_head"), "kn"),
           ("lm_head_ce_train.dgrad", lm.exp_dgrad_tree(True), dgrad("lm_head"), "kn"),
           ("lm_head_ce_train.dw", lm.accumulate_tree("bfloat16"), (c.vocab, c.d, fwd["lm_head"][0]), "mn"))
    fixed = {"lm_head_ce_train.logits": lm.exp_config(card)}  # its tile is the exp form's tile
    return [KernelSpec.of("bfloat16", "bfloat16", majors[0], majors[1],
                          fixed.get(op) or choose_config(tree, *mnk, 1, False, False, sms, card=card), tree, ARCH, sms,
                          label=op)
            for op, tree, mnk, majors in ops]


def coda_fp8_specs(model: str = "llama3-8b", sms: int = 132, row: bool = False,
                   fast: bool = False) -> list[KernelSpec]:
    """One kernel per block-scaled GEMM of the FP8 sublayers and the FP8 LM head, labelled with its role: the forward
    trees, the dgrads (dY @ W through W's FP8 transpose: K-major like every FP8 operand) and the
    weight-gradient form (dY^T X over the tokens, B scaled per row), on the config each one's
    heuristic picks (``choose_config`` with block scales) at the ``model`` layer. ``row``: the
    sublayers' forward and dgrad GEMMs in the row-wise recipe instead (``fp8_gemms.row_scaled``
    trees on the plain FP8 kernel; no LM head, which runs the block recipe); ``fast``: those with
    fast accumulation (``Fp8Recipe.fast_accum``), on the configs the heuristic picks for it."""
    from .kernels.epilogue.plain import gemm_tree
    from .ops import lm_head_ce as lm
    from .ops import qkv, residual, rmsnorm, swiglu
    from .ops.fp8_gemms import row_scaled
    from .sol.shapes import LLAMA3, llama_block

    c = LLAMA3[model]
    fwd = {s.layer: s.mnk for s in llama_block(c)}
    m = fwd["qkv"][0]
    n_qk = (c.n_heads + c.n_kv_heads) * c.head_dim
    plain = gemm_tree("none", "none", "bfloat16")
    ops = (("fp8.norm_swiglu", swiglu.norm_swiglu_tree(), fwd["gate_up"], False),
           ("fp8.residual.down", residual.residual_norm_stats_tree(), fwd["down"], False),
           # the same with y quantized in its epilogue for the next layer's QKV (E.quantize)
           ("fp8.residual.down+quantize", residual.residual_norm_stats_tree(True), fwd["down"], False),
           ("fp8.norm_rope_qkv", qkv.norm_rope_qkv_tree(n_qk, c.head_dim, False), fwd["qkv"], False),
           ("fp8.residual.o", residual.residual_norm_stats_tree(), fwd["o"], False),
           ("fp8.swiglu_backward", swiglu.swiglu_backward_tree(), (m, c.ffn, c.d), False),
           ("fp8.norm_backward.gate_up", rmsnorm.norm_backward_tree(True), (m, c.d, 2 * c.ffn), False),
           ("fp8.dgrad.o", plain, (m, fwd["o"][2], c.d), False),
           ("fp8.wgrad.gate_up", plain, (2 * c.ffn, c.d, m), True),
           # the LM head's (the recipe's lm_head_fp8): logits, dgrad, the fp32 weight-gradient sum
           ("fp8.lm_head.logits", lm.logits_tree(), fwd["lm_head"], False),
           ("fp8.norm_backward.lm_head", rmsnorm.norm_backward_tree(False, True), (m, c.d, c.vocab), False),
           ("fp8.lm_head.dw", lm.accumulate_tree("float32"), (c.vocab, c.d, m), True))
    if row:
        specs = []
        for op, tree, mnk, b_rows in ops:
            if b_rows or "lm_head" in op or "quantize" in op:
                continue
            if op == "fp8.swiglu_backward":  # the row-wise recipe keeps h from its forward (ops.mlp_fp8)
                tree = swiglu.swiglu_backward_tree(recompute_h=False)
            t = row_scaled(tree)
            specs.append(KernelSpec.of("float8_e4m3fn", "float8_e4m3fn", "k", "k",
                                       choose_config(t, *mnk, 1, True, fast, sms), t, ARCH, sms,
                                       label=op.replace("fp8.", "fp8_row_fast." if fast else "fp8_row.")))
        return specs
    return [KernelSpec.of("float8_e4m3fn", "float8_e4m3fn", "k", "k",
                          choose_config(tree, *mnk, 1, True, False, sms, True, b_rows), tree, ARCH, sms,
                          label=op, block_scaled=True, b_rows=b_rows)
            for op, tree, mnk, b_rows in ops]


def expected_wgmma(spec: GemmSpec | KernelSpec) -> str:
    """PTX WGMMA suffix the kernel must issue: a 64-row warpgroup atom spanning the tile's whole
    N, 32 bytes of K (k16 for 16-bit, k32 for FP8), fp32 accumulation."""
    k = 32 if spec.a_dtype in FP8_DTYPES else 16
    return f"m64n{spec.config.tile_n}k{k}.f32.{_PTX_TYPE[spec.a_dtype]}.{_PTX_TYPE[spec.b_dtype]}"


def expected_gmma(spec: GemmSpec | KernelSpec) -> str:
    """SASS opcode prefix of that WGMMA: HGMMA for 16-bit inputs, QGMMA for FP8."""
    fp8 = spec.a_dtype in FP8_DTYPES
    return f"{'QGMMA' if fp8 else 'HGMMA'}.64x{spec.config.tile_n}x{32 if fp8 else 16}.F32"


@functools.lru_cache(maxsize=None)
def inspect_kernel(spec: GemmSpec | KernelSpec) -> tuple[CompiledKernel, PtxCensus, SassCensus | None]:
    """Compile ``spec`` with its artifacts and census its PTX and SASS (once per process; the
    CPU tests share this cache). SASS is None when ``nvdisasm`` is not installed."""
    kernel = compile_gemm(spec, keep_artifacts=True)
    sass = disassemble(kernel.cubin)
    return kernel, scan_ptx(kernel.ptx), None if sass is None else scan_sass(sass)


@dataclass
class KernelReport:
    family: str
    spec: GemmSpec | KernelSpec
    kernel: CompiledKernel | None = None
    ptx: PtxCensus | None = None
    sass: SassCensus | None = None  # None: no nvdisasm (or the compile failed)
    error: str | None = None

    @property
    def multicast_expected(self) -> bool:
        return self.spec.config.cluster_m * self.spec.config.cluster_n > 1

    @property
    def tree(self):
        return (self.spec.kernel_spec if isinstance(self.spec, GemmSpec) else self.spec).tree

    @property
    def label(self) -> str:
        """The row's first column: the operand majors of a GEMM, the op of a fused kernel."""
        layout = self.spec.a_major + self.spec.b_major
        return layout if isinstance(self.spec, GemmSpec) else self.spec.label

    @property
    def store_expected(self) -> bool:
        return any(o.kind == "store" for o in self.tree.outputs)

    def expected(self, what: str) -> bool:
        """Whether an instruction class of :meth:`presence` belongs in this kernel."""
        return {"multicast": self.multicast_expected, "tma_store": self.store_expected}.get(what, True)

    @property
    def epi_bytes(self) -> int:
        return tree_smem_bytes(self.tree, self.spec.config, DTYPE_BYTES[self.spec.a_dtype])

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self.spec.config, DTYPE_BYTES[self.spec.a_dtype], self.epi_bytes, self.scale_bytes)

    @property
    def stages(self) -> int:
        return pipeline_stages(self.spec.config, DTYPE_BYTES[self.spec.a_dtype], self.epi_bytes, self.scale_bytes)

    @property
    def scale_bytes(self) -> int:
        """A stage's block scales (block-scaled FP8), 0 otherwise."""
        if not getattr(self.spec, "block_scaled", False):  # a GemmSpec (no tree) never is
            return 0
        return block_scale_stage_bytes(self.spec.config, self.spec.b_rows)

    def presence(self) -> dict[str, tuple[bool, bool | None]]:
        """(in PTX, in SASS or None if unknown) per instruction class."""
        p, s = self.ptx, self.sass
        return {
            "wgmma": (bool(p.wgmma), None if s is None else bool(s.gmma)),
            "tma_load": (p.tma_loads > 0, None if s is None else s.tma_loads > 0),
            "tma_store": (p.tma_stores > 0, None if s is None else s.tma_stores > 0),
            "multicast": (p.multicast_loads > 0, None if s is None else s.multicast_loads > 0),
        }

    def wgmma_problems(self) -> list[str]:
        """WGMMA shape/type mismatches in the PTX and (when known) the SASS."""
        out = []
        if self.ptx.wgmma != (expected_wgmma(self.spec),):
            out.append(f"PTX WGMMA {list(self.ptx.wgmma)}, expected {expected_wgmma(self.spec)}")
        if self.sass is not None and (not self.sass.gmma or not all(
                g.startswith(expected_gmma(self.spec)) for g in self.sass.gmma)):
            out.append(f"SASS GMMA {list(self.sass.gmma)}, expected {expected_gmma(self.spec)}*")
        return out

    def problems(self) -> list[str]:
        """Everything that differs from the intended kernel; empty when ok."""
        if self.error:
            return [self.error]
        out = self.wgmma_problems()
        if self.ptx.target != self.spec.arch:
            out.append(f"PTX target {self.ptx.target}, expected {self.spec.arch}")
        for what, (in_ptx, in_sass) in self.presence().items():
            want = self.expected(what)
            if in_ptx != want or in_sass not in (None, want):
                out.append(f"{what} {'missing' if want else 'unexpected'}")
        stats = self.kernel.stats
        if "registers" not in stats:
            out.append("no ptxas statistics")
        elif stats.get("spill_stores", 0) or stats.get("spill_loads", 0):
            out.append(f"spills {stats.get('spill_stores', 0)} B stores / {stats.get('spill_loads', 0)} B loads")
        if stats.get("wgmma_serialized"):
            out.append("ptxas serialized the WGMMAs (C7514)")
        return out

    def record(self) -> dict:
        """The JSON record of this kernel."""
        spec = self.spec
        rec = {
            "kind": "kernel", "name": spec.name, "family": self.family, "arch": spec.arch,
            "a_dtype": spec.a_dtype, "b_dtype": spec.b_dtype, "layout": spec.a_major + spec.b_major,
            "config_name": spec.config.name, "config": dataclasses.asdict(spec.config),
            "multicast_expected": self.multicast_expected,
            "problems": self.problems(), "ok": not self.problems(), "error": self.error,
        }
        if isinstance(spec, GemmSpec):
            rec.update({"d_dtype": spec.d_dtype, "scale_a": spec.scale_a, "scale_b": spec.scale_b})
        else:
            rec.update({"op": spec.label, "outputs": [dataclasses.asdict(o) for o in self.tree.outputs]})
        if self.error:
            return rec
        stats = self.kernel.stats
        has = {k: ptx and sass is not False for k, (ptx, sass) in self.presence().items()}
        rec.update({
            "smem_bytes": self.smem_bytes, "stages": self.stages,
            "registers": stats.get("registers"),
            "spills": {"stores": stats.get("spill_stores"), "loads": stats.get("spill_loads")},
            "stack_frame": stats.get("stack_frame"), "wgmma_serialized": stats.get("wgmma_serialized"),
            "compile_seconds": round(self.kernel.compile_seconds, 3),
            "has_wgmma": has["wgmma"], "has_tma": has["tma_load"],
            "has_tma_store": has["tma_store"], "has_multicast": has["multicast"],
            "sass_checked": self.sass is not None,
            "ptx": dataclasses.asdict(self.ptx),
            "sass": None if self.sass is None else dataclasses.asdict(self.sass),
        })
        return rec


def build_reports(specs: list[tuple[str, GemmSpec]], log: Console | None = None) -> list[KernelReport]:
    """Compile and inspect every spec; a failing compile becomes a report with ``error`` set."""
    out = []
    for i, (family, spec) in enumerate(specs, 1):
        t0 = time.perf_counter()
        try:
            kernel, ptx, sass = inspect_kernel(spec)
            rep = KernelReport(family, spec, kernel, ptx, sass)
        except Exception as e:  # noqa: BLE001 - one broken config must not hide the others
            rep = KernelReport(family, spec, error=f"{type(e).__name__}: {e}")
        out.append(rep)
        if log is not None:
            status = "[green]ok[/]" if not rep.problems() else f"[red]{'; '.join(rep.problems())[:200]}[/]"
            log.print(f"[{i:>2}/{len(specs)}] {family:<8} {rep.label:<22} "
                      f"{spec.config.name:<34} {time.perf_counter() - t0:5.2f} s  {status}",
                      highlight=False)
    return out


LEGEND = ("spill B: ptxas spill stores/loads; WGMMA: the SASS opcode (the PTX suffix without nvdisasm); "
          "TMA ld/st, mcast: PTX/SASS, ✓ present, – absent as intended, ✗ missing, ! unexpected, "
          "? unknown (no nvdisasm)")


def _mark(present: bool | None, want: bool) -> str:
    if present is None:
        return "[dim]?[/]"
    if present != want:
        return "[bold red]✗[/]" if want else "[bold red]![/]"
    return "✓" if present else "–"


def family_table(family: str, reports: list[KernelReport]) -> Table:
    t = Table(title=FAMILIES[family], title_justify="left")
    for col in ("kernel", "config", "regs", "spill B", "stack B", "smem B", "stages", "compile s",
                "WGMMA", "TMA ld", "TMA st", "mcast", "ok"):
        left = col in ("kernel", "config", "WGMMA")
        t.add_column(col, justify="left" if left else "right", no_wrap=left)
    for r in reports:
        head = [r.label, r.spec.config.name]
        if r.error:
            t.add_row(*head, *[""] * 10, "[bold red]compile failed[/]")
            continue
        st = r.kernel.stats
        pres = r.presence()
        marks = []
        for what in ("tma_load", "tma_store", "multicast"):
            want = r.expected(what)
            marks.append("/".join(_mark(p, want) for p in pres[what]))
        wg_ok = not r.wgmma_problems()
        wg_text = ", ".join(r.sass.gmma) if r.sass is not None else f"{', '.join(r.ptx.wgmma)} (SASS ?)"
        t.add_row(
            *head, str(st.get("registers", "?")),
            f"{st.get('spill_stores', '?')}/{st.get('spill_loads', '?')}",
            str(st.get("stack_frame", "?")), str(r.smem_bytes), str(r.stages),
            f"{r.kernel.compile_seconds:.2f}",
            f"[{'green' if wg_ok else 'bold red'}]{wg_text or 'none'}[/]",
            *marks,
            "[green]yes[/]" if not r.problems() else "[bold red]no[/]",
        )
    return t


# -- GPU part ------------------------------------------------------------------------------------
def _gpu_arch(console: Console) -> str | None:
    if not torch.cuda.is_available():
        return None
    try:
        return dispatch.arch_of(torch.device("cuda", torch.cuda.current_device()))
    except NotImplementedError as e:
        console.print(f"[yellow]not running the ops on this GPU: {e}")
        return None


def _op_cases(m: int, n: int, k: int):
    """(label, a, b, scale_a, scale_b) on fresh random CUDA data, one per op the report runs."""
    def rand(*shape, dtype):
        return torch.randn(*shape, device="cuda").to(dtype)

    bf16, fp16 = torch.bfloat16, torch.float16
    yield "bf16 x @ W.T", rand(m, k, dtype=bf16), rand(n, k, dtype=bf16).t(), None, None
    yield "bf16 dY @ W (dgrad)", rand(m, k, dtype=bf16), rand(k, n, dtype=bf16), None, None
    yield "bf16 dY.T @ X (wgrad)", rand(k, m, dtype=bf16).t(), rand(k, n, dtype=bf16), None, None
    yield "fp16 x @ W.T", rand(m, k, dtype=fp16), rand(n, k, dtype=fp16).t(), None, None
    for rowwise in (True, False):
        x, w = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
        # 448 is e4m3's largest finite value: scale each row (or the tensor) onto the fp8 range.
        dims = dict(dim=1, keepdim=True) if rowwise else {}
        sx, sw = x.abs().amax(**dims) / 448, w.abs().amax(**dims) / 448
        a = (x / sx).to(torch.float8_e4m3fn)
        b = (w / sw).to(torch.float8_e4m3fn).t()
        label = "fp8 e4m3 row-wise scales" if rowwise else "fp8 e4m3 per-tensor scales"
        yield label, a, b, sx.contiguous(), sw.t().contiguous()


def _median_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    d = out.double()
    if not torch.isfinite(d).all():
        return float("inf")
    return ((d - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def run_ops(m: int, n: int, k: int, arch: str) -> list[dict]:
    """Run and time every op once (see the module docstring); one ``"kind": "run"`` record each."""
    from . import gemm as coda_gemm
    from .reference import gemm_ref

    device = torch.device("cuda", torch.cuda.current_device())
    sms = dispatch.num_sms(device)
    flops = 2 * m * n * k
    out = []
    for label, a, b, sa, sb in _op_cases(m, n, k):
        fp8 = sa is not None
        ours = lambda: coda_gemm(a, b, scale_a=sa, scale_b=sb)  # noqa: E731
        if fp8:
            theirs = lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)  # noqa: E731
        else:
            theirs = lambda: torch.mm(a, b)  # noqa: E731
        ref = gemm_ref(a, b, sa, sb, round_output=False)
        row = {"kind": "run", "op": label, "arch": arch, "m": m, "n": n, "k": k,
               "config": dispatch.select_config(m, n, k, 1, fp8, False, sms, dispatch.card_of(device)).name,
               "torch_op": "torch._scaled_mm" if fp8 else "torch.mm"}
        for who, fn in (("coda", ours), ("torch", theirs)):
            try:
                err = _rel_err(fn(), ref)
                ms = _median_ms(fn)
                row[who] = {"rel_err": err, "ms": ms, "tflops": flops / ms / 1e9}
            except Exception as e:  # noqa: BLE001 - show the failure, keep running the other ops
                row[who] = {"error": f"{type(e).__name__}: {e}"}
        row["ok"] = row["coda"].get("rel_err", float("inf")) < RUN_ERROR_BOUND
        out.append(row)
    return out


def run_table(rows: list[dict], device_name: str) -> Table:
    m, n, k = rows[0]["m"], rows[0]["n"], rows[0]["k"]
    t = Table(title=f"ops on {device_name}, {m}x{n}x{k}: error vs fp32 reference, median of 20 CUDA-event "
                    "timings after warm-up", title_justify="left")
    for col in ("op", "config", "coda err", "torch err", "coda ms", "torch ms", "coda TFLOP/s",
                "torch TFLOP/s", "coda/torch", "torch op"):
        t.add_column(col, justify="left" if col in ("op", "config", "torch op") else "right")
    for r in rows:
        c, th = r["coda"], r["torch"]
        ratio = f"{th['ms'] / c['ms']:.3f}" if "ms" in c and "ms" in th else ""
        t.add_row(r["op"], r["config"], f"[{'green' if r['ok'] else 'bold red'}]{_cell(c, 'rel_err', '.2e')}[/]",
                  _cell(th, "rel_err", ".2e"), _cell(c, "ms", ".3f"), _cell(th, "ms", ".3f"),
                  _cell(c, "tflops", ".0f"), _cell(th, "tflops", ".0f"), ratio, r["torch_op"])
    return t


def _cell(result: dict, key: str, fmt: str) -> str:
    if "error" in result:
        return f"[red]{result['error'][:60]}[/]" if key == "rel_err" else "[red]-[/]"
    return format(result[key], fmt)


# -- command line ---------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON (a list of records) here")
    p.add_argument("--configs", choices=("all", "default"), default="all",
                   help="all: every config of the config space (default); default: the heuristic's "
                        "large-problem config per family")
    p.add_argument("--compile-only", action="store_true", help="skip running the ops even with a GPU")
    p.add_argument("--shape", nargs=3, type=int, default=(4096, 4096, 4096), metavar=("M", "N", "K"),
                   help="problem size of the GPU runs (default 4096 4096 4096)")


def run(args) -> int:
    console = Console()
    if not console.is_terminal:
        console = Console(width=170)
    log = Console(stderr=True, width=console.width)
    specs = kernel_specs(args.configs)
    if find_nvdisasm() is None:
        log.print("[yellow]nvdisasm not found: SASS columns show ?. Install it with "
                  "pip install 'nvidia-cutlass-dsl-libs-base[sass]'.")
    log.print(f"compiling {len(specs)} kernels for {ARCH} ...")
    t0 = time.perf_counter()
    reports = build_reports(specs, log)
    wall = time.perf_counter() - t0
    for family in FAMILIES:
        fam = [r for r in reports if r.family == family]
        if fam:
            console.print(family_table(family, fam))
    console.print(LEGEND, style="dim", highlight=False)
    bad = [r for r in reports if r.problems()]
    secs = sorted(r.kernel.compile_seconds for r in reports if r.kernel is not None)
    median = f", median compile {secs[len(secs) // 2]:.2f} s, max {secs[-1]:.2f} s" if secs else ""
    console.print(f"{len(reports)} kernels for {ARCH} in {wall:.0f} s{median}; "
                  f"{len(reports) - len(bad)} as intended, {len(bad)} not", highlight=False)
    for r in bad:
        console.print(f"[red]  {r.spec.name}: {'; '.join(r.problems())}", highlight=False)
    records = [r.record() for r in reports]

    log.print(f"compiling the element-wise kernels for {ARCH} ...")
    elementwise = report_elementwise.build(log)
    console.print(report_elementwise.table(elementwise))
    bad_elementwise = [r for r in elementwise if r.problems()]
    console.print(f"{len(elementwise)} element-wise kernels for {ARCH}; {len(elementwise) - len(bad_elementwise)} "
                  f"as intended, {len(bad_elementwise)} not", highlight=False)
    records += [r.record() for r in elementwise]

    runs = []
    arch = None if args.compile_only else _gpu_arch(console)
    if arch is not None:
        m, n, k = args.shape
        log.print(f"running the ops at {m}x{n}x{k} on {torch.cuda.get_device_name()} ...")
        runs = run_ops(m, n, k, arch)
        console.print(run_table(runs, torch.cuda.get_device_name()))
    elif not args.compile_only:
        console.print("no Hopper GPU: compiled only (ops not run)")
    records += runs

    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=1)
        log.print(f"wrote {len(records)} records to {args.json}")
    return 1 if bad or bad_elementwise or not all(r["ok"] for r in runs) else 0

