"""Where the GPU waits during a CODA training step: idle gaps between kernels, and what the CPU
was doing when the kernel after each gap was launched.

One step (forward + ``loss.backward()``) of the 2-layer ``CodaLlama`` of
``scripts/bench_train.py`` (``--model train``: one micro-batch of ``coda-cute train``'s default
model through ``apply_coda``, fp32 master weights under bf16 autocast; ``--hf``: that model
without ``apply_coda``), after warm-up, under torch.profiler (CPU and CUDA activity). From the
trace: every kernel's device interval, the gaps between consecutive kernels longer than
``--min-gap-us``, and for each the CPU ops around the launch of the kernel that ended it (the
outermost and the innermost op whose span holds that launch). The sum of all gaps is the step
time the GPU spends waiting for the host.

The top kernels by device time and the top CPU ops by self time follow; ``--cprofile`` adds the
Python functions with the most cumulative host time over five steps; ``--shapes`` lists torch's
own kernels in the step by the op (and its input shapes) that launched each.

    python scripts/trace_step.py [--config 8b] [--fp8] [--min-gap-us 20] [--trace out.json] [--shapes]
    python scripts/trace_step.py --model train [--hf] [--cprofile]
    python scripts/trace_step.py --model mlp-fp8 [--fast-accum all]

``--model mlp-fp8``: the FP8 MLP sublayer of ``scripts/bench_fp8.py`` instead (forward +
backward, d 4096, ffn 14336, 16384 tokens, the row-wise recipe with ``--fast-accum``), whose
target is 1.05x its six row-wise ``_scaled_mm``: the same trace and timings, and the timings of
that shadow (same fast accumulation) next to them, so that host gaps, clocks and GPU work can be
told apart in the ratio.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_models as TM  # noqa: E402  (the benchmark models of scripts/bench_train.py)

from coda_cute.nn.llama import CodaLlama, LlamaConfig  # noqa: E402


class HostIndex:
    """The trace's CPU ops by time and its runtime calls by correlation id: which ops were open
    when the host launched a kernel or made a call."""

    def __init__(self, ev: list):
        self.launches = {e["args"].get("correlation"): e for e in ev if e.get("cat") == "cuda_runtime"
                         and "correlation" in e.get("args", {})}
        self.ops = sorted((e for e in ev if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
        self.starts = [o["ts"] for o in self.ops]

    def ops_at(self, ts: float) -> list:
        """The CPU ops whose span holds ``ts``, outermost first."""
        i = bisect.bisect_right(self.starts, ts)
        return [o for o in self.ops[:i] if o["ts"] + o["dur"] >= ts]

    def launching_ops(self, kernel: dict) -> list:
        """The CPU ops open at ``kernel``'s launch, outermost first ([] without its launch)."""
        launch = self.launches.get(kernel["args"].get("correlation"))
        return self.ops_at(launch["ts"]) if launch is not None else []


def gaps_of(trace: dict, min_gap_us: float) -> tuple[list, dict]:
    ev = trace["traceEvents"]
    kernels = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    host = HostIndex(ev)
    rows, total = [], 0.0
    for prev, nxt in zip(kernels, kernels[1:]):
        gap = nxt["ts"] - (prev["ts"] + prev["dur"])
        if gap <= 0:
            continue
        total += gap
        if gap < min_gap_us:
            continue
        around = [o["name"] for o in host.launching_ops(nxt)]
        rows.append(dict(gap_us=gap, kernel=nxt["name"][:80], outer=around[0] if around else "?",
                         inner=around[-1] if around else "?"))
    syncs = []
    for e in ev:
        if e.get("cat") == "cuda_runtime" and any(w in e["name"] for w in ("Synchronize", "Memcpy", "Malloc", "Free")):
            around = [o["name"] for o in host.ops_at(e["ts"])]
            syncs.append(dict(call=e["name"], us=e["dur"], outer=around[0] if around else "?",
                              inner=" < ".join(around[-3:][::-1]) if around else "?"))
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    step = next((e for e in ev if e.get("name") == "step" and e.get("ph") == "X"
                 and e.get("cat") in ("cpu_op", "user_annotation")), None)
    lead = (kernels[0]["ts"] - step["ts"]) / 1e3 if step else float("nan")
    cpu = step["dur"] / 1e3 if step else float("nan")
    busy = sum(k["dur"] for k in kernels)
    return rows, dict(span_ms=span / 1e3, busy_ms=busy / 1e3, gaps_ms=total / 1e3, kernels=len(kernels),
                      lead_ms=lead, cpu_ms=cpu, syncs=syncs)


def launchers_of(trace: dict, ours: str = "coda") -> list[dict]:
    """Every kernel of the trace that is neither ours (``ours`` in its name) nor cuDNN's, grouped
    by kernel, the innermost CPU op whose span holds its launch, and that op's input shapes
    (the profile needs ``record_shapes``): total device ms and launches of each group."""
    ev = trace["traceEvents"]
    host = HostIndex(ev)
    groups: dict = {}
    for k in (e for e in ev if e.get("cat") == "kernel"):
        if ours in k["name"] or "cudnn" in k["name"]:
            continue
        around = host.launching_ops(k)
        op = around[-1]["name"] if around else "?"
        dims = str(around[-1]["args"].get("Input Dims", "")) if around else ""
        g = groups.setdefault((k["name"][:60], op, dims), dict(kernel=k["name"][:60], op=op, dims=dims, ms=0.0, n=0))
        g["ms"] += k["dur"] / 1e3
        g["n"] += 1
    return sorted(groups.values(), key=lambda g: -g["ms"])


def bench_step(config: str, layers: int, precision: str = "bf16"):
    spec = TM.SPECS[config]
    torch.manual_seed(0)
    model = CodaLlama(LlamaConfig(**spec.coda_kwargs(layers), precision=precision), device="cuda")
    tokens = TM.random_tokens(4, 4096, spec.vocab_size).cuda()
    return TM.coda_step(model, tokens, TM.shift_labels(tokens), list(model.parameters()))


def mlp_fp8_steps(fast_accum: str) -> tuple:
    """(ours, shadow): ``bench_fp8``'s row-wise FP8 MLP sublayer step with ``fast_accum`` and its
    six row-wise ``_scaled_mm`` with the same fast accumulation."""
    import bench_fp8 as BF

    from coda_cute.nn.llama import embedding_norm_stats

    torch.manual_seed(0)
    m, d, f = 16384, 4096, 14336
    y, w_gu, w_down, dy2 = BF.mlp_case(m, d, f)
    ours = BF.coda_step(torch.ops.coda.mlp_block_fp8, y, embedding_norm_stats(y), w_gu, w_down, dy2, BF.EPS,
                        row_scaling=True, fast_accum=fast_accum)
    return ours, BF.shadow_step(BF.mlp_gemms(m, d, f), fast_accum=fast_accum)


def train_step(plain_hf: bool):
    from coda_cute import train as T
    from coda_cute.nn import apply_coda

    cfg = T.TrainConfig()
    model = T.build_model(cfg).cuda()
    if not plain_hf:
        apply_coda(model)
    forward = T.hf_forward(model)
    batch = torch.randint(0, 256, (cfg.micro_batch, cfg.seq + 1), device="cuda")
    ids, nxt = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(ids, nxt)
        loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def timed_alone(step, rounds: int = 10) -> dict:
    """The step timed as ``bench_train`` times it (events, L2 flushed, the host free to run ahead
    into the next step), once back to back and once with the GPU drained before each step (then
    the host's launch latency at the step's start counts), and with only the host's time: which
    of GPU work, queueing and host work the timed median holds beyond the profiler's busy time.
    Then the clocks' share: the step after a second of idle GPU (clocks up, as for the profiled
    step, which follows the profiler's set-up) against the step after 5 s of steps back to back
    (the clocks a sustained run settles at)."""
    import time

    from coda_cute.sol.timing import interleaved_medians

    out = {"in turns": interleaved_medians({"step": step}, rounds=rounds, warmup=2)["step"]}

    def drained():
        torch.cuda.synchronize()
        step()
    out["drained first"] = interleaved_medians({"step": drained}, rounds=rounds, warmup=1)["step"]
    host = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    out["host only"] = sorted(host)[len(host) // 2]
    cool = []
    for _ in range(5):
        time.sleep(1.0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        cool.append(start.elapsed_time(end))
    out["after 1 s idle"] = sorted(cool)[len(cool) // 2]
    out["settled 5 s"] = interleaved_medians({"step": step}, rounds=rounds, warmup=1, settle_ms=5000)["step"]
    return out


def host_profile(step, steps: int = 5):
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="8b", choices=sorted(TM.SPECS))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--min-gap-us", type=float, default=20.0)
    ap.add_argument("--trace", help="also keep the chrome trace here")
    ap.add_argument("--model", choices=("bench", "train", "mlp-fp8"), default="bench")
    ap.add_argument("--fast-accum", choices=("none", "forward", "all"), default="all",
                    help="--model mlp-fp8: the GEMMs that accumulate in the tensor core")
    ap.add_argument("--hf", action="store_true", help="--model train without apply_coda")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="the benchmark model with precision=\"fp8\" (bench_train's coda_fp8)")
    ap.add_argument("--shapes", action="store_true",
                    help="record op input shapes and list the kernels outside ours and cuDNN's by the op "
                         "and shapes that launched them (the recording adds host time to the gaps)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("trace_step needs a CUDA GPU")
    from torch.profiler import ProfilerActivity, profile

    shadow = None
    if args.model == "mlp-fp8":
        step, shadow = mlp_fp8_steps(args.fast_accum)
    elif args.model == "train":
        step = train_step(args.hf)
    else:
        step = bench_step(args.config, args.layers, "fp8" if args.fp8 else "bf16")
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=args.shapes) as prof:
        with torch.profiler.record_function("step"):
            step()
        torch.cuda.synchronize()
    path = args.trace or tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    trace = json.load(open(path))
    rows, summary = gaps_of(trace, args.min_gap_us)
    console = Console(width=200)
    if args.shapes:
        lt = Table(title="kernels outside ours and cuDNN's, by the op that launched them")
        for col in ("ms", "launches", "kernel", "innermost CPU op", "its input shapes"):
            lt.add_column(col, justify="right" if col in ("ms", "launches") else "left", overflow="fold")
        for g in launchers_of(trace)[:30]:
            lt.add_row(f"{g['ms']:.3f}", str(g["n"]), g["kernel"], g["op"], g["dims"][:90])
        console.print(lt)
    what = args.config if args.model == "bench" else args.model
    t = Table(title=f"{what}: GPU idle gaps >= {args.min_gap_us:.0f} us in one step")
    for col in ("gap us", "next kernel", "outermost CPU op", "innermost CPU op"):
        t.add_column(col, justify="right" if col == "gap us" else "left", overflow="fold")
    for r in sorted(rows, key=lambda r: -r["gap_us"])[:40]:
        t.add_row(f"{r['gap_us']:.0f}", r["kernel"], r["outer"], r["inner"])
    console.print(t)
    st = Table(title="host calls that wait for the GPU or the allocator (synchronize, memcpy, malloc, free)")
    for col in ("call", "us", "outermost CPU op", "innermost CPU ops"):
        st.add_column(col, justify="right" if col == "us" else "left", overflow="fold")
    for r in sorted(summary["syncs"], key=lambda r: -r["us"])[:25]:
        st.add_row(r["call"], f"{r['us']:.0f}", r["outer"], r["inner"])
    console.print(st)
    console.print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70))
    console.print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    if args.cprofile:
        host_profile(step)
    alone = timed_alone(step)
    console.print(f"kernels {summary['kernels']}, first kernel to last {summary['span_ms']:.2f} ms, busy "
                  f"{summary['busy_ms']:.2f} ms, idle gaps {summary['gaps_ms']:.2f} ms "
                  f"({len(rows)} of them >= {args.min_gap_us:.0f} us); the step's host code ran "
                  f"{summary['cpu_ms']:.2f} ms and launched its first kernel after {summary['lead_ms']:.2f} ms")
    console.print("CUDA-event medians of the step without the profiler: "
                  + ", ".join(f"{k} {v:.2f} ms" for k, v in alone.items()))
    if shadow is not None:
        ref = timed_alone(shadow)
        console.print("the same of its shadow: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ref.items()))
        console.print("ours / shadow: " + ", ".join(f"{k} {alone[k] / ref[k]:.3f}" for k in alone if k != "host only"))


if __name__ == "__main__":
    main()
