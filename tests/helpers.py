"""Shared test helpers."""

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN/Inf anywhere in ``out`` counts as failure."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def loss_and_grads(model, ids, labels, **kw):
    """(loss, {name: fp32 gradient}) of one HF-contract forward + backward of ``model``."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    return out.loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


def flat_grads(grads: dict, names) -> torch.Tensor:
    """All of ``names``' gradients as one vector (the error over every gradient together)."""
    return torch.cat([grads[n].flatten() for n in names])


def on_path(path: str):
    """The context an op call runs in for a bad-input test: "cpu" (the reference path) or "fake"
    (FakeTensorMode, real inputs allowed): its argument rules must raise on both."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import coda_cute

    if path == "cpu":
        return coda_cute.reference_on_cpu()
    if path == "fake":
        return FakeTensorMode(allow_non_fake_inputs=True)
    raise ValueError(f"on_path: path must be 'cpu' or 'fake', got {path!r}")
