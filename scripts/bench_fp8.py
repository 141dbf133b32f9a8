"""Benchmark the MLP (or attention) sublayer in FP8, forward + backward (the FP8 training issue's
first table):
``coda.mlp_block_fp8`` against its FP8 GEMM shadow, our bf16 ``coda.mlp_block``, and torchao's
float8 training under ``torch.compile`` (tensor-wise and row-wise recipes, and the prototype
block-wise one, which is ours, where torchao imports).
``coda fp8`` runs with ``mlp_fp8.FUSED_QUANT`` as the package sets it; ``coda fp8, quantize fused``
with it on (h^T and dz' quantized in the GEMMs that produce them); ``coda fp8, tail carry on``
(or ``off``: the other way from ``runner.TAIL_CARRY`` as the package sets it) with its
block-scaled forward-form GEMMs carrying each tile's last promotion group into the next tile
where K allows (``GemmConfig.tail_carry``) or not; ``coda fp8 row-wise`` the
second recipe (``row_scaling``: one scale per row along K, the shadow's own scaling, on the plain
FP8 kernel; dz' quantized in one read, its FP8 bytes transposed for its weight gradient and y's
columns quantized after an amax pass; the down-proj's weight gradient the other way round, h's
forward FP8 bytes transposed and dy2's columns quantized), all timed in the same turns. ``--fast-accum
forward|all`` adds ``coda fp8 row-wise, fast accum`` (the GEMMs of those roles accumulating in the
tensor core, ``fast_accum``) with a shadow of its own whose ``_scaled_mm`` calls of the same roles
take ``use_fast_accum``, ``..., weights kept``: the same with its weights quantized once outside
the step, as ``WeightQuantCache`` keeps them between two optimizer steps (what each micro-batch of
a gradient accumulation costs; the other variants, like torchao's, quantize their weights in every
step, which a step without accumulation does too), ``..., GEMM on the current stream``: the GEMMs
beside the weight gradients' passes launched on the current stream rather than on one of higher
priority (``beside.GEMM_PRIORITY`` 0), and ``..., 2x2 clusters``: its ping-pong picks on 2x2
clusters where they build without spills
(``runner.FP8_PINGPONG_2X2``, an experiment switch); ``--poll`` adds ``..., polling``: its GEMMs'
mainloops polling their stage barriers instead of sleeping between polls (``runner.POLL_FULL``).
``--forward-side-sms N ...`` adds the row-wise fast variant whose first projection leaves N SMs
to the weights' passes beside it (0: in series), ``--switch NAME=VALUE ...`` one with the integer
switch ``mlp_fp8.NAME`` set, and ``--variants REGEX`` times only the variants it matches (and the
shadows).

Shapes: d 4096, ffn 14336, 16384 tokens by default (Llama-3-8B's MLP). The shadow is the six GEMMs
of one forward + backward (gate/up, down; the two dgrads and the two wgrads) as FP8 row-wise
``torch._scaled_mm`` on pre-quantized operands in the layouts each needs: nothing but tensor-core
time. The torchao module is the same sublayer (RMSNorm, gate and up projections, SwiGLU, down
projection, residual) built from ``nn.Linear``s and converted with ``convert_to_float8_training``.
All variants timed in turns (``coda_cute.sol.timing.interleaved_medians``, L2 flushed, CUDA-event
medians). Also printed: the bytes our separate quantization passes move per step.

    python scripts/bench_fp8.py [--tokens 16384] [--dim 4096] [--ffn 14336] [--rounds 20] [--json out.json]
        [--profile]                                  # also the kernels of one coda fp8 step (both variants)
    python scripts/bench_fp8.py --baselines-only   # torchao and the shadow, without the CuTe DSL
    python scripts/bench_fp8.py --sublayer attention [--heads 32 --kv-heads 8 --head-dim 128 --seq 4096]
    ncu --nvtx --nvtx-include "coda-fp8-step" python scripts/bench_fp8.py --once --fast-accum all

``--once``: no timing; our row-wise variant (with ``--fast-accum``'s) runs one warm-up step, then
one step inside the NVTX range ``coda-fp8-step``, for a profiler to take its kernels alone;
``--once-shadow`` then does the same with the shadow of that accumulation (range ``fp8-shadow-step``),
so that one profile holds each of our GEMMs and the ``_scaled_mm`` of its role.

``--sublayer attention``: the attention sublayer (``coda.attention_block_fp8`` in both recipes and
the bf16 ``coda.attention_block``: QKV with the RMSNorm and RoPE in its epilogue, the causal GQA
core, out-proj with the residual) against its shadow: its six projection GEMMs in FP8 (QKV and
out-proj, forward, dgrad, wgrad) plus SDPA forward + backward in bf16; no torchao rows.

Each variant is also timed alone, five calls back to back, with the host time to issue them (the
table's last two columns).
``--baselines-only`` is for a machine call that carries torchao's full wheel instead of the DSL:
the shadow is timed in both runs, so each run's ratios to it compare. ``scripts/torchao_wheel.sh``
strips torchao to its float8 training (tensor-wise and row-wise) so that it fits beside the DSL
pack, and ``gpu_session.sh torchao`` then times it in the same turns as ours.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

from coda_cute.nn.llama import embedding_norm_stats
from coda_cute.sol.timing import interleaved_medians
from switches import parse as parse_switches, switched
from train_shadow import attention_fn, fp8_gemm

EPS = 1e-5
#: every CODA step's leaves, by step (:func:`drop_grads`)
_LEAVES: dict = {}


def coda_step(op, x, ss, w_a, w_b, dy, *rest, **kw):
    """One forward + backward of a CODA sublayer op, ``op(x, ss, w_a, w_b, *rest, **kw)`` (leaf
    copies of x and the two weights made once, gradients set to None)."""
    leaves = [t.clone().requires_grad_() for t in (x, w_a, w_b)]

    def step():
        for t in leaves:
            t.grad = None
        op(leaves[0], ss, leaves[1], leaves[2], *rest, **kw)[0].backward(dy)
    _LEAVES[step] = leaves
    return step


def with_switch(step, name: str, value, owner=None):
    """``step`` with ``<owner>.<name>`` set to ``value`` while it runs, its forward and its
    backward both: by default ``mlp_fp8.FUSED_QUANT``; ``runner.FP8_PINGPONG_2X2``,
    ``runner.POLL_FULL`` or ``runner.TAIL_CARRY`` with the epilogue runner as ``owner``,
    ``beside.GEMM_PRIORITY`` with ``ops.beside``."""
    if owner is None:
        from coda_cute.ops import mlp_fp8 as owner
    run = switched(step, [(owner, name, value)])
    if step in _LEAVES:
        _LEAVES[run] = _LEAVES[step]
    return run


def shadow_step(gemms, extra=None, fast_accum: str = "none"):
    """The FP8 row-wise GEMMs ``gemms`` ((rows of A, K, N, role) each) of a sublayer's forward +
    backward on pre-quantized operands (``train_shadow.fp8_gemm``; those of the roles
    ``fast_accum`` names with ``use_fast_accum``), then ``extra`` (the attention core) if given."""
    from coda_cute.ops.fp8_gemms import fast_for

    runs = [fp8_gemm(rows_a, n, k, "cuda", fast_for(fast_accum, role)) for rows_a, k, n, role in gemms]

    def step():
        for run in runs:
            run()
        if extra is not None:
            extra()
    return step


def mlp_gemms(m, d, f):
    """The MLP sublayer's six GEMMs (rows of A, K, N, role): gate/up, down; the two dgrads and the
    two wgrads."""
    return [(m, d, 2 * f, "forward"), (m, f, d, "forward"),     # gate/up, down
            (m, d, f, "dgrad"), (d, m, f, "wgrad"),             # down dgrad, down wgrad (d x f over tokens)
            (2 * f, m, d, "wgrad"), (m, 2 * f, d, "dgrad")]     # gate/up wgrad, gate/up dgrad


def attention_gemms(m, d, qkv, hq):
    """The attention sublayer's six projection GEMMs (rows of A, K, N, role): QKV (``qkv`` wide) and
    out-proj (from the ``hq`` = heads x head_dim columns of the core's output), forward, dgrad,
    wgrad."""
    return [(m, d, qkv, "forward"), (m, hq, d, "forward"),      # QKV, out-proj
            (m, d, hq, "dgrad"), (d, m, hq, "wgrad"),           # out-proj dgrad, wgrad
            (m, qkv, d, "dgrad"), (qkv, m, d, "wgrad")]         # QKV dgrad, wgrad


class Mlp(torch.nn.Module):
    """y + down(silu(gate(n)) * up(n)), n = RMSNorm(y): the sublayer torchao converts."""

    def __init__(self, d, f):
        super().__init__()
        self.norm = torch.nn.RMSNorm(d, eps=EPS)
        self.gate, self.up = torch.nn.Linear(d, f, bias=False), torch.nn.Linear(d, f, bias=False)
        self.down = torch.nn.Linear(f, d, bias=False)

    def forward(self, y):
        n = self.norm(y)
        return y + self.down(torch.nn.functional.silu(self.gate(n)) * self.up(n))


def torchao_steps(y, dy2, d, f, console):
    """{label: step} for torchao's tensor-wise and row-wise float8 training under torch.compile
    (empty where torchao does not import)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        console.print(f"torchao not importable ({e}); its rows are left out")
        return {}
    steps = {}
    for recipe in ("tensorwise", "rowwise"):
        module = Mlp(d, f).cuda().to(torch.bfloat16)
        convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name(recipe))
        compiled = torch.compile(module)
        leaf = y.clone().requires_grad_()

        def step(compiled=compiled, leaf=leaf, module=module):
            leaf.grad = None
            module.zero_grad(set_to_none=True)
            compiled(leaf).backward(dy2)
        steps[f"torchao {recipe} + compile"] = step
    steps.update(torchao_blockwise_step(y, dy2, d, f, console))
    return steps


def torchao_blockwise_step(y, dy2, d, f, console) -> dict:
    """torchao's prototype block-wise FP8 training (``Float8BlockwiseLinear``: our recipe, 1 x 128
    activation and gradient blocks, 128 x 128 weight blocks, the weight gradient from 1 x 128 x 128
    x 1 operands; Triton quantizers, ``torch._scaled_mm``'s block-wise GEMMs) under torch.compile:
    the same recipe as ``coda.mlp_block_fp8`` (empty where it does not import)."""
    try:
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear
    except ImportError as e:
        console.print(f"torchao's block-wise training not importable ({e}); its row is left out")
        return {}
    module = Mlp(d, f).cuda().to(torch.bfloat16)
    for name in ("gate", "up", "down"):
        setattr(module, name, Float8BlockwiseLinear.from_float(getattr(module, name)))
    compiled = torch.compile(module)
    leaf = y.clone().requires_grad_()

    def step():
        leaf.grad = None
        module.zero_grad(set_to_none=True)
        compiled(leaf).backward(dy2)
    return {"torchao blockwise (prototype) + compile": step}


def attention_case(m, d, heads, kv_heads, head_dim, seq):
    """(args of ``coda.attention_block[_fp8]`` after (x, ss, w_qkv, w_o), x (B, S, d), w_qkv, w_o,
    dy, the attention core's forward + backward for the shadow) at ``m`` tokens in sequences of
    ``seq``."""
    from coda_cute.reference import rope_inv_freq

    x = torch.randn(m, d, device="cuda").bfloat16()
    qkv = (heads + 2 * kv_heads) * head_dim
    w_qkv = (torch.randn(qkv, d, device="cuda") * d ** -0.5).bfloat16()
    w_o = (torch.randn(d, heads * head_dim, device="cuda") * (heads * head_dim) ** -0.5).bfloat16()
    pos = torch.arange(seq, dtype=torch.int32, device="cuda").repeat(m // seq)
    rest = (pos, rope_inv_freq(head_dim, 500000.0, "cuda"), EPS, heads, kv_heads, head_dim)
    core = attention_fn(dict(n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim), m // seq, seq, "cuda")
    b = m // seq
    return rest, x.view(b, seq, d), w_qkv, w_o, torch.randn_like(x).view(b, seq, d), core


#: bytes per element: an FP8 value and its share of a 1 x 128 block's fp32 scale
_FP8 = 1 + 4 / 128


def quantize_bytes(m, d, f) -> list[dict]:
    """What quantization moves per forward + backward of ``coda.mlp_block_fp8``, per tensor:
    today's separate passes (each reads the bf16 tensor, 2 bytes per element, and writes each
    layout's FP8 values and scales) against the same quantization in the producing GEMM's epilogue
    (``E.quantize``: the writes only), and whether the epilogue's sinks take that tensor yet. y
    and dy2 are full-width outputs of the neighbouring sublayers' GEMMs (their sinks can write
    them, both layouts in one pass); h is the gate/up GEMM's half-width output (its transposed
    layout has a sink; along its columns a block-scaled tile holds half a block of each row), dz'
    the down dgrad's double-width one (both layouts); the weights are quantized by
    their own kernel with their FP8 transposes (read bf16, write both), once per version with
    ``nn.fold.WeightQuantCache``. ``row_wise``: the same tensors in the row-wise recipe, bytes per
    element: a tensor needed along K is read once and written (3, ``elementwise_fp8.QuantizeWholeRowsSpec``);
    a column quantization over all the tokens reads once more first for the columns' amaxes (5,
    ``elementwise_fp8.abs_max``; the weights' transposes too); dz''s FP8 rows are transposed as bytes
    for its wgrad (2 more, ``elementwise_fp8.transpose_fp8``; the wgrad folds its row scales into y's
    columns), and so are h's, kept from the forward (2: the down-proj wgrad folds h's row scales
    into dy2's columns, ``fp8_gemms.wgrad_kept``; the down dgrad no longer stores h either)."""
    rows = [("y (forward, along K)", m * d, 1, "yes: the previous residual GEMM", 3),
            ("h (forward, along K)", m * f, 1, "no: a row of h is half a block per block-scaled tile", 3),
            ("dy2 (both layouts)", m * d, 2, "yes: the next sublayer's dgrad", 3 + 5),
            ("dz' (both layouts)", m * 2 * f, 2, "yes: the down dgrad (double-width, both layouts)", 3 + 2),
            ("h (along the tokens)", m * f, 1, "yes: the gate/up GEMM (half-width, transposed)", 2),
            ("y (along the tokens)", m * d, 1, "yes: the previous residual GEMM (transposed sink)", 5)]
    out = [dict(tensor=name, elements=n, separate=n * (2 + layouts * _FP8), fused=n * layouts * _FP8, sink=sink,
                row_wise=n * row_wise)
           for name, n, layouts, sink, row_wise in rows]
    w = 3 * f * d
    out.append(dict(tensor="W_gu, W_down (128 x 128, with transposes)", elements=w, separate=w * (2 + 2),
                    fused=None, sink="own kernel, once per version when cached", row_wise=w * (2 + 2 + 2)))
    return out


def print_quantize_bytes(rows: list, console) -> tuple[float, float]:
    """The table of :func:`quantize_bytes`; returns the separate passes' total GB in the block
    and in the row-wise recipe."""
    t = Table(title="bytes moved by quantization per MLP forward + backward (GB)")
    for col in ("tensor", "separate passes (block recipe)", "row-wise recipe's passes", "in the producing epilogue",
                "sink today"):
        t.add_column(col, justify="left" if col in ("tensor", "sink today") else "right")
    for r in rows:
        t.add_row(r["tensor"], f"{r['separate'] / 1e9:.3f}", f"{r['row_wise'] / 1e9:.3f}",
                  "-" if r["fused"] is None else f"{r['fused'] / 1e9:.3f}", r["sink"])
    total, row_wise = sum(r["separate"] for r in rows) / 1e9, sum(r["row_wise"] for r in rows) / 1e9
    fused = sum(r["fused"] if r["fused"] is not None else r["separate"] for r in rows) / 1e9
    t.add_row("total", f"{total:.3f}", f"{row_wise:.3f}", f"{fused:.3f}", "")
    console.print(t)
    return total, row_wise


def back_to_back_ms(fn, calls: int = 5) -> tuple[float, float]:
    """(GPU ms, host ms) per call of ``calls`` calls in a row (no flush between): CUDA events, and
    the host's own time to issue them (perf_counter, no sync inside). Next to the interleaved
    median, the first shows whether a variant's time depends on what ran before it; a host time
    near or above the GPU time says the launches, not the kernels, set the pace."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / calls
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls, host


def print_profile(fn, console, label: str = "coda fp8") -> None:
    """The kernels of one call of ``fn`` in launch order with their GPU times (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    t = Table(title=f"one {label} step: {len(kernels)} kernels, "
                    f"{sum(e.device_time for e in kernels) / 1e3:.3f} ms GPU time")
    t.add_column("ms", justify="right")
    t.add_column("kernel", overflow="fold")
    for e in kernels:
        name = re.sub(r"_object_at_[0-9a-fx]+", "", e.name)
        t.add_row(f"{e.device_time / 1e3:.3f}", name[:70] + (" ... " + name[-50:] if len(name) > 120 else name[70:]))
    console.print(t)


#: the shadow's row label: the sublayer's six FP8 row-wise GEMMs (and, for attention, its core)
SHADOW = "fp8 shadow (6 row-wise _scaled_mm)"


def fast_label(fast_accum: str) -> tuple[str, str]:
    """The shadow's and our row-wise variant's labels with fast accumulation in ``fast_accum``'s
    roles."""
    return f"fp8 shadow, fast accum ({fast_accum})", f"coda fp8 row-wise, fast accum ({fast_accum})"


def kept_label(fast_accum: str) -> str:
    """The row-wise fast variant whose weights are quantized once outside the step."""
    return fast_label(fast_accum)[1] + ", weights kept"


def cluster_label(fast_accum: str) -> str:
    """The row-wise fast variant whose ping-pong picks take 2x2 clusters
    (``runner.FP8_PINGPONG_2X2``)."""
    return fast_label(fast_accum)[1] + ", 2x2 clusters"


def current_stream_label(fast_accum: str) -> str:
    """The row-wise fast variant whose GEMMs beside the weight gradients' passes go on the current
    stream, of the passes' priority (``beside.GEMM_PRIORITY`` 0)."""
    return fast_label(fast_accum)[1] + ", GEMM on the current stream"


def kept_weights(w_gu, w_down) -> dict:
    """The two weights' row-wise FP8 quantizations as ``WeightQuantCache`` keeps them between two
    optimizer steps (every micro-batch of a gradient accumulation then skips its weights' four
    bandwidth-bound passes), as ``mlp_block_fp8``'s keyword arguments."""
    from coda_cute.ops.fp8_gemms import weight

    out = {}
    for name, w in (("gu", w_gu), ("down", w_down)):
        out.update(zip((f"{name}_q", f"{name}_s", f"{name}_qt"), weight(w, False, True)))
    return out


def mlp_case(m, d, f):
    """The MLP sublayer's inputs: y (m, d), w_gu (2f, d), w_down (d, f) at 1 / sqrt(K) and the
    output gradient dy2 (m, d), bf16, random."""
    y = torch.randn(m, d, device="cuda").bfloat16()
    w_gu = (torch.randn(2 * f, d, device="cuda") * d ** -0.5).bfloat16()
    w_down = (torch.randn(d, f, device="cuda") * f ** -0.5).bfloat16()
    return y, w_gu, w_down, torch.randn(m, d, device="cuda").bfloat16()


def poll_label(fast_accum: str) -> str:
    """The row-wise fast variant whose GEMMs' mainloops poll their stage barriers (``runner.POLL_FULL``)."""
    return fast_label(fast_accum)[1] + ", polling"


def carry_label() -> str:
    """The block recipe with ``runner.TAIL_CARRY`` the other way from the package's setting."""
    from coda_cute.epilogue import runner

    return f"coda fp8, tail carry {'off' if runner.TAIL_CARRY else 'on'}"


def side_label(fast_accum: str, down: int, gate_up: int) -> str:
    """The row-wise fast variant whose down dgrad and gate/up dgrad leave ``down`` and ``gate_up``
    SMs to the weight gradients' passes (``mlp_fp8.SIDE_SMS_*``; 0 and 0: the passes in series)."""
    return fast_label(fast_accum)[1] + f", side SMs {down} / {gate_up}"


def forward_side_label(fast_accum: str, sms: int) -> str:
    """The row-wise fast variant whose first projection (the MLP's gate/up, attention's QKV) leaves
    ``sms`` SMs to the weights' passes (``mlp_fp8.SIDE_SMS_GATE_UP_FORWARD``,
    ``attention_fp8.SIDE_SMS_QKV_FORWARD``; 0: those passes in series, after it)."""
    return fast_label(fast_accum)[1] + f", forward side SMs {sms}"


def switch_label(fast_accum: str, name: str, value: int) -> str:
    """The row-wise fast variant with ``mlp_fp8.<name>`` set to ``value`` (``--switch``)."""
    return fast_label(fast_accum)[1] + f", {name}={value}"


def mlp_fns(m, d, f, baselines_only: bool, console, fast_accum: str = "none", poll: bool = False,
            side_sms=(), forward_side=(), switches=()) -> dict:
    """{label: step} of the MLP sublayer: the shadow, our variants, torchao's; with ``fast_accum``
    also the row-wise recipe with it and its shadow, with ``poll`` that recipe polling, for
    each (down, gate/up) of ``side_sms`` that recipe with those side SMs beside its dgrads, for
    each count of ``forward_side`` with those beside its gate/up forward, and for each (name,
    value) of ``switches`` with ``mlp_fp8.<name>`` set to that value."""
    y, w_gu, w_down, dy2 = mlp_case(m, d, f)
    ss = None if baselines_only else embedding_norm_stats(y)
    fns = {SHADOW: shadow_step(mlp_gemms(m, d, f))}
    if fast_accum != "none":
        fns[fast_label(fast_accum)[0]] = shadow_step(mlp_gemms(m, d, f), fast_accum=fast_accum)
    if not baselines_only:
        fns["coda fp8"] = coda_step(torch.ops.coda.mlp_block_fp8, y, ss, w_gu, w_down, dy2, EPS)
        fns["coda fp8, quantize fused"] = with_switch(coda_step(torch.ops.coda.mlp_block_fp8, y, ss, w_gu,
                                                                w_down, dy2, EPS), "FUSED_QUANT", True)
        from coda_cute.epilogue import runner

        fns[carry_label()] = with_switch(
            coda_step(torch.ops.coda.mlp_block_fp8, y, ss, w_gu, w_down, dy2, EPS), "TAIL_CARRY",
            not runner.TAIL_CARRY, runner)
        row_op = functools.partial(torch.ops.coda.mlp_block_fp8, row_scaling=True)
        fns["coda fp8 row-wise"] = coda_step(row_op, y, ss, w_gu, w_down, dy2, EPS)
        if fast_accum != "none":
            ours = fast_label(fast_accum)[1]
            fns[ours] = coda_step(row_op, y, ss, w_gu, w_down, dy2, EPS, fast_accum=fast_accum)
            fns[kept_label(fast_accum)] = coda_step(row_op, y, ss, w_gu, w_down, dy2, EPS, fast_accum=fast_accum,
                                                    **kept_weights(w_gu, w_down))
            from coda_cute.ops import beside

            fns[current_stream_label(fast_accum)] = with_switch(
                coda_step(row_op, y, ss, w_gu, w_down, dy2, EPS, fast_accum=fast_accum), "GEMM_PRIORITY", 0, beside)
            fns[cluster_label(fast_accum)] = with_switch(
                coda_step(row_op, y, ss, w_gu, w_down, dy2, EPS, fast_accum=fast_accum), "FP8_PINGPONG_2X2", True,
                runner)
            for down, gate_up in side_sms:
                fns[side_label(fast_accum, down, gate_up)] = with_switch(with_switch(
                    coda_step(row_op, y, ss, w_gu, w_down, dy2, EPS, fast_accum=fast_accum),
                    "SIDE_SMS_DOWN_DGRAD", down), "SIDE_SMS_GATE_UP_DGRAD", gate_up)
            for sms in forward_side:
                fns[forward_side_label(fast_accum, sms)] = with_switch(
                    coda_step(row_op, y, ss, w_gu, w_down, dy2, EPS, fast_accum=fast_accum), "SIDE_SMS_GATE_UP_FORWARD",
                    sms)
            for name, value in switches:
                fns[switch_label(fast_accum, name, value)] = with_switch(
                    coda_step(row_op, y, ss, w_gu, w_down, dy2, EPS, fast_accum=fast_accum), name, value)
            if poll:
                fns[poll_label(fast_accum)] = with_switch(
                    coda_step(row_op, y, ss, w_gu, w_down, dy2, EPS, fast_accum=fast_accum), "POLL_FULL", True, runner)
        fns["coda bf16"] = coda_step(torch.ops.coda.mlp_block, y, ss, w_gu, w_down, dy2, EPS)
    fns.update(torchao_steps(y, dy2, d, f, console))
    return fns


def attention_fns(m, d, heads, kv_heads, head_dim, seq, baselines_only: bool, fast_accum: str = "none",
                  forward_side=()) -> dict:
    """{label: step} of the attention sublayer (QKV with RMSNorm and RoPE, the causal GQA core,
    out-proj with the residual): the shadow (its six GEMMs in FP8 plus SDPA forward + backward in
    bf16), ``coda.attention_block_fp8`` in both recipes and the bf16 ``coda.attention_block``;
    with ``fast_accum`` also the row-wise recipe with it and its shadow, and for each count of
    ``forward_side`` that recipe with those SMs beside its QKV forward
    (``attention_fp8.SIDE_SMS_QKV_FORWARD``)."""
    if m % seq:
        raise SystemExit(f"--tokens {m} must be a multiple of --seq {seq}")
    rest, x, w_qkv, w_o, dy, core = attention_case(m, d, heads, kv_heads, head_dim, seq)
    fns = {SHADOW: shadow_step(attention_gemms(m, d, w_qkv.shape[0], w_o.shape[1]), core)}
    if not baselines_only:
        case = (x, embedding_norm_stats(x.view(m, d)), w_qkv, w_o, dy, *rest)
        fns["coda fp8"] = coda_step(torch.ops.coda.attention_block_fp8, *case)
        fns["coda fp8 row-wise"] = coda_step(torch.ops.coda.attention_block_fp8, *case, row_scaling=True)
        if fast_accum != "none":
            shadow, ours = fast_label(fast_accum)
            fns[shadow] = shadow_step(attention_gemms(m, d, w_qkv.shape[0], w_o.shape[1]), core, fast_accum)
            fns[ours] = coda_step(torch.ops.coda.attention_block_fp8, *case, row_scaling=True, fast_accum=fast_accum)
            from coda_cute.ops import attention_fp8

            fns[ours + ", passes in series"] = with_switch(
                coda_step(torch.ops.coda.attention_block_fp8, *case, row_scaling=True, fast_accum=fast_accum),
                "SIDE_SMS_QKV_DGRAD", 0, attention_fp8)
            for sms in forward_side:
                fns[forward_side_label(fast_accum, sms)] = with_switch(
                    coda_step(torch.ops.coda.attention_block_fp8, *case, row_scaling=True, fast_accum=fast_accum),
                    "SIDE_SMS_QKV_FORWARD", sms, attention_fp8)
        fns["coda bf16"] = coda_step(torch.ops.coda.attention_block, *case)
    return fns


def drop_grads(keep) -> None:
    """Every CODA step's gradients dropped but step ``keep``'s (which drops its own as it starts):
    each variant's memory is then measured from the same state rather than among the blocks the
    variants before it left behind."""
    kept = _LEAVES.get(keep)
    for leaves in _LEAVES.values():
        if leaves is not kept:
            for t in leaves:
                t.grad = None


def reserved_by_stream() -> dict:
    """{stream: bytes} of the caching allocator's segments, by the stream each was reserved for."""
    out: dict = {}
    for seg in torch.cuda.memory_snapshot():
        out[seg["stream"]] = out.get(seg["stream"], 0) + seg["total_size"]
    return out


def peak_step_mib(fn) -> tuple[float, float, dict]:
    """MiB that one (warm) call of ``fn`` allocates at its peak beyond what was allocated before it
    (``max_memory_allocated``: every stream's blocks, the side stream's passes' outputs too), the
    MiB the caching allocator reserves for it from an emptied cache (blocks freed on one stream are
    not handed to another: a second stream can raise this one alone), and that growth by stream
    ({stream handle: MiB}, the current stream's and a side stream's apart)."""
    drop_grads(fn)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    before = reserved_by_stream()
    fn()
    torch.cuda.synchronize()
    after = reserved_by_stream()
    by_stream = {str(s): (after[s] - before.get(s, 0)) / 2 ** 20 for s in after if after[s] != before.get(s, 0)}
    return ((torch.cuda.max_memory_allocated() - base) / 2 ** 20,
            (torch.cuda.max_memory_reserved() - base_reserved) / 2 ** 20, by_stream)


def one_step_in_range(fn, nvtx_range: str, name: str, console) -> None:
    """``fn`` once to warm up, then once inside ``nvtx_range`` (for a profiler's filter). A
    start/end range, which holds every thread's launches: a push/pop range is the pushing
    thread's alone, and autograd launches the backward from a thread of its own."""
    fn()
    torch.cuda.synchronize()
    rid = torch.cuda.nvtx.range_start(nvtx_range)
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_end(rid)
    console.print(f"{name}: one step in the NVTX range {nvtx_range}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--json")
    p.add_argument("--profile", action="store_true",
                   help="print the kernels of one step of each shadow and of our variants")
    p.add_argument("--once", action="store_true",
                   help="our row-wise step once after a warm-up one, in the NVTX range coda-fp8-step (for ncu)")
    p.add_argument("--once-shadow", action="store_true",
                   help="with --once: then the shadow with --fast-accum's accumulation the same way, in the "
                        "NVTX range fp8-shadow-step (its GEMMs next to ours in one profile)")
    p.add_argument("--baselines-only", action="store_true", help="torchao and the shadow only (no CODA ops)")
    p.add_argument("--sublayer", choices=("mlp", "attention"), default="mlp")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seq", type=int, default=4096, help="attention: tokens per sequence")
    p.add_argument("--fast-accum", choices=("none", "forward", "all"), default="none",
                   help="also the row-wise recipe with fast accumulation in these roles, and its shadow")
    p.add_argument("--poll", action="store_true",
                   help="with --fast-accum: also the row-wise fast variant whose GEMMs' mainloops poll their stage "
                        "barriers (runner.POLL_FULL, GemmConfig.poll_full)")
    p.add_argument("--side-sms", nargs="+", default=[], metavar="DOWN,GATE_UP",
                   help="with --fast-accum: also the row-wise fast variant whose down dgrad and gate/up dgrad leave "
                        "these SMs to the weight gradients' passes beside them (mlp_fp8.SIDE_SMS_*; 0,0: in series)")
    p.add_argument("--forward-side-sms", nargs="+", type=int, default=[], metavar="SMS",
                   help="with --fast-accum: also the row-wise fast variant whose first projection (gate/up, QKV) "
                        "leaves these SMs to the weights' passes beside it (0: in series, after it)")
    p.add_argument("--switch", nargs="+", default=[], metavar="NAME=VALUE",
                   help="with --fast-accum: also the row-wise fast MLP with the integer switch mlp_fp8.NAME set "
                        "to VALUE (e.g. SIDE_SMS_DOWN_WGRAD=0), one variant each")
    p.add_argument("--variants", metavar="REGEX",
                   help="time only the variants whose label matches REGEX (the shadows always)")
    args = p.parse_args(argv)
    if any(v < 0 for v in args.forward_side_sms):
        p.error(f"--forward-side-sms takes SM counts >= 0, got {args.forward_side_sms}")
    try:
        switches = [(name, value) for _, name, value in parse_switches(args.switch, ("mlp_fp8",))]
    except ValueError as exc:
        p.error(f"--switch: {exc}")
    side_sms = [tuple(int(v) for v in pair.split(",")) for pair in args.side_sms]
    if any(len(pair) != 2 or min(pair) < 0 for pair in side_sms):
        p.error(f"--side-sms takes pairs DOWN,GATE_UP of SM counts >= 0, got {args.side_sms}")
    console = Console()
    if not torch.cuda.is_available():
        console.print("[red]bench_fp8 needs a CUDA GPU[/]")
        return 2
    m, d, f = args.tokens, args.dim, args.ffn
    fns = mlp_fns(m, d, f, args.baselines_only, console, args.fast_accum, args.poll, side_sms, args.forward_side_sms,
                  switches) \
        if args.sublayer == "mlp" else \
        attention_fns(m, d, args.heads, args.kv_heads, args.head_dim, args.seq, args.baselines_only, args.fast_accum,
                      args.forward_side_sms)
    if args.variants:
        fns = {k: v for k, v in fns.items() if "shadow" in k or re.search(args.variants, k)}
    if args.once:
        ours, shadow = fast_label(args.fast_accum)[::-1] if args.fast_accum != "none" else ("coda fp8 row-wise", SHADOW)
        one_step_in_range(fns[ours], "coda-fp8-step", ours, console)
        if args.once_shadow:
            one_step_in_range(fns[shadow], "fp8-shadow-step", shadow, console)
        return 0
    peak_mib = {}
    for name, fn in list(fns.items()):  # one variant that fails to run leaves the others' table
        try:
            fn()
            peak_mib[name] = peak_step_mib(fn)
        except Exception as e:  # noqa: BLE001
            console.print(f"[red]{name} failed, left out: {type(e).__name__}: {e}[/]")
            del fns[name]
    ms = interleaved_medians(fns, rounds=args.rounds, settle_ms=2000)
    alone = {name: back_to_back_ms(fn) for name, fn in fns.items()}
    shadow = ms[SHADOW]
    ao = [v for k, v in ms.items() if k.startswith("torchao")]
    shape = f"ffn {f}" if args.sublayer == "mlp" else f"{args.heads} / {args.kv_heads} heads of {args.head_dim}"
    t = Table(title=f"{args.sublayer} sublayer forward + backward, M {m}, d {d}, {shape} (median ms)")
    for col in ("variant", "ms", "/ fp8 shadow", "torchao best / this", "back to back ms", "host ms", "peak MiB",
                "reserved MiB"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    for name, v in ms.items():
        t.add_row(name, f"{v:.3f}", f"{v / shadow:.3f}", f"{min(ao) / v:.3f}" if ao else "-", f"{alone[name][0]:.3f}",
                  f"{alone[name][1]:.3f}", *(f"{v:.0f}" for v in peak_mib[name][:2]))
    console.print(t)
    fast_shadow, fast_ours = fast_label(args.fast_accum)
    for name, (_, _, by_stream) in peak_mib.items():
        if len(by_stream) > 1:  # a side stream's pool grew too
            console.print(f"{name}: reserved MiB by stream " + ", ".join(f"{v:.0f}" for v in by_stream.values()))
    for ours in (fast_ours, kept_label(args.fast_accum), current_stream_label(args.fast_accum),
                 cluster_label(args.fast_accum), poll_label(args.fast_accum),
                 *(side_label(args.fast_accum, *pair) for pair in side_sms),
                 *(forward_side_label(args.fast_accum, sms) for sms in args.forward_side_sms),
                 *(switch_label(args.fast_accum, *sw) for sw in switches)):
        if fast_shadow in ms and ours in ms:
            console.print(f"{ours}: {ms[ours] / ms[fast_shadow]:.3f}x its shadow with the same fast "
                          f"accumulation ({ms[fast_shadow]:.3f} ms), {ms[ours] / shadow:.3f}x the row-wise one")
    if args.profile:
        # the shadows' kernels too: each of our GEMMs next to the _scaled_mm of its role
        for name in (SHADOW, fast_shadow, "coda fp8", carry_label(), "coda fp8, quantize fused", "coda fp8 row-wise",
                     fast_ours, cluster_label(args.fast_accum), poll_label(args.fast_accum)):
            if name in fns:
                print_profile(fns[name], console, name)
    bytes_rows, gb, row_gb = [], None, None
    if args.sublayer == "mlp":
        bytes_rows = quantize_bytes(m, d, f)
        gb, row_gb = print_quantize_bytes(bytes_rows, console)
        console.print(f"our separate quantize passes move {gb:.2f} GB per step in the block recipe, "
                      f"{row_gb:.2f} in the row-wise one (~{gb / 4.24:.2f} / {row_gb / 4.24:.2f} ms at the "
                      f"H200's 4.24 TB/s copy bandwidth)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"sublayer": args.sublayer, "shape": [m, d, f], "ms": ms,
                       "back_to_back_ms": {k: v[0] for k, v in alone.items()},
                       "host_ms": {k: v[1] for k, v in alone.items()},
                       "peak_mib": {k: v[:2] for k, v in peak_mib.items()},
                       "reserved_by_stream_mib": {k: v[2] for k, v in peak_mib.items()}, "quantize_gb": gb,
                       "quantize_gb_row_wise": row_gb,
                       "quantize_bytes": bytes_rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
