"""GPU test of ``coda-cute train --cuda-graphs``: the graphed gradients are the eager ones.

For plain HF and ``apply_coda`` on a small byte-level Llama (2 layers, grad accumulation 2):
one step's loss and every gradient replayed from :class:`coda_cute.train.GraphedGradients`, on
data other than the capture's and replayed twice (each replay overwrites the gradients, it does
not add to them), against :class:`coda_cute.train.Gradients` on the same data.
"""

import pytest
import torch

from coda_cute import train as T
from coda_cute.nn import apply_coda
from helpers import rel_err

pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

CFG = T.TrainConfig(dim=256, layers=2, heads=4, kv_heads=2, ffn=512, seq=128, micro_batch=2, accum=2)


@pytest.mark.parametrize("coda", [False, True], ids=["hf", "coda"])
def test_graphed_gradients_are_the_eager_ones(coda):
    device = torch.device("cuda")
    train, _ = T.corpus_split(0.1, limit=300_000)
    model = T.build_model(CFG).to(device)
    if coda:
        apply_coda(model)
    forward = T.hf_forward(model)
    gen = torch.Generator().manual_seed(torch.initial_seed())  # the test's fresh seed
    batches = torch.stack([T.windows(train, CFG.micro_batch, CFG.seq, gen) for _ in range(CFG.accum)]).to(device)
    eager = T.Gradients(model, forward, CFG, device, train)
    want_loss = float(eager(batches))
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    eager.zero_grad()
    graphed = T.GraphedGradients(model, forward, CFG, device, train)
    for _ in range(2):
        loss = float(graphed(batches))
    assert abs(loss - want_loss) <= 1e-3 * want_loss
    for n, p in model.named_parameters():
        assert p.grad.dtype == torch.float32
        assert rel_err(p.grad, want[n]) < 1e-2, n  # bf16 autocast: weight cache on in eager, off in the graph
    # after optimizer steps the replays must see the new weights (nothing captured may go stale)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.step()
        graphed(batches)
    loss = float(graphed(batches))
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)  # the graph keeps its own gradient tensors
    want_loss = float(T.Gradients(model, forward, CFG, device, train)(batches))
    assert abs(loss - want_loss) <= 1e-3 * want_loss
    for n, p in model.named_parameters():
        assert rel_err(got[n], p.grad) < 1e-2, n
