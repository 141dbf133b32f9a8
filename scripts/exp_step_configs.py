"""Experiment: the CODA training step under GEMM config policies, timed in turns, with joules per step.

During a training step the H200 sits at its 700 W power cap, so a step's time follows its energy
(``coda_cute.sol.energy``). The heuristic's rates (``dispatch._RATES_16``) were measured one GEMM at
a time. This times the whole step of ``scripts/bench_train.py``'s CODA model (2 layers, 4 x 4096
tokens) with every 16-bit GEMM forced onto one config, where that config holds the GEMM's epilogue
without spilling (else the heuristic's pick stays), against the heuristic's own picks: the step
medians in turns (``interleaved_medians``), then each policy's joules per step back to back.

Policies (``--policies``, default all):

* ``heuristic``: the heuristic's pick for every GEMM;
* ``coop 128x256 2x1``: the cooperative 128 x 256 tile, the config that loads the fewest operand
  bytes per FLOP (``dispatch.l2_intensity``) and reads the fewest shared-memory bytes per WGMMA
  FLOP (64 x 256 per warpgroup);
* ``pingpong 128x128 2x1``: the heuristic's large-GEMM pick while its rates were measured from a cool
  GPU (before 2026-12-04), everywhere;
* ``lm head coop 128x256 2x1``: the cooperative 128 x 256 tile for the LM head's GEMMs only (an
  extent equal to the vocabulary), about half of the step's FLOPs;
* ``coop 128x256 2x1 for K >= 4096``: the cooperative tile where the k-loop is long enough to
  hide its epilogue, which cooperative warpgroups run after their mainloop with the tensor cores
  idle (ping-pong overlaps it with the other warpgroup's mainloop).

    python scripts/exp_step_configs.py [--config 8b] [--rounds 6] [--policies heuristic ...]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_models as TM  # noqa: E402  (the benchmark models of scripts/bench_train.py)

from coda_cute import dispatch  # noqa: E402
from coda_cute import epilogue as E  # noqa: E402
from coda_cute.epilogue import runner  # noqa: E402
from coda_cute.kernels.common.config import GemmConfig  # noqa: E402
from coda_cute.nn.llama import CodaLlama, LlamaConfig  # noqa: E402
from coda_cute.sol.energy import joules_over_run  # noqa: E402
from coda_cute.sol.timing import interleaved_medians  # noqa: E402

COOP_256 = GemmConfig(128, 256, 64, "cooperative", 2, 1)
PINGPONG_128 = GemmConfig(128, 128, 64, "pingpong", 2, 1)
#: {name: (forced config or None, whether it applies to the LM head's GEMMs only, the least K it
#: applies to)}
POLICIES = {"heuristic": (None, False, 0), "coop 128x256 2x1": (COOP_256, False, 0),
            "pingpong 128x128 2x1": (PINGPONG_128, False, 0), "lm head coop 128x256 2x1": (COOP_256, True, 0),
            "coop 128x256 2x1 for K >= 4096": (COOP_256, False, 4096)}


@contextlib.contextmanager
def policy(name: str, vocab: int, forced: dict):
    """Inside: ``E.run`` calls without a config take policy ``name``'s config where it fits (no
    FP8, the epilogue's shared memory fits, no spills) and the launch takes it; ``forced`` maps
    each GEMM shape to the config it ran on or to why it kept the heuristic's (a caller that
    preallocated per-tile outputs for the heuristic's tile width refuses another width)."""
    cfg, lm_only, min_k = POLICIES[name]
    plain = E.run
    sms = dispatch.num_sms(torch.device("cuda"))

    def run(tree, a, b, inputs, *, config=None, **kw):
        if cfg is not None and config is None and a.dtype in (torch.bfloat16, torch.float16) \
                and "block_scales" not in kw:
            m, n, k = a.shape[-2], b.shape[-1], a.shape[-1]
            if (not lm_only or vocab in (m, n, k)) and k >= min_k and runner.fits(tree, cfg, 2) \
                    and not runner.spills(tree, cfg, False, sms):
                try:
                    out = plain(tree, a, b, inputs, config=cfg, **kw)
                    forced[(m, n, k)] = cfg.name
                    return out
                except (ValueError, TypeError) as exc:
                    forced[(m, n, k)] = f"kept: {str(exc)[:60]}"
        return plain(tree, a, b, inputs, config=config, **kw)

    E.run = run
    try:
        yield
    finally:
        E.run = plain


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="8b", choices=sorted(TM.SPECS))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("exp_step_configs needs a CUDA GPU")
    console = Console(width=160)
    spec = TM.SPECS[args.config]
    torch.manual_seed(0)
    model = CodaLlama(LlamaConfig(**spec.coda_kwargs(args.layers)), device="cuda")
    tokens = TM.random_tokens(4, 4096, spec.vocab_size).cuda()
    base = TM.coda_step(model, tokens, TM.shift_labels(tokens), list(model.parameters()))
    forced = {name: {} for name in args.policies}

    def step_of(name):
        def step():
            with policy(name, spec.vocab_size, forced[name]):
                return base()
        return step

    steps = {name: step_of(name) for name in args.policies}
    losses = {name: float(fn()) for name, fn in steps.items()}  # builds every policy's kernels
    for name in args.policies:
        took = sum(1 for v in forced[name].values() if not v.startswith("kept"))
        console.log(f"{name}: loss {losses[name]:.5f}, {took} of {len(forced[name])} GEMM shapes on its config")
        for shape, what in forced[name].items():
            if what.startswith("kept"):
                console.log(f"  {shape}: {what}")
    ms = interleaved_medians(steps, rounds=args.rounds, warmup=1, settle_ms=1000)
    joules = {name: joules_over_run(fn, ms[name]) for name, fn in steps.items()}
    t = Table(title=f"{args.config}: CODA step ({args.layers} layers, 4 x 4096 tokens) under GEMM config policies")
    for col in ("policy", "step ms (in turns)", "/ heuristic", "J / step", "W", "GEMM shapes forced"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    ref = ms.get("heuristic")
    for name in args.policies:
        e = joules[name]
        t.add_row(name, f"{ms[name]:.2f}", f"{ms[name] / ref:.3f}" if ref else "-",
                  "-" if e is None else f"{e['j_per_call']:.1f}", "-" if e is None else f"{e['watts']:.0f}",
                  str(sum(1 for v in forced[name].values() if not v.startswith("kept"))))
    console.print(t)


if __name__ == "__main__":
    main()
