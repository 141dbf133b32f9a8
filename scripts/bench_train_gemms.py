"""Every GEMM of a Llama training step on our kernel against cuBLAS, in the layouts the step
hands them over: forward ``x @ W.T`` (A and B K-major), dgrad ``dY @ W`` (B N-major), wgrad
``dY.T @ X`` (A M-major, B N-major). bf16 in and out, random data, CUDA-event medians with L2
flushed, ours and cuBLAS timed in turns per shape (``coda_cute.sol.timing.interleaved_medians``).
Prints the ratio (cuBLAS time / ours: > 1 is faster than cuBLAS) per GEMM, the geomean and the
minimum.

    python scripts/bench_train_gemms.py [--configs 1b 8b] [--tokens 16384] [--json out.json]
    python scripts/bench_train_gemms.py --widths 2048 8192 --tokens 8192 32768   # other Llama sizes
    python scripts/bench_train_gemms.py --sweep --lm-rows 4096 5504   # every plausible config too

``--sweep`` also times every config of the config space whose predicted time is within
``SWEEP_SLACK`` of the heuristic's (the rest cannot win) and prints the best per GEMM: the data
the heuristic's layout rates come from. ``--lm-rows`` adds the LM head's GEMMs at these row
counts (the row chunks of ``coda.lm_head_ce_train``).

The LM head's GEMMs run at the rows of one chunk of ``coda.lm_head_ce_train`` (4096 at
vocab 128256), as in the step. ``--configs`` takes the two models of ``scripts/bench_train.py`` (d 2048 / ffn 8192 / head_dim 64
and d 4096 / ffn 14336 / head_dim 128, 32 / 8 heads, vocab 128256); ``--widths`` builds Llama-3
like models of other widths (ffn = 3.5 d rounded to 256, 128-wide heads, 8 KV heads) to check
that the heuristic holds beyond the shapes it was tuned on.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
from rich.console import Console
from rich.table import Table

from coda_cute import dispatch
from coda_cute.ops.gemm import gemm_impl
from coda_cute.ops.lm_head_ce import plan_chunks
from coda_cute.sol.timing import interleaved_medians

VOCAB = 128256
#: --sweep times the configs predicted at most this much slower than the heuristic's choice
SWEEP_SLACK = 1.35
MODELS = {"1b": (2048, 8192, 32, 8, 64), "8b": (4096, 14336, 32, 8, 128)}  # d, ffn, H, Hkv, hd


def model_of_width(d: int):
    ffn = round(3.5 * d / 256) * 256
    return d, ffn, d // 128, 8, 128


def linears(d, ffn, h, hkv, hd):
    """(name, out_features, in_features) of one block's linears, and the LM head."""
    return [("qkv", (h + 2 * hkv) * hd, d), ("o", d, h * hd), ("gate_up", 2 * ffn, d),
            ("down", d, ffn), ("lm_head", VOCAB, d)]


def gemm_rows(name: str, m: int, d: int) -> int:
    """M of a linear's GEMMs at m tokens: the LM head's run per row chunk of
    ``coda.lm_head_ce_train`` (``plan_chunks``), the others over all tokens."""
    return plan_chunks(m, VOCAB, d)[0] if name == "lm_head" else m


def operands(kind: str, m: int, n_out: int, k_in: int):
    """(a, b) of the training GEMM ``kind`` for a linear W (n_out, k_in) at m tokens."""
    def r(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    if kind == "fwd":  # (m, k_in) @ W.T
        return r(m, k_in), r(n_out, k_in).t()
    if kind == "dgrad":  # dY (m, n_out) @ W (n_out, k_in)
        return r(m, n_out), r(n_out, k_in)
    return r(m, n_out).t(), r(m, k_in)  # wgrad: dY.T (n_out, m) @ X (m, k_in)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="*", default=["1b", "8b"], choices=sorted(MODELS))
    ap.add_argument("--widths", nargs="*", type=int, default=[], help="Llama-3-like models of these widths")
    ap.add_argument("--tokens", nargs="+", type=int, default=[16384])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also time every plausible config")
    ap.add_argument("--lm-rows", nargs="*", type=int, default=[], help="LM-head GEMMs at these M")
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_train_gemms needs a CUDA GPU")
    torch.manual_seed(0)
    sms = dispatch.num_sms(torch.device("cuda", torch.cuda.current_device()))
    models = {c: MODELS[c] for c in args.configs} | {f"d{w}": model_of_width(w) for w in args.widths}
    console = Console(width=150)
    rows, sweeps = [], []
    jobs = [(label, m, gemm_rows(lin[0], m, dims[0]), lin) for label, dims in models.items()
            for m in args.tokens for lin in linears(*dims)]
    jobs += [(label, m, m, ("lm_head", VOCAB, dims[0])) for label, dims in models.items() for m in args.lm_rows]
    for label, m, gemm_m, (name, n_out, k_in) in jobs:
        for kind in ("fwd", "dgrad", "wgrad"):
            a, b = operands(kind, gemm_m, n_out, k_in)
            mm, kk = a.shape
            nn = b.shape[1]
            cfg = dispatch.select_config(mm, nn, kk, 1, False, False, sms)
            fns = {"cublas": lambda a=a, b=b: torch.mm(a, b), "coda": lambda a=a, b=b: gemm_impl(a, b)}
            if args.sweep:
                best = dispatch.predicted_time(cfg, mm, nn, kk, 1, sms, False)
                for c in dispatch.config_space(False):
                    if c != cfg and dispatch.predicted_time(c, mm, nn, kk, 1, sms, False) <= SWEEP_SLACK * best:
                        fns[c.name] = lambda a=a, b=b, c=c: gemm_impl(a, b, config=c)
            times = interleaved_medians(fns, rounds=args.rounds, settle_ms=500)
            gemm = f"{name}.{kind}"
            rows.append(dict(model=label, tokens=m, gemm=gemm, m=mm, n=nn, k=kk,
                             cublas_ms=times["cublas"], coda_ms=times["coda"],
                             ratio=times["cublas"] / times["coda"], config=cfg.name))
            if args.sweep:
                swept = {k: v for k, v in times.items() if k != "cublas"} | {cfg.name: times["coda"]}
                top = min(swept, key=swept.get)
                sweeps.append(dict(model=label, tokens=m, gemm=gemm, m=mm, n=nn, k=kk,
                                   cublas_ms=times["cublas"], best=top, best_ratio=times["cublas"] / swept[top],
                                   times={k: v for k, v in swept.items()}))
            console.log(f"{label} {m} {gemm} {mm}x{nn}x{kk}: {rows[-1]['ratio']:.3f}"
                        + (f" (best {sweeps[-1]['best']} {sweeps[-1]['best_ratio']:.3f})" if args.sweep else ""))
    t = Table(title="training-step GEMMs: cuBLAS time / ours (> 1: ours faster)")
    for col in ("model", "tokens", "GEMM", "M x N x K", "cuBLAS ms", "coda ms", "ratio", "config"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["model"], str(r["tokens"]), r["gemm"], f"{r['m']}x{r['n']}x{r['k']}",
                  f"{r['cublas_ms']:.3f}", f"{r['coda_ms']:.3f}", f"{r['ratio']:.3f}", r["config"])
    console.print(t)
    for label in models:
        sel = [r["ratio"] for r in rows if r["model"] == label]
        g = math.exp(sum(math.log(x) for x in sel) / len(sel))
        console.print(f"{label}: geomean {g:.3f}, min {min(sel):.3f} over {len(sel)} GEMMs")
    if args.sweep:
        t = Table(title="config sweep: the fastest config per GEMM (cuBLAS time / its time)")
        for col in ("model", "tokens", "GEMM", "M x N x K", "heuristic", "best config", "best ratio"):
            t.add_column(col, justify="right")
        for r, sw in zip(rows, sweeps):
            t.add_row(r["model"], str(r["tokens"]), r["gemm"], f"{r['m']}x{r['n']}x{r['k']}",
                      f"{r['ratio']:.3f}", sw["best"], f"{sw['best_ratio']:.3f}")
        console.print(t)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "sweeps": sweeps}, fh, indent=1)


if __name__ == "__main__":
    main()
