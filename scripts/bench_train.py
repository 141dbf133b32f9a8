"""Training-step benchmark: CodaLlama against HF Llama (eager, torch.compile, Liger-Kernel) on one GPU.

One training step = forward + backward of the loss, no optimizer (gradients set to None at the
start of every step), of a random-init ``--layers``-layer Llama (default 2) with the Llama-3 vocab
(128256), on ``--batch`` x ``--seq`` (default 4 x 4096) random token ids (fixed seed), labels =
the input ids (HF convention: the model shifts them). Configs (``--configs``):

  1b: hidden 2048, 32 heads / 8 KV heads, head_dim 64,  ffn 8192,  rope_theta 500000, rms eps 1e-5
  8b: hidden 4096, 32 heads / 8 KV heads, head_dim 128, ffn 14336, rope_theta 500000, rms eps 1e-5

The HF model is a transformers ``LlamaForCausalLM`` (tie_word_embeddings=False, sdpa attention,
use_cache=False) built in bf16 on the GPU with its rotary ``inv_freq`` kept in fp32 (checked);
every variant runs on the same weights:

  coda        coda_cute.nn.CodaLlama.from_hf(...)(tokens, targets).backward(), eager; targets are
              the labels shifted (targets[:, :-1] = labels[:, 1:], targets[:, -1] = -100), so it
              computes the same loss as HF (checked at start-up: both printed, ~1e-2 relative)
  coda_fp8    (``--fp8``) the same model with precision="fp8": the decoder layers' GEMMs in
              block-scaled FP8 (coda.attention_block_fp8, coda.mlp_block_fp8), the LM head bf16
  coda_fp8_row  (``--fp8-row``) the same in the row-wise recipe, Fp8Recipe(scaling="row")
  coda_fp8_row_fast  (``--fp8-row-fast forward|all``) the row-wise recipe with its GEMMs of those
              roles accumulating in the tensor core, Fp8Recipe(scaling="row", fast_accum=...)
  coda_fp8_row_fast_switched  (``--fp8-switch [MODULE.]NAME=VALUE ...``, with --fp8-row-fast) the
              same model with experiment switches of the FP8 ops set while its step runs
              (``mlp_fp8.SIDE_SMS_DOWN_WGRAD=16``; scripts/switches.py), in the same turns; not
              profiled
  hf_eager    LlamaForCausalLM(input_ids, labels=labels).loss.backward()
  hf_compile  torch.compile(hf_model) (default mode) of the same; compiled before timing
  liger       a second HF instance (a deep copy, same weights) patched by Liger-Kernel's
              apply_liger_kernel_to_llama(model=...), default options (RMSNorm, SwiGLU, RoPE, fused
              linear cross-entropy); only where ``import liger_kernel`` works, else null. Liger
              also patches module globals of transformers' modeling_llama (RoPE, the RMSNorm and
              MLP classes); the script undoes that right away and re-applies it only around the
              Liger model's own forward, so the HF baselines stay unpatched.

``--cache-folds``: both CODA models built with ``cache_folds=True``, so that their gamma folds (and
the FP8 ones' quantized weights, ``WeightQuantCache``) are made once per version of the weights
and kept: no step here changes a weight, so every timed step is then a micro-batch after the
first of a gradient accumulation, where the default times one whose optimizer step ran just
before it (folds and weight quantization paid in the step). The HF baselines have nothing to keep.

Timing: every variant's step is a function; all of a config's steps are timed IN TURNS in one
``coda_cute.sol.timing.interleaved_medians`` call (CUDA events around each step, L2 flushed
before each, a fresh random order per round, warm-up calls and a settle period first): the
medians share the GPU's clock drift. A variant that fails (build, first step, timing) prints its
error and is recorded as null; the others go on. With no sync between the steps the host runs
ahead and hides what a step costs it before its first launch; ``--sync-each`` times every step
after a host sync instead, as a loop that logs ``loss.item()`` each step runs them (the idle GPU
while the host prepares a step's first GEMM then counts).

The shadow: what the step would cost if it were only its GEMMs on cuBLAS plus attention. Each
GEMM of the step with its training layout (torch.mm, bf16), M = batch x seq tokens:
  per layer, for W in qkv (fused, (H + 2 Hkv) hd x d), o (d x H hd), gate/up (fused, 2f x d),
  down (d x f):  fwd x @ W.T (M x out x in), dgrad dY @ W (M x in x out), wgrad dY.T @ X
  (out x in x M); and the LM head's three (V x d): 12 x layers + 3 GEMMs. Plus attention forward
  + backward (F.scaled_dot_product_attention, causal, enable_gqa, on (B, H, S, hd) q and
  (B, Hkv, S, hd) k, v; torch.autograd.grad through it) once per layer. Each distinct piece is
  timed in turns with the others; shadow_ms = sum of count x piece + layers x attention, and the
  step's target is coda / shadow <= 1. "chain" times the same sequence back to back as one launch.
  With ``--fp8`` / ``--fp8-row`` also the FP8 shadow: the layers' GEMMs as FP8 row-wise
  ``torch._scaled_mm`` on pre-quantized operands, the LM head's in bf16, attention as above
  (shadow_fp8_ms; each piece's ``fp8_ms``; the same sequence back to back as one launch,
  shadow_fp8_chain_ms): shadow / FP8 shadow is what the FP8 step could gain on the bf16 one if
  its quantization cost nothing.

Block: CodaLlamaBlock (layer 0 of the CODA model) forward + backward on a random residual stream
x (B, S, d) bf16 (grad w.r.t. x, its norm stats ss = embedding_norm_stats(x) as a leaf that needs
grad, and the block's weights; loss = (out.float() * cotangent).sum()), timed in the shadow's
group: block_ratio = (block - attention) / (that layer's 12 cuBLAS GEMMs).

Peak memory: per variant, max_memory_allocated during one step (after reset_peak_memory_stats,
every model's gradients None), minus what was allocated before the step (the resident models'
parameters, the inputs) and minus the bytes of the variant's own gradients: activations and
temporaries beyond parameters + gradients, in GiB.

Energy: each variant's step back to back for ~``coda_cute.sol.energy.RUN_MS`` (at least 5
steps), joules per step from the board's energy counter with the idle board's share taken off
(``coda_cute.sol.energy.joules_per_call``), and the run's mean power: under the power cap a step's
time follows its joules. The shadow's chain (its GEMMs and attention back to back as one launch)
is measured the same way (shadow_chain_j): a step whose kernels take the shadow's time uncapped
but more joules falls behind it at the cap. Null where the counter is missing.

Profile: torch.profiler (CUDA activity) over one CODA step: kernel time grouped by kernel name,
top 15 with their share of all GPU time and their call counts.

JSON (``--json``): a list, one record per config: config, tokens, batch, seq, layers;
{coda,hf_eager,hf_compile,liger}_ms, _peak_gib and _j_per_step (null when not run or failed;
``energy``: each variant's joules_per_call record); ratio_to_coda
(baseline ms / coda ms); losses, loss_rel_diff, loss_ok; shadow_ms, shadow_fp8_ms,
shadow_fp8_chain_ms, shadow_gemm_ms, shadow_attention_ms, shadow_chain_ms, shadow_chain_j,
coda_over_shadow, gemm_flops, shadow_pieces (name, layout, m, n, k, count, ms, tflops, fp8_ms),
attention_ms (one layer); block_ms, block_gemm_ms, block_ratio; profile (total_ms, kernels, rows: name, ms, share,
calls) and, with --fp8 / --fp8-row / --fp8-row-fast, coda_fp8_profile / coda_fp8_row_profile /
coda_fp8_row_fast_profile (its ratio to the FP8 shadow compares with the shadow's promoted
accumulation); errors (what
failed, why); env.

Running it on the GPU machine (torch >= 2.11 with CUDA, triton, transformers, coda_cute importable):
Liger-Kernel 0.8.x is pure Python. Fetch it on a machine with PyPI access into .wheels/
(git-ignored: never committed, so copy that folder along with the tree) as one xz archive of its
installed files, unpack that there into a folder of its own and put that on PYTHONPATH:

    bash scripts/liger_wheel.sh       # with PyPI access, once (0.47 MB: it fits a device call's carry)
    mkdir -p /tmp/liger && tar xJf .wheels/liger-xdist-site.tar.xz -C /tmp/liger  # on the GPU machine
    PYTHONPATH=/tmp/liger:$PYTHONPATH python scripts/bench_train.py --json bench_train.json

Without it the liger variant is recorded as null (``--no-liger`` skips it outright). The first
steps compile (torch.compile of the HF model, coda_cute's kernels on first use): a few minutes per
config cold; ``--configs 1b`` and ``--configs 8b`` may run as separate commands, and ``--json`` is
rewritten after every config.

    python scripts/bench_train.py [--configs 1b 8b] [--rounds 20] [--warmup 3] [--layers 2]
        [--batch 4 --seq 4096] [--no-compile] [--no-liger] [--json out.json]
    python scripts/bench_train.py --smoke     # every variant once on a tiny config on CPU
                                              # (CODA through coda_cute.reference_on_cpu())

``--smoke`` runs no timing worth the name (one wall-clock call per function), no compile, no Liger
and no memory numbers: it only checks that every code path of the benchmark executes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_models import (  # noqa: E402  (the benchmark's pieces, in modules of their own)
    CODA_IMPORT_ERROR, SMOKE_BATCH, SMOKE_SEQ, SMOKE_SPEC, SPECS, CodaLlama, CodaLlamaConfig,
    ModelSpec, build_hf_model, build_liger_model, coda_kwargs_from_hf, coda_step, coda_cute, hf_config,
    hf_step, liger_version, random_tokens, shift_labels, zero_grads)
import switches  # noqa: E402
from train_shadow import (  # noqa: E402
    _free, peak_gib, profile_step, report_failure, run_shadow, say, sync, time_fns)

from coda_cute.sol.energy import joules_over_run  # noqa: E402

SHADOW_KEYS = ("shadow_ms", "shadow_fp8_ms", "shadow_fp8_chain_ms", "shadow_gemm_ms", "shadow_attention_ms",
               "shadow_chain_ms", "shadow_chain_j", "attention_ms", "coda_over_shadow", "block_ms", "block_gemm_ms",
               "block_ratio", "gemm_flops")
CODA_VARIANTS = ("coda", "coda_fp8", "coda_fp8_row", "coda_fp8_row_fast", "coda_fp8_row_fast_switched")
BASELINES = ("hf_eager", "hf_compile", "liger")
VARIANTS = CODA_VARIANTS + BASELINES

out_console = Console(width=180)


# -- one config ---------------------------------------------------------------------------------------
def run_config(spec: ModelSpec, args, device) -> dict:
    smoke = args.smoke
    b, s, layers = args.batch, args.seq, args.layers
    m = b * s
    errors: dict = {}
    rec = {"config": spec.name, "mode": "smoke" if smoke else "gpu", "tokens": m, "batch": b, "seq": s,
           "layers": layers, "spec": asdict(spec), "rounds": args.rounds, "warmup": args.warmup,
           "sync_each": args.sync_each, "cache_folds": args.cache_folds,
           **{f"{v}_ms": None for v in VARIANTS}, **{f"{v}_peak_gib": None for v in VARIANTS},
           **{f"{v}_j_per_step": None for v in VARIANTS}, "energy": {},
           "losses": {}, "loss_rel_diff": None, "loss_ok": None, "ratio_to_coda": {}, "profile": None,
           **{k: None for k in SHADOW_KEYS}, "shadow_pieces": [], "fp8_switches": None, "errors": errors}
    say(f"[bold]== {spec.name}[/]: {layers} layers, {b} x {s} tokens, dim {spec.dim}, "
        f"{spec.n_heads}/{spec.n_kv_heads} heads x {spec.head_dim}, ffn {spec.ffn_dim}, vocab {spec.vocab_size}")

    hf_cfg = hf_config(spec, layers, s)
    c = coda_kwargs_from_hf(hf_cfg)
    rec["coda_config"] = c
    say("building the HF model")
    hf_model = build_hf_model(hf_cfg, device)
    rec["hf_attn_implementation"] = getattr(hf_model.config, "_attn_implementation", None)
    rec["hf_inv_freq_dtype"] = str(hf_model.model.rotary_emb.inv_freq.dtype)
    say(f"  attention {rec['hf_attn_implementation']}, rotary inv_freq {rec['hf_inv_freq_dtype']}, "
        f"{sum(p.numel() for p in hf_model.parameters()) / 1e9:.3f} B parameters")
    ids = random_tokens(b, s, spec.vocab_size).to(device)
    labels = ids
    targets = shift_labels(labels)
    hf_params = list(hf_model.parameters())
    rec["param_bytes"] = sum(p.numel() * p.element_size() for p in hf_params)

    steps: dict = {}    # name -> (step fn, its params)
    models: dict = {"hf": hf_model}
    steps["hf_eager"] = (hf_step(hf_model, ids, labels, hf_params), hf_params)

    say("building the CODA model")
    try:
        if CODA_IMPORT_ERROR:
            raise RuntimeError(CODA_IMPORT_ERROR)
        coda = CodaLlama.from_hf(CodaLlamaConfig(**c), hf_model.state_dict(), device=device,
                                 cache_folds=args.cache_folds)
        coda.train()
        models["coda"] = coda
        coda_params = list(coda.parameters())
        steps["coda"] = (coda_step(coda, ids, targets, coda_params), coda_params)
    except Exception as exc:  # noqa: BLE001
        report_failure("coda: build", exc, errors, "coda")
    for name, wanted, scaling, fast in (("coda_fp8", args.fp8, "block", "none"),
                                        ("coda_fp8_row", args.fp8_row, "row", "none"),
                                        ("coda_fp8_row_fast", args.fp8_row_fast, "row", args.fp8_row_fast)):
        if not wanted:
            continue
        say(f"building the CODA model in FP8 ({scaling} scaling, fast accumulation: {fast})")
        try:
            if CODA_IMPORT_ERROR:
                raise RuntimeError(CODA_IMPORT_ERROR)
            from coda_cute.precision import Fp8Recipe
            fp8 = CodaLlama.from_hf(CodaLlamaConfig(**c, precision=Fp8Recipe(scaling=scaling, fast_accum=fast)),
                                    hf_model.state_dict(), device=device, cache_folds=args.cache_folds)
            fp8.train()
            fp8_params = list(fp8.parameters())
            steps[name] = (coda_step(fp8, ids, targets, fp8_params), fp8_params)
            if name == "coda_fp8_row_fast" and args.fp8_switch:  # the same model, the switches set
                rec["fp8_switches"] = switches.label(args.fp8_switch)
                steps[f"{name}_switched"] = (switches.switched(steps[name][0], args.fp8_switch), fp8_params)
        except Exception as exc:  # noqa: BLE001
            report_failure(f"{name}: build", exc, errors, name)

    if not args.no_compile and not smoke:
        say("torch.compile(hf_model)")
        try:
            compiled = torch.compile(hf_model)
            models["hf_compile"] = compiled
            steps["hf_compile"] = (hf_step(compiled, ids, labels, hf_params), hf_params)
        except Exception as exc:  # noqa: BLE001
            report_failure("hf_compile: torch.compile", exc, errors, "hf_compile")

    rec["liger_version"] = None
    if not args.no_liger and not smoke:
        rec["liger_version"] = liger_version()
        if rec["liger_version"] is None:
            say("[yellow]liger: `import liger_kernel` failed; recorded as null[/] (see the docstring for "
                "PYTHONPATH=/tmp/liger)")
            errors["liger"] = "liger_kernel not importable"
        else:
            say(f"liger-kernel {rec['liger_version']}: patching a copy of the HF model")
            try:
                liger_model, patches = build_liger_model(hf_model)
                liger_params = list(liger_model.parameters())
                models["liger"] = liger_model
                rec["liger_patches"] = sorted({f"{getattr(o, '__name__', o)}.{n}" for o, n, _ in patches})
                steps["liger"] = (hf_step(liger_model, ids, labels, liger_params, patches), liger_params)
            except Exception as exc:  # noqa: BLE001
                report_failure("liger: patch", exc, errors, "liger")

    # First steps: compile / JIT warm-up, and the losses for the start-up check.
    losses = {}
    for name in VARIANTS:
        if name not in steps:
            continue
        say(f"first steps: {name}")
        try:
            t0 = time.perf_counter()
            losses[name] = float(steps[name][0]())
            if not smoke:
                steps[name][0]()
            sync(device)
            say(f"  {name}: loss {losses[name]:.5f} ({time.perf_counter() - t0:.1f} s)")
        except Exception as exc:  # noqa: BLE001
            report_failure(f"{name}: first step", exc, errors, name)
            del steps[name]
    all_params = [p for _, ps in steps.values() for p in ps]
    zero_grads(all_params)
    rec["losses"] = losses
    rec["loss_rel_diff"] = None
    rec["loss_ok"] = None
    if "coda" in losses and "hf_eager" in losses:
        rel = abs(losses["coda"] - losses["hf_eager"]) / abs(losses["hf_eager"])
        rec["loss_rel_diff"], rec["loss_ok"] = rel, bool(rel <= 1e-2)
        style = "green" if rec["loss_ok"] else "bold red"
        say(f"[{style}]loss check: coda {losses['coda']:.5f}, hf_eager {losses['hf_eager']:.5f}, "
            f"relative difference {rel:.2e} ({'ok' if rec['loss_ok'] else 'MISMATCH, want <= 1e-2'})[/]")
        if not math.isfinite(losses["coda"]):
            say("[bold red]coda loss is not finite[/]")
    for name in BASELINES:
        if name in losses and name != "hf_eager" and "hf_eager" in losses:
            say(f"  {name} loss {losses[name]:.5f} (hf_eager {losses['hf_eager']:.5f})")

    # Peak memory, one step each.
    for name, (step, params) in list(steps.items()):
        try:
            rec[f"{name}_peak_gib"] = peak_gib(step, params, all_params, device)
        except Exception as exc:  # noqa: BLE001
            report_failure(f"{name}: peak memory step", exc, errors, f"{name}_peak")

    # The steps, in turns.
    say(f"timing {', '.join(steps)} " + ("once each (smoke)" if smoke else f"in turns ({args.rounds} rounds)"))
    timed = {n: (_after_sync(st, device) if args.sync_each else st) for n, (st, _) in steps.items()}
    times = time_fns(timed, args.rounds, args.warmup, smoke, errors, "step")
    for name in VARIANTS:
        if times.get(name) is not None:
            rec[f"{name}_ms"] = times[name]
    coda_ms = rec["coda_ms"]
    rec["ratio_to_coda"] = {n: (rec[f"{n}_ms"] / coda_ms if coda_ms and rec[f"{n}_ms"] else None)
                            for n in BASELINES}
    zero_grads(all_params)

    # Joules per step, each variant back to back.
    if not smoke:
        say("energy per step, each variant back to back")
        for name, (step, _) in steps.items():
            ms = rec[f"{name}_ms"]
            try:
                e = joules_over_run(step, ms, device)
            except Exception as exc:  # noqa: BLE001
                report_failure(f"{name}: energy", exc, errors, f"{name}_energy")
                continue
            if e is None:
                say("  no energy counter on this board")
                break
            rec["energy"][name], rec[f"{name}_j_per_step"] = e, e["j_per_call"]
            say(f"  {name}: {e['j_per_call']:.1f} J per step, {e['watts']:.0f} W, {e['ms_per_call']:.2f} ms "
                f"per step back to back (idle board {e['idle_watts']:.0f} W)")
        zero_grads(all_params)

    # Per-kernel profile of the CODA step.
    rec["profile"] = None
    for name in CODA_VARIANTS:
        if name not in steps or name.endswith("_switched"):  # the switch's gain is read in turns
            continue
        say(f"profiling one {name} step")
        try:
            rec["profile" if name == "coda" else f"{name}_profile"] = profile_step(steps[name][0], device)
        except Exception as exc:  # noqa: BLE001
            report_failure(f"{name}: profile", exc, errors, f"{name}_profile")
        zero_grads(all_params)

    # Shadow pieces and the block, in turns among themselves; the variants' models stay resident
    # (weights only, gradients None).
    del steps
    _free(device)
    try:
        run_shadow(rec, c, models.get("coda"), args, device, errors)
    except Exception as exc:  # noqa: BLE001
        report_failure("shadow", exc, errors, "shadow")
    _free(device)

    del models, hf_model, hf_params, all_params
    if not smoke and not args.no_compile:
        torch._dynamo.reset()
    _free(device)
    return rec


# -- report -----------------------------------------------------------------------------------------------
def _ms(v):
    return "-" if v is None else f"{v:.3f}"


def _gib(v):
    return "-" if v is None else f"{v:.2f}"


def _joules(e):
    return "-" if e is None else f"{e['j_per_call']:.1f} ({e['watts']:.0f})"


def report(rec: dict, console: Console = out_console):
    smoke = rec["mode"] == "smoke"
    note = " (SMOKE: one CPU wall-clock call each, not a benchmark)" if smoke else ""
    if rec.get("cache_folds"):
        note += ", CODA's folds and FP8 weights kept (a micro-batch of a gradient accumulation)"
    t = Table(title=f"{rec['config']}: training step (fwd + bwd), {rec['layers']} layers, "
                    f"{rec['batch']} x {rec['seq']} tokens{note}")
    for col in ("variant", "step ms", "variant / coda", "variant / shadow", "peak GiB (beyond params + grads)",
                "J / step (W)", "loss", "status"):
        t.add_column(col, justify="left" if col in ("variant", "status") else "right")
    coda_ms, shadow_ms = rec["coda_ms"], rec["shadow_ms"]
    for v in VARIANTS:
        ms = rec[f"{v}_ms"]
        loss = rec["losses"].get(v)
        status = rec["errors"].get(v, "ok" if ms is not None else "not run")
        if v == "coda" and rec.get("loss_ok") is False:
            status = f"LOSS MISMATCH ({rec['loss_rel_diff']:.1e})"
        t.add_row(v, _ms(ms), f"{ms / coda_ms:.2f}x" if ms and coda_ms else "-",
                  f"{ms / shadow_ms:.2f}x" if ms and shadow_ms else "-", _gib(rec[f"{v}_peak_gib"]),
                  _joules(rec.get("energy", {}).get(v)), "-" if loss is None else f"{loss:.4f}",
                  Text(status[:80]))
    console.print(t)

    if not rec["shadow_pieces"]:
        console.print("shadow: -")
    pieces = Table(title=f"{rec['config']}: the shadow (cuBLAS torch.mm, bf16; SDPA fwd + bwd)")
    for col in ("piece", "layout", "M x N x K", "count", "ms", "TFLOP/s"):
        pieces.add_column(col, justify="left" if col in ("piece", "layout", "M x N x K") else "right")
    for p in rec["shadow_pieces"]:
        pieces.add_row(p["name"], p["layout"], f"{p['m']}x{p['n']}x{p['k']}", str(p["count"]),
                       _ms(p["ms"]) + ("" if p.get("fp8_ms") is None else f" (FP8 {p['fp8_ms']:.3f})"),
                       "-" if p["tflops"] is None else f"{p['tflops']:.4g}")
    pieces.add_row("attention", "sdpa causal gqa", f"B{rec['batch']} S{rec['seq']}", str(rec["layers"]),
                   _ms(rec["attention_ms"]), "")
    if rec["shadow_pieces"]:
        console.print(pieces)
    line = (f"shadow {_ms(rec['shadow_ms'])} ms = GEMMs {_ms(rec['shadow_gemm_ms'])} + attention "
            f"{_ms(rec['shadow_attention_ms'])} (back to back as one launch: {_ms(rec['shadow_chain_ms'])} ms); "
            f"coda / shadow = {'-' if rec['coda_over_shadow'] is None else format(rec['coda_over_shadow'], '.3f')}")
    console.print(line)
    if rec.get("shadow_chain_j") and rec.get("coda_j_per_step"):
        coda_j, shadow_j = rec["coda_j_per_step"], rec["shadow_chain_j"]
        console.print(f"joules per step back to back: coda {coda_j:.1f}, shadow chain {shadow_j:.1f} "
                      f"(coda / shadow {coda_j / shadow_j:.3f})")
    if rec.get("shadow_fp8_ms"):
        fp8_line = (f"FP8 shadow (the layers' GEMMs as FP8 row-wise _scaled_mm, LM head bf16, attention) "
                    f"{rec['shadow_fp8_ms']:.3f} ms (back to back as one launch: {_ms(rec.get('shadow_fp8_chain_ms'))} "
                    f"ms): shadow / FP8 shadow = {rec['shadow_ms'] / rec['shadow_fp8_ms']:.3f} "
                    f"(what an FP8 step with free quantization would gain on the bf16 one)")
        for v in CODA_VARIANTS[1:]:
            if rec.get(f"{v}_ms"):
                fp8_line += f"; {v} / FP8 shadow = {rec[f'{v}_ms'] / rec['shadow_fp8_ms']:.3f}"
        console.print(fp8_line)
    if rec["block_ratio"] is not None:
        console.print(f"block (layer 0) fwd + bwd {rec['block_ms']:.3f} ms, attention {rec['attention_ms']:.3f} "
                      f"ms, its 12 GEMMs on cuBLAS {rec['block_gemm_ms']:.3f} ms: (block - attention) / GEMMs "
                      f"= {rec['block_ratio']:.3f}")
    else:
        console.print("block ratio: -")
    for variant in CODA_VARIANTS:
        prof = rec.get("profile" if variant == "coda" else f"{variant}_profile")
        if prof:
            _print_profile(rec, variant, prof, smoke, console)
    if rec["errors"]:
        console.print(f"[red]{rec['config']} errors:[/]")
        for k, v in rec["errors"].items():
            console.print(f"  {k}: {v}", markup=False)


def _print_profile(rec: dict, variant: str, prof: dict, smoke: bool, console: Console):
    what = "CPU self time per op (smoke)" if smoke else "GPU time per kernel"
    pt = Table(title=f"{rec['config']}: {variant} step, {what}: top {len(prof['rows'])} of {prof['kernels']}, "
                     f"total {prof['total_ms']:.3f} ms")
    pt.add_column("kernel", overflow="fold")
    for col in ("ms", "share", "calls"):
        pt.add_column(col, justify="right")
    for r in prof["rows"]:
        name = r["name"] if len(r["name"]) <= 120 else r["name"][:117] + "..."
        pt.add_row(Text(name), f"{r['ms']:.3f}", f"{100 * r['share']:.1f}%", str(r["calls"]))
    console.print(pt)


# -- main -------------------------------------------------------------------------------------------------
def _after_sync(step, device):
    """``step`` run after a host sync (``--sync-each``): inside the timed span the GPU waits for
    the host from the sync to the step's first launch."""
    def run():
        sync(device)
        return step()
    return run


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", choices=sorted(SPECS), default=["1b", "8b"])
    ap.add_argument("--rounds", type=int, default=20, help="timing rounds (each runs every variant once)")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up calls of each function before timing")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=None, help="default 4 (--smoke: 2)")
    ap.add_argument("--seq", type=int, default=None, help="default 4096 (--smoke: 32)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--no-liger", action="store_true", help="skip the Liger-Kernel baseline")
    ap.add_argument("--fp8", action="store_true", help="also time CodaLlama with precision='fp8' (coda_fp8)")
    ap.add_argument("--fp8-row", action="store_true",
                    help="also time CodaLlama in the row-wise FP8 recipe, Fp8Recipe(scaling='row') (coda_fp8_row)")
    ap.add_argument("--fp8-row-fast", choices=("forward", "all"),
                    help="also time the row-wise recipe with fast accumulation in the GEMMs of these roles, "
                         "Fp8Recipe(scaling='row', fast_accum=...) (coda_fp8_row_fast)")
    ap.add_argument("--fp8-switch", nargs="+", default=[], metavar="[MODULE.]NAME=VALUE",
                    help="with --fp8-row-fast: also coda_fp8_row_fast_switched, the same model with these integer "
                         "switches of coda_cute.ops.mlp_fp8 (default) or attention_fp8 set while its step runs")
    ap.add_argument("--fused-quant", action="store_true",
                    help="coda_fp8 with mlp_fp8.FUSED_QUANT on (h^T and dz' quantized in their GEMMs)")
    ap.add_argument("--cache-folds", action="store_true",
                    help="CODA models with cache_folds=True: gamma folds and FP8 weights made once per weight "
                         "version (a micro-batch of a gradient accumulation)")
    ap.add_argument("--sync-each", action="store_true",
                    help="time each step after a host sync (a loop that reads its loss every step)")
    ap.add_argument("--json", help="write the records (one per config) to this path")
    ap.add_argument("--smoke", action="store_true",
                    help="run every variant once on a tiny config on CPU (no timing, compile, Liger)")
    args = ap.parse_args(argv)
    if args.batch is None:
        args.batch = SMOKE_BATCH if args.smoke else 4
    if args.seq is None:
        args.seq = SMOKE_SEQ if args.smoke else 4096
    for flag in ("rounds", "layers", "batch", "seq"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be >= 1")
    if args.fp8_switch and not args.fp8_row_fast:
        ap.error("--fp8-switch sets switches of the row-wise fast step: give --fp8-row-fast too")
    try:
        args.fp8_switch = switches.parse(args.fp8_switch)
    except ValueError as exc:
        ap.error(f"--fp8-switch: {exc}")
    if args.smoke:
        args.configs = [SMOKE_SPEC.name]
    return args


def environment(device) -> dict:
    env = {"torch": torch.__version__, "device": str(device)}
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        env["transformers"] = None
    if torch.device(device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    env["coda_cute_import_error"] = CODA_IMPORT_ERROR
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        device = "cpu"
        if coda_cute is None:
            say(f"[bold red]{CODA_IMPORT_ERROR}[/]")
        ctx = coda_cute.reference_on_cpu() if coda_cute is not None else contextlib.nullcontext()
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_train needs a CUDA GPU (or --smoke)")
        device = "cuda"
        ctx = contextlib.nullcontext()
    if args.fused_quant:
        from coda_cute.ops import mlp_fp8
        mlp_fp8.FUSED_QUANT = True
    env = environment(device)
    env["fused_quant"] = args.fused_quant
    env["cache_folds"] = args.cache_folds
    say(f"torch {env['torch']}, transformers {env['transformers']}, {env.get('gpu', device)}")
    if CODA_IMPORT_ERROR:
        say(f"[bold red]{CODA_IMPORT_ERROR}[/]: the coda variant is recorded as null")
    specs = [SMOKE_SPEC] if args.smoke else [SPECS[name] for name in args.configs]
    records = []
    with ctx:
        for spec in specs:
            try:
                rec = run_config(spec, args, device)
            except Exception as exc:  # noqa: BLE001
                errs: dict = {}
                report_failure(f"config {spec.name}", exc, errs, "config")
                rec = {"config": spec.name, "tokens": args.batch * args.seq, "errors": errs,
                       **{f"{v}_ms": None for v in VARIANTS}, "shadow_ms": None}
                _free(device)
            rec["env"] = env
            records.append(rec)
            _free(device)
            if args.json:  # after every config: a later failure keeps the earlier records
                with open(args.json, "w") as f:
                    json.dump(records, f, indent=1)
            if "losses" in rec:
                report(rec)
    if args.json:
        say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
