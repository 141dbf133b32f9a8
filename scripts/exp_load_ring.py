"""Experiment: how deep the epilogue's tile-input ring must be for a tree that streams a wide
tile input (the SwiGLU backward: z (M, 2f) read, dz' (M, 2f) and h (M, f) written).

The ring's depth is ``kernels.sm90.epilogue.LOAD_STAGES`` (sub-tiles the load warp runs ahead),
capped so that it never costs an A/B stage. Variants, each compiled afresh (no disk cache) and
timed in turns with our plain GEMM and cuBLAS on the same operands:
  ring 4 / A-B stages as fit (today's: 5), ring 2 and one store buffer per output / 6 A-B stages
  (the plain GEMM's count), ring 2 / as fit, and ring 4 / 4 A-B stages (what a lost stage costs).
  Measured first (H200): ring 8 / 4 stages cost as much as ring 4 / 4 stages, 11-12 % over today's.

    CODA_CUTE_CACHE_DIR=0 python scripts/exp_load_ring.py [--shapes 8b]
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ["CODA_CUTE_CACHE_DIR"] = "0"

import torch  # noqa: E402
from rich.console import Console  # noqa: E402

from coda_cute import compiler, dispatch  # noqa: E402
from coda_cute.epilogue import runner  # noqa: E402
from coda_cute.kernels.sm90 import epilogue as EP  # noqa: E402
from coda_cute.ops.gemm import gemm_impl  # noqa: E402
from coda_cute.ops.rmsnorm import norm_inputs  # noqa: E402
from coda_cute.ops.swiglu import swiglu_backward_tree  # noqa: E402
from coda_cute.sol.timing import interleaved_times, paired_ratios, ratio_text  # noqa: E402

SHAPES = {"1b": (16384, 8192, 2048), "8b": (16384, 14336, 4096)}  # M, f, d
#: name: (load ring, store ring or None for today's, A/B stages or 0 for as many as fit)
VARIANTS = {"ring4_fit": (4, None, 0), "ring2_store1_s6": (2, 1, 6), "ring2_store2_fit": (2, None, 0),
            "ring4_s4": (4, None, 4)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    args = ap.parse_args()
    console = Console(width=160)
    tree = swiglu_backward_tree()
    sms = dispatch.num_sms(torch.device("cuda"))
    for label in args.shapes:
        m, f, d = SHAPES[label]
        dy = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(d, f, device="cuda", dtype=torch.bfloat16) * d ** -0.5
        z = torch.randn(m, 2 * f, device="cuda", dtype=torch.bfloat16)
        ss = torch.rand(m, 1, device="cuda") * d + 1
        inputs = dict(norm_inputs(d, ss, 1e-5), z=z)
        base = runner.choose_config(tree, m, f, d, 1, False, False, sms)
        fns = {"cublas": lambda: torch.mm(dy, w), "plain": lambda: gemm_impl(dy, w)}
        today = EP.epi_stage_count
        for name, (ring, store, stages) in VARIANTS.items():
            EP.LOAD_STAGES, EP.MIN_LOAD_STAGES = ring, min(ring, 2)
            EP.epi_stage_count = today if store is None else (lambda *_a, s=store: s)
            compiler._cache.clear()
            runner._plans.clear()
            plan = runner._make_plan(tree, dy, w, inputs, base.with_(stages=stages), False, "exp")
            fns[name] = lambda p=plan: p.launch(dy, w, inputs)
            console.log(f"{label} {name}: config {plan.config.name}")
        EP.LOAD_STAGES, EP.MIN_LOAD_STAGES, EP.epi_stage_count = 4, 2, today
        times = interleaved_times(fns, rounds=20, settle_ms=500)
        paired = paired_ratios(times, "cublas")
        for k, v in times.items():
            console.print(f"{label} {m}x{f}x{d} {k}: {statistics.median(v):.3f} ms, / cuBLAS per round "
                          f"{ratio_text(paired[k])}")


if __name__ == "__main__":
    main()
