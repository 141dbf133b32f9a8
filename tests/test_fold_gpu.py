"""GPU tests of ``torch.ops.coda.fold_gamma``: the kernel's W * gamma equals torch's bit for bit
(the product in fp32, rounded once) on ragged and strided weights, writes every element, and the
op's gradients are autograd's for W * gamma; ``coda.scale``'s scalar form likewise."""

import pytest
import torch

from coda_cute.compiler import get_kernel
from coda_cute.elementwise import ScaleColumnsSpec
from coda_cute.ops.fold import _kernel_applies

pytestmark = pytest.mark.gpu


def _rand(n, k, dtype, row_stride=None):
    w = torch.randn(n, row_stride or k, device="cuda", dtype=dtype)[:, :k]
    gamma = (1 + 0.2 * torch.randn(k, device="cuda")).to(dtype)
    return w, gamma


# N: one row, part of a band of 8 rows, many bands; K/8: under and over one CTA's 128 groups
@pytest.mark.parametrize("n, k", [(1, 8), (17, 4104), (4095, 1000), (6144, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fold_kernel_equals_torch_and_writes_everything(n, k, dtype):
    w, gamma = _rand(n, k, dtype)
    assert _kernel_applies(w, gamma)
    out = torch.full_like(w, float("nan"))
    get_kernel(ScaleColumnsSpec(str(dtype)[6:])).fn(w, gamma, out)
    torch.testing.assert_close(out, w * gamma, rtol=0, atol=0)
    torch.testing.assert_close(torch.ops.coda.fold_gamma(w, gamma), w * gamma, rtol=0, atol=0)


def test_fold_kernel_on_a_strided_weight():
    w, gamma = _rand(333, 512, torch.bfloat16, row_stride=520)
    assert _kernel_applies(w, gamma)
    torch.testing.assert_close(torch.ops.coda.fold_gamma(w, gamma), w * gamma, rtol=0, atol=0)


def test_fold_falls_back_to_torch_where_the_kernel_does_not_apply():
    w, gamma = _rand(64, 36, torch.bfloat16)  # K not a multiple of 8
    assert not _kernel_applies(w, gamma)
    torch.testing.assert_close(torch.ops.coda.fold_gamma(w, gamma), w * gamma, rtol=0, atol=0)
    w32 = torch.randn(64, 64, device="cuda")
    g16 = torch.ones(64, device="cuda", dtype=torch.bfloat16)
    assert not _kernel_applies(w32, g16)
    torch.testing.assert_close(torch.ops.coda.fold_gamma(w32, g16), w32 * g16, rtol=0, atol=0)


def test_fold_op_gradients_on_gpu():
    w, gamma = _rand(300, 256, torch.bfloat16)
    w, gamma = w.contiguous().requires_grad_(), gamma.requires_grad_()
    dy = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    got = torch.autograd.grad(torch.ops.coda.fold_gamma(w, gamma), (w, gamma), dy)
    want = torch.autograd.grad(w * gamma, (w, gamma), dy)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)  # dW: one rounding, like torch
    # d gamma: fp32 products and sum, rounded once to bf16 (half an ulp, <= 2^-8 relative), where
    # torch rounds each product to bf16 first
    exact = (dy.double() * w.detach().double()).sum(0)
    slack = 1e-6 * (dy.double() * w.detach().double()).abs().sum(0)
    assert bool(((got[1].double() - exact).abs() <= exact.abs() * 2.0**-8 + slack).all())
    assert (got[1].double() - exact).norm() <= (want[1].double() - exact).norm()


# N: one row, a partial band of 64 rows, many bands with a ragged last one; K: under and over one CTA
@pytest.mark.parametrize("n, k", [(1, 8), (70, 4104), (4095, 1000), (6147, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fold_backward_kernel_is_torch_dw_and_an_fp32_dgamma(n, k, dtype):
    """dW = dW' * gamma bit for bit (one rounding, like torch); d gamma's products summed in fp32
    (closer to float64 than torch's 16-bit products); every output element written (NaN-poisoned)."""
    from coda_cute.elementwise import FoldBackwardSpec
    from coda_cute.kernels.elementwise.fold_backward import num_bands

    w, gamma = _rand(n, k, dtype)
    dw = torch.randn(n, k, device="cuda", dtype=dtype)
    out = torch.full_like(w, float("nan"))
    partial = torch.full((num_bands(n), k), float("nan"), device="cuda")
    get_kernel(FoldBackwardSpec(str(dtype)[6:])).fn(dw, w, gamma, out, partial)
    torch.testing.assert_close(out, (dw * gamma).to(dtype), rtol=0, atol=0)
    want = (dw.double() * w.double()).sum(0)
    got = partial.sum(0).double()
    assert torch.isfinite(partial).all()
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    ours = torch.ops.coda.fold_gamma  # the op's backward takes this path
    w2, g2 = w.clone().requires_grad_(), gamma.clone().requires_grad_()
    ours(w2, g2).backward(dw)
    torch.testing.assert_close(w2.grad, out, rtol=0, atol=0)
    torch.testing.assert_close(g2.grad, got.to(dtype), rtol=0, atol=0)


# rows: one, a partial band of 8, many with a ragged last band; K/8 under and over one CTA's 128
@pytest.mark.parametrize("shape", [(1, 8), (17, 4104), (2, 2047, 1000), (16384, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scale_kernel_is_the_fp32_product_rounded_once(shape, dtype):
    """x * s with s an fp32 device number that no 16-bit type holds, every element written
    (NaN-poisoned output), and the op's torch fallback gives the same values."""
    from coda_cute.ops.fold import _scale_kernel_applies, scale

    x = torch.randn(*shape, device="cuda", dtype=dtype)
    s = torch.rand((), device="cuda") + 1 / 3
    assert _scale_kernel_applies(x, dtype)
    rows = x.view(-1, shape[-1])
    out = torch.full_like(rows, float("nan"))
    get_kernel(ScaleColumnsSpec(str(dtype)[6:], scalar=True)).fn(rows, s.reshape(1), out)
    want = (x.float() * s).to(dtype)
    torch.testing.assert_close(out.view(shape), want, rtol=0, atol=0)
    torch.testing.assert_close(scale(x, s), want, rtol=0, atol=0)
    strided = x.transpose(-1, -2)  # not contiguous: torch's path
    assert not _scale_kernel_applies(strided, dtype)
    torch.testing.assert_close(scale(strided, s), (strided.float() * s).to(dtype), rtol=0, atol=0)
    # fp32 in (the FP8 LM head's dW), 16-bit out in the same pass
    x32 = torch.randn(*shape, device="cuda")
    assert _scale_kernel_applies(x32, dtype)
    out = torch.full(shape, float("nan"), device="cuda", dtype=dtype)
    get_kernel(ScaleColumnsSpec(str(dtype)[6:], scalar=True, in_dtype="float32")).fn(
        x32.view(-1, shape[-1]), s.reshape(1), out.view(-1, shape[-1]))
    torch.testing.assert_close(out, (x32 * s).to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(scale(x32, s, dtype), (x32 * s).to(dtype), rtol=0, atol=0)
