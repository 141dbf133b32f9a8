"""``coda-cute train``: a small Llama trained twice on a corpus every machine has, as plain HF and
through ``apply_coda``, from the same initialization and data order.

    coda-cute train                      # the default config on one GPU (python -m coda_cute.train)
    coda-cute train --compile            # the HF run under torch.compile
    coda-cute train --cuda-graphs        # every run's forward + backward replayed from a CUDA graph
    coda-cute train --tiny               # a few steps on the CPU (coda_cute.reference_on_cpu)
    torchrun --nproc_per_node 2 -m coda_cute.train --fsdp    # FSDP2 (or --ddp) over 2 GPUs

Data: the Python standard library's own source files (``*.py`` under ``sysconfig``'s stdlib
path, sorted), read at run time, as byte tokens (vocabulary 256). Every ``1 / val_fraction``-th
file is held out for validation, so both splits sample the whole library (the last bytes in
path order, ``unittest`` to ``zoneinfo``, made a validation set unlike the training data, on
which runs that differed only in the GPU's nondeterminism ended up to 3 % apart). Each
optimizer step draws ``micro_batch x accum`` windows of ``seq + 1`` bytes at offsets from a
generator seeded with ``data_seed``, so runs with one seed see the same data in the same order.
The validation loss is the mean over ``eval_batches`` fixed windows every ``eval_every`` steps;
the last one covers the whole validation split in consecutive windows (at most
``final_eval_tokens``) and is the run's ``final_val_loss``. Under torchrun (``--fsdp`` /
``--ddp``, :mod:`coda_cute.parallel`)
``--micro-batch`` is per rank and each rank trains on its rows of every micro-batch.

Training: an HF ``LlamaForCausalLM`` in fp32 master weights, ``torch.autocast`` to bf16,
AdamW (betas 0.9 / 0.95, weight decay on matrices), gradient accumulation, linear warm-up then a
cosine decay to ``min_lr_ratio`` of the peak, gradient clipping at 1. The runs:

* ``hf``: the plain HF model (``--compile``: under ``torch.compile``);
* ``hf_seed2``: the same with the data-order seed + 1, the spread two plain runs differ by;
* ``coda``: ``apply_coda`` on a copy of the same initial weights;
* ``coda_fp8`` (``--precision fp8``): ``apply_coda(model, precision="fp8")``, the decoder layers'
  GEMMs in block-scaled FP8 (``--fp8-lm-head``: the LM head's too; ``--pow2-scales``: power-of-two
  scales; ``--row-scaling``: the row-wise recipe instead, ``--fast-accum forward|all`` with its
  GEMMs of those roles accumulating in the tensor core), against the bf16 ``coda`` run on the
  same data.

Output: a rich progress bar (loss, tokens/s), a table (tokens/s, step ms, peak memory, final train
and validation loss per run), a JSON log of every step and a PNG of the loss curves
(``--out``, default ``train_out/``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import math
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from .argtypes import positive_int
from . import parallel
from .parallel import Ranks, no_sync_needed
from .precision import FAST_ACCUM, Fp8Recipe

PRECISIONS = ("bf16", "fp8")
#: steps left out of the timing: the first ones compile kernels and warm the allocator
WARM_STEPS = 5
#: the progress bar's loss is read from the device every this many steps
PROGRESS_EVERY = 10


@dataclass(frozen=True)
class TrainConfig:
    dim: int = 1024
    layers: int = 8
    heads: int = 16
    kv_heads: int = 4
    ffn: int = 2816
    seq: int = 1024
    micro_batch: int = 8
    accum: int = 1  # 8,192 tokens a step: 0.83 passes over the train split, so no run sees a window twice
    steps: int = 1000
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    eval_every: int = 100
    eval_batches: int = 8
    final_eval_tokens: int = 4_000_000
    val_fraction: float = 0.05
    seed: int = 0
    data_seed: int = 0
    precision: str = "bf16"
    fp8_lm_head: bool = False  # with precision "fp8": the coda_fp8 run's LM head in FP8 too
    pow2_scales: bool = False  # with precision "fp8": the coda_fp8 run's scales powers of two
    row_scaling: bool = False  # with precision "fp8": the coda_fp8 run in the row-wise recipe
    fast_accum: str = "none"  # with row_scaling: Fp8Recipe.fast_accum
    world: int = 1  # ranks; micro_batch is per rank

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.world * self.accum * self.seq


TINY = TrainConfig(dim=64, layers=2, heads=4, kv_heads=2, ffn=128, seq=64, micro_batch=2, accum=2,
                   steps=6, warmup=2, eval_every=3, eval_batches=2, final_eval_tokens=2048, val_fraction=0.25,
                   lr=3e-3)


# -- data ---------------------------------------------------------------------------------------------
def corpus_files(root: str | None = None) -> list[Path]:
    """The standard library's ``*.py`` files, sorted (site-packages and test suites left out)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
    return sorted(p for p in base.rglob("*.py") if not skip & set(p.relative_to(base).parts[:-1]))


def corpus_split(val_fraction: float, root: str | None = None,
                 limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) byte tokens (uint8): the corpus files in order, each followed by a
    newline, every ``round(1 / val_fraction)``-th of them (the last of each run of that many) in
    validation and the others in train; ``limit``: read files until this many bytes (both
    splits together), the last file cut there."""
    every = max(2, round(1 / val_fraction))
    parts: tuple[list, list] = ([], [])
    total = 0
    for i, path in enumerate(corpus_files(root)):
        data = (path.read_bytes() + b"\n")[: None if limit is None else limit - total]
        parts[i % every == every - 1].append(data)
        total += len(data)
        if limit is not None and total >= limit:
            break
    train, val = (b"".join(p) for p in parts)
    if not train or not val:
        raise RuntimeError("coda-cute train: found too few Python source files under the standard library "
                           f"for a train and a validation split ({total} bytes)")
    return tuple(torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in (train, val))


def windows(data: torch.Tensor, n: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """n windows of seq + 1 tokens at random offsets (int64, (n, seq + 1))."""
    starts = torch.randint(0, len(data) - seq - 1, (n,), generator=gen)
    return torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long()


def consecutive_windows(data: torch.Tensor, seq: int, limit_tokens: int) -> torch.Tensor:
    """The windows of seq + 1 tokens that tile ``data`` from its start, seq apart (every token
    but the first predicted once), at most ``limit_tokens // seq`` of them (int64)."""
    n = min((len(data) - 1) // seq, max(1, limit_tokens // seq))
    return data[: n * seq + 1].long().unfold(0, seq + 1, seq)


def step_windows(data: torch.Tensor, cfg: TrainConfig, gen: torch.Generator) -> torch.Tensor:
    """One optimizer step's windows, (accum, micro_batch x world, seq + 1), drawn in one call:
    the same sequences for every split of them into ranks and micro-batches."""
    rows = cfg.micro_batch * cfg.world
    return windows(data, cfg.accum * rows, cfg.seq, gen).view(cfg.accum, rows, cfg.seq + 1)


# -- model and schedule --------------------------------------------------------------------------------
def build_model(cfg: TrainConfig):
    """An HF Llama in fp32 (master weights), byte vocabulary, seeded initialization."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(vocab_size=256, hidden_size=cfg.dim, intermediate_size=cfg.ffn,
                     num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                     num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.seq,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                     tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(hf).float()


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then a cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup - 1)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def optimizer(model, cfg: TrainConfig, device: torch.device, fused: bool = True):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95),
                             fused=fused and device.type == "cuda")


# -- one run ---------------------------------------------------------------------------------------------
def train_run(label: str, model, forward, cfg: TrainConfig, data_seed: int, train, val, device,
              progress=None, cuda_graphs: bool = False, ranks: Ranks = Ranks(), sync=no_sync_needed) -> dict:
    """Train ``model`` (``forward(ids, labels)`` -> loss) for ``cfg.steps`` optimizer steps;
    returns the run's log and summary. ``cuda_graphs``: the micro-batches' forward and backward
    replay from one CUDA graph (:class:`GraphedGradients`). ``ranks``, ``sync``: this rank and
    the context of each micro-batch (:mod:`coda_cute.parallel`); losses are means over the ranks."""
    # fused AdamW over FSDP2's DTensor shards is left out: foreach is the path FSDP2 documents
    opt = optimizer(model, cfg, device, fused=ranks.mode != "fsdp")
    gen = torch.Generator().manual_seed(data_seed)
    val_gen = torch.Generator().manual_seed(12345)  # one validation set for every run
    val_batches = [ranks.rows(windows(val, cfg.micro_batch * cfg.world, cfg.seq, val_gen))
                   for _ in range(cfg.eval_batches)]
    rows = cfg.micro_batch * cfg.world  # the whole split, for the last evaluation (rows per rank alike)
    whole = consecutive_windows(val, cfg.seq, cfg.final_eval_tokens)
    whole_batches = [ranks.rows(b) for b in whole[: len(whole) // rows * rows].split(rows)] or val_batches
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    steps, evals, losses, norms = [], [], [], []
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    task = progress.add_task(label, total=cfg.steps) if progress else None
    grads, label = gradients(label, model, forward, cfg, device, train, cuda_graphs, progress)
    grads.sync = sync
    clock = StepClock(cuda)
    wall = time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        clock.start()
        batches = ranks.rows(step_windows(train, cfg, gen), dim=1)
        step_loss = ranks.mean(grads(batches.to(device, non_blocking=True)))
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        grads.zero_grad()
        clock.stop()
        losses.append(step_loss)
        steps.append({"step": step, "lr": lr_at(step, cfg)})
        if step + 1 == cfg.steps:
            evals.append({"step": step, "val_loss": evaluate(forward, whole_batches, device, autocast, ranks),
                          "tokens": sum(b.numel() - len(b) for b in whole_batches) * cfg.world})
        elif (step + 1) % cfg.eval_every == 0:
            evals.append({"step": step, "val_loss": evaluate(forward, val_batches, device, autocast, ranks)})
        if progress:  # the description reads a device value (a sync): every PROGRESS_EVERY steps
            text = None
            if step % PROGRESS_EVERY == 0:
                value = float(step_loss)  # waits for the step: the wall clock below includes it
                rate = (step + 1) * cfg.tokens_per_step / (time.perf_counter() - wall)
                text = f"{label}: loss {value:.3f}, {rate:,.0f} tok/s (wall, with evaluation)"
            progress.update(task, advance=1, **({"description": text} if text else {}))
    ms = clock.milliseconds()
    for row, loss, norm, t in zip(steps, losses, norms, ms):
        row["loss"], row["grad_norm"], row["ms"] = float(loss), float(norm), t
    timed = ms[WARM_STEPS:] if len(ms) > WARM_STEPS else ms[-1:]
    return {"label": label, "steps": steps, "evals": evals,
            "tokens_per_s": cfg.tokens_per_step * len(timed) / sum(timed) * 1e3,
            "step_ms": sum(timed) / len(timed),
            "peak_gib": ranks.max(torch.cuda.max_memory_allocated(device) / 2**30, device) if cuda else None,
            "final_train_loss": sum(s["loss"] for s in steps[-10:]) / len(steps[-10:]),
            "final_val_loss": evals[-1]["val_loss"]}


def gradients(label, model, forward, cfg, device, train, cuda_graphs: bool, progress):
    """(:class:`GraphedGradients` and the label + "+graph", or where the capture fails, e.g. a
    host readback in the model, :class:`Gradients` and the label, the failure printed)."""
    if cuda_graphs:
        try:
            return GraphedGradients(model, forward, cfg, device, train), label + "+graph"
        except RuntimeError as e:
            model.zero_grad(set_to_none=True)
            say = progress.console.print if progress else print
            say(f"{label}: CUDA graph capture failed ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                "this run trains eagerly")
    return Gradients(model, forward, cfg, device, train), label


class Gradients:
    """One optimizer step's gradients: forward and backward of each micro-batch (bf16 autocast),
    the gradients accumulated in the parameters' ``.grad``; returns the mean loss (a device value,
    not read back)."""

    autocast_cache = True
    #: ``sync(last)``: the context of each micro-batch (gradients reduced across ranks on the last)
    sync = staticmethod(no_sync_needed)

    def __init__(self, model, forward, cfg: TrainConfig, device, train):
        self.model, self.forward, self.cfg, self.device = model, forward, cfg, device

    def __call__(self, batches: torch.Tensor) -> torch.Tensor:
        step_loss = torch.zeros((), device=self.device)
        for i, batch in enumerate(batches):
            with self.sync(i == len(batches) - 1):
                with torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=self.autocast_cache):
                    loss = self.forward(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
                (loss / self.cfg.accum).backward()
            step_loss += loss.detach() / self.cfg.accum
        return step_loss

    def zero_grad(self):
        self.model.zero_grad(set_to_none=True)


class GraphedGradients(Gradients):
    """:class:`Gradients` captured once as one CUDA graph over all micro-batches and replayed on
    each step's data (copied into the graph's input buffer): no host work per kernel. The
    gradients become the graph's own tensors, which each replay overwrites (so they are never
    zeroed or freed between steps); autocast runs without its weight cache, which a capture
    cannot hold. The warm-up before the capture draws its batches from a generator of its own,
    so the run sees the same data as an eager one."""

    autocast_cache = False

    def __init__(self, model, forward, cfg: TrainConfig, device, train):
        super().__init__(model, forward, cfg, device, train)
        gen = torch.Generator().manual_seed(2**31 - 1)
        self.batches = step_windows(train, cfg, gen).to(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # compiles kernels and warms the allocator off the capture
            for _ in range(2):
                super().__call__(self.batches)
        torch.cuda.current_stream(device).wait_stream(side)
        model.zero_grad(set_to_none=True)  # the first backward in the graph allocates .grad
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = super().__call__(self.batches)

    def __call__(self, batches: torch.Tensor) -> torch.Tensor:
        self.batches.copy_(batches)
        self.graph.replay()
        return self.loss.clone()  # the next replay overwrites it

    def zero_grad(self):
        pass


class StepClock:
    """Per-step times without stalling the GPU: CUDA events recorded around each step, read once
    at the end (wall clock on the CPU)."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []

    def start(self):
        self.marks.append([self._now(), None])

    def stop(self):
        self.marks[-1][1] = self._now()

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def milliseconds(self) -> list:
        if not self.cuda:
            return [(b - a) * 1e3 for a, b in self.marks]
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in self.marks]


@torch.no_grad()
def evaluate(forward, batches, device, autocast, ranks: Ranks = Ranks()) -> float:
    total = torch.zeros((), device=device)
    for batch in batches:
        batch = batch.to(device)
        with autocast:
            total += forward(batch[:, :-1].contiguous(), batch[:, 1:].contiguous()).float()
    return float(ranks.mean(total)) / len(batches)


def hf_forward(model):
    """The loss through HF's forward contract. The windows hold the next tokens explicitly, so
    they go in as ``shift_labels`` (HF's loss uses them instead of shifting ``labels``; every
    position is trained)."""
    return lambda ids, nxt: model(input_ids=ids, labels=nxt, shift_labels=nxt).loss


# -- the command --------------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    d = TrainConfig()
    p.add_argument("--tiny", action="store_true", help="a few steps of a tiny model on the CPU (reference path)")
    p.add_argument("--compile", action="store_true", help="torch.compile the plain HF runs")
    p.add_argument("--steps", type=positive_int, help=f"optimizer steps (default {d.steps}; --tiny {TINY.steps})")
    p.add_argument("--micro-batch", type=positive_int,
                   help=f"sequences per micro-batch and rank (default {d.micro_batch}; --tiny {TINY.micro_batch})")
    p.add_argument("--accum", type=positive_int,
                   help=f"micro-batches per optimizer step (default {d.accum}; --tiny {TINY.accum})")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16",
                   help="fp8: also train the CODA model with its decoder layers' GEMMs in FP8 (coda_fp8), "
                        "next to the bf16 one")
    p.add_argument("--fp8-lm-head", action="store_true",
                   help="with --precision fp8: the coda_fp8 run's LM head in FP8 too (Fp8Recipe(lm_head_fp8=True))")
    p.add_argument("--pow2-scales", action="store_true",
                   help="with --precision fp8: the coda_fp8 run's scales rounded up to powers of two "
                        "(Fp8Recipe(pow2_scales=True))")
    p.add_argument("--row-scaling", action="store_true",
                   help="with --precision fp8: the coda_fp8 run in the row-wise recipe, one scale per whole "
                        "row along K of every GEMM operand (Fp8Recipe(scaling='row'))")
    p.add_argument("--fast-accum", choices=FAST_ACCUM, default="none",
                   help="with --row-scaling: which of the coda_fp8 run's GEMMs accumulate in the tensor core "
                        "for the whole k-loop (Fp8Recipe(fast_accum=...); forward: torchao's default)")
    p.add_argument("--no-spread", action="store_true", help="skip the second plain-HF run (data seed + 1)")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="train every run this many times (same seed; the GPU's nondeterminism alone moves "
                        "a run's final validation loss by a few %%) and compare their means")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="every run replays its micro-batches' forward and backward from one CUDA graph")
    p.add_argument("--out", default="train_out", help="folder for train_log.json and loss_curves.png")
    par = p.add_mutually_exclusive_group()
    par.add_argument("--fsdp", action="store_true", help="FSDP2 over the ranks torchrun starts (coda_cute.parallel)")
    par.add_argument("--ddp", action="store_true", help="DDP over the ranks torchrun starts")


def run(args) -> int:
    from rich.console import Console

    console = Console()
    try:
        ranks = parallel.from_env("fsdp" if args.fsdp else "ddp" if args.ddp else None)
    except ValueError as e:
        console.print(f"[red]{e}[/]")
        return 2
    cfg = TINY if args.tiny else TrainConfig()
    if args.steps is not None:
        cfg = replace(cfg, steps=args.steps, eval_every=min(cfg.eval_every, args.steps))
    for flag in ("fp8_lm_head", "pow2_scales", "row_scaling"):
        if getattr(args, flag) and args.precision != "fp8":
            console.print(f"[red]coda-cute train: --{flag.replace('_', '-')} goes with --precision fp8[/]")
            return 2
    if args.fast_accum != "none" and not args.row_scaling:
        console.print("[red]coda-cute train: --fast-accum goes with --precision fp8 --row-scaling (block scales "
                      "are promoted per k-block)[/]")
        return 2
    if args.fp8_lm_head and args.row_scaling:
        console.print("[red]coda-cute train: the FP8 LM head runs the block recipe; drop --fp8-lm-head or "
                      "--row-scaling[/]")
        return 2
    cfg = replace(cfg, precision=args.precision, fp8_lm_head=args.fp8_lm_head, pow2_scales=args.pow2_scales,
                  row_scaling=args.row_scaling, fast_accum=args.fast_accum, world=ranks.world,
                  micro_batch=args.micro_batch or cfg.micro_batch, accum=args.accum or cfg.accum)
    if args.cuda_graphs and (args.tiny or ranks.mode):
        console.print("[red]coda-cute train: --cuda-graphs needs a CUDA GPU and one process; "
                      f"{'--tiny runs on the CPU' if args.tiny else f'--{ranks.mode} runs several'}[/]")
        return 2
    if not args.tiny and not torch.cuda.is_available():
        console.print("[red]coda-cute train needs a CUDA GPU (or --tiny for the CPU reference path)[/]")
        return 2
    device = parallel.start(ranks, cpu=args.tiny)
    try:
        rc = _train_all(args, cfg, ranks, device, Console(quiet=not ranks.main))
    except BaseException:
        parallel.stop(ranks, together=False)
        raise
    parallel.stop(ranks)
    return rc


def _train_all(args, cfg: TrainConfig, ranks: Ranks, device, console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from . import reference_on_cpu
    from .nn import apply_coda

    train, val = corpus_split(cfg.val_fraction, limit=200_000 if args.tiny else None)
    spread = "" if ranks.mode is None else f", {ranks.mode} over {ranks.world} ranks"
    console.print(f"corpus: {len(corpus_files())} stdlib files, {(len(train) + len(val)) / 1e6:.2f} M byte tokens "
                  f"({len(train) / 1e6:.2f} M train, {len(val) / 1e6:.2f} M validation: every "
                  f"{max(2, round(1 / cfg.val_fraction))}th file); {cfg.steps} steps "
                  f"of {cfg.tokens_per_step:,} tokens, model d {cfg.dim} x {cfg.layers} layers{spread}")
    base = build_model(cfg)
    runs = [("hf", cfg.data_seed, None)] + ([] if args.no_spread else [("hf_seed2", cfg.data_seed + 1, None)])
    runs.append(("coda", cfg.data_seed, "bf16"))
    if cfg.precision == "fp8":
        runs.append(("coda_fp8", cfg.data_seed, Fp8Recipe(scaling="row" if cfg.row_scaling else "block",
                                                          lm_head_fp8=cfg.fp8_lm_head, pow2_scales=cfg.pow2_scales,
                                                          fast_accum=cfg.fast_accum)))
    results = []
    mode = reference_on_cpu() if args.tiny else contextlib.nullcontext()
    with mode, Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, disable=not ranks.main) as progress:
        for (label, seed, coda), repeat in itertools.product(runs, range(args.repeats)):
            model = copy.deepcopy(base).to(device)
            if coda:
                model = apply_coda(model, precision=coda)
            target, sync = parallel.wrap(model, ranks, device, compile_model=args.compile and not coda)
            label += ("+compile" if args.compile and not coda else "") + (f"+{ranks.mode}" if ranks.mode else "")
            label += f" #{repeat + 1}" if args.repeats > 1 else ""
            results.append(train_run(label, model, hf_forward(target), cfg, seed, train, val, device,
                                     progress if ranks.main else None, args.cuda_graphs, ranks, sync))
            del model, target
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if not ranks.main:
        return 0
    head = ((" (LM head too)" if cfg.fp8_lm_head else "") + (", power-of-two scales" if cfg.pow2_scales else "")
            + (", row-wise scales" if cfg.row_scaling else "")
            + (f", fast accumulation ({cfg.fast_accum})" if cfg.fast_accum != "none" else ""))
    t = Table(title=f"coda-cute train: {cfg.steps} steps x {cfg.tokens_per_step:,} tokens, {cfg.precision}{head}{spread}")
    for col in ("run", "tokens/s", "step ms", "peak GiB", "train loss", "val loss"):
        t.add_column(col, justify="left" if col == "run" else "right")
    for r in results:
        t.add_row(r["label"], f"{r['tokens_per_s']:,.0f}", f"{r['step_ms']:.1f}",
                  "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}",
                  f"{r['final_train_loss']:.4f}", f"{r['final_val_loss']:.4f}")
    console.print(t)
    if args.repeats > 1:
        console.print(summary(results))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_log.json").write_text(json.dumps(
        {"config": asdict(cfg), "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(),
         "compile": args.compile, "cuda_graphs": args.cuda_graphs, "parallel": ranks.mode, "runs": results},
        indent=1))
    plot(results, out / "loss_curves.png", cfg)
    console.print(f"wrote {out / 'train_log.json'} and {out / 'loss_curves.png'}")
    return 0


def summary(results: list):
    """A rich table of each run's repeats: mean tokens/s, mean / min / max final validation loss,
    and the mean's distance from the first run's (plain HF)."""
    from rich.table import Table

    groups: dict = {}
    for r in results:
        groups.setdefault(r["label"].rsplit(" #", 1)[0], []).append(r)
    t = Table(title="means over the repeats")
    for col in ("run", "repeats", "tokens/s", "val loss mean", "min", "max", "mean vs first run"):
        t.add_column(col, justify="left" if col == "run" else "right")
    first = None
    for label, rs in groups.items():
        vals = [r["final_val_loss"] for r in rs]
        mean = sum(vals) / len(vals)
        first = mean if first is None else first
        t.add_row(label, str(len(rs)), f"{sum(r['tokens_per_s'] for r in rs) / len(rs):,.0f}", f"{mean:.4f}",
                  f"{min(vals):.4f}", f"{max(vals):.4f}", f"{100 * (mean / first - 1):+.2f} %")
    return t


def plot(results: list, path, cfg: TrainConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        line, = ax.plot([s["step"] for s in r["steps"]], [s["loss"] for s in r["steps"]], lw=1,
                        alpha=0.8, label=f"{r['label']} train")
        ax.plot([e["step"] for e in r["evals"]], [e["val_loss"] for e in r["evals"]], "o--",
                color=line.get_color(), ms=3, label=f"{r['label']} validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(f"byte-level Llama on the Python stdlib: {cfg.tokens_per_step:,} tokens per step")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="coda-cute train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
