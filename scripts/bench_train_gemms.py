"""Every GEMM of a Llama training step on our kernel against cuBLAS, in the layouts the step
hands them over: forward ``x @ W.T`` (A and B K-major), dgrad ``dY @ W`` (B N-major), wgrad
``dY.T @ X`` (A M-major, B N-major). bf16 in and out, random data, CUDA-event medians with L2
flushed, ours and cuBLAS timed in turns per shape (``coda_cute.sol.timing.interleaved_medians``).
Prints the ratio (cuBLAS time / ours: > 1 is faster than cuBLAS) per GEMM, the geomean and the
minimum.

    python scripts/bench_train_gemms.py [--configs 1b 8b] [--tokens 16384] [--json out.json]
    python scripts/bench_train_gemms.py --widths 2048 8192 --tokens 8192 32768   # other Llama sizes

``--configs`` takes the two models of ``scripts/bench_train.py`` (d 2048 / ffn 8192 / head_dim 64
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
from coda_cute.sol.timing import interleaved_medians

VOCAB = 128256
MODELS = {"1b": (2048, 8192, 32, 8, 64), "8b": (4096, 14336, 32, 8, 128)}  # d, ffn, H, Hkv, hd


def model_of_width(d: int):
    ffn = round(3.5 * d / 256) * 256
    return d, ffn, d // 128, 8, 128


def linears(d, ffn, h, hkv, hd):
    """(name, out_features, in_features) of one block's linears, and the LM head."""
    return [("qkv", (h + 2 * hkv) * hd, d), ("o", d, h * hd), ("gate_up", 2 * ffn, d),
            ("down", d, ffn), ("lm_head", VOCAB, d)]


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
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_train_gemms needs a CUDA GPU")
    torch.manual_seed(0)
    sms = dispatch.num_sms(torch.device("cuda", torch.cuda.current_device()))
    models = {c: MODELS[c] for c in args.configs} | {f"d{w}": model_of_width(w) for w in args.widths}
    console = Console(width=150)
    rows = []
    for label, dims in models.items():
        for m in args.tokens:
            for name, n_out, k_in in linears(*dims):
                for kind in ("fwd", "dgrad", "wgrad"):
                    a, b = operands(kind, m, n_out, k_in)
                    mm, kk = a.shape
                    nn = b.shape[1]
                    times = interleaved_medians({"cublas": lambda a=a, b=b: torch.mm(a, b),
                                                 "coda": lambda a=a, b=b: gemm_impl(a, b)},
                                                rounds=args.rounds, settle_ms=500)
                    cfg = dispatch.select_config(mm, nn, kk, 1, False, False, sms)
                    rows.append(dict(model=label, tokens=m, gemm=f"{name}.{kind}", m=mm, n=nn, k=kk,
                                     cublas_ms=times["cublas"], coda_ms=times["coda"],
                                     ratio=times["cublas"] / times["coda"], config=cfg.name))
                    console.log(f"{label} {m} {name}.{kind} {mm}x{nn}x{kk}: {rows[-1]['ratio']:.3f}")
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
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
