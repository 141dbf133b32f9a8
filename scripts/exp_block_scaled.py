"""Experiment: where the block-scaled FP8 GEMM (``coda.gemm_blockwise``) loses to row-wise FP8.

Measured first (H200, 16384 x N x K, bf16 out, ``scripts/bench_fp8_gemm.py``): the block-scaled
GEMM at 0.56-0.68 of our row-wise FP8 GEMM and 0.63-0.73 of ``torch._scaled_mm``'s block-wise
kernel. A reading of 1005 TFLOP/s for the weight-gradient form then did not reproduce (385 the
next session; likely a binary of the disk cache's key collision, since fixed). The kernels
promote k-tiles in groups (``kernels.common.config.PROMOTION_GROUP``, per form); each k-tile's
scales come with its stage by TMA (``kernels.sm90.block_scales``). Variants, each compiled afresh (no disk
cache) and timed in turns with our row-wise FP8 GEMM and torch's block-wise one on the same
operands:

* ``paired``: k-tiles promoted in pairs;
* ``single``: one promotion per k-tile (the ping-pong weight-gradient form's loop);
* ``group 3``, ``group 4``: k-tiles promoted in software-pipelined groups of 3 or 4 instead of
  pairs (one wait for the tensor cores per group);
* ``row paired``, ``row group 4``: our row-wise FP8 GEMM (two-level) with pairs and with groups of 4;
* with ``--stages``: ``paired`` and our row-wise GEMM each with one A/B stage fewer than they
  get (the scales' shared memory costs the block-scaled 128 x 128 bf16-out kernel its sixth
  stage; the row-wise one keeps six): how much one stage is worth to each; and ``paired 64x1``:
  the epilogue in 64-column sub-tiles through one store buffer (``kernels.sm90.epilogue``'s
  ``WIDE_SUB_TILES`` / ``SUBTILE_BUFFERS``), whose freed shared memory buys a stage back. With
  ``--wgrad``, ``paired 64x1`` only;
* with ``--clusters 2x2 1x2 ...`` (forward form): the kernel as built (its promotion group,
  ``PROMOTION_GROUP["block"]``) on its pick and on those clusters (the scales still load per
  CTA), next to our row-wise GEMM and torch's block-wise kernel only. On the row-wise FP8 gate/up
  forward (an H100, 2026-12-05) 2x2 cut L2-bound time by 8 %; on this kernel in pairs (an H100,
  2026-12-06) it cost 10-12 %. torch's block-wise kernel runs 1x2 (ncu, 2026-12-06: the A tile
  multicast along N, six stages) and moved 20 % fewer DRAM bytes than the pick at K = 14336.
* with ``--poll``: the kernel as built with its mainloop's stage waits turned the other way
  (``GemmConfig.poll_full``: polling ``mbarrier.try_wait`` or sleeping between polls; the forward
  form's picks poll, the weight-gradient form's sleep), as ``--clusters``' variants are; with
  ``--wgrad``, the pick so turned;
* with ``--around SPEC ...`` (forward form): the kernel as built on its pick changed by each
  SPEC, space-separated tokens: ``MxN`` (cluster), ``poll`` / ``sleep`` (``poll_full``), ``gN``
  (raster band), ``one-buffer`` (the epilogue in 64-column sub-tiles through one buffer, the
  shared memory it frees going to A/B stages), ``carry`` / ``no-carry``
  (``GemmConfig.tail_carry``, which the pick has under ``runner.TAIL_CARRY`` where K allows:
  each tile's last promotion group takes its last 3 k-tiles and the next tile's first, issued
  before the epilogue, instead of 3 single promotions and the next tile's first issued alone),
  ``late-release`` (a k-tile's stage freed after its promotion, not before:
  ``mainloop.RELEASE_BEFORE_PROMOTION`` off),
  e.g. ``--around "1x2" "g16" "one-buffer" carry``;
* with ``--energy`` (forward form): torch's block-wise kernel and each variant of ours back to
  back for 600 ms: joules per call, mean watts, milliseconds per call (``coda_cute.sol.energy``):
  whether a variant's time in turns follows its power;
* with ``--shapes M,N,K ...`` (forward form): those shapes instead of the three 8B ones. At
  16384 x 28672 (an H100, 2026-12-07, ``gpu_session.sh block-k``) the kernel as built ran 1136 /
  1141 / 1114 TFLOP/s at K = 2048 / 4096 / 8192 against torch's 1077 / 1146 / 1116 (1.064x /
  0.996x / 0.998x with 1x2's 1145 at K = 2048): no per-tile cost that a longer k-loop hides;
  torch's kernel is at its best at K = 4096, ours about level;
* with ``--kernels`` (forward form): only the cuBLAS kernels torch's block-wise and row-wise
  ``_scaled_mm`` launch at each shape (torch.profiler), nothing of ours;
* with ``--once [M,N,K]`` (for ncu): one call each of our row-wise GEMM, ``coda.gemm_blockwise``
  and torch's block-wise and row-wise kernels at that shape (default the last, K = 14336),
  inside the NVTX range ``gemms``, after one untimed call each outside it.

The weight-gradient form (``--wgrad``; dW = dY^T X over 16384 tokens at the Llama-3-8B weight
shapes, fp32 out): promotion in pairs, groups of 3 or 4, or one k-tile at a time, the scales as
our quantizers lay them out (``precision.block_scales_m_major``, which its kernel reads in place), against cuBLAS
bf16 on the same product, our row-wise FP8 GEMM and torch's block-wise 1x128 x 128x1 (the kernel
torchao's block-wise training uses for dW; bf16 out) where torch takes it, the pick with bf16 out
(as the FP8 MLP writes its weight gradients, and like for like with torch's), and every other
block-scaled config (a log line per shape).

    CODA_CUTE_CACHE_DIR=0 python scripts/exp_block_scaled.py [--rounds 20] [--wgrad] [--stages] [--clusters 2x2 1x2]
        [--poll] [--around "1x2 sleep" g16 one-buffer] [--energy] [--shapes M,N,K ...] [--once [M,N,K]]
"""

from __future__ import annotations

import argparse
import contextlib
import os

os.environ["CODA_CUTE_CACHE_DIR"] = "0"

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from coda_cute import compiler, dispatch  # noqa: E402
from coda_cute import epilogue as E  # noqa: E402
from coda_cute import reference as R  # noqa: E402
from coda_cute.epilogue import runner  # noqa: E402
from coda_cute.kernels.common.config import (PROMOTION_GROUP, block_scale_stage_bytes,  # noqa: E402
                                             pipeline_stages, promotion_form, tail_carry_rule)
from coda_cute.kernels.epilogue.plain import gemm_tree  # noqa: E402
from coda_cute.ops.gemm import gemm_impl  # noqa: E402
from coda_cute.kernels.sm90 import epilogue as EPI  # noqa: E402
from coda_cute.kernels.sm90 import gemm as G  # noqa: E402
from coda_cute.kernels.sm90 import mainloop as ML  # noqa: E402
from coda_cute.precision import block_scales_m_major  # noqa: E402
from coda_cute.sol.energy import joules_lines  # noqa: E402
from coda_cute.sol.timing import calls_in_range, interleaved_medians  # noqa: E402

SHAPES = [(16384, 6144, 4096), (16384, 28672, 4096), (16384, 4096, 14336)]
#: (N_out, N_in, tokens) of the weight gradients: QKV, gate/up, down at the 8B-like widths, then
#: at the 1B-like ones (d 2048, ffn 8192), where no config was tuned
WGRAD_SHAPES = [(6144, 4096, 16384), (28672, 4096, 16384), (4096, 14336, 16384),
                (3072, 2048, 16384), (16384, 2048, 16384), (2048, 8192, 16384)]


#: {name: (whether a second temporary may pair k-tiles, k-tiles per promotion group)}. Groups of 3
#: and 4 (``config.PROMOTION_GROUP``) build spill-free and unserialized for both block-scaled
#: forms in today's kernel (2026-12-03; they spilled when pairs were chosen); a group waits for the
#: tensor cores once, at its last promotion, so larger groups drain a warpgroup's WGMMAs less often
#: (in pairs, after every second k-tile).
VARIANTS = {"paired": (True, 2), "single": (False, 2), "group 3": (True, 3), "group 4": (True, 4)}
#: the row-wise GEMM's variants timed next to them (its promotion group is its own; its groups of 4
#: spill and serialize the WGMMAs)
ROW_VARIANTS = ("paired", "group 4")


def _variant_plan(name, tree, a, b, config, scales, b_rows=False, inputs=None):
    """``_fresh_plan`` under variant ``name``'s module switches, restored afterwards; the form
    (``config.PROMOTION_GROUP``'s key) is the wgrad form's with ``b_rows``, else the
    block-scaled one's, else (no ``scales``) the row-wise one's."""
    paired, group = VARIANTS[name]
    form = promotion_form(scales is not None, b_rows)
    max_acc, before = G.MAX_ACC_REGISTERS, PROMOTION_GROUP[form]
    G.MAX_ACC_REGISTERS = max_acc if paired else 0  # 0: no room for a second temporary
    PROMOTION_GROUP[form] = group
    try:
        if not paired or tail_carry_rule(config, a.shape[1], True, scales is not None, b_rows) is not None:
            config = config.with_(tail_carry=False)  # no groups, or a group this K's k-tiles do not fill
        return _fresh_plan(tree, a, b, config, scales, b_rows, inputs)
    finally:
        G.MAX_ACC_REGISTERS, PROMOTION_GROUP[form] = max_acc, before


def _fresh_plan(tree, a, b, config, scales, b_rows=False, inputs=None):
    """A launch plan compiled afresh (the module switches just changed)."""
    compiler._cache.clear()
    runner._plans.clear()
    return runner._make_plan(tree, a, b, inputs or {}, config, False, "exp", scales, b_rows)


def one_buffer_plan(tree, a, b, config, scales, b_rows=False):
    """(plan, its A/B stages) with the epilogue in 64-column sub-tiles through one buffer."""
    widths = EPI.WIDE_SUB_TILES
    EPI.WIDE_SUB_TILES, EPI.SUBTILE_BUFFERS = (64,), 1
    try:
        plan = _fresh_plan(tree, a, b, config, scales, b_rows)
        epi = EPI.Sm90TreeEpilogue(tree, config, 1)
        stages = pipeline_stages(config, 1, epi.smem_bytes(), block_scale_stage_bytes(config, b_rows))
    finally:
        EPI.WIDE_SUB_TILES, EPI.SUBTILE_BUFFERS = widths, None
    return plan, stages


#: ``--around``'s tokens that turn a kernel module switch off for the variant's build
SWITCHES = {"late-release": (ML, "RELEASE_BEFORE_PROMOTION")}


@contextlib.contextmanager
def switched_off(spec: str):
    """``spec``'s :data:`SWITCHES` off while a variant is built (and traced), restored after."""
    turned = [SWITCHES[tok] for tok in spec.split() if tok in SWITCHES]
    before = [getattr(mod, name) for mod, name in turned]
    for mod, name in turned:
        setattr(mod, name, False)
    try:
        yield
    finally:
        for (mod, name), value in zip(turned, before):
            setattr(mod, name, value)


def _around(cfg, spec: str):
    """(the config ``spec`` makes of ``cfg``, whether its epilogue takes one 64-column buffer):
    ``--around``'s tokens, in the module docstring (:data:`SWITCHES`' are :func:`switched_off`'s)."""
    one_buffer = False
    for tok in spec.split():
        if tok in SWITCHES:
            continue
        if tok in ("poll", "sleep"):
            cfg = cfg.with_(poll_full=tok == "poll")
        elif tok == "one-buffer":
            one_buffer = True
        elif tok in ("carry", "no-carry"):
            cfg = cfg.with_(tail_carry=tok == "carry")
        elif tok[0] == "g" and tok[1:].isdigit():
            cfg = cfg.with_(raster_group=int(tok[1:]))
        elif len(tok.split("x")) == 2 and all(x.isdigit() for x in tok.split("x")):
            cm, cn = (int(x) for x in tok.split("x"))
            cfg = cfg.with_(cluster_m=cm, cluster_n=cn)
        else:
            raise SystemExit(f"--around: {tok!r} in {spec!r} is none of MxN, poll, sleep, gN, one-buffer, "
                             f"carry, no-carry, {', '.join(SWITCHES)}")
    return cfg, one_buffer


def wgrad(console, rounds, stages=False, poll=False):
    """The weight-gradient form's variants (module docstring), TFLOP/s."""
    tree, tree16 = gemm_tree("none", "none", "float32"), gemm_tree("none", "none", "bfloat16")
    sms = dispatch.num_sms(torch.device("cuda"))
    names = list(VARIANTS) + (["paired 64x1"] if stages else [])
    table = Table(title="block-scaled FP8 weight-gradient form (E4M3, 1x128 x 1x128 along the tokens, fp32 out), TFLOP/s")
    for col in ["N_out x N_in x tokens", "config", "cuBLAS bf16", "ours row", "torch block", *names, "best / bf16",
                "best / torch block", "pick bf16 out", "bf16 out / torch block"]:
        table.add_column(col, justify="right")
    for m, n, k in WGRAD_SHAPES:
        dy, x = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
        a_q, sa = R.quantize_blocks_ref(dy, (1, 128))
        b_q, sb = R.quantize_blocks_ref(x, (1, 128))
        scales = tuple(block_scales_m_major(*q.shape, "cuda").copy_(s) for q, s in ((a_q, sa), (b_q, sb)))
        a16, b16 = dy.bfloat16(), x.bfloat16().t()
        ra = a_q.float().abs().amax(-1, keepdim=True) / 448.0
        rb = b_q.float().abs().amax(-1, keepdim=True).t().contiguous() / 448.0
        fns = {"cuBLAS bf16": lambda: torch.mm(a16, b16),  # bf16 out
               "ours row": lambda: torch.ops.coda.gemm(a_q, b_q.t(), ra, rb, torch.float32)}
        # torch's block-wise 1x128 x 128x1 (what torchao's block-wise training calls for dW): A's
        # scales M-major, B's (K / 128, N) row-major; bf16 out (its block-wise path has no fp32)
        ta, tb = sa.t().contiguous().t(), sb.t().contiguous()
        try:
            torch._scaled_mm(a_q, b_q.t(), scale_a=ta, scale_b=tb, out_dtype=torch.bfloat16)
            fns["torch block"] = lambda: torch._scaled_mm(a_q, b_q.t(), scale_a=ta, scale_b=tb,
                                                          out_dtype=torch.bfloat16)
        except (RuntimeError, ValueError) as e:
            console.log(f"wgrad {m}x{n}x{k}: torch's block-wise 1x128 x 128x1 refused: {e}")
        base = runner.choose_config(tree, m, n, k, 1, True, False, sms, True, True)
        want = R.block_scaled_gemm_ref(a_q[:256], sa[:256], (1, 128), b_q, sb, (1, 128), torch.float64)
        for name in VARIANTS:
            plan = _variant_plan(name, tree, a_q, b_q.t(), base, scales, True)
            fns[name] = lambda p=plan: p.launch(a_q, b_q.t(), {}, None, scales)
            err = (fns[name]()["out"][:256].double() - want).norm() / want.norm()
            console.log(f"wgrad {m}x{n}x{k} {name}: config {plan.config.name}, rel err {float(err):.2e} (first 256 rows)")
        others = [c for c in dispatch.block_scaled_config_space(True) if c.tile_m == 128 or c.tile_n == 128]
        if poll:  # the pick with its stage waits turned the other way
            others.append(base.with_(poll_full=not base.poll_full))
        for c in others:  # the other schedules and clusters: ping-pong overlaps one warpgroup's
            if c == base:  # promotion arithmetic with the other's WGMMAs
                continue
            fns[c.name] = lambda c=c: E.run(tree, a_q, b_q.t(), {}, config=c, block_scales=scales, b_block="1x128")
            err = (fns[c.name]()["out"][:256].double() - want).norm() / want.norm()
            console.log(f"wgrad {m}x{n}x{k} {c.name}: rel err {float(err):.2e} (first 256 rows)")
        # the pick with bf16 out, as the FP8 MLP's weight gradients and torch's block-wise kernel
        # write them (fp32 out writes twice the bytes): the like-for-like comparison
        base16 = runner.choose_config(tree16, m, n, k, 1, True, False, sms, True, True)
        fns["pick bf16 out"] = lambda: E.run(tree16, a_q, b_q.t(), {}, config=base16, block_scales=scales,
                                             b_block="1x128")
        err = (fns["pick bf16 out"]()["out"][:256].double() - want).norm() / want.norm()
        console.log(f"wgrad {m}x{n}x{k} pick bf16 out: config {base16.name}, rel err {float(err):.2e} (first 256 rows)")
        if stages:
            plan, n_stages = one_buffer_plan(tree, a_q, b_q.t(), base, scales, True)
            fns["paired 64x1"] = lambda p=plan: p.launch(a_q, b_q.t(), {}, None, scales)
            err = (fns["paired 64x1"]()["out"][:256].double() - want).norm() / want.norm()
            console.log(f"wgrad {m}x{n}x{k} paired 64x1: {n_stages} A/B stages, rel err {float(err):.2e}")
        ms = interleaved_medians(fns, rounds=rounds, settle_ms=500)
        tf = {name: 2 * m * n * k / v / 1e9 for name, v in ms.items()}
        best = max(tf[name] for name in names)
        tb_tf = tf.get("torch block")
        console.log(f"wgrad {m}x{n}x{k} every config: " + ", ".join(
            f"{c.name} {tf[c.name]:.0f}" for c in others if c.name in tf) + f"; {base.name} (pick) {tf['paired']:.0f}")
        table.add_row(f"{m} x {n} x {k}", base.name, f"{tf['cuBLAS bf16']:.0f}", f"{tf['ours row']:.0f}",
                      "-" if tb_tf is None else f"{tb_tf:.0f}", *(f"{tf[name]:.0f}" for name in names),
                      f"{best / tf['cuBLAS bf16']:.3f}", "-" if tb_tf is None else f"{best / tb_tf:.3f}",
                      f"{tf['pick bf16 out']:.0f}", "-" if tb_tf is None else f"{tf['pick bf16 out'] / tb_tf:.3f}")
    console.print(table)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--wgrad", action="store_true", help="the weight-gradient form's variants instead")
    ap.add_argument("--stages", action="store_true", help="also one A/B stage fewer, block-scaled and row-wise")
    ap.add_argument("--clusters", nargs="+", default=[], metavar="MxN",
                    help="forward form: the kernel as built on its pick and on these clusters (no other variant)")
    ap.add_argument("--poll", action="store_true",
                    help="also the kernel as built with its stage waits turned the other way (GemmConfig.poll_full: "
                         "polling or sleeping; forward form: with --clusters' variants, no other; --wgrad: the pick)")
    ap.add_argument("--around", nargs="+", default=[], metavar="SPEC",
                    help="forward form: the kernel as built on its pick changed by each SPEC (module docstring)")
    ap.add_argument("--energy", action="store_true",
                    help="forward form: also joules, watts and ms per call of torch's kernel and ours, back to back")
    ap.add_argument("--shapes", nargs="+", metavar="M,N,K", default=[",".join(map(str, x)) for x in SHAPES],
                    help="forward form: these shapes instead of the three 8B ones (at one N, several K "
                         "split a tile's fixed cost from its k-loop's)")
    ap.add_argument("--kernels", action="store_true",
                    help="forward form: only the kernels torch's block-wise and row-wise _scaled_mm launch at "
                         "each shape, with their GPU times (torch.profiler): which cuBLAS kernel each shape gets")
    ap.add_argument("--once", nargs="?", const=",".join(map(str, SHAPES[-1])), metavar="M,N,K",
                    help="one call of each GEMM at this shape (default the last), for ncu")
    args = ap.parse_args()
    console = Console(width=160)
    if args.wgrad:
        return wgrad(console, args.rounds, args.stages, args.poll)
    if args.once:
        return once(*(int(x) for x in args.once.split(",")))
    if args.kernels:
        return torch_kernels(console, args.shapes)
    tree, rtree = gemm_tree("none", "none", "bfloat16"), gemm_tree("row", "row", "bfloat16")
    sms = dispatch.num_sms(torch.device("cuda"))
    table = Table(title="block-scaled FP8 GEMM variants (E4M3, bf16 out), TFLOP/s")
    built = next(n for n, (paired, group) in VARIANTS.items() if paired and group == PROMOTION_GROUP["block"])
    polls = dispatch.block_scaled_config_space()[0].poll_full  # how the forward form's picks wait
    around = [*args.clusters, *(["sleep" if polls else "poll"] if args.poll else []), *args.around]
    names = [built, *(f"{built} {c}" for c in around)] if around else list(VARIANTS)
    row_variants = () if around else ROW_VARIANTS
    for col in ["M x N x K", "config", "ours row", *(f"row {v}" for v in row_variants), "torch block", *names,
                "best / torch"]:
        table.add_column(col, justify="right")
    for m, n, k in (tuple(int(x) for x in spec.split(",")) for spec in args.shapes):
        a_q, sa, b_q, sb, ra, rb = operands(m, n, k)
        fns = {"ours row": lambda: torch.ops.coda.gemm(a_q, b_q.t(), ra, rb),
               "torch block": lambda: torch._scaled_mm(a_q, b_q.t(), scale_a=sa, scale_b=sb.t(),
                                                      out_dtype=torch.bfloat16)}
        base = runner.choose_config(tree, m, n, k, 1, True, False, sms, True)
        if args.stages:
            fewer = _fewer_stages(tree, rtree, base, runner.choose_config(rtree, m, n, k, 1, True, False, sms))
            block_plan = _fresh_plan(tree, a_q, b_q.t(), fewer["block"], (sa, sb))
            fns[f"block s{fewer['block'].stages}"] = lambda p=block_plan: p.launch(a_q, b_q.t(), {}, None, (sa, sb))
            fns[f"row s{fewer['row'].stages}"] = lambda c=fewer["row"]: gemm_impl(a_q, b_q.t(), ra, rb, config=c)
            one_plan, n_stages = one_buffer_plan(tree, a_q, b_q.t(), base, (sa, sb))
            fns[f"block 64x1 s{n_stages}"] = lambda p=one_plan: p.launch(a_q, b_q.t(), {}, None, (sa, sb))
            want = R.block_scaled_gemm_ref(a_q[:256], sa[:256], (1, 128), b_q, sb, (128, 128), torch.float64)
            err = (fns[f"block 64x1 s{n_stages}"]()["out"][:256].double() - want).norm() / want.norm()
            console.log(f"{m}x{n}x{k} block 64x1: {n_stages} A/B stages, rel err {float(err):.2e} (first 256 rows)")
        row_cfg = runner.choose_config(rtree, m, n, k, 1, True, False, sms)
        row_in = {"scale_a": ra.reshape(-1), "scale_b": rb.reshape(-1)}
        for name in row_variants:  # the row-wise GEMM's pairs against its groups of 4
            plan = _variant_plan(name, rtree, a_q, b_q.t(), row_cfg, None, inputs=row_in)
            fns[f"row {name}"] = lambda p=plan: p.launch(a_q, b_q.t(), row_in)
        for name in names:
            variant, cfg, one_buffer, spec = name, base, False, ""
            if name != built and around:  # "<built> <spec>"
                variant, spec = built, name[len(built) + 1:]
                cfg, one_buffer = _around(base, spec)
            with switched_off(spec):
                plan = one_buffer_plan(tree, a_q, b_q.t(), cfg, (sa, sb))[0] if one_buffer else \
                    _variant_plan(variant, tree, a_q, b_q.t(), cfg, (sa, sb))
            fns[name] = lambda p=plan: p.launch(a_q, b_q.t(), {}, None, (sa, sb))
            want = R.block_scaled_gemm_ref(a_q[:256], sa[:256], (1, 128), b_q, sb, (128, 128), torch.float64)
            err = (fns[name]()["out"][:256].double() - want).norm() / want.norm()
            console.log(f"{m}x{n}x{k} {name}: config {plan.config.name}, rel err {float(err):.2e} (first 256 rows)")
        ms = interleaved_medians(fns, rounds=args.rounds, settle_ms=500)
        tf = {name: 2 * m * n * k / v / 1e9 for name, v in ms.items()}
        best = max(tf[name] for name in names)
        table.add_row(f"{m} x {n} x {k}", base.name, f"{tf['ours row']:.0f}",
                      *(f"{tf[f'row {v}']:.0f}" for v in row_variants), f"{tf['torch block']:.0f}",
                      *(f"{tf[name]:.0f}" for name in names), f"{best / tf['torch block']:.3f}")
        for line in joules_lines(fns, ms, ["torch block", *names], run_ms=600) if args.energy else ():
            console.log(f"{m}x{n}x{k} {line}")
        if args.stages:
            console.log(f"{m}x{n}x{k} one stage fewer: " + ", ".join(
                f"{name} {tf[name]:.0f}" for name in tf if " s" in name))
    console.print(table)


def operands(m, n, k):
    """(A, its 1 x 128 scales M-major as the ops pass them, B, its 128 x 128 scales, A's and B's
    row-wise scales) of a random E4M3 product."""
    a_q, sa = R.quantize_blocks_ref(torch.randn(m, k, device="cuda"), (1, 128))
    b_q, sb = R.quantize_blocks_ref(torch.randn(n, k, device="cuda"), (128, 128))
    ra = a_q.float().abs().amax(-1, keepdim=True) / 448.0
    rb = b_q.float().abs().amax(-1, keepdim=True).t().contiguous() / 448.0
    return a_q, sa.t().contiguous().t(), b_q, sb, ra, rb


def once(m, n, k):
    """One call each of our row-wise GEMM, the block-scaled op, torch's block-wise kernel and its
    row-wise one, inside the NVTX range ``gemms`` (ncu: ``--nvtx --nvtx-include gemms/``)."""
    a_q, sa, b_q, sb, ra, rb = operands(m, n, k)
    calls_in_range({"ours row": lambda: torch.ops.coda.gemm(a_q, b_q.t(), ra, rb),
                    "ours block": lambda: torch.ops.coda.gemm_blockwise(a_q, sa, b_q, sb),
                    "torch block": lambda: torch._scaled_mm(a_q, b_q.t(), scale_a=sa, scale_b=sb.t(),
                                                            out_dtype=torch.bfloat16),
                    "torch row": lambda: torch._scaled_mm(a_q, b_q.t(), scale_a=ra, scale_b=rb,
                                                          out_dtype=torch.bfloat16)})


def torch_kernels(console, shapes):
    """The kernels one call of torch's block-wise and row-wise ``_scaled_mm`` launches at each
    of ``shapes``. On an H100 (2026-12-07) the block-wise one was ``nvjet_sm90_qqtst_128x128_
    128x6_1x2_..._Ablk128_Bvec128_TNN`` at all six shapes of ``gpu_session.sh release``: its
    higher rate at 16384 x 28672 x 4096 than at 16384 x 6144 x 4096 is one kernel's, not a pick's."""
    from bench_fp8 import print_profile

    for spec in shapes:
        m, n, k = (int(x) for x in spec.split(","))
        a_q, sa, b_q, sb, ra, rb = operands(m, n, k)
        print_profile(lambda: torch._scaled_mm(a_q, b_q.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16),
                      console, f"torch block {m}x{n}x{k}")
        print_profile(lambda: torch._scaled_mm(a_q, b_q.t(), scale_a=ra, scale_b=rb, out_dtype=torch.bfloat16),
                      console, f"torch row {m}x{n}x{k}")


def _fewer_stages(tree, rtree, block_cfg, row_cfg) -> dict:
    """The block-scaled and row-wise configs with one A/B stage fewer than the kernels pick."""
    block = pipeline_stages(block_cfg, 1, runner.tree_smem_bytes(tree, block_cfg, 1),
                            block_scale_stage_bytes(block_cfg, False))
    row = pipeline_stages(row_cfg, 1, runner.tree_smem_bytes(rtree, row_cfg, 1))
    return {"block": block_cfg.with_(stages=block - 1), "row": row_cfg.with_(stages=row - 1)}


if __name__ == "__main__":
    main()
