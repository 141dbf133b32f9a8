"""Experiment: what the SwiGLU epilogues cost their GEMMs, per config and per store (this was
``exp_swiglu_backward.py``, the backward alone, until the forward joined it).

``coda.swiglu_backward`` is the down-proj dgrad dh = dy @ W_down with the SwiGLU backward in its
epilogue: per output column it reads the saved pre-activation pair (g, u) (a wide tile: twice
the output's width) and writes dz' (twice the width), h and the per-tile zdz partials, 2.7x the
plain output's bytes. ``bench_step_gemms.py`` (H200, 2026-12-02) measured it at 1.104x (1b:
16384 x 8192 x 2048) and 1.054x (8b: 16384 x 14336 x 4096) cuBLAS's time for the plain product,
where our plain GEMM of the shape runs at 0.895 / 0.950. This times, in turns with cuBLAS and
our plain GEMM, the op's tree on each config the heuristic ranks (the first ``--configs``, those
whose build does not spill) and the tree with some of its sinks left out (``subtrees``: what each
store costs). A 2- or 6-deep tile-input ring measured no different from the default (2026-12-02).
Two store buffers per output (``kernels.sm90.epilogue``'s ``SUBTILE_BUFFERS = 2``, the default
before 2026-12-02) take the picked ping-pong 128 x 128 config from six A/B stages to five (its
epilogue needs 57 KB, 34 KB leave six). With one buffer claimed before the sub-tile's math the
build spilled 120 bytes and still ran faster (1.082 -> 1.067 at 1b, 1.045 -> 1.012 at 8b, same
outputs bit for bit); the epilogue now takes one buffer on ping-pong where two would leave
fewer than six stages and one buys a stage, claimed after the math (spill-free): 1.019 / 1.013
against 1.069 / 1.039 for the two-buffer ring in the same run. ``two store buffers`` times the
old ring against it, outputs checked bit-identical.

    CODA_CUTE_CACHE_DIR=0 python scripts/exp_swiglu_epilogues.py [--rounds 10] [--configs 6]
        [--also CONFIG_NAME ...] [--cluster MxN ...] [--raster G ...] [--split S ...]
        [--shape TOKENS,D,FFN ...] [--fp8-row-fast] [--forward] [--energy] [--once]

``--once`` (for ncu): instead of timing, one call each of cuBLAS's plain product, our plain GEMM,
the pick's tree and its ``--cluster`` / ``--raster`` / ``--split`` variants per shape inside the NVTX range
``gemms`` (``--nvtx --nvtx-include gemms/``).

The table gives each variant's median time over cuBLAS's median and, since one run's ratios on
an H100 moved by up to 0.11 between runs (2026-12-06), the median and quartiles of its per-round
ratios (``sol.timing.paired_ratios``): variants whose quartile ranges overlap are not told apart.

``--raster G``: the pick on raster band G (``GemmConfig.raster_group``). On an H100 (2026-12-06)
ncu read 7 GB of DRAM traffic in the bf16 SwiGLU backward on its pick (ping-pong 128 x 128 2x1,
band 8) and 5.3 GB in our plain GEMM on that tile, against 2.5 GB for cuBLAS's plain product:
the operands' rereads, not the tree's 2.35 GB, fill most of it.

``--split S``: the pick's tree as S launches over row bands of M, into one set of outputs. The
persistent slots drift apart over a launch's waves, and the concurrent tiles' operands then miss
in L2; the FP8 GEMMs read 2-3x fewer DRAM bytes cut into 4 or 8 launches (2026-12-05), in the
same time. Whether the bf16 tree, whose DRAM runs at two thirds of its peak, gains from it.

``--energy``: also cuBLAS's plain product, our plain GEMM and the pick's tree back to back for
600 ms each: joules per call, mean watts and milliseconds per call (``coda_cute.sol.energy``). A
tree whose extra time follows its extra joules at the power cap costs energy, not stalls.

``--cluster 2x2``: the pick with both operands multicast (each CTA reads a third less of a k-tile
from L2; on an H100 the FP8 gate/up forward's plain GEMM kept L2 85.9 % busy, 2026-12-05). With
``--fp8-row-fast --forward`` on an H100 (2026-12-05): 8b 2.899 ms on 2x2 against 3.162 on the
pick, 1b 0.944 against 0.933; the backward's tree spills on 2x2 (1b 2.171 against 1.740 ms).

``--fp8-row-fast``: the row-wise FP8 recipe's tree with fast accumulation instead, without h
(the recipe keeps the forward's h, ``ops.mlp_fp8``), against ``torch._scaled_mm`` with
``use_fast_accum`` of the plain product (row scales), on FP8 operands: each spill-free ranked
config, and the pick's with two store buffers (which spilled on ping-pong 128 x 128 and sent the
pick to 64 x 128 before the one-buffer rule for double-width stores).
The FP8 form, on the block-scaled configs: ``scripts/exp_block_scaled_trees.py``.

``--forward``: the gate/up projection y @ W_gu^T with the RMSNorm + SwiGLU tree instead
(``coda.norm_swiglu``: z and h stored, 1.5x the plain output's bytes), the same variants, its
subtrees z alone and h alone. With ``--fp8-row-fast`` it is the row-wise FP8 MLP's forward GEMM,
which a profiled step on an H100 (2026-12-05) measured at 2.779 ms against ``_scaled_mm`` fast's
2.473 (its down dgrad: 1.545 against 1.231).
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ["CODA_CUTE_CACHE_DIR"] = "0"

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from coda_cute import compiler, dispatch  # noqa: E402
from coda_cute import epilogue as E  # noqa: E402
from coda_cute.epilogue import runner  # noqa: E402
from coda_cute.kernels.common.config import pipeline_stages  # noqa: E402
from coda_cute.kernels.sm90 import epilogue as EPI  # noqa: E402
from coda_cute.ops.fp8_gemms import FP8, row_scaled  # noqa: E402
from coda_cute.ops.gemm import gemm_impl  # noqa: E402
from coda_cute.ops.rmsnorm import norm_inputs  # noqa: E402
from coda_cute.ops.swiglu import norm_swiglu_tree, swiglu_backward_tree  # noqa: E402
from coda_cute.sol.energy import joules_lines  # noqa: E402
from coda_cute.sol.timing import calls_in_range, interleaved_times, paired_ratios, ratio_text  # noqa: E402

#: (label, tokens, d, ffn)
SHAPES = [("1b", 16384, 2048, 8192), ("8b", 16384, 4096, 14336)]


def parse_shape(text: str) -> tuple:
    """``--shape TOKENS,D,FFN`` -> (label, tokens, d, ffn), the label ``d<D>/f<FFN>/m<TOKENS>``."""
    try:
        m, d, f = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape wants TOKENS,D,FFN (three integers), got {text!r}") from None
    return f"d{d}/f{f}/m{m}", m, d, f


def _operands(m, d, f, fp8: bool = False, forward: bool = False):
    """(a, b, the tree's inputs, N, K) of a @ b: the backward's dy (M, d) @ W_down (d, f), or with
    ``forward`` y (M, d) @ W_gu^T (d, 2f); ``fp8``: a and b's K-major copy in E4M3 (b as its
    transpose's view) with the row-wise recipe's scales among the inputs."""
    n = 2 * f if forward else f
    a = torch.randn(m, d, device="cuda").bfloat16()
    w = (torch.randn(d, n, device="cuda") / d ** 0.5).bfloat16()
    ss = torch.rand(m, 4, device="cuda") * d
    inputs = norm_inputs(d, ss, 1e-5)
    if not forward:
        inputs["z"] = torch.randn(m, 2 * f, device="cuda").bfloat16()
    if not fp8:
        return a, w, inputs, n, d
    scales = dict(scale_a=torch.rand(m, device="cuda") + 0.5, scale_b=torch.rand(n, device="cuda") / d ** 0.5)
    return a.to(FP8), w.t().contiguous().to(FP8).t(), dict(inputs, **scales), n, d


def _baseline(dy, w, inputs, fp8: bool):
    """cuBLAS's plain product: torch.mm, or ``_scaled_mm`` with the row scales and fast
    accumulation."""
    if not fp8:
        return lambda: torch.mm(dy, w)
    sa, sb = inputs["scale_a"][:, None], inputs["scale_b"][None, :]
    return lambda: torch._scaled_mm(dy, w, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True)


def subtrees(tree, forward: bool = False) -> dict:
    """The op's tree with some of its sinks left out, to see what each costs: the backward's
    without h (what keeping the forward's h would leave: dz' and zdz) and dz' alone; the
    forward's z alone and h alone."""
    keep = lambda *names: E.Epilogue(*[s for s in tree.sinks if s.name in names])  # noqa: E731
    if forward:
        return {"z alone": keep("z"), "h alone": keep("h")}
    return {"without h": keep("dz", "zdz"), "dz' alone": keep("dz")}


#: tree input kinds with one entry per row of A (sliced with it by ``split_launches``)
ROW_INPUTS = ("row_vec", "tile", "row_sum")


def split_launches(tree, config, a, b, inputs, parts: int, fp8: bool):
    """A call that runs ``tree`` on ``config`` as ``parts`` launches over consecutive row bands
    of A (and of the tree's row-vector, tile and row-sum inputs and of its outputs), into one set
    of outputs; returns them. Each launch starts its persistent slots together, so they drift
    apart over a band's waves only, not over the whole launch's. Trees whose outputs all have A's
    rows only (stores and row reductions)."""
    other = [o.name for o in tree.outputs if o.kind not in ("store", "row_reduce")]
    if other:
        raise SystemExit(f"--split: outputs {other} do not have A's rows (stores and row reductions only)")
    rows = {i.name for i in tree.inputs if i.kind in ROW_INPUTS}
    outs = E.run(tree, a, b, inputs, config=config, use_fast_accum=fp8)
    cuts = [a.shape[0] * i // parts for i in range(parts + 1)]
    bands = [(a[i:j], {k: v[i:j] if k in rows else v for k, v in inputs.items()},
              {k: v[i:j] for k, v in outs.items()}) for i, j in zip(cuts, cuts[1:])]

    def call():
        for a_i, in_i, out_i in bands:
            E.run(tree, a_i, b, in_i, config=config, use_fast_accum=fp8, outputs=out_i)
        return outs
    return call


def forced_buffers_plan(tree, dy, w, inputs, config, buffers: int, fp8: bool = False):
    """(plan of ``tree`` on ``config`` with ``buffers`` store buffers per output, compiled
    afresh, its A/B stages)."""
    EPI.SUBTILE_BUFFERS = buffers
    ab = 1 if fp8 else 2
    try:
        compiler._cache.clear()
        runner._plans.clear()
        plan = runner._make_plan(tree, dy, w, inputs, config, fp8, "exp")
        stages = pipeline_stages(config, ab, EPI.Sm90TreeEpilogue(tree, config, ab).smem_bytes())
    finally:
        EPI.SUBTILE_BUFFERS = None
        compiler._cache.clear()
        runner._plans.clear()
    return plan, stages


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--configs", type=int, default=6, help="how many of the ranked configs to time")
    ap.add_argument("--also", action="append", default=[], metavar="NAME",
                    help="a ranked config's name (e.g. coop_128x256x128_c2x1_g8_fastacc) to time as well")
    ap.add_argument("--cluster", action="append", default=[], metavar="MxN",
                    help="the pick with this cluster shape as well (e.g. 2x2), outputs checked against the pick's")
    ap.add_argument("--raster", action="append", default=[], type=int, metavar="G",
                    help="the pick with this raster band (cluster rows per L2 band) as well, outputs checked")
    ap.add_argument("--split", action="append", default=[], type=int, metavar="S",
                    help="the pick's tree as S launches over row bands of M as well, outputs checked")
    ap.add_argument("--shape", action="append", default=[], metavar="TOKENS,D,FFN", type=parse_shape,
                    help="time this MLP shape instead of the 1b and 8b ones (repeatable)")
    ap.add_argument("--fp8-row-fast", action="store_true",
                    help="the row-wise FP8 tree (the backward's without h), fast accumulation, against _scaled_mm")
    ap.add_argument("--forward", action="store_true", help="the gate/up GEMM's RMSNorm + SwiGLU tree instead")
    ap.add_argument("--once", action="store_true",
                    help="for ncu: one call each of cuBLAS, our plain GEMM and the pick per shape, no timing")
    ap.add_argument("--energy", action="store_true",
                    help="also joules per call of cuBLAS, our plain GEMM and the pick, back to back (module docstring)")
    args = ap.parse_args()
    console = Console(width=150)
    sms = dispatch.num_sms(torch.device("cuda"))
    fp8, fwd = args.fp8_row_fast, args.forward
    tree = norm_swiglu_tree() if fwd else swiglu_backward_tree(recompute_h=not fp8)
    if fp8:
        tree = row_scaled(tree)
    what = "SwiGLU forward (gate/up + epilogue): time / cuBLAS plain y @ W_gu^T" if fwd else \
        "SwiGLU backward (dgrad + epilogue): time / cuBLAS plain dy @ W_down"
    table = Table(title=what)
    for col in ("shape", "variant", "ms", "/ cuBLAS", "per round [quartiles]"):
        table.add_column(col, justify="right")
    for label, m, d, f in args.shape or SHAPES:
        a, b, inputs, n, k = _operands(m, d, f, fp8, fwd)
        run = lambda t, c: E.run(t, a, b, inputs, config=c, use_fast_accum=fp8)  # noqa: E731
        pick = runner.choose_config(tree, m, n, k, 1, fp8, fp8, sms)
        every = runner.ranked_configs(tree, m, n, k, 1, fp8, fp8, sms)
        unknown = set(args.also) - {c.name for c in every}
        if unknown:
            raise SystemExit(f"--also: no ranked config named {sorted(unknown)}")
        ranked = [c for c in every if not runner.spills(tree, c, fp8, sms)][: args.configs]
        ranked += [c for c in every if c.name in args.also and c not in ranked]
        fns = {"cublas": _baseline(a, b, inputs, fp8)}
        fns["plain"] = (lambda: gemm_impl(a, b, inputs["scale_a"][:, None], inputs["scale_b"][None, :],
                                          torch.bfloat16, True)) if fp8 else (lambda: gemm_impl(a, b))
        for c in ranked:
            fns[c.name + (" (pick)" if c == pick else "")] = lambda c=c: run(tree, c)
        picks = [name for name in fns if name.endswith(" (pick)")]
        around = [pick.with_(cluster_m=int(cm), cluster_n=int(cn))
                  for cm, cn in (shape.split("x") for shape in args.cluster)]
        around += [pick.with_(raster_group=g) for g in args.raster]
        variants = {c.name: lambda c=c: run(tree, c) for c in around}
        variants.update({f"{pick.name} in {parts} launches along M":
                         split_launches(tree, pick, a, b, inputs, parts, fp8) for parts in args.split})
        want = run(tree, pick) if variants else {}
        for name, fn in variants.items():
            got = fn()
            same = all(torch.equal(got[x], want[x]) for x in want)
            console.log(f"{label} {name}: outputs {'bit-identical to' if same else 'DIFFER from'} the pick's")
        fns.update(variants)
        if args.once:
            calls_in_range({name: fns[name] for name in ("cublas", "plain", *picks, *variants)},
                           log=lambda name: console.log(f"{label} {m}x{n}x{k}: {name}"))
            continue
        plan, stages = forced_buffers_plan(tree, a, b, inputs, pick, 2, fp8)
        fns[f"two store buffers, {stages} stages ({pick.name})"] = lambda p=plan: p.launch(a, b, inputs)
        got, want = plan.launch(a, b, inputs), run(tree, pick)
        same = all(torch.equal(got[name], want[name]) for name in want)
        console.log(f"{label} two store buffers: outputs {'bit-identical to' if same else 'DIFFER from'} the op's")
        # the backward's FP8 tree has no h already: its subtrees are the forward's alone
        for name, variant in ({} if fp8 and not fwd else subtrees(tree, fwd)).items():
            own = runner.choose_config(variant, m, n, k, 1, fp8, fp8, sms)
            for c in dict.fromkeys([own, pick]):  # its own pick, and the full tree's
                fns[f"{name} ({c.name})"] = lambda v=variant, c=c: run(v, c)
        times = interleaved_times(fns, rounds=args.rounds, settle_ms=300)
        t = {name: statistics.median(v) for name, v in times.items()}
        paired = paired_ratios(times, "cublas")
        for name, ms in t.items():
            table.add_row(f"{label} {m}x{n}x{k}", name, f"{ms:.3f}", f"{ms / t['cublas']:.3f}",
                          ratio_text(paired[name]))
            console.log(f"{label} {name}: {ms / t['cublas']:.3f} (per round {ratio_text(paired[name])})")
        for line in joules_lines(fns, t, ["cublas", "plain", *picks], run_ms=600) if args.energy else ():
            console.log(f"{label} {line}")
    if not args.once:
        console.print(table)


if __name__ == "__main__":
    main()
