"""CPU tests of the gamma fold: ``torch.ops.coda.fold_gamma`` (its kernel builds for sm_90a with
16-byte accesses; the op on CPU, fake tensors, bad input) and the fold cache (coda_cute.nn.fold):
W * gamma is computed once per version of the weights, and gradients over several micro-batches
match a fresh fold per forward."""

import copy
import pickle

import pytest
import torch
from torch.testing._internal.optests import OpCheckError

from coda_cute.artifacts import disassemble, find_nvdisasm
from coda_cute.compiler import spill_bytes
from coda_cute.elementwise import ScaleColumnsSpec, compile_elementwise
from coda_cute.nn import CodaLlama, LlamaConfig
from coda_cute.nn.fold import FoldCache
from coda_cute.ops.fold import fold_gamma_impl
from helpers import generator


def _params(seed):
    g = generator(seed)
    w = torch.randn(24, 16, generator=g).requires_grad_()
    gamma = (1 + 0.1 * torch.randn(16, generator=g)).requires_grad_()
    return w, gamma


def test_fold_is_reused_until_a_weight_changes():
    w, gamma = _params(0)
    cache = FoldCache(enabled=True)
    first = cache(w, gamma)
    assert cache(w, gamma) is first
    torch.testing.assert_close(first, w * gamma, rtol=0, atol=0)
    with torch.no_grad():
        w.add_(1.0)  # an optimizer step
    second = cache(w, gamma)
    assert second is not first
    torch.testing.assert_close(second, w * gamma, rtol=0, atol=0)
    with torch.no_grad():
        gamma.mul_(2.0)
        assert cache(w, gamma) is not second
        torch.testing.assert_close(cache(w, gamma), w * gamma, rtol=0, atol=0)


def test_fold_follows_the_grad_mode():
    w, gamma = _params(1)
    cache = FoldCache(enabled=True)
    with torch.no_grad():
        assert cache(w, gamma).grad_fn is None
    assert cache(w, gamma).grad_fn is not None
    with torch.no_grad():
        assert cache(w, gamma).grad_fn is None


def test_gradients_over_micro_batches_match_a_fresh_fold_each():
    w, gamma = _params(2)
    w2, gamma2 = (t.detach().clone().requires_grad_() for t in (w, gamma))
    xs = [torch.randn(5, 16) for _ in range(3)]
    cache = FoldCache(enabled=True)
    for x in xs:  # one cached fold, three backwards through it
        (x @ cache(w, gamma).t()).square().sum().backward()
        (x @ (w2 * gamma2).t()).square().sum().backward()
    torch.testing.assert_close(w.grad, w2.grad)
    torch.testing.assert_close(gamma.grad, gamma2.grad)


def test_backward_after_an_in_place_update_raises_like_autograd():
    w, gamma = _params(3)
    cache = FoldCache(enabled=True)
    loss = (torch.randn(5, 16) @ cache(w, gamma).t()).sum()
    with torch.no_grad():
        w.add_(0.5)
    with pytest.raises(RuntimeError, match="modified in place"):
        loss.backward()


def test_disabled_cache_folds_every_call():
    w, gamma = _params(4)
    cache = FoldCache()
    assert cache(w, gamma) is not cache(w, gamma)


def test_a_replaced_parameter_refolds_even_at_the_same_address_and_version():
    w, gamma = _params(5)
    cache = FoldCache(enabled=True)
    with torch.no_grad():
        first = cache(w, gamma)
        w2 = torch.nn.Parameter(w.detach().clone() + 1)  # e.g. load_state_dict(assign=True)
        cache.key = (w2.data_ptr(), w2._version) + cache.key[2:]  # as if the allocator reused it
        torch.testing.assert_close(cache(w2, gamma), w2 * gamma, rtol=0, atol=0)
        assert cache.value is not first


def test_an_inference_mode_fold_is_not_reused_under_autograd():
    w, gamma = _params(6)
    w.requires_grad_(False)
    gamma.requires_grad_(False)  # frozen weights: no grad either way
    cache = FoldCache(enabled=True)
    with torch.inference_mode():
        assert cache(w, gamma).is_inference()
    x = torch.randn(5, 16, requires_grad=True)
    (x @ cache(w, gamma).t()).sum().backward()  # an inference tensor here could not be saved
    assert x.grad is not None


def test_copies_and_pickles_start_without_a_fold():
    cfg = LlamaConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=8)
    model = CodaLlama(cfg, device="cpu", cache_folds=True)
    blk = model.layers[0]
    blk._folds[0](blk.wqkv, blk.attn_norm)  # a graph node: deepcopy of a non-leaf would raise
    twin = copy.deepcopy(model)
    assert twin.layers[0]._folds[0].value is None and twin.layers[0]._folds[0].enabled
    assert pickle.loads(pickle.dumps(blk._folds[0])).value is None
    model.clear_folds()
    assert blk._folds[0].value is None


# -- torch.ops.coda.fold_gamma: its kernel builds; the op on CPU, fake tensors, bad input ------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fold_backward_kernel_builds_with_16_byte_accesses_and_no_spills(dtype):
    """dW' and W read, dW and the fp32 partials written, 16 bytes per access only."""
    from coda_cute.elementwise import FoldBackwardSpec

    k = compile_elementwise(FoldBackwardSpec(dtype), keep_artifacts=True)
    assert ".target sm_90a" in k.ptx and spill_bytes(k) == 0
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    ops = [line.split()[1] for line in disassemble(k.cubin).splitlines() if " LDG." in line or " STG." in line]
    assert ops and all(op.endswith(".128") for op in ops), ops
    assert sum(op.startswith("LDG") for op in ops) >= 1 + 2 * 8  # gamma, then dW' and W of a step


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fold_kernel_builds_with_16_byte_accesses_and_no_spills(dtype):
    k = compile_elementwise(ScaleColumnsSpec(dtype), keep_artifacts=True)
    assert ".target sm_90a" in k.ptx
    assert spill_bytes(k) == 0
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    ops = [line.split()[1] for line in disassemble(k.cubin).splitlines()
           if " LDG." in line or " STG." in line]
    # W and gamma are read, W' written, 16 bytes per access only (no scalar fallback)
    assert ops and all(op.endswith(".128") for op in ops), ops
    assert sum(op.startswith("LDG") for op in ops) >= 9  # gamma + the 8 rows of a full band


def test_fold_op_on_cpu_matches_torch_and_passes_opcheck():
    g = generator(3)
    w = torch.randn(19, 24, generator=g).to(torch.bfloat16)
    gamma = (1 + 0.1 * torch.randn(24, generator=g)).to(torch.bfloat16)
    torch.testing.assert_close(torch.ops.coda.fold_gamma(w, gamma), w * gamma, rtol=0, atol=0)
    torch.library.opcheck(torch.ops.coda.fold_gamma.default, (w.requires_grad_(), gamma.requires_grad_()))


def test_fold_op_gradients_are_those_of_w_times_gamma():
    w, gamma = _params(5)
    dy = torch.randn(24, 16)
    gw, gg = torch.autograd.grad(torch.ops.coda.fold_gamma(w, gamma), (w, gamma), dy)
    rw, rg = torch.autograd.grad(w * gamma, (w, gamma), dy)
    torch.testing.assert_close(gw, rw, rtol=0, atol=0)
    torch.testing.assert_close(gg, rg, rtol=1e-6, atol=1e-6)


def test_fold_op_fake_tensor_has_the_promoted_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.coda.fold_gamma(torch.empty(8, 16, dtype=torch.bfloat16), torch.empty(16))
    assert out.shape == (8, 16) and out.dtype == torch.float32


def test_fold_backward_traces_as_one_op_on_fake_cuda_tensors(monkeypatch):
    """A compiled backward traces the fold's backward with fake CUDA tensors: it must reach the
    op's fake impl (shapes and dtypes of W and gamma), never the kernel path that reads pointers."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from coda_cute import dispatch
    from coda_cute.ops import fold

    monkeypatch.setattr(dispatch, "arch_of", lambda device: "sm_90a")
    with FakeTensorMode():
        w = torch.empty(64, 64, dtype=torch.bfloat16, device="cuda")
        gamma = torch.empty(64, dtype=torch.float32, device="cuda")
        dw, dgamma = fold.fold_gamma_backward(torch.empty(64, 64, device="cuda"), w, gamma)
    assert (dw.shape, dw.dtype, dgamma.shape, dgamma.dtype) == ((64, 64), torch.bfloat16, (64,), torch.float32)


FOLD_OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _fold_backward_cases():
    """(dW', W, gamma): dW' in W' = W * gamma's dtype (the promoted one), as the fold's backward
    receives it."""
    g = generator(7)
    w = torch.randn(24, 40, generator=g).to(torch.bfloat16)
    gamma = (1 + 0.1 * torch.randn(40, generator=g)).to(torch.bfloat16)
    dw = torch.randn(24, 40, generator=g)
    yield pytest.param((dw.to(torch.bfloat16), w, gamma), id="bf16")
    yield pytest.param((dw, w, gamma.float()), id="fp32 gamma")  # W' fp32: dW fp32 -> bf16, d gamma fp32
    yield pytest.param((dw, w.float(), gamma), id="fp32 W")
    # A gradient that arrives transposed (W' used as W'.t() elementwise): the torch path (on CPU,
    # and on CUDA, whose kernel takes a contiguous gradient only) returns a contiguous dW, the
    # fake's layout (it once kept the gradient's strides, which failed inductor's stride assertion)
    yield pytest.param((torch.randn(40, 24, generator=g).to(torch.bfloat16).t(), w, gamma), id="transposed dW'")


@pytest.mark.parametrize("args", list(_fold_backward_cases()))
def test_fold_backward_op_passes_opcheck(args):
    """A backward op with no autograd of its own (no double backward): inputs without grad."""
    import coda_cute

    dw, w, gamma = args
    with coda_cute.reference_on_cpu():
        gw, gg = torch.ops.coda.fold_gamma_backward(dw, w, gamma)
        result = torch.library.opcheck(torch.ops.coda.fold_gamma_backward.default, (dw, w, gamma),
                                       test_utils=FOLD_OPCHECKS)
    assert set(result) == set(FOLD_OPCHECKS) and all(v == "SUCCESS" for v in result.values()), result
    assert (gw.dtype, gg.dtype) == (w.dtype, gamma.dtype)
    torch.testing.assert_close(gw, (dw.float() * gamma.float()).to(w.dtype), rtol=0, atol=0)
    torch.testing.assert_close(gg.double(), (dw.double() * w.double()).sum(0).to(gamma.dtype).double(),
                               rtol=1e-5 if gamma.dtype == torch.float32 else 2 ** -8, atol=1e-5)


@pytest.mark.parametrize("w_shape, g_shape, dtypes, match", [
    ((4, 8, 2), (8,), (torch.bfloat16, torch.bfloat16), "w must be 2-D"),
    ((4, 8), (16,), (torch.bfloat16, torch.bfloat16), "gamma must be 1-D with one entry per column"),
    ((4, 8), (4, 8), (torch.bfloat16, torch.bfloat16), "gamma must be 1-D"),
    ((4, 8), (8,), (torch.int32, torch.bfloat16), "must be floating point"),
])
def test_fold_op_rejects_bad_input(w_shape, g_shape, dtypes, match):
    with pytest.raises((ValueError, TypeError), match=match):
        fold_gamma_impl(torch.ones(w_shape, dtype=dtypes[0]), torch.ones(g_shape, dtype=dtypes[1]))


# -- coda.scale: x times one device number ---------------------------------------------------------
@pytest.mark.parametrize("in_dtype", [None, "float32"])
def test_scale_kernel_builds_with_16_byte_accesses_and_no_spills(in_dtype):
    """The scalar form reads its factor once (one 32-bit load) and x, out 16 bytes per access
    (an fp32 x: two loads per 8 elements, converted to bf16 in the same pass)."""
    k = compile_elementwise(ScaleColumnsSpec("bfloat16", scalar=True, in_dtype=in_dtype), keep_artifacts=True)
    assert ".target sm_90a" in k.ptx and spill_bytes(k) == 0
    assert k.ptx.count("ld.global.b32") == 1
    assert k.ptx.count("ld.global.v4") == (2 if in_dtype else 1) * k.ptx.count("st.global.v4")
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    ops = [line.split()[1] for line in disassemble(k.cubin).splitlines() if " LDG." in line or " STG." in line]
    wide = [op for op in ops if op.endswith(".128")]
    assert len(ops) - len(wide) == 1 and sum(op.startswith("LDG") for op in wide) >= 8, ops


def test_scale_op_on_cpu_rounds_the_fp32_product_once_and_passes_opcheck():
    from coda_cute.ops.fold import scale

    g = generator(4)
    x = torch.randn(3, 5, 24, generator=g).to(torch.bfloat16)
    s = torch.tensor(1 / 3)  # not a bf16 number: the factor must stay fp32
    torch.testing.assert_close(scale(x, s), (x.float() * (1 / 3)).to(torch.bfloat16), rtol=0, atol=0)
    torch.library.opcheck(torch.ops.coda.scale.default, (x, s))
    torch.library.opcheck(torch.ops.coda.scale.default, (x.float(), s.reshape(1)))
    # fp32 in, 16-bit out: the fp32 product rounded once to the output dtype
    x32 = torch.randn(6, 40, generator=g)
    got = scale(x32, s, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, (x32 * (1 / 3)).to(torch.bfloat16), rtol=0, atol=0)
    torch.library.opcheck(torch.ops.coda.scale.default, (x32, s, torch.bfloat16))


@pytest.mark.parametrize("x, s, exc, match", [
    (torch.ones(4, 8, dtype=torch.int32), torch.tensor(1.0), TypeError, "x must be a floating-point"),
    (torch.ones(4, 8), torch.tensor([1.0, 2.0]), ValueError, "s must be a float32 tensor of one element"),
    (torch.ones(4, 8), torch.tensor(1.0, dtype=torch.float64), ValueError, "s must be a float32"),
    (torch.ones(4, 8), 2.0, ValueError, "s must be a float32 tensor"),
    (torch.ones(4, 8), torch.tensor(1.0), TypeError, "out_dtype must be a floating-point dtype"),
])
def test_scale_op_rejects_bad_input(x, s, exc, match):
    from coda_cute.ops.fold import check_scale

    with pytest.raises(exc, match=match):
        check_scale(x, s, torch.int32 if "out_dtype" in match else None)


def test_scale_op_rejects_a_factor_on_another_device_while_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(8, 16, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="x is on cuda.* but s is on cpu"):
            torch.ops.coda.scale(x, torch.empty((), device="cpu"))
        assert torch.ops.coda.scale(x, torch.empty((), device="cuda")).shape == (8, 16)


# -- nn.fold.WeightQuantCache: the FP8 weights once per version ---------------------------------------


def test_weight_quant_cache_keeps_one_quantization_per_version(monkeypatch):
    import coda_cute
    from coda_cute.nn import fold as F
    from coda_cute.ops.fp8_gemms import weight

    calls = []
    monkeypatch.setattr(F, "weight", lambda w, pow2, row: calls.append(pow2) or weight(w, pow2, row))
    w = torch.randn(160, 144).bfloat16().requires_grad_()
    cache = F.WeightQuantCache(enabled=True)
    with coda_cute.reference_on_cpu():
        first = cache(w, False)
        assert cache(w, False) is first and len(calls) == 1
        assert all(torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                               b.view(torch.uint8) if b.dtype != torch.float32 else b)
                   for a, b in zip(first, weight(w.detach(), False)))
        cache(w, True)  # the recipe's scale rounding is part of the key
        assert len(calls) == 2
        with torch.no_grad():
            w.mul_(2)  # an optimizer step: a new version
        again = cache(w, True)
        assert len(calls) == 3 and torch.equal(again[1], 2 * weight(w.detach() / 2, True)[1])
        twin = w.detach().clone().requires_grad_()  # same values, another tensor: quantized anew
        cache(twin, True)
        assert len(calls) == 4
        row = cache(twin, True, True)  # so is the recipe's scaling
        assert len(calls) == 5 and row[1].shape == (160 + 144, 1)
    assert F.WeightQuantCache(enabled=False)(w, False) is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert cache(twin, True) is None
    assert copy.deepcopy(cache).value is None and pickle.loads(pickle.dumps(cache)).enabled


@pytest.mark.parametrize("scaling", ["block", "row"])
def test_fp8_model_with_cached_weights_trains_like_the_uncached_one(scaling):
    """CodaLlama(precision="fp8", cache_folds=True): the layers' FP8 weights quantized once and
    reused by the next micro-batch (same objects), the loss and every gradient equal to the
    model quantizing on each forward, and an in-place weight update re-quantizes; both recipes."""
    import coda_cute
    from coda_cute.precision import Fp8Recipe

    cfg = LlamaConfig(dim=128, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=96, head_dim=32,
                      precision=Fp8Recipe(scaling=scaling))
    plain = CodaLlama(cfg, device="cpu")
    cached = CodaLlama(cfg, device="cpu", cache_folds=True)
    cached.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 96, (2, 32))
    targets = torch.roll(tokens, -1, 1)
    blk = cached.layers[0]
    with coda_cute.reference_on_cpu():
        for step in range(2):
            for model in (plain, cached):
                model(tokens, targets).backward()
            if step == 0:
                kept = [c.value for c in blk._quants]
                assert all(v is not None for v in kept)
        assert all(c.value is v for c, v in zip(blk._quants, kept))  # the second micro-batch reused them
        for (name, p), q in zip(plain.named_parameters(), cached.parameters()):
            assert torch.equal(p.grad, q.grad), name
        with torch.no_grad():
            blk.w_down.mul_(0.5)
        cached(tokens, targets)
    assert blk._quants[3].value is not kept[3] and blk._quants[0].value is kept[0]
    cached.clear_folds()
    assert all(c.value is None for c in blk._quants)


@pytest.mark.parametrize("fake", [False, True], ids=["cpu", "fake"])
@pytest.mark.parametrize("dw, match", [
    (lambda dev: torch.ones(1, 64, device=dev), "dw must be a floating-point tensor shaped like w"),
    (lambda dev: torch.ones(80, 64, dtype=torch.int32, device=dev), "dw must be a floating-point tensor"),
], ids=["broadcasting-shape", "int"])
def test_fold_backward_checks_dw(fake, dw, match):
    """dw shaped like w and floating point on both paths (a (1, K) dw broadcast against gamma on
    the CPU path while the fake path answered w's shape)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from coda_cute.ops import fold

    def call(dev):
        w = torch.ones(80, 64, dtype=torch.bfloat16, device=dev)
        gamma = torch.ones(64, dtype=torch.float32, device=dev)
        return fold.fold_gamma_backward(dw(dev), w, gamma)

    with pytest.raises(ValueError, match=match):
        if fake:
            with FakeTensorMode():
                call("cuda")
        else:
            call("cpu")
