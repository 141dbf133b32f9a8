"""What the host costs on the CODA path, where the GPU work is small.

1. Per call, on a 256 x 256 x 256 bf16 GEMM (a few microseconds of GPU work, so a loop of calls
   without a sync measures the host): ``torch.mm``; the runner's cached plan launched directly
   (``Plan.launch``: the kernel call itself); ``E.run`` (plan lookup); ``torch.ops.coda.gemm``
   (the custom-op layer on top); the same under autograd (``requires_grad`` operands); the
   direct call (``coda_cute.ops.eager``) without and with autograd.
2. One micro-step (forward + backward) of ``coda-cute train``'s default model, fp32 master
   weights under bf16 autocast, wall clock per step after warm-up (CUDA-event medians): plain HF,
   HF under ``torch.compile``, ``apply_coda`` (ops called directly, and through the dispatcher:
   ``coda_cute.ops.eager.enabled(False)``), ``apply_coda`` under ``torch.compile``, and
   ``apply_coda``'s step captured once in a CUDA graph and replayed (``--graph``), which is the
   GPU time of the step with no host in the way.
3. ``--cprofile``: the Python functions with the most host time over five forward passes of
   ``apply_coda`` under no_grad (one thread: cProfile's numbers hold there, unlike a backward,
   which runs on autograd's device thread).

    python scripts/bench_host.py [--steps 20] [--no-compile] [--graph] [--cprofile]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import traceback

import torch
from rich.console import Console
from rich.table import Table

from coda_cute import epilogue as E
from coda_cute import train as T
from coda_cute.epilogue import runner
from coda_cute.kernels.epilogue.plain import gemm_tree
from coda_cute.nn import apply_coda
from coda_cute.ops import eager
from coda_cute.ops.gemm import gemm_op


def per_call_us(fn, calls: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def host_rows():
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    tree = gemm_tree("none", "none", "bfloat16")
    E.run(tree, a, b, {}, op="coda.gemm")
    plan = next(p for p in runner._plans.values() if p.tree is tree)
    ag, bg = a.clone().requires_grad_(), b.clone().requires_grad_()
    return [("torch.mm", per_call_us(lambda: torch.mm(a, b))),
            ("Plan.launch (kernel call)", per_call_us(lambda: plan.launch(a, b, {}))),
            ("E.run", per_call_us(lambda: E.run(tree, a, b, {}, op="coda.gemm"))),
            ("torch.ops.coda.gemm", per_call_us(lambda: torch.ops.coda.gemm(a, b))),
            ("torch.ops.coda.gemm, autograd", per_call_us(lambda: torch.ops.coda.gemm(ag, bg))),
            ("direct gemm (ops.eager)", per_call_us(lambda: gemm_op(a, b))),
            ("direct gemm, autograd", per_call_us(lambda: gemm_op(ag, bg))),
            ("torch.mm, autograd", per_call_us(lambda: torch.mm(ag, bg)))]


def step_ms(step, steps: int) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        step()
        e1.record()
        times.append((e0, e1))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in times)


def micro_step(model, ids, nxt):
    forward = T.hf_forward(model)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = forward(ids, nxt)
        loss.backward()
        return loss
    return step


def graphed(step, model):
    """The step captured once (after warm-up on a side stream) and replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            model.zero_grad(set_to_none=False)
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--graph", action="store_true")
    ap.add_argument("--cprofile", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_host needs a CUDA GPU")
    console = Console(width=150)
    t = Table(title="host cost per call, 256^3 bf16 GEMM")
    t.add_column("call")
    t.add_column("us / call", justify="right")
    for name, us in host_rows():
        t.add_row(name, f"{us:.1f}")
    console.print(t)

    cfg = T.TrainConfig()
    batch = torch.randint(0, 256, (cfg.micro_batch, cfg.seq + 1), device="cuda")
    ids, nxt = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    if args.cprofile:
        forward_profile(cfg, ids, nxt)
    runs = [("HF eager", False, False), ("CODA eager", True, False)]
    if not args.no_compile:
        runs += [("HF + torch.compile", False, True), ("CODA + torch.compile", True, True)]
    console.print(f"coda-cute train default micro-step (d{cfg.dim} x {cfg.layers} layers, "
                  f"{cfg.micro_batch} x {cfg.seq} tokens), forward + backward, median ms:")
    for name, coda, compiled in runs:  # a row as soon as it is measured: a later one may fail
        model = T.build_model(cfg).cuda()
        if coda:
            apply_coda(model)
        m = torch.compile(model) if compiled else model
        console.print(f"  {name}: {attempt(lambda: step_ms(micro_step(m, ids, nxt), args.steps))}")
        if coda and not compiled:
            with eager.enabled(False):
                console.print("  CODA eager, every op through the dispatcher: "
                              + attempt(lambda: step_ms(micro_step(m, ids, nxt), args.steps)))
        if coda and not compiled and args.graph:
            console.print("  CODA, CUDA graph replay: " + attempt(
                lambda: step_ms(graphed(micro_step(model, ids, nxt), model), args.steps)))
        model = m = None  # free the model before the next one is built
        with contextlib.suppress(Exception):
            torch._dynamo.reset()
        torch.cuda.empty_cache()


def forward_profile(cfg, ids, nxt, passes: int = 5):
    import cProfile
    import pstats

    model = apply_coda(T.build_model(cfg).cuda())
    forward = T.hf_forward(model)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        for _ in range(3):
            forward(ids, nxt)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(passes):
            forward(ids, nxt)
        torch.cuda.synchronize()
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


def attempt(measure) -> str:
    """An experiment's row: the milliseconds, or why it failed (the next rows still run)."""
    try:
        return f"{measure():.2f}"
    except Exception as e:  # where it failed: the frames nearest the error
        where = " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
                            for f in traceback.extract_tb(e.__traceback__)[-6:][::-1])
        return f"failed: {type(e).__name__}: {str(e)[:160]}\n    at {where}"


if __name__ == "__main__":
    main()
