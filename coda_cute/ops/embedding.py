"""``torch.ops.coda.embedding``: the token embedding ``weight[ids]`` whose backward is ours,

    dE[v, :] = sum_{i : ids[i] = v} dx[i, :]    (fp32 sums in token order, rounded once)

deterministic (every run gives the same bits, with or without
``torch.use_deterministic_algorithms``) and one pass over the table: the ids are sorted once
(stable), each table row's range of the sorted order is found by ``searchsorted``, and our kernel
(``kernels.elementwise.embedding_backward``) writes every row once, its range's sum or zeros.
torch's backward fills the table with zeros and then runs two kernels over the sorted ids.
``padding_idx`` (>= 0) gets no gradient, as ``nn.Embedding``'s. The forward is torch's gather.

Bad ids (outside [0, V)) raise a ``ValueError`` naming the first one, read back without stalling
the GPU (``checks.PendingIndexCheck``); the gather itself reads clamped ids, so no device-side
assert poisons the CUDA context first. ``coda.embedding_backward`` checks its ids the same way
(its row ranges would silently drop a bad id's gradient).
"""

from __future__ import annotations

import torch

from .. import dispatch
from ..elementwise import embedding_backward as embedding_backward_kernel
from ..reference import embedding_backward_ref
from .checks import INDEX_DTYPES, PendingIndexCheck, check_index_range, check_same_device
from .eager import direct

OP, OP_BWD = "coda.embedding", "coda.embedding_backward"
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_embedding(weight: torch.Tensor, ids: torch.Tensor, padding_idx: int) -> None:
    """``coda.embedding``'s rules (the ids' values are checked on the data, without a stall)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"{OP}: weight must be a 2-D floating-point (V, d) tensor, got "
                         f"{getattr(weight, 'dtype', type(weight).__name__)} {tuple(getattr(weight, 'shape', ()))}")
    _check_ids(OP, ids, weight.shape[0], padding_idx)
    check_same_device(OP, weight=weight, ids=ids)


def _check_ids(op: str, ids, num_rows: int, padding_idx: int) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dtype not in INDEX_DTYPES:
        raise ValueError(f"{op}: ids must be an int32 / int64 tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    if num_rows < 1:
        raise ValueError(f"{op}: the table needs at least one row, got {num_rows}")
    if not -1 <= padding_idx < num_rows:
        raise ValueError(f"{op}: padding_idx must be -1 (none) or a row of the table in [0, {num_rows}), "
                         f"got {padding_idx}")


@torch.library.custom_op("coda::embedding", mutates_args=())
def embedding(weight: torch.Tensor, ids: torch.Tensor, padding_idx: int = -1) -> torch.Tensor:
    """weight[ids]: ids of any shape, the result ids.shape + (d,) in weight's dtype."""
    check_embedding(weight, ids, padding_idx)
    if weight.device.type == "cpu":
        dispatch.require_reference(OP)
        check_index_range(OP, "ids", ids, weight.shape[0])
        return torch.nn.functional.embedding(ids, weight)
    clamped = ids.clamp(0, weight.shape[0] - 1)
    check = PendingIndexCheck(OP, "ids", ids, weight.shape[0], clamped=clamped)
    out = torch.nn.functional.embedding(clamped, weight)
    check.wait()
    return out


@embedding.register_fake
def _fake(weight, ids, padding_idx=-1):
    check_embedding(weight, ids, padding_idx)
    return weight.new_empty((*ids.shape, weight.shape[1]))


def _kernel_applies(grad: torch.Tensor) -> bool:
    """Our kernel's rules: a contiguous (M, d) gradient of a kernel dtype, d 16-byte vectors."""
    if not (grad.is_cuda and grad.dtype in KERNEL_DTYPES and grad.is_contiguous() and grad.numel()):
        return False
    if grad.shape[-1] % 8 or grad.data_ptr() % 16:
        return False
    try:
        return dispatch.arch_of(grad.device) == "sm_90a"
    except NotImplementedError:
        return False


@torch.library.custom_op("coda::embedding_backward", mutates_args=())
def embedding_backward(grad: torch.Tensor, ids: torch.Tensor, num_rows: int, padding_idx: int = -1,
                       check_ids: bool = True) -> torch.Tensor:
    """dE (num_rows, d) in grad's dtype of ``weight[ids]`` (module docstring); grad ids.shape + (d,).
    ``check_ids=False``: the caller has range-checked ``ids`` already (the autograd backward: its
    forward checked these saved ids, which cannot have changed since)."""
    _check_backward(grad, ids, num_rows, padding_idx)
    # an id outside the table would drop its gradient row silently (the kernel's row ranges
    # never reach it): read back while the backward runs, as the forward does
    check = PendingIndexCheck(OP_BWD, "ids", ids, num_rows) if check_ids else None
    if grad.device.type == "cpu":
        dispatch.require_reference(OP_BWD)
        return embedding_backward_ref(grad, ids, num_rows, padding_idx)
    d = grad.shape[-1]
    grad = grad.reshape(-1, d)
    if not _kernel_applies(grad):
        if check is not None:
            check.wait()  # before torch's kernel, which does not bound its writes by the table
        return torch.ops.aten.embedding_dense_backward(grad, ids.reshape(-1), num_rows, padding_idx, False)
    out = backward_into(torch.empty((num_rows, d), dtype=grad.dtype, device=grad.device), grad, ids, padding_idx)
    if check is not None:
        check.wait()
    return out


def backward_into(out: torch.Tensor, grad: torch.Tensor, ids: torch.Tensor, padding_idx: int = -1) -> torch.Tensor:
    """Our kernel's dE into ``out`` (V, d), contiguous, grad's dtype, every row written: sorts the
    ids (stable), finds each table row's range of the sorted order, launches. grad (M, d) as
    :func:`_kernel_applies` wants it, ids (M,) within [0, V)."""
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    rows = torch.arange(out.shape[0], device=ids.device, dtype=sorted_ids.dtype)
    starts = torch.searchsorted(sorted_ids, rows).int()
    ends = torch.searchsorted(sorted_ids, rows, right=True).int()
    if padding_idx >= 0:
        ends[padding_idx] = starts[padding_idx]
    return embedding_backward_kernel(grad, order.int(), starts, ends, out)


def _check_backward(grad, ids, num_rows, padding_idx):
    """``coda.embedding_backward``'s rules."""
    _check_ids(OP_BWD, ids, num_rows, padding_idx)
    if (not isinstance(grad, torch.Tensor) or not grad.is_floating_point() or grad.dim() != ids.dim() + 1
            or tuple(grad.shape[:-1]) != tuple(ids.shape)):
        raise ValueError(f"{OP_BWD}: grad must be a floating-point tensor of ids.shape + (d,) = "
                         f"{tuple(ids.shape)} + (d,), got {tuple(getattr(grad, 'shape', ()))}")
    check_same_device(OP_BWD, grad=grad, ids=ids)


@embedding_backward.register_fake
def _backward_fake(grad, ids, num_rows, padding_idx=-1, check_ids=True):
    _check_backward(grad, ids, num_rows, padding_idx)
    return grad.new_empty((num_rows, grad.shape[-1]))


def _setup(ctx, inputs, output):
    weight, ids, padding_idx = inputs
    ctx.save_for_backward(ids)
    ctx.args = (weight.shape[0], padding_idx)


def _backward(ctx, grad):
    (ids,) = ctx.saved_tensors
    num_rows, padding_idx = ctx.args
    # the forward checked these ids: a second read-back would sync the step's end for nothing
    dw = (embedding_backward(grad.contiguous(), ids, num_rows, padding_idx, check_ids=False)
          if ctx.needs_input_grad[0] else None)
    return dw, None, None


embedding.register_autograd(_backward, setup_context=_setup)

# Python callers skip the dispatcher where nothing needs it (ops.eager)
embedding = direct(embedding)
embedding_backward = direct(embedding_backward)
