"""Experiment: why our bf16 GEMM falls behind cuBLAS on the largest training GEMMs.

``bench_train_gemms.py --widths 8192 --tokens 32768`` (H200, 2026-12-02): our heuristic's
ping-pong 128x128 2x1 at 0.69-0.83 of cuBLAS on the GEMMs with an operand of 1.9 GB or more
(gate/up dgrad 32768x8192x57344 0.711, gate/up wgrad 57344x8192x32768 0.692, down fwd
32768x8192x28672 0.761) while cuBLAS held 640-670 TFLOP/s; the same (M, N) at K = 8192 ran at
1.01-1.05. This times those GEMMs, in their training layouts, against cuBLAS in turns with the
raster band (``raster_group``) and the tile shape varied, and samples the SM clock and power
through the run (``nvidia-smi``, 50 ms) to tell a slower kernel from a throttled one.

``--fp8``: the row-wise FP8 MLP's six GEMMs at the 8B shapes (16384 tokens, both operands K-major
in E4M3, row and column scales, fast accumulation, bf16 out) against ``_scaled_mm`` fast. On an
H100 (2026-12-05) our picks ran 1.12-1.16x its time on the short-K GEMMs with the widest outputs
(gate/up forward 16384 x 28672 x 4096, down dgrad 16384 x 14336 x 4096; `_scaled_mm` there is
`nvjet_sm90_qqtst_128x128_128x6_1x2`: our tile and stage count, the other cluster) and at parity
on the long-K ones; this varies the raster band and the cluster around the pick, and gives a
ping-pong pick the cooperative schedule's wider epilogue sub-tiles (64 columns: half the TMA
store rounds and barriers per tile). Every variant's result is checked against the baseline's.
On an H100 (2026-12-05) none of these closed the gap, except a 2x2 cluster on the gate/up forward
(0.894 -> 0.966 of `_scaled_mm`'s speed); 2x2 slowed the other five by 6-11 %.

``--split 4 8``: the pick on M cut into 4 and 8 launches (row blocks of A) into one output. In
one launch the persistent slots walk their tiles round-robin, and a slot that runs slower falls
behind, so the tiles in flight spread beyond the band that shares operands in L2; each launch
starts them together again. On an H100 (2026-12-06, ncu) the gate/up forward read 2.80 GB from
DRAM in one launch, 1.33 GB in 4 and 1.16 GB in 8 (`_scaled_mm` fast: 1.73 GB), and took the same
time (2.91 ms each way): the slots do drift apart, and the DRAM bytes it costs do not set the
time. ``tile ...`` variants (same day): ping-pong 64 x 256 2x1 0.860 of `_scaled_mm`'s speed,
1x2 0.464, cooperative 256 x 128 2x1 0.941, 128 x 256 2x2 0.872, against 0.940 for the pick and
0.960 on 2x2 (gate/up forward; the down dgrad 0.870 / 0.534 / 0.877 / 0.811 against 0.981 and
0.900): fewer L2 or shared-memory operand bytes per FLOP do not close it either.

``--only`` keeps some cases (by label), ``--variants`` the variants whose names start with one of
its prefixes (``ours`` is the pick, ``poll`` the pick whose mainloop polls ``mbarrier.try_wait``
without sleeping between polls, ``GemmConfig.poll_full``), ``--once`` runs each once for ncu
instead of timing.

    python scripts/exp_large_gemms.py [--rounds 5] [--log clocks.csv] [--fp8] [--only gate_up.fwd]
        [--variants ours split tile] [--split 4 8] [--once]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

# variants built under a module switch (``PINGPONG_WIDE_SUB_TILES``) share their spec with the
# default kernel: no disk cache, or one would load (or leave behind) the other's binary
os.environ["CODA_CUTE_CACHE_DIR"] = "0"

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from coda_cute import compiler, dispatch  # noqa: E402
from coda_cute.epilogue import runner  # noqa: E402
from coda_cute.kernels.sm90.gemm import resident_clusters  # noqa: E402
from coda_cute.kernels.epilogue.plain import gemm_tree  # noqa: E402
from coda_cute.kernels.sm90 import epilogue as EPI  # noqa: E402
from coda_cute.ops.fp8_gemms import FP8  # noqa: E402
from coda_cute.ops.gemm import gemm_impl  # noqa: E402
from coda_cute.sol.timing import calls_in_range, interleaved_medians  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train_gemms as BTG  # noqa: E402  (the training layouts' operands)

#: (label, kind, tokens, out_features, in_features): the slow ones, and one that was not
CASES = [("gate_up.dgrad", "dgrad", 32768, 57344, 8192), ("gate_up.wgrad", "wgrad", 32768, 57344, 8192),
         ("down.fwd", "fwd", 32768, 8192, 28672), ("gate_up.dgrad K-short", "dgrad", 8192, 57344, 8192)]
GROUPS = (2, 4, 16, 32)
#: (label, M, N, K) of the row-wise FP8 MLP's GEMMs (d 4096, ffn 14336, 16384 tokens), the two
#: that lose most first
FP8_CASES = [("gate_up.fwd", 16384, 28672, 4096), ("down.dgrad", 16384, 14336, 4096),
             ("down.fwd", 16384, 4096, 14336), ("gate_up.dgrad", 16384, 4096, 28672),
             ("down.wgrad", 4096, 14336, 16384), ("gate_up.wgrad", 28672, 4096, 16384)]


def bf16_case(kind, m, n_out, k_in, sms):
    """(cuBLAS's product, (M, N, K), name -> ours) of a bf16 training GEMM."""
    a, b = BTG.operands(kind, m, n_out, k_in)
    cfg = dispatch.select_config(a.shape[0], b.shape[1], a.shape[1], 1, False, False, sms)
    variants = {f"ours {cfg.name}": None}
    variants.update({f"g{g}": cfg.with_(raster_group=g) for g in GROUPS})
    variants.update({c.name: c for c in (dispatch.GemmConfig(128, 256, 64, "cooperative", 2, 1),
                                         dispatch.GemmConfig(128, 128, 64, "pingpong", 1, 1))})
    fns = {name: (lambda c=c: gemm_impl(a, b, config=c)) for name, c in variants.items()}
    return (lambda: torch.mm(a, b)), (a.shape[0], b.shape[1], a.shape[1]), fns


def fp8_variants(cfg) -> dict:
    """name -> config around the FP8 pick ``cfg`` (None: the pick itself, through the heuristic):
    its raster band varied, its cluster turned (`_scaled_mm`'s 1x2), dropped or doubled (2x2: both
    operands multicast, a third less of each CTA's k-tile read from L2), cooperative 128 x 256
    2x1, and ``tile ...``: ping-pong 64 x 256 (one m64n256 WGMMA per k-step: a sixth fewer
    shared-memory operand bytes per FLOP than 128 x 128's two m64n128) on 2x1 and 1x2, cooperative
    256 x 128 2x1 and 128 x 256 2x2 (half the L2 bytes per FLOP of the pick); ``poll``: the pick
    with ``poll_full``."""
    variants = {f"ours {cfg.name}": None}
    variants.update({f"g{g}": cfg.with_(raster_group=g) for g in GROUPS if g != cfg.raster_group})
    variants.update({f"cluster {cm}x{cn}": cfg.with_(cluster_m=cm, cluster_n=cn)
                     for cm, cn in ((1, 2), (1, 1), (2, 2)) if (cm, cn) != (cfg.cluster_m, cfg.cluster_n)})
    coop = dispatch.GemmConfig(128, 256, 128, "cooperative", 2, 1, fp8_fast_accum=True)
    if coop != cfg:
        variants[coop.name] = coop
    # wider WGMMAs (fewer shared-memory operand bytes per FLOP) and fewer L2 bytes per FLOP
    wide = (dispatch.GemmConfig(64, 256, 128, "pingpong", 2, 1, fp8_fast_accum=True),
            dispatch.GemmConfig(64, 256, 128, "pingpong", 1, 2, fp8_fast_accum=True),
            dispatch.GemmConfig(256, 128, 128, "cooperative", 2, 1, fp8_fast_accum=True),
            dispatch.GemmConfig(128, 256, 128, "cooperative", 2, 2, fp8_fast_accum=True))
    variants.update({f"tile {c.name}": c for c in wide if c != cfg})
    variants["poll"] = cfg.with_(poll_full=True)
    return variants


def fp8_case(m, n, k, sms, splits=()):
    """The same for a row-wise FP8 GEMM with fast accumulation, against ``_scaled_mm`` fast; a
    ping-pong pick also with 64-column epilogue sub-tiles (``PINGPONG_WIDE_SUB_TILES``); and for
    each ``s`` of ``splits`` the pick on M cut into ``s`` launches (``split s``) into one output."""
    a = torch.randn(m, k, device="cuda").to(FP8)
    b = torch.randn(n, k, device="cuda").to(FP8).t()
    sa = torch.rand(m, 1, device="cuda") + 0.5
    sb = (torch.rand(1, n, device="cuda") + 0.5) / k ** 0.5
    pick = dispatch.select_config(m, n, k, 1, True, True, sms)
    fns = {name: (lambda c=c: gemm_impl(a, b, sa, sb, torch.bfloat16, True, config=c))
           for name, c in fp8_variants(pick).items()}
    if pick.schedule == "pingpong":
        inputs = {"scale_a": sa.view(-1), "scale_b": sb.view(-1)}
        plan = wide_sub_tile_plan(gemm_tree("row", "row", "bfloat16"), a, b, inputs, pick)
        fns[f"64-column sub-tiles ({pick.name})"] = lambda: plan.launch(a, b, inputs)["out"]
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16) if splits else None
    for s in splits:
        rows = [slice(i * m // s, (i + 1) * m // s) for i in range(s)]
        fns[f"split {s}"] = lambda rows=rows: [gemm_impl(a[r], b, sa[r], sb, torch.bfloat16, True, out=out[r])
                                               for r in rows] and out
    base = lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,  # noqa: E731
                                    use_fast_accum=True)
    return base, (m, n, k), fns


def wide_sub_tile_plan(tree, a, b, inputs, config):
    """A launch plan of ``tree`` on ping-pong ``config`` with the cooperative schedule's wider
    epilogue sub-tiles, compiled afresh (the caches cleared before and after: the switch is not
    part of a kernel's spec)."""
    EPI.PINGPONG_WIDE_SUB_TILES = True
    try:
        compiler._cache.clear()
        runner._plans.clear()
        return runner._make_plan(tree, a, b, inputs, config, config.fp8_fast_accum, "exp")
    finally:
        EPI.PINGPONG_WIDE_SUB_TILES = False
        compiler._cache.clear()
        runner._plans.clear()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--log", help="write nvidia-smi's SM clock and power samples here (CSV)")
    ap.add_argument("--fp8", action="store_true", help="the row-wise FP8 MLP's six GEMMs instead (module docstring)")
    ap.add_argument("--only", nargs="+", metavar="LABEL", help="these cases only (their labels, e.g. gate_up.fwd)")
    ap.add_argument("--variants", nargs="+", metavar="PREFIX", help="the variants whose names start with these only")
    ap.add_argument("--split", nargs="+", type=int, default=[], metavar="S",
                    help="--fp8: also the pick on M cut into S launches each (a launch starts every slot afresh: "
                         "how much L2 reuse the persistent slots' drift apart costs)")
    ap.add_argument("--once", action="store_true",
                    help="for ncu: one call of the baseline and of each variant, after a warm-up call of each, "
                         "inside the NVTX range gemms (--nvtx --nvtx-include gemms/), instead of timing")
    args = ap.parse_args()
    smi = None
    if args.log:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                                "--format=csv", "-lms", "50", "-f", args.log])
    console = Console(width=150)
    sms = dispatch.num_sms(torch.device("cuda"))
    if args.fp8:  # a 2x2 variant's launch takes the driver's count of resident 4-CTA clusters
        torch.empty(1, device="cuda")  # the driver query wants a current context, as a launch has
        console.log(f"resident 4-CTA clusters: {resident_clusters(sms, 4)} (of {sms // 4} were every SM used)")
    table = Table(title="large training GEMMs: cuBLAS time / ours per variant (> 1: ours faster)")
    for col in ("GEMM", "M x N x K", "cuBLAS TFLOP/s", "variant", "ratio"):
        table.add_column(col, justify="right")
    cases = [(label, lambda m=m, n=n, k=k: fp8_case(m, n, k, sms, args.split)) for label, m, n, k in FP8_CASES] \
        if args.fp8 \
        else [(c[0], lambda c=c: bf16_case(*c[1:], sms)) for c in CASES]
    if args.only:
        cases = [c for c in cases if c[0] in args.only]
    if args.variants:
        cases = [(label, lambda make=make: kept_variants(make(), args.variants)) for label, make in cases]
    if args.once:
        return once(cases, console)
    try:
        for label, make in cases:
            base, (mm, nn, kk), fns = make()
            want = base().float()
            for name, fn in fns.items():  # every variant's result against the baseline's
                err = float((fn().float() - want).norm() / want.norm())
                flag = "" if err < 2e-2 else "  DIFFERS"
                console.log(f"{label} {mm}x{nn}x{kk} {name}: rel. difference {err:.2e}{flag}")
            del want
            t = interleaved_medians({"cublas": base, **fns}, rounds=args.rounds, settle_ms=300)
            tflops = 2 * mm * nn * kk / t["cublas"] / 1e9
            for name, ms in t.items():
                if name != "cublas":
                    table.add_row(label, f"{mm}x{nn}x{kk}", f"{tflops:.0f}", name, f"{t['cublas'] / ms:.3f}")
                    console.log(f"{label} {name}: {t['cublas'] / ms:.3f}")
            del base, fns
            torch.cuda.empty_cache()
    finally:
        if smi is not None:
            smi.terminate()
    console.print(table)


def kept_variants(case, prefixes):
    """``case`` (baseline, shape, name -> variant) with the variants whose names start with one of
    ``prefixes``."""
    base, shape, fns = case
    return base, shape, {name: fn for name, fn in fns.items() if name.startswith(tuple(prefixes))}


def once(cases, console):
    """One call of each case's baseline and variants inside the NVTX range ``gemms`` (compiled and
    warmed up outside it), in the order the console logs."""
    for label, make in cases:
        base, _, fns = make()
        calls_in_range({"baseline": base, **fns}, log=lambda name: console.log(f"{label}: {name}"))
        del base, fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
