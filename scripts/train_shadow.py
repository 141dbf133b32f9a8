"""The measurements of ``scripts/bench_train.py``: the step's shadow (its GEMMs on cuBLAS in their
training layouts, attention alone), timing in turns with a per-function fallback, peak memory
beyond parameters and gradients, and the profiler's per-kernel table.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from rich.console import Console

from train_models import BF16, block_fn, zero_grads

try:
    from coda_cute.sol.timing import interleaved_medians
except Exception:  # noqa: BLE001  (timing.py needs only torch: load it from the tree)
    _spec = importlib.util.spec_from_file_location(
        "_coda_timing", os.path.join(os.path.dirname(__file__), "..", "coda_cute", "sol", "timing.py"))
    _timing = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_timing)
    interleaved_medians = _timing.interleaved_medians

GIB = 2 ** 30
#: warm-up of each timing group, ms: run its functions in turns this long first, so that timing
#: starts at the clocks a sustained sequence settles at (scripts/bench_block.py)
SETTLE_MS = 2000
TOP_KERNELS = 15

err_console = Console(stderr=True, width=180)


def say(msg: str):
    err_console.print(msg)


# -- the shadow's GEMMs ---------------------------------------------------------------------------
LAYOUTS = {"fwd": "x @ W.T", "dgrad": "dY @ W", "wgrad": "dY.T @ X"}


@dataclass(frozen=True)
class Gemm:
    """One GEMM of the training step, (m, n, k) as torch.mm's (m, k) @ (k, n); ``count`` times per step."""
    linear: str
    kind: str  # fwd / dgrad / wgrad
    m: int
    n: int
    k: int
    count: int

    @property
    def name(self) -> str:
        return f"{self.linear}.{self.kind}"

    @property
    def layout(self) -> str:
        return LAYOUTS[self.kind]

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    @property
    def per_layer(self) -> bool:
        return self.linear != "lm_head"


def linears(c: dict) -> list:
    """(name, out_features, in_features, count per step) of every weight, as the CODA model holds
    them (fused QKV, fused gate/up)."""
    h, hkv, hd, d, f = c["n_heads"], c["n_kv_heads"], c["head_dim"], c["dim"], c["ffn_dim"]
    n = c["n_layers"]
    return [("qkv", (h + 2 * hkv) * hd, d, n), ("o", d, h * hd, n), ("gate_up", 2 * f, d, n),
            ("down", d, f, n), ("lm_head", c["vocab_size"], d, 1)]


def step_gemms(c: dict, tokens: int) -> list:
    """The GEMMs of one training step of the model ``c`` (coda LlamaConfig fields) on ``tokens``
    rows: per weight W (out, in): fwd x @ W.T (tokens x out x in), dgrad dY @ W (tokens x in x
    out), wgrad dY.T @ X (out x in x tokens)."""
    out = []
    for name, n_out, n_in, count in linears(c):
        out += [Gemm(name, "fwd", tokens, n_out, n_in, count), Gemm(name, "dgrad", tokens, n_in, n_out, count),
                Gemm(name, "wgrad", n_out, n_in, tokens, count)]
    return out


def gemm_fns(gemms: list, device, dtype=BF16) -> dict:
    """name -> a function running that GEMM with torch.mm in its training layout, on random
    operands shared by the three GEMMs of one weight: X (M, in), W (out, in), dY (M, out)."""
    ops = {}
    fns = {}
    for g in gemms:
        if g.linear not in ops:
            fwd = next(x for x in gemms if x.linear == g.linear and x.kind == "fwd")
            m, n_out, n_in = fwd.m, fwd.n, fwd.k
            ops[g.linear] = (torch.randn(m, n_in, device=device, dtype=dtype),
                             torch.randn(n_out, n_in, device=device, dtype=dtype) * n_in ** -0.5,
                             torch.randn(m, n_out, device=device, dtype=dtype))
        x, w, dy = ops[g.linear]
        fns[g.name] = {"fwd": lambda x=x, w=w: torch.mm(x, w.t()),
                       "dgrad": lambda dy=dy, w=w: torch.mm(dy, w),
                       "wgrad": lambda dy=dy, x=x: torch.mm(dy.t(), x)}[g.kind]
    return fns


def fp8_gemm(m: int, n: int, k: int, device, fast_accum: bool = False) -> Callable:
    """An (m, n, k) GEMM as FP8 row-wise ``torch._scaled_mm`` (E4M3 operands quantized with one
    fp32 scale per row of A and per column of B, as an FP8 step's are, bf16 out) on random
    operands: A (m, k) row-major, B (k, n) column-major, the layouts each GEMM of an FP8 step takes
    its operands in (``fast_accum``: ``use_fast_accum``). No quantization is timed: tensor-core
    time only."""
    fp8 = torch.float8_e4m3fn

    def rowwise(rows):
        x = torch.randn(rows, k, device=device)
        s = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / torch.finfo(fp8).max
        return (x / s).to(fp8), s

    (a, sa), (b, sb) = rowwise(m), rowwise(n)
    b, sb = b.t(), sb.t()
    return lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=BF16, use_fast_accum=fast_accum)


def fp8_gemm_fns(gemms: list, device) -> dict:
    """name + ".fp8" -> the decoder layers' GEMMs (not the LM head's) as :func:`fp8_gemm`."""
    return {g.name + ".fp8": fp8_gemm(g.m, g.n, g.k, device) for g in gemms if g.per_layer}


def attention_fn(c: dict, batch: int, seq: int, device, dtype=BF16) -> Callable:
    """SDPA forward + backward (causal, GQA) on (B, H, S, hd) q and (B, Hkv, S, hd) k, v."""
    hd = c["head_dim"]
    q = torch.randn(batch, c["n_heads"], seq, hd, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, c["n_kv_heads"], seq, hd, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, c["n_kv_heads"], seq, hd, device=device, dtype=dtype, requires_grad=True)
    do = torch.randn(batch, c["n_heads"], seq, hd, device=device, dtype=dtype)

    def attention():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(o, (q, k, v), do)
    return attention


# -- measurement helpers ----------------------------------------------------------------------------
def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:500]


def report_failure(what: str, exc: BaseException, errors: dict, key: str):
    errors[key] = _err(exc)
    say(f"[bold red]{what} failed[/]: {errors[key]}")
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    err_console.print("".join(tb[-12:]).rstrip(), style="dim", markup=False, highlight=False)


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_fns(fns: dict, rounds: int, warmup: int, smoke: bool, errors: dict, group: str) -> dict:
    """Medians in ms of ``fns`` timed in turns (interleaved_medians); on failure, each fn alone, so
    that one broken fn costs only its own number. ``smoke``: one wall-clock call each (CPU)."""
    if not fns:
        return {}
    if smoke:
        out = {}
        for name, fn in fns.items():
            try:
                t0 = time.perf_counter()
                fn()
                out[name] = (time.perf_counter() - t0) * 1e3
            except Exception as exc:  # noqa: BLE001
                report_failure(f"{group}: {name}", exc, errors, name)
                out[name] = None
        return out
    try:
        return interleaved_medians(fns, rounds=rounds, warmup=warmup, settle_ms=SETTLE_MS)
    except Exception as exc:  # noqa: BLE001
        report_failure(f"{group}: timing in turns", exc, errors, f"{group}_timing")
    out = {}
    for name, fn in fns.items():
        try:
            out[name] = interleaved_medians({name: fn}, rounds=rounds, warmup=warmup)[name]
        except Exception as exc:  # noqa: BLE001
            report_failure(f"{group}: {name} timed alone", exc, errors, name)
            out[name] = None
    return out


def peak_gib(step: Callable, own_params: list, all_params: list, device) -> Optional[float]:
    """Peak bytes allocated during one ``step`` beyond what was allocated before it and beyond its
    own gradients, GiB (None off CUDA)."""
    if torch.device(device).type != "cuda":
        return None
    zero_grads(all_params)
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    grads = sum(p.numel() * p.element_size() for p in own_params)
    zero_grads(all_params)
    return (peak - base - grads) / GIB


def kernel_rows(events, device_type: str = "cuda", top: int = TOP_KERNELS) -> dict:
    """Group profiler events by name: {"total_ms", "rows": [{"name", "ms", "share", "calls"}]},
    top ``top`` by time. ``device_type`` "cuda": the GPU's events (kernels, memcpy, memset) with
    their device durations; "cpu": the ops' self CPU time (the --smoke run)."""
    from torch.autograd import DeviceType

    want = DeviceType.CUDA if device_type == "cuda" else DeviceType.CPU
    groups: dict = {}
    for e in events:
        if e.device_type != want:
            continue
        us = e.time_range.elapsed_us() if device_type == "cuda" else e.self_cpu_time_total
        t, n = groups.get(e.name, (0.0, 0))
        groups[e.name] = (t + us, n + 1)
    total = sum(t for t, _ in groups.values())
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return {"total_ms": total / 1e3, "kernels": len(groups),
            "rows": [{"name": name, "ms": t / 1e3, "share": t / total if total else 0.0, "calls": n}
                     for name, (t, n) in rows]}


def profile_step(step: Callable, device) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        step()
        sync(device)
    out = kernel_rows(prof.events(), "cuda" if cuda else "cpu")
    if cuda and not out["rows"]:  # a profiler build that needs the CPU activity to keep kernels
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            sync(device)
        out = kernel_rows(prof.events(), "cuda")
    return out


def _free(device):
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def chain_joules(chain, ms: float, device, errors: dict) -> Optional[float]:
    """Joules per call of the shadow's chain, back to back (``coda_cute.sol.energy``); None
    without an energy counter or where the measurement fails (recorded in ``errors``)."""
    try:
        from coda_cute.sol.energy import joules_over_run

        e = joules_over_run(chain, ms, device)
    except Exception as exc:  # noqa: BLE001
        report_failure("shadow: energy", exc, errors, "shadow_energy")
        return None
    if e is not None:
        say(f"  shadow chain: {e['j_per_call']:.1f} J per step, {e['watts']:.0f} W, {e['ms_per_call']:.2f} ms "
            "per step back to back")
    return None if e is None else e["j_per_call"]


def run_shadow(rec: dict, c: dict, coda, args, device, errors: dict):
    """Time the shadow pieces, the chain of all of them and the CODA block in turns; fill ``rec``."""
    b, s, layers, smoke = args.batch, args.seq, args.layers, args.smoke
    say("timing the shadow (cuBLAS GEMMs, SDPA) and the CODA block " + ("once each (smoke)" if smoke else "in turns"))
    gemms = step_gemms(c, b * s)
    rec["gemm_flops"] = sum(g.flops * g.count for g in gemms)
    rec["shadow_pieces"] = [dict(name=g.name, linear=g.linear, kind=g.kind, layout=g.layout, m=g.m, n=g.n,
                                 k=g.k, count=g.count, ms=None, tflops=None) for g in gemms]
    fns = gemm_fns(gemms, device)
    fp8 = (getattr(args, "fp8", False) or getattr(args, "fp8_row", False) or getattr(args, "fp8_row_fast", None)) \
        and torch.device(device).type == "cuda"
    if fp8:
        fns.update(fp8_gemm_fns(gemms, device))
    attention = attention_fn(c, b, s, device)
    fns["attention"] = attention

    def chain():
        for g in gemms:
            for _ in range(g.count):
                fns[g.name]()
        for _ in range(layers):
            attention()
    fns["chain"] = chain
    if fp8:
        def chain_fp8():
            for g in gemms:
                for _ in range(g.count):
                    fns[g.name + ".fp8" if g.per_layer else g.name]()
            for _ in range(layers):
                attention()
        fns["chain.fp8"] = chain_fp8
    if coda is not None:
        try:
            fns["block"] = block_fn(coda, b, s, device)
        except Exception as exc:  # noqa: BLE001
            report_failure("coda block: setup", exc, errors, "block")
    st = time_fns(fns, args.rounds, args.warmup, smoke, errors, "shadow")
    if not smoke and st.get("chain"):  # before the pieces go: the chain calls them
        rec["shadow_chain_j"] = chain_joules(chain, st["chain"], device, errors)
    fns.clear()
    for p, g in zip(rec["shadow_pieces"], gemms):
        p["ms"] = st.get(g.name)
        p["tflops"] = g.flops / p["ms"] / 1e9 if p["ms"] else None
        p["fp8_ms"] = st.get(g.name + ".fp8")
    rec["shadow_fp8_chain_ms"] = st.get("chain.fp8")
    rec["attention_ms"] = st.get("attention")
    rec["shadow_chain_ms"] = st.get("chain")
    rec["block_ms"] = st.get("block")
    if any(st.get(g.name) is None for g in gemms) or rec["attention_ms"] is None:
        return
    rec["shadow_gemm_ms"] = sum(st[g.name] * g.count for g in gemms)
    rec["shadow_attention_ms"] = layers * rec["attention_ms"]
    rec["shadow_ms"] = rec["shadow_gemm_ms"] + rec["shadow_attention_ms"]
    if rec["coda_ms"]:
        rec["coda_over_shadow"] = rec["coda_ms"] / rec["shadow_ms"]
    if fp8 and all(st.get(g.name + ".fp8") is not None for g in gemms if g.per_layer):
        # the FP8 step's shadow: the layers' GEMMs in FP8, the LM head's in bf16, attention
        rec["shadow_fp8_ms"] = rec["shadow_attention_ms"] + sum(
            (st[g.name + ".fp8"] if g.per_layer else st[g.name]) * g.count for g in gemms)
    rec["block_gemm_ms"] = sum(st[g.name] for g in gemms if g.per_layer)
    if rec["block_ms"] is not None:
        rec["block_ratio"] = (rec["block_ms"] - rec["attention_ms"]) / rec["block_gemm_ms"]
