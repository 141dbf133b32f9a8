"""Every GEMM launch of one CODA training step, replayed: its fused epilogue against our plain
GEMM and cuBLAS on the same operands, timed in turns.

One step (forward + ``loss.backward()``) of the 2-layer ``CodaLlama`` of ``scripts/bench_train.py``
runs with the epilogue runner's launches recorded (tree, operands, inputs, preallocated outputs).
Each distinct launch is then timed as it ran (``fused``), as a plain bf16 GEMM of ours on the same
operands (``plain``: what the epilogue costs) and as ``torch.mm`` (``cuBLAS``), all in turns with
L2 flushed (``coda_cute.sol.timing.interleaved_medians``). The sums weighted by how often each
launch ran say how far the step's GEMMs are from the shadow's, and which trees carry the gap.

    python scripts/bench_step_gemms.py [--configs 1b 8b] [--rounds 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_models as TM  # noqa: E402  (the benchmark models of scripts/bench_train.py)

from coda_cute.epilogue import runner  # noqa: E402
from coda_cute.nn.llama import CodaLlama, LlamaConfig  # noqa: E402
from coda_cute.ops.gemm import gemm_impl  # noqa: E402
from coda_cute.sol.timing import interleaved_medians  # noqa: E402


def record_launches(step) -> list:
    """Run ``step()`` once with every epilogue launch recorded: [(plan, a, b, inputs, outputs)],
    one entry per distinct plan with the number of launches it made."""
    seen: dict = {}
    original = runner.Plan.launch

    def launch(plan, a, b, inputs, outputs=None, block_scales=None):
        entry = seen.get(id(plan))
        if entry is None:
            seen[id(plan)] = entry = [plan, a, b, dict(inputs), dict(outputs or {}), block_scales, 0]
        entry[6] += 1
        return original(plan, a, b, inputs, outputs, block_scales)

    runner.Plan.launch = launch
    try:
        step()
        torch.cuda.synchronize()
    finally:
        runner.Plan.launch = original
    return list(seen.values())


def label(plan) -> str:
    return f"{plan.op} [{'+'.join(o.name for o in plan.tree.outputs)}]"


def time_config(name: str, layers: int, rounds: int, console: Console) -> list:
    spec = TM.SPECS[name]
    b, s = 4, 4096
    cfg = LlamaConfig(**spec.coda_kwargs(layers))
    torch.manual_seed(0)
    model = CodaLlama(cfg, device="cuda")
    model.train()
    tokens = TM.random_tokens(b, s, spec.vocab_size).cuda()
    targets = TM.shift_labels(tokens)
    params = list(model.parameters())
    step = TM.coda_step(model, tokens, targets, params)
    step()  # compile every kernel before recording
    launches = record_launches(step)
    rows = []
    for plan, a, b_, inputs, outputs, scales, count in launches:
        mm = torch.bmm if a.dim() == 3 else torch.mm
        fns = {"fused": lambda p=plan, a=a, b=b_, i=inputs, o=outputs, s=scales: p.launch(a, b, i, o or None, s),
               "plain": lambda a=a, b=b_: gemm_impl(a, b),
               "cublas": lambda a=a, b=b_, mm=mm: mm(a, b)}
        t = interleaved_medians(fns, rounds=rounds, settle_ms=300)
        m, k = a.shape[-2:]
        n = b_.shape[-1]
        rows.append(dict(config=name, launch=label(plan), count=count, m=m, n=n, k=k,
                         layout=("k" if a.stride(-1) == 1 else "m") + ("k" if b_.stride(-2) == 1 else "n"),
                         tile=plan.config.name, **{f"{key}_ms": v for key, v in t.items()}))
        r = rows[-1]
        console.log(f"{name} {r['launch']} {m}x{n}x{k} x{count}: fused {r['fused_ms']:.3f} plain "
                    f"{r['plain_ms']:.3f} cuBLAS {r['cublas_ms']:.3f}")
    return rows


def report(rows: list, console: Console):
    for name in dict.fromkeys(r["config"] for r in rows):
        sel = [r for r in rows if r["config"] == name]
        t = Table(title=f"{name}: the step's GEMM launches (ms per launch; ratios > 1: slower than cuBLAS)")
        for col in ("launch", "M x N x K", "layout", "count", "config", "fused", "plain", "cuBLAS",
                    "fused / cuBLAS", "plain / cuBLAS"):
            t.add_column(col, justify="left" if col in ("launch", "config") else "right")
        for r in sorted(sel, key=lambda r: -r["fused_ms"] * r["count"]):
            t.add_row(r["launch"], f"{r['m']}x{r['n']}x{r['k']}", r["layout"], str(r["count"]), r["tile"],
                      f"{r['fused_ms']:.3f}", f"{r['plain_ms']:.3f}", f"{r['cublas_ms']:.3f}",
                      f"{r['fused_ms'] / r['cublas_ms']:.3f}", f"{r['plain_ms'] / r['cublas_ms']:.3f}")
        console.print(t)
        tot = {k: sum(r[f"{k}_ms"] * r["count"] for r in sel) for k in ("fused", "plain", "cublas")}
        console.print(f"{name}: sum over the step's launches: fused {tot['fused']:.2f} ms, plain "
                      f"{tot['plain']:.2f} ms, cuBLAS {tot['cublas']:.2f} ms (fused / cuBLAS "
                      f"{tot['fused'] / tot['cublas']:.3f}, plain / cuBLAS {tot['plain'] / tot['cublas']:.3f})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["1b", "8b"], choices=sorted(TM.SPECS))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_step_gemms needs a CUDA GPU")
    console = Console(width=180)
    rows = []
    for name in args.configs:
        rows += time_config(name, args.layers, args.rounds, console)
        torch.cuda.empty_cache()
    report(rows, console)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
