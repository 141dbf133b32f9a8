"""Experiment: which block-scaled config runs the FP8 sublayers' epilogue trees with tile inputs
fastest (the heuristic's cooperative-versus-ping-pong charge, ``runner.COOP_TILE_INPUT_COST``).

The block-scaled kernel's configs are cooperative 128 x 128 (rate 1204 TFLOP/s on the plain
GEMM) and ping-pong 64 x 128 (817), each with a 2x1 or 1x1 cluster. A cooperative CTA runs its
epilogue with the tensor cores idle, ping-pong overlaps one warpgroup's epilogue with the
other's mainloop. For each tree ``coda.mlp_block_fp8`` runs with a tile input (the SwiGLU
backward in the down-proj dgrad: the wide tile z; the norm backward in the gate/up dgrad: y and
dres; the residual in the down-proj forward: the residual) and each shape, on real FP8 operands
(1 x 128 activation blocks, 128 x 128 weight blocks), timed in turns with the plain product on
``torch._scaled_mm`` row-wise: the heuristic's first four block-scaled configs (those whose
build does not spill), and which it picks. Shapes: the 1B- and 8B-like MLPs at 16384 tokens and a d 8192 one at 8192
tokens (not among those the heuristic was set on).

    python scripts/exp_block_scaled_trees.py [--rounds 10]
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

from coda_cute import dispatch
from coda_cute import epilogue as E
from coda_cute.elementwise_fp8 import quantize_rows, quantize_weight
from coda_cute.epilogue import runner
from coda_cute.epilogue.block_scales import tma_block_scales
from coda_cute.ops.residual import residual_norm_stats_tree
from coda_cute.ops.rmsnorm import norm_backward_tree, norm_inputs
from coda_cute.ops.swiglu import swiglu_backward_tree
from coda_cute.sol.timing import interleaved_medians

FP8 = torch.float8_e4m3fn
#: (label, tokens, d, ffn)
SHAPES = [("1b", 16384, 2048, 8192), ("8b", 16384, 4096, 14336), ("d8192", 8192, 8192, 28672)]


def _bf16(*shape):
    return torch.randn(*shape, device="cuda").bfloat16()


def cases(m, d, f):
    """(name, tree, (a rows, N, K), inputs, the weight as nn.Linear holds it, whether the GEMM is
    its dgrad) of each tree."""
    ss = torch.rand(m, 4, device="cuda") * d
    norm = norm_inputs(d, ss, 1e-5)
    zdz = torch.randn(m, -(-2 * f // 128), device="cuda")
    return [("swiglu backward (down dgrad)", swiglu_backward_tree(), (m, f, d), dict(norm, z=_bf16(m, 2 * f)),
             (_bf16(d, f) / d ** 0.5), True),
            ("norm backward (gate/up dgrad)", norm_backward_tree(True), (m, d, 2 * f),
             dict(norm, zdz=zdz, y=_bf16(m, d), dres=_bf16(m, d)), (_bf16(2 * f, d) / f ** 0.5), True),
            ("residual (down forward)", residual_norm_stats_tree(), (m, d, f), {"residual": _bf16(m, d)},
             (_bf16(d, f) / f ** 0.5), False)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    console = Console(width=160)
    sms = dispatch.num_sms(torch.device("cuda"))
    table = Table(title="block-scaled FP8 trees with tile inputs: time / torch._scaled_mm row-wise plain product")
    for col in ("shape", "tree", "M x N x K", "config", "ms", "/ _scaled_mm"):
        table.add_column(col, justify="left" if col in ("tree", "config") else "right")
    for label, m, d, f in SHAPES:
        for name, tree, (rows, n, k), inputs, w, transposed in cases(m, d, f):
            a_q, a_s = quantize_rows(_bf16(rows, k), FP8)
            a_s = tma_block_scales(a_s, True)
            # the GEMM's B (K, N), K-major (column-major for _scaled_mm): W.T for a forward, the
            # FP8 transpose's .t() for a dgrad (as ops.fp8_gemms.project takes them)
            w_q, w_s, w_qt = quantize_weight(w, None, FP8, transposed=True)
            b, b_s = (w_qt.t(), w_s.t()) if transposed else (w_q.t(), w_s)
            one_a, one_b = torch.ones(rows, 1, device="cuda"), torch.ones(1, n, device="cuda")
            fns = {"_scaled_mm": lambda a=a_q, b=b, sa=one_a, sb=one_b: torch._scaled_mm(
                a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)}
            pick = runner.choose_config(tree, rows, n, k, 1, True, False, sms, True)
            for c in runner.ranked_configs(tree, rows, n, k, 1, True, False, sms, True)[:4]:
                if runner.spills(tree, c, True, sms, True):
                    continue
                fns[c.name + (" (pick)" if c == pick else "")] = (
                    lambda c=c, tree=tree, a=a_q, b=b, ins=inputs, s=(a_s, b_s):
                    E.run(tree, a, b, ins, config=c, block_scales=s))
            t = interleaved_medians(fns, rounds=args.rounds, settle_ms=300)
            for cname, ms in t.items():
                table.add_row(label, name, f"{rows}x{n}x{k}", cname, f"{ms:.3f}", f"{ms / t['_scaled_mm']:.3f}")
                console.log(f"{label} {name} {cname}: {ms:.3f} ms, {ms / t['_scaled_mm']:.3f}")
    console.print(table)


if __name__ == "__main__":
    main()
