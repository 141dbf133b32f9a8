"""Experiment: the row-wise FP8 MLP backward's memory-bound passes beside a GEMM, on SMs it leaves.

Our persistent GEMMs take every SM for their whole run, so a quantize or transpose pass on another
stream waits for the GEMM to end: in the row-wise fast MLP (d 4096, ffn 14336, 16384 tokens) the
passes run between the GEMMs, about 1.5 ms of a 15 ms step on the H200. Four of the backward's
passes feed only the weight gradients, which run last:

    dz'^T   the FP8 transpose of dz''s rows            (16384 x 28672 bytes)
    y_col   y's columns with dz''s fold factors        (16384 x 4096 bf16 read twice)
    h^T     the FP8 transpose of h's kept rows         (16384 x 14336 bytes)
    dy2_col dy2's columns with h's fold factors        (16384 x 4096 bf16 read twice)

so they could run on a side stream while the gate/up dgrad (16384 x 4096 x 28672, the longest
GEMM that needs none of them) runs on ``sms - r`` SMs: the GEMM loses r / sms of its SMs for its
whole run, the passes leave the critical path. This times, in turns: the GEMM on every SM then
the passes (``serial``); each alone; and for each r the GEMM on ``sms - r`` SMs alone and with the
passes beside it (``beside r``), the side stream joined before the end event. Every variant's
outputs are checked bit for bit against ``serial``'s. On an H100 (2026-12-06, two runs): serial
3.436 / 3.399 ms, the GEMM alone 2.640 / 2.604 and on 116 SMs 2.968 / 2.910, the passes alone
0.803 / 0.801, beside 16 3.108 / 3.055 (0.905 / 0.899 of serial), beside 8, 12 and 24 0.910-0.938.

    python scripts/exp_side_stream.py [--rounds 8] [--reserve 8 12 16 24]
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from rich.console import Console
from rich.table import Table

from coda_cute import dispatch
from coda_cute.epilogue import runner
from coda_cute.kernels.epilogue.plain import gemm_tree
from coda_cute.ops.fp8_gemms import FP8
from coda_cute.ops.quantize import quantize_grad_rowwise_fp8, quantize_rowwise_fp8, transpose_bytes
from coda_cute.sol.timing import interleaved_medians

M, D, F = 16384, 4096, 14336


@contextlib.contextmanager
def sm_count(n: int):
    """``dispatch.num_sms`` answering ``n`` (a plan built inside sizes its persistent grid by it)."""
    real = dispatch.num_sms
    dispatch.num_sms = lambda device: n
    try:
        yield
    finally:
        dispatch.num_sms = real


def gemm_plan(a, b, sa, sb, sms: int):
    """A launch of the row-wise fast FP8 GEMM a @ b on a grid of ``sms`` SMs: () -> bf16 out."""
    tree = gemm_tree("row", "row", "bfloat16")
    inputs = {"scale_a": sa, "scale_b": sb}
    with sm_count(sms):
        plan = runner._make_plan(tree, a, b, inputs, None, True, "exp")
    return lambda: plan.launch(a, b, inputs)["out"]


def operands():
    g = torch.Generator(device="cuda").manual_seed(0)
    dz = torch.randn(M, 2 * F, device="cuda", generator=g).bfloat16()
    h = torch.randn(M, F, device="cuda", generator=g).bfloat16()
    y = torch.randn(M, D, device="cuda", generator=g).bfloat16()
    dy2 = torch.randn(M, D, device="cuda", generator=g).bfloat16()
    w_gu_t = torch.randn(D, 2 * F, device="cuda", generator=g).to(FP8)  # W_gu^T's FP8 rows: K-major B
    dz_q, dz_s, _, dz_fold = quantize_grad_rowwise_fp8(dz, FP8, transposed=False)
    h_q, _, _, h_fold = quantize_grad_rowwise_fp8(h, FP8, transposed=False)
    sb = torch.rand(D, device="cuda", generator=g) / (2 * F) ** 0.5
    return dz_q, dz_s[:, 0].contiguous(), dz_fold, h_q, h_fold, y, dy2, w_gu_t, sb


def side_passes(dz_q, dz_fold, h_q, h_fold, y, dy2):
    """The four passes only the weight gradients read: their outputs, as a tuple."""
    dzt = transpose_bytes(dz_q)
    _, _, yt, yt_s = quantize_rowwise_fp8(y, FP8, rows=False, fold=dz_fold)
    ht = transpose_bytes(h_q)
    _, _, dyt, dyt_s = quantize_rowwise_fp8(dy2, FP8, rows=False, fold=h_fold)
    return dzt, yt, yt_s, ht, dyt, dyt_s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reserve", type=int, nargs="+", default=[8, 12, 16, 24],
                    help="SMs the GEMM leaves to the side stream (even: its clusters are 2 CTAs)")
    args = ap.parse_args()
    console = Console(width=140)
    sms = dispatch.num_sms(torch.device("cuda"))
    dz_q, dz_s, dz_fold, h_q, h_fold, y, dy2, w_gu_t, sb = operands()
    b = w_gu_t.t()  # (K, N) view of the (N, K) rows
    side = torch.cuda.Stream()
    passes = lambda: side_passes(dz_q, dz_fold, h_q, h_fold, y, dy2)  # noqa: E731

    def beside(gemm):
        def fn():
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            out = gemm()  # queued first: its CTAs take their SMs before the passes' do
            with torch.cuda.stream(side):
                rest = passes()
            cur.wait_stream(side)
            for t in rest:
                t.record_stream(cur)
            return (out, *rest)
        return fn

    full = gemm_plan(dz_q, b, dz_s, sb, sms)
    fns = {"serial": lambda: (full(), *passes()), "gemm alone": full, "passes alone": passes}
    for r in args.reserve:
        g = gemm_plan(dz_q, b, dz_s, sb, sms - r)
        fns[f"gemm on {sms - r}"] = g
        fns[f"beside {r}"] = beside(g)
    fns["beside 0"] = beside(full)

    want = fns["serial"]()
    torch.cuda.synchronize()
    for name, fn in fns.items():
        if not name.startswith("beside"):
            continue
        got = fn()
        torch.cuda.synchronize()
        same = all(torch.equal(x.view(torch.uint8) if x.dtype == FP8 else x, w.view(torch.uint8) if w.dtype == FP8 else w)
                   for x, w in zip(got, want))
        console.log(f"{name}: outputs {'bit for bit' if same else 'DIFFER'}")
    del want

    t = interleaved_medians(fns, rounds=args.rounds, settle_ms=300)
    table = Table(title=f"gate/up dgrad {M}x{D}x{2 * F} (row-wise FP8, fast) and the wgrad passes, {sms} SMs")
    for col in ("variant", "ms", "/ serial"):
        table.add_column(col, justify="right")
    for name, ms in t.items():
        table.add_row(name, f"{ms:.3f}", f"{ms / t['serial']:.3f}")
    console.print(table)


if __name__ == "__main__":
    main()
