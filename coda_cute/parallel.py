"""``coda-cute train --fsdp / --ddp`` under ``torchrun``: the ranks, how each run's model is wrapped,
and the reductions the training loop needs.

    torchrun --nproc_per_node 2 -m coda_cute.train --fsdp      # or: coda-cute train --ddp ...

torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` / ``MASTER_PORT``)
names the ranks; NCCL on GPUs, gloo for ``--tiny`` on CPUs. ``--micro-batch`` is per rank, so a step
trains on ``micro_batch x world x accum`` sequences: every rank draws the whole step's windows from
the same generator and keeps its own rows of each micro-batch, and a one-process run with
``--micro-batch micro_batch x world`` trains on the same sequences. FSDP2 wraps each model with
:func:`coda_cute.nn.shard` (one unit per decoder layer, bf16 compute over fp32 master weights through a
``MixedPrecisionPolicy``, ``--compile`` per decoder layer); DDP wraps the whole model (``--compile``
over the DDP module). Gradients synchronize only on a step's last micro-batch.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Optional

import torch

MODES = ("fsdp", "ddp")
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks (``mode`` None: one process, nothing distributed)."""

    mode: Optional[str] = None
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def rows(self, batch: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's equal share of ``batch`` along ``dim`` (its size a multiple of the world)."""
        return batch.chunk(self.world, dim)[self.rank] if self.world > 1 else batch

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        """The mean of ``t`` over the ranks (gloo has no AVG: a sum, divided)."""
        if self.mode is None:
            return t
        t = t.detach().clone()
        torch.distributed.all_reduce(t)
        return t / self.world

    def max(self, value: float, device) -> float:
        if self.mode is None:
            return value
        t = torch.tensor(value, dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return float(t)


def from_env(mode: Optional[str]) -> Ranks:
    """The ranks torchrun started (``mode`` None: one process). Raises ValueError, saying how to
    launch, when ``--fsdp`` / ``--ddp`` is given outside torchrun."""
    if mode is None:
        return Ranks()
    if mode not in MODES:
        raise ValueError(f"coda-cute train: parallel mode must be one of {MODES}, got {mode!r}")
    missing = [k for k in _ENV if k not in os.environ]
    if missing:
        raise ValueError(f"coda-cute train --{mode} runs under torchrun (no {', '.join(missing)} in the "
                         f"environment): torchrun --nproc_per_node N -m coda_cute.train --{mode} ...")
    return Ranks(mode, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))


def start(ranks: Ranks, cpu: bool) -> torch.device:
    """This rank's device, the process group started on it (NCCL, or gloo on CPUs)."""
    if cpu:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", ranks.local_rank if ranks.mode else torch.cuda.current_device())
        torch.cuda.set_device(device)
    if ranks.mode is not None:
        torch.distributed.init_process_group("gloo" if cpu else "nccl", rank=ranks.rank,
                                             world_size=ranks.world, device_id=None if cpu else device)
    return device


def stop(ranks: Ranks, together: bool = True) -> None:
    """Leave the process group; ``together`` (a run that finished): all ranks first meet, since
    rank 0 writes the outputs last and a rank that tore its group down while another still used it
    was seen to abort under gloo. After an error no barrier: the other ranks may never reach it."""
    if ranks.mode is not None and torch.distributed.is_initialized():
        if together:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def wrap(model, ranks: Ranks, device, compile_model: bool):
    """(what to call for the loss, ``sync(last)``: the context each micro-batch runs in, so that
    gradients are reduced across the ranks only on a step's last one). ``compile_model``: the
    plain run under ``torch.compile`` (per decoder layer under FSDP2)."""
    if ranks.mode == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from .nn import shard

        shard(model, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
              compile_layers=compile_model)

        @contextlib.contextmanager
        def sync(last: bool):
            model.set_requires_gradient_sync(last)
            yield

        return model, sync
    if ranks.mode == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=None if device.type == "cpu"
                                                        else [device.index])
        return (torch.compile(ddp) if compile_model else ddp), (
            lambda last: contextlib.nullcontext() if last else ddp.no_sync())
    return (torch.compile(model) if compile_model else model), no_sync_needed


def no_sync_needed(last: bool):
    return contextlib.nullcontext()
