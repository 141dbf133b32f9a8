"""CPU test of an ``apply_coda`` model under FSDP2 (``fully_shard`` per decoder layer and at the
root) and DDP: two processes on the gloo backend, the reference path (``reference_on_cpu``). Each
rank takes half of a global batch; the loss averaged over the ranks and every gradient (FSDP2's
sharded ones gathered) must equal one process's on the whole batch. This is what FSDP2 needs of
the CODA forward: every decoder layer runs through its own module, so its pre-forward hook
unshards the parameters before the CODA ops read them (a sharded DTensor reaching an op fails)."""

import os
import socket

import pytest
import torch

import coda_cute
from coda_cute.nn import apply_coda
from helpers import flat_grads, rel_err

transformers = pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

WORLD = 2


def tiny_model():
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=99,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    return apply_coda(transformers.LlamaForCausalLM(cfg).to(torch.bfloat16))


def global_batch():
    return torch.randint(0, 99, (2 * WORLD, 24), generator=torch.Generator().manual_seed(7))


def _worker(rank, port, mode, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = tiny_model()
        if mode == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            wrapped = model
        else:
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
        ids = global_batch().chunk(WORLD)[rank]
        with coda_cute.reference_on_cpu():
            loss = wrapped(input_ids=ids, labels=ids).loss
            loss.backward()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = g.float()
        if rank == 0:
            torch.save({"loss": total / WORLD, "grads": grads}, out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_two_ranks_give_the_single_process_loss_and_gradients(mode, tmp_path):
    out = tmp_path / "rank0.pt"
    torch.multiprocessing.spawn(_worker, args=(_free_port(), mode, str(out)), nprocs=WORLD)
    got = torch.load(out)
    model = tiny_model()
    ids = global_batch()
    with coda_cute.reference_on_cpu():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    want = {n: p.grad.float() for n, p in model.named_parameters()}
    # equal token counts per rank: the global mean loss is the mean of the ranks' losses
    loss = float(loss.detach())
    assert abs(float(got["loss"]) - loss) <= 2e-3 * loss
    assert set(got["grads"]) == set(want)
    # bf16 gradients reduced across ranks vs summed in one process: rounding-level differences
    assert rel_err(flat_grads(got["grads"], want), flat_grads(want, want)) < 2e-2
