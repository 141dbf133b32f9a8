"""Experiment: FP8 two-level accumulation in 64-row waves on cooperative 256 x 128 tiles.

Promoted (two-level) FP8 GEMMs keep a temporary next to the fp32 accumulator, and a whole second
accumulator fits the registers only up to 128 x 128 tiles (64 + 64, or 64 x 3 in pairs), while
fast accumulation runs 128 x 256 and 256 x 128. Cooperative 256 x 128 can promote instead in
waves (``GemmConfig.promotion_waves``, ``kernels.sm90.mainloop``): each warpgroup issues a k-tile
one 64-row WGMMA atom at a time into a temporary one atom tall (128 + 64 registers) and promotes
it before the next, the other warpgroup's wave keeping the tensor cores busy meanwhile; nothing
is issued ahead of the epilogue. The dispatch tables have no rate for it yet, so no heuristic
picks it; this measures what it is worth.

Part 1, the GEMMs of the FP8 MLP sublayer (d 4096, ffn 14336, 16384 tokens; ``bench_fp8.py``'s
six shapes), all in turns, TFLOP/s:

* row-wise scales, bf16 out: ``torch._scaled_mm`` promoted and with fast accumulation, our
  heuristic's two-level config, our 256 x 128 in waves, our fast-accumulation pick;
* block scales (1 x 128 activations; on the weight-gradient shapes both operands 1 x 128 along
  the tokens, fp32 out): the heuristic's config and 256 x 128 in waves.

Every one of ours is checked first against float64 on its first 256 rows (relative error logged).

Part 2 (``--mlp``): ``coda.mlp_block_fp8`` forward + backward in the two promoted recipes
(row-wise, and block-scaled), each as the heuristic picks today and with 256 x 128 in waves given
rates from part 1 (its median ratio to the pick, per form, times the pick's table rate), in turns
(each variant on its own launch plans).

    python scripts/exp_wave_promotion.py [--rounds 10] [--mlp] [--mlp-rounds 10]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
from rich.console import Console
from rich.table import Table

from bench_fp8 import EPS, coda_step, mlp_case, mlp_gemms
from coda_cute import dispatch
from coda_cute import epilogue as E
from coda_cute import reference as R
from coda_cute.epilogue import runner
from coda_cute.kernels.common.config import GemmConfig
from coda_cute.kernels.epilogue.plain import gemm_tree
from coda_cute.nn.llama import embedding_norm_stats
from coda_cute.ops.gemm import gemm_impl
from coda_cute.precision import block_scales_m_major
from coda_cute.sol.timing import interleaved_medians

WAVES = GemmConfig(256, 128, 128, "cooperative", 2, 1)
FP8 = torch.float8_e4m3fn


def _key(cfg: GemmConfig) -> tuple:
    return (cfg.schedule, cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n)


def _rel(out, want) -> float:
    return float((out.double() - want).norm() / want.norm())


def row_case(m, n, k, console, sms):
    """{label: fn} of the row-wise GEMMs at (m, n, k), ours checked; and the heuristic's pick."""
    x, w = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
    sa = x.abs().amax(1, keepdim=True) / 448.0
    sw = w.abs().amax(1, keepdim=True) / 448.0
    a, b = (x / sa).to(FP8), (w / sw).to(FP8).t()
    sb = sw.t().contiguous()
    pick = dispatch.select_config(m, n, k, 1, True, False, sms)
    fast = dispatch.select_config(m, n, k, 1, True, True, sms)
    fns = {
        "_scaled_mm": lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16),
        "_scaled_mm fast": lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                    use_fast_accum=True),
        "pick": lambda: gemm_impl(a, b, sa, sb, config=pick),
        "waves": lambda: gemm_impl(a, b, sa, sb, config=WAVES.with_(split_tail=True)),
        "fast pick": lambda: gemm_impl(a, b, sa, sb, use_fast_accum=True, config=fast),
    }
    want = (a[:256].double() * sa[:256].double()) @ (b.double() * sb.double())
    for name in ("pick", "waves", "fast pick"):
        console.log(f"row {m}x{n}x{k} {name}: rel err {_rel(fns[name]()[:256], want):.2e}")
    return fns, pick


def block_case(m, n, k, wgrad: bool, console, sms):
    """{label: fn} of the block-scaled GEMM at (m, n, k) (``wgrad``: the weight-gradient form),
    ours checked; and the heuristic's pick."""
    b_block = (1, 128) if wgrad else (128, 128)
    tree = gemm_tree("none", "none", "float32" if wgrad else "bfloat16")
    a_q, sa = R.quantize_blocks_ref(torch.randn(m, k, device="cuda"), (1, 128))
    b_q, sb = R.quantize_blocks_ref(torch.randn(n, k, device="cuda"), b_block)
    if wgrad:
        scales = tuple(block_scales_m_major(*q.shape, "cuda").copy_(s) for q, s in ((a_q, sa), (b_q, sb)))
    else:
        scales = (sa.t().contiguous().t(), sb)  # M-major activation scales, as the ops pass them
    form = "1x128" if wgrad else "128x128"
    pick = runner.choose_config(tree, m, n, k, 1, True, False, sms, True, wgrad)
    fns = {name: (lambda c=c: E.run(tree, a_q, b_q.t(), {}, config=c, block_scales=scales, b_block=form)["out"])
           for name, c in (("pick", pick), ("waves", WAVES))}
    want = R.block_scaled_gemm_ref(a_q[:256], sa[:256], (1, 128), b_q, sb, b_block, out_dtype=torch.float64)
    for name in fns:
        console.log(f"block {'wgrad ' if wgrad else ''}{m}x{n}x{k} {name}: rel err {_rel(fns[name]()[:256], want):.2e}")
    return fns, pick


def gemms(console, rounds, tokens, d, f) -> dict:
    """Part 1; returns {form: [waves / pick ratios]} (forms "row", "block", "wgrad")."""
    sms = dispatch.num_sms(torch.device("cuda"))
    ratios = {"row": [], "block": [], "wgrad": []}
    table = Table(title=f"FP8 MLP GEMMs (d {d}, ffn {f}, {tokens} tokens), TFLOP/s in turns")
    for col in ("M x N x K", "role", "_scaled_mm", "_scaled_mm fast", "row pick", "row waves", "row fast pick",
                "block pick", "block waves", "row waves / pick", "block waves / pick"):
        table.add_column(col, justify="right")
    for m, k, n, role in mlp_gemms(tokens, d, f):
        row_fns, row_pick = row_case(m, n, k, console, sms)
        wgrad = role == "wgrad"
        block_fns, block_pick = block_case(m, n, k, wgrad, console, sms)
        fns = {**{f"row {x}": fn for x, fn in row_fns.items()}, **{f"block {x}": fn for x, fn in block_fns.items()}}
        ms = interleaved_medians(fns, rounds=rounds, settle_ms=500)
        tf = {name: 2 * m * n * k / v / 1e9 for name, v in ms.items()}
        r_row, r_block = tf["row waves"] / tf["row pick"], tf["block waves"] / tf["block pick"]
        ratios["row"].append(r_row)
        ratios["wgrad" if wgrad else "block"].append(r_block)
        console.log(f"{m}x{n}x{k} {role}: row pick {row_pick.name}, block pick {block_pick.name}")
        table.add_row(f"{m} x {n} x {k}", role, *(f"{tf[c]:.0f}" for c in (
            "row _scaled_mm", "row _scaled_mm fast", "row pick", "row waves", "row fast pick", "block pick",
            "block waves")), f"{r_row:.3f}", f"{r_block:.3f}")
    console.print(table)
    return ratios


def with_plans_and_rates(step, rates: list):
    """``step`` on launch plans of its own, with ``rates`` ((dispatch table, {key: rate}) pairs)
    patched into the tables while it runs (restored after)."""
    plans = {}

    def run():
        saved_plans, saved = runner._plans, [dict(table) for table, _ in rates]
        runner._plans = plans
        for table, patch in rates:
            table.update(patch)
        try:
            step()
        finally:
            runner._plans = saved_plans
            for (table, _), before in zip(rates, saved):
                table.clear()
                table.update(before)
    return run


def mlp(console, rounds, tokens, d, f, ratios: dict):
    """Part 2: the FP8 MLP's promoted recipes with and without 256 x 128 in waves."""
    key = _key(WAVES)
    fwd = statistics.median(ratios["row"] + ratios["block"])
    wg = statistics.median(ratios["wgrad"]) if ratios["wgrad"] else fwd
    fwd_rate = fwd * dispatch._RATES_FP8[("cooperative", 128, 128, 2, 1)]
    wgrad_rate = wg * dispatch._RATES_FP8_WGRAD[("cooperative", 128, 128, 1, 1)]
    console.log(f"rates given to {key}: {fwd_rate:.0f} (median ratio {fwd:.3f} to the picks), "
                f"{wgrad_rate:.0f} in the weight-gradient form ({wg:.3f})")
    y, w_gu, w_down, dy2 = mlp_case(tokens, d, f)
    ss = embedding_norm_stats(y)
    row_op = functools.partial(torch.ops.coda.mlp_block_fp8, row_scaling=True)
    rates = [(dispatch._RATES_FP8, {key: fwd_rate}), (dispatch._RATES_FP8_WGRAD, {key: wgrad_rate})]
    fns = {}
    for label, op in (("row-wise", row_op), ("block", torch.ops.coda.mlp_block_fp8)):
        fns[label] = with_plans_and_rates(coda_step(op, y, ss, w_gu, w_down, dy2, EPS), [])
        fns[f"{label}, waves"] = with_plans_and_rates(coda_step(op, y, ss, w_gu, w_down, dy2, EPS), rates)
    for fn in fns.values():
        fn()
    ms = interleaved_medians(fns, rounds=rounds, settle_ms=2000)
    t = Table(title=f"FP8 MLP sublayer forward + backward (d {d}, ffn {f}, {tokens} tokens), median ms in turns")
    for col in ("variant", "ms", "/ today's"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    for name, v in ms.items():
        base = ms[name.split(",")[0]]
        t.add_row(name, f"{v:.3f}", f"{v / base:.3f}")
    console.print(t)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--mlp", action="store_true", help="also part 2, the FP8 MLP sublayer")
    ap.add_argument("--mlp-rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    args = ap.parse_args()
    console = Console(width=170)
    if not torch.cuda.is_available():
        console.print("[red]exp_wave_promotion needs a CUDA GPU[/]")
        return 2
    ratios = gemms(console, args.rounds, args.tokens, args.dim, args.ffn)
    if args.mlp:
        mlp(console, args.mlp_rounds, args.tokens, args.dim, args.ffn, ratios)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
