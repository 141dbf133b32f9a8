"""CPU (CI) tests of coda.gemm up to the kernel launch: the fp32 reference, argument validation,
the host path that turns tensors into a kernel spec and TMA views, and the torch.library
registration (opcheck, fake tensors, torch.compile, autograd).

Layout and alignment rules are device-independent, so they run on CPU tensors through
``gemm_impl`` with the device check and the launch stubbed out (``hopper_host``); dtype and shape
rules also run through the public op on fake CUDA tensors.
"""

import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import coda_cute
from coda_cute import dispatch
from coda_cute.epilogue import runner as run_mod
from coda_cute.kernels.common.config import MAX_TAIL_SPLIT, GemmConfig, tail_split
from coda_cute.ops import gemm as gemm_mod
from coda_cute.reference import gemm_ref
from helpers import on_path, rel_err

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# -- reference math --------------------------------------------------------------------------------
A2 = [[1.0, 2.0], [3.0, 4.0]]
B2 = [[5.0, 6.0], [7.0, 8.0]]
AB2 = [[19.0, 22.0], [43.0, 50.0]]


@pytest.mark.parametrize("dtype", [BF16, F16, E4M3, E5M2])
def test_ref_hand_computed(dtype):
    out = gemm_ref(torch.tensor(A2).to(dtype), torch.tensor(B2).to(dtype))
    assert out.dtype == (BF16 if dtype in (E4M3, E5M2) else dtype)
    assert out.float().tolist() == AB2


def test_ref_fp8_scales():
    a, b = torch.tensor(A2).to(E4M3), torch.tensor(B2).to(E4M3)
    sa, sb = torch.tensor([[2.0], [0.5]]), torch.tensor([[1.0, 0.25]])
    want = [[38.0, 11.0], [21.5, 6.25]]
    assert gemm_ref(a, b, sa, sb, out_dtype=F32).tolist() == want
    assert gemm_ref(a, b, sa.flatten(), sb.flatten(), out_dtype=F32).tolist() == want  # (M,), (N,)
    assert gemm_ref(a, b, torch.tensor(0.5), torch.tensor([4.0]), out_dtype=F32).tolist() == \
        [[2 * v for v in row] for row in AB2]


def test_ref_batched_with_rowwise_scales():
    a = torch.tensor([A2, [[1.0, 0.0], [0.0, 1.0]]]).to(E4M3)  # batch 1 is the identity
    b = torch.tensor([B2, B2]).to(E4M3)
    sa = torch.tensor([[[1.0], [1.0]], [[2.0], [4.0]]])  # (L, M, 1)
    sb = torch.ones(2, 1, 2)  # (L, 1, N)
    out = gemm_ref(a, b, sa, sb, out_dtype=F32)
    assert out.shape == (2, 2, 2)
    assert out[0].tolist() == AB2
    assert out[1].tolist() == [[10.0, 12.0], [28.0, 32.0]]
    assert gemm_ref(a, b, sa.squeeze(-1), sb.squeeze(1), out_dtype=F32).equal(out)  # (L, M), (L, N)


def test_ref_rounds_once_at_the_end():
    a, b = torch.randn(33, 70).to(BF16), torch.randn(70, 20).to(BF16)
    exact = gemm_ref(a, b, round_output=False)
    assert exact.dtype == F32
    assert torch.allclose(exact, a.double().matmul(b.double()).float(), rtol=1e-5, atol=1e-5)
    assert gemm_ref(a, b).equal(exact.to(BF16))
    assert gemm_ref(a, b, out_dtype=F32).equal(exact)


def test_ref_fp8_matches_scaled_mm():
    a, w = torch.randn(32, 64).to(E4M3), torch.randn(48, 64).to(E4M3)
    sa, sb = torch.tensor(0.5), torch.tensor(2.0)
    ours = gemm_ref(a, w.t(), sa, sb, out_dtype=F32)
    theirs = torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=F32)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-4)


# -- dtype and shape rules through the public op on fake CUDA tensors --------------------------------
def _cuda(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="cuda")


def _fp8_args(m=64, n=32, k=48, sa=None, sb=None, batch=()):
    a = _cuda(*batch, m, k, dtype=E4M3)
    b = _cuda(*batch, n, k, dtype=E4M3).transpose(-1, -2)
    sa = _cuda(*batch, m, 1, dtype=F32) if sa is None else sa()
    sb = _cuda(*batch, 1, n, dtype=F32) if sb is None else sb()
    return (a, b), dict(scale_a=sa, scale_b=sb)


BAD_CALLS = {
    "bf16 x fp16": (lambda: ((_cuda(64, 48), _cuda(48, 32, dtype=F16)), {}),
                    TypeError, r"a and b must be both bfloat16, both float16, or both FP8.*a=torch.bfloat16, b=torch.float16"),
    "fp32 inputs": (lambda: ((_cuda(64, 48, dtype=F32), _cuda(48, 32, dtype=F32)), {}),
                    TypeError, r"both bfloat16, both float16"),
    "fp8 x bf16": (lambda: ((_cuda(64, 48, dtype=E4M3), _cuda(48, 32)), {}),
                   TypeError, r"cannot mix FP8 and 16-bit operands: a is torch.float8_e4m3fn, b is torch.bfloat16"),
    "fp8 without scales": (lambda: ((_cuda(64, 48, dtype=E4M3), _cuda(32, 48, dtype=E4M3).t()), {}),
                           ValueError, r"FP8 inputs need fp32 scale_a and scale_b"),
    "fp8 without scale_b": (lambda: ((_cuda(64, 48, dtype=E4M3), _cuda(32, 48, dtype=E4M3).t()),
                                     dict(scale_a=_cuda(64, 1, dtype=F32))),
                            ValueError, r"FP8 inputs need fp32 scale_a and scale_b"),
    "scale_a one short": (lambda: _fp8_args(sa=lambda: _cuda(63, 1, dtype=F32)),
                          ValueError, r"scale_a must hold one number, or one per row of a: shape \(64,\) or \(64, 1\)"),
    "scale_b as a column": (lambda: _fp8_args(sb=lambda: _cuda(32, 1, dtype=F32)),
                            ValueError, r"scale_b must hold one number, or one per column of b: .*\(1, 32\).*got \(32, 1\)"),
    "scale_a bf16": (lambda: _fp8_args(sa=lambda: _cuda(64, 1, dtype=BF16)),
                     TypeError, r"scale_a must be a float32 tensor, got torch.bfloat16"),
    "scale_a strided": (lambda: _fp8_args(sa=lambda: torch.empty_strided((64, 1), (2, 1), device="cuda")),
                        ValueError, r"scale_a must be contiguous along its 64 entries"),
    "batched scale_a without batch": (lambda: _fp8_args(sa=lambda: _cuda(64, 1, dtype=F32), batch=(2,)),
                                      ValueError, r"scale_a .* shape \(2, 64\) or \(2, 64, 1\)"),
    "scales on bf16": (lambda: ((_cuda(64, 48), _cuda(48, 32)), dict(scale_a=_cuda(1, dtype=F32))),
                       ValueError, r"scale_a / scale_b apply to FP8 inputs only"),
    "K mismatch": (lambda: ((_cuda(64, 48), _cuda(40, 32)), {}),
                   ValueError, r"inner dimensions differ: a is \(64, 48\) \(K=48\), b is \(40, 32\) \(K=40\)"),
    "batch mismatch": (lambda: ((_cuda(2, 64, 48), _cuda(3, 48, 32)), {}),
                       ValueError, r"batch sizes differ: a has 2, b has 3"),
    "2-D x 3-D": (lambda: ((_cuda(64, 48), _cuda(1, 48, 32)), {}),
                  ValueError, r"a and b must both be 2-D .* or both 3-D .*a.dim\(\)=2, b.dim\(\)=3"),
    "1-D": (lambda: ((_cuda(48), _cuda(48)), {}), ValueError, r"must both be 2-D"),
    "out_dtype int32": (lambda: ((_cuda(64, 48), _cuda(48, 32)), dict(out_dtype=torch.int32)),
                        TypeError, r"out_dtype must be bfloat16, float16 or float32, got torch.int32"),
    "out_dtype fp8": (lambda: (_fp8_args()[0], dict(_fp8_args()[1], out_dtype=E4M3)),
                      TypeError, r"out_dtype must be"),
    "fast accumulation on bf16": (lambda: ((_cuda(64, 48), _cuda(48, 32)), dict(use_fast_accum=True)),
                                  ValueError, r"use_fast_accum applies to FP8 inputs only"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_arguments_on_fake_cuda(case):
    build, exc, match = BAD_CALLS[case]
    with FakeTensorMode():
        args, kwargs = build()
        with pytest.raises(exc, match=match):
            coda_cute.gemm(*args, **kwargs)


def test_scale_must_be_a_tensor():
    # The op's schema already refuses non-tensors; gemm_impl callers get the same rule.
    with pytest.raises(TypeError, match=r"scale_b must be a float32 tensor, got float"):
        gemm_mod.check_shapes(_fp8(8, 16), _fp8(8, 16).t(), torch.ones(1), 1.0, None)


@pytest.mark.parametrize("shapes,out_shape,dtype,kw", [
    (((64, 48), (32, 48)), (64, 32), BF16, {}),
    (((3, 64, 48), (3, 32, 48)), (3, 64, 32), BF16, {}),
    (((64, 48), (32, 48)), (64, 32), F32, dict(out_dtype=F32)),
])
def test_fake_cuda_output_meta(shapes, out_shape, dtype, kw):
    with FakeTensorMode():
        a, w = _cuda(*shapes[0]), _cuda(*shapes[1])
        out = coda_cute.gemm(a, w.transpose(-1, -2), **kw)
        assert (tuple(out.shape), out.dtype, out.device) == (out_shape, dtype, torch.device("cuda", 0))
        args, kwargs = _fp8_args(batch=(2,))
        out8 = torch.ops.coda.gemm(*args, **kwargs, out_dtype=F16)
        assert (tuple(out8.shape), out8.dtype, out8.device.type) == ((2, 64, 32), F16, "cuda")


# -- layout and alignment rules on the host path (CPU tensors, launch stubbed out) -------------------
@pytest.fixture
def hopper_host(monkeypatch):
    """Run gemm_impl on CPU tensors as if on an sm_90 device; record the launch instead of doing it.

    Yields the list of launches: (spec, a_view, b_view, d_view, scale_a_view, scale_b_view), where
    ``spec`` describes the plain GEMM the epilogue tree encodes (d_dtype, scale modes).
    """
    launches = []

    def fake_kernel(spec):
        inputs = {i.name: i.kind for i in spec.tree.inputs}
        mode = {"row_vec": "row", "col_vec": "row", "scalar_tensor": "tensor", None: "none"}
        desc = types.SimpleNamespace(
            a_major=spec.a_major, b_major=spec.b_major, a_dtype=spec.a_dtype, arch=spec.arch,
            config=spec.config, d_dtype=spec.tree.outputs[0].dtype,
            scale_a=mode[inputs.get("scale_a")], scale_b=mode[inputs.get("scale_b")])

        def launch(a, b, ins, outs, scalars, workspace, block_scales):
            launches.append((desc, a, b, outs[0], *(ins or (None, None))))
        return types.SimpleNamespace(fn=launch, stats={})

    monkeypatch.setattr(gemm_mod, "check_device", lambda *args: "sm_90a")
    monkeypatch.setattr(dispatch, "arch_of", lambda device: "sm_90a")
    monkeypatch.setattr(dispatch, "num_sms", lambda device: 132)
    monkeypatch.setattr(run_mod, "get_gemm", fake_kernel)
    monkeypatch.setattr(run_mod, "_plans", {})
    monkeypatch.setattr(gemm_mod, "_prepared", {})
    return launches


def _bf16(*shape):
    return torch.randn(*shape).to(BF16)


def _fp8(*shape):
    return torch.randn(*shape).to(E4M3)


BAD_LAYOUTS = {
    "a row stride not 16 B": (lambda: (_bf16(64, 60), _bf16(60, 32)), r"a's strides must be multiples of 16 bytes \(8 elements of torch.bfloat16\)"),
    "b row stride not 16 B": (lambda: (_bf16(64, 64), _bf16(64, 36)), r"b's strides must be multiples of 16 bytes"),
    "N not 16 B (out)": (lambda: (_bf16(64, 64), _bf16(36, 64).t()), r"out's strides must be multiples of 16 bytes"),
    "batch stride not 16 B": (lambda: (_bf16(3 * (64 * 64 + 3)).as_strided((3, 64, 64), (64 * 64 + 3, 64, 1)),
                                       _bf16(3, 64, 32)), r"a's strides must be multiples of 16 bytes"),
    "misaligned pointer": (lambda: (_bf16(64 * 64 + 1)[1:].view(64, 64), _bf16(64, 32)),
                           r"a's data pointer must be 16-byte aligned \(got offset 2 bytes\)"),
    "neither dim contiguous": (lambda: (_bf16(64, 64, 2)[..., 0], _bf16(64, 32)),
                               r"a has strides \(128, 2\): one of its last two dimensions must be contiguous"),
    "b neither dim contiguous": (lambda: (_bf16(64, 64), _bf16(64, 32, 2)[..., 0]),
                                 r"b has strides .* must be contiguous"),
    "fp8 a M-major": (lambda: (_fp8(64, 96).t(), _fp8(32, 64).t()), r"FP8 operands must be K-major"),
    "fp8 b N-major": (lambda: (_fp8(96, 64), _fp8(64, 32)), r"FP8 operands must be K-major"),
}


@pytest.mark.parametrize("case", list(BAD_LAYOUTS))
def test_bad_layouts_rejected_before_launch(case, hopper_host):
    build, match = BAD_LAYOUTS[case]
    a, b = build()
    scales = {}
    if a.dtype == E4M3:
        scales = dict(scale_a=torch.ones(a.shape[0], 1), scale_b=torch.ones(1, b.shape[1]))
    with pytest.raises(ValueError, match=match):
        gemm_mod.gemm_impl(a, b, **scales)
    assert not hopper_host


def test_bad_out_rejected(hopper_host):
    with pytest.raises(ValueError, match=r"out must be a torch.bfloat16 tensor of shape \(64, 32\), got torch.bfloat16 \(32, 64\)"):
        gemm_mod.gemm_impl(_bf16(64, 48), _bf16(48, 32), out=torch.empty(32, 64, dtype=BF16))
    assert not hopper_host


def test_prepared_calls_stay_bounded(hopper_host, monkeypatch):
    """A run whose token count changes every step (packed sequences) adds a call signature per
    step: the per-signature cache is bounded, and a call after it is cleared still launches."""
    monkeypatch.setattr(gemm_mod, "_MAX_PREPARED", 3)
    b = _bf16(40, 72).t()
    for m in range(8, 64, 8):
        gemm_mod.gemm_impl(_bf16(m, 72), b)
        assert len(gemm_mod._prepared) <= 3
    assert [dv.shape[0] for _, _, _, dv, _, _ in hopper_host] == list(range(8, 64, 8))

@pytest.mark.parametrize("layout,majors", [("x@W.T", "kk"), ("dY@W", "kn"), ("dY.T@X", "mn"), ("mk", "mk")])
def test_training_layouts_launch_without_copies(layout, majors, hopper_host):
    m, n, k = 96, 40, 72
    a = _bf16(m, k) if majors[0] == "k" else _bf16(k, m).t()
    b = _bf16(n, k).t() if majors[1] == "k" else _bf16(k, n)
    out = gemm_mod.gemm_impl(a, b)
    (spec, av, bv, dv, sa, sb), = hopper_host
    assert (spec.a_major, spec.b_major) == tuple(majors)
    assert (spec.a_dtype, spec.d_dtype, spec.scale_a, spec.arch) == ("bfloat16", "bfloat16", "none", "sm_90a")
    assert spec.config == dispatch.select_config(m, n, k, 1, False, False, 132)
    assert av.data_ptr() == a.data_ptr() and bv.data_ptr() == b.data_ptr()  # views, not copies
    assert (av.shape, bv.shape, dv.shape) == ((m, k, 1), (n, k, 1), (m, n, 1))
    assert dv.data_ptr() == out.data_ptr() and out.shape == (m, n) and sa is None and sb is None
    assert (av.stride(1) if majors[0] == "k" else av.stride(0)) == 1


def test_fp8_launch_spec_and_scale_views(hopper_host):
    a, b = _fp8(2, 64, 128), _fp8(2, 48, 128).transpose(-1, -2)
    sa, sb = torch.rand(2, 64, 1), torch.rand(2, 1, 48)
    gemm_mod.gemm_impl(a, b, sa, sb, out_dtype=F32, use_fast_accum=True)
    gemm_mod.gemm_impl(a[0], b[0], torch.tensor(2.0), torch.tensor([3.0]))
    (spec, av, bv, dv, sav, sbv), (spec1, *_, sav1, sbv1) = hopper_host
    assert (spec.a_dtype, spec.d_dtype, spec.scale_a, spec.scale_b) == ("float8_e4m3fn", "float32", "row", "row")
    assert spec.config.fp8_fast_accum and spec.config.tile_k == 128
    assert (av.shape, dv.shape) == ((64, 128, 2), (64, 48, 2))
    # scale_b is a column vector: the launch zero-pads it to whole cluster tiles (read unclamped)
    width = spec.config.tile_n * spec.config.cluster_n
    n_tiles = -(-48 // width) * width
    assert (sav.shape, sav.stride(), sbv.shape, sbv.stride()) == ((64, 2), (1, 64), (n_tiles, 2), (1, n_tiles))
    assert torch.equal(sbv[:48].t(), sb[:, 0]) and not sbv[48:].any()
    assert (spec1.scale_a, spec1.scale_b, spec1.d_dtype) == ("tensor", "tensor", "bfloat16")
    assert not spec1.config.fp8_fast_accum
    assert sav1.shape == sbv1.shape == (1,)


def test_column_vectors_are_padded_to_whole_clusters(hopper_host):
    # 3 column tiles in 1x2 clusters: the second CTA of the last cluster visits a tile past N and
    # reads scale_b there (unclamped), so even a tile-aligned N gets a padded copy
    a, b, sb = _fp8(64, 128), _fp8(384, 128).t(), torch.rand(1, 384)
    cfg = GemmConfig(128, 128, 128, "cooperative", 1, 2)
    gemm_mod.gemm_impl(a, b, torch.rand(64, 1), sb, out_dtype=BF16, config=cfg)
    gemm_mod.gemm_impl(a, b[:, :256], torch.rand(64, 1), sb[:, :256].contiguous(), out_dtype=BF16, config=cfg)
    (_, *_, sbv), (_, *_, sbv2) = hopper_host
    assert sbv.shape == (512, 1) and torch.equal(sbv[:384, 0], sb[0]) and not sbv[384:].any()
    assert sbv2.shape == (256, 1)  # whole clusters already: the caller's tensor itself


def test_extent_one_dims_get_legal_strides(hopper_host):
    # M == 1 with an odd row stride, and K == 1 (outer product): both are fine for TMA.
    gemm_mod.gemm_impl(_bf16(3, 64)[:1].as_strided((1, 64), (7, 1)), _bf16(64, 32))
    gemm_mod.gemm_impl(_bf16(64, 1), _bf16(1, 32))
    (s1, a1, *_), (s2, a2, b2, *_) = hopper_host
    assert s1.a_major == "k" and a1.stride(0) % 8 == 0
    assert (s2.a_major, s2.b_major) == ("m", "n")
    assert a2.stride(0) == 1 and b2.stride(0) == 1


@pytest.mark.parametrize("path", ["cpu", "fake"])
def test_empty_products_on_the_other_paths_are_the_launch_path_s(path):
    """K = 0 gives zeros and N = 0 an empty result, as torch.mm and the CUDA path do (the fake
    and CPU paths raised that K and N must be multiples of 8, which 0 is); fast accumulation on
    16-bit inputs is refused there too."""
    with on_path(path):
        zeros = coda_cute.gemm(_bf16(64, 0), _bf16(0, 32))
        assert tuple(zeros.shape) == (64, 32)
        if path == "cpu":
            assert not zeros.any()
        assert tuple(coda_cute.gemm(_bf16(64, 64), _bf16(64, 0)).shape) == (64, 0)
        with pytest.raises(ValueError, match="use_fast_accum applies to FP8 inputs only"):
            coda_cute.gemm(_bf16(64, 48), _bf16(48, 32), use_fast_accum=True)


def test_empty_problems_skip_the_launch(hopper_host):
    out = gemm_mod.gemm_impl(_bf16(64, 0), _bf16(0, 32))
    assert out.shape == (64, 32) and out.dtype == BF16 and not out.any()
    assert gemm_mod.gemm_impl(_bf16(0, 16), _bf16(16, 32), out_dtype=F32).shape == (0, 32)
    assert not hopper_host


# -- devices ------------------------------------------------------------------------------------------
def test_cpu_tensors_need_reference_mode():
    a, b = _bf16(8, 16), _bf16(16, 8)
    with pytest.raises(ValueError, match=r"runs on CUDA tensors .*reference_on_cpu"):
        coda_cute.gemm(a, b)
    with pytest.raises(ValueError, match=r"run on CUDA tensors; got tensors on 'cpu'"):
        gemm_mod.gemm_impl(a, b)


def test_mixed_devices_rejected():
    with pytest.raises(ValueError, match=r"a is on meta but b is on cpu"):
        gemm_mod.check_device(torch.empty(8, 8, device="meta"), torch.empty(8, 8), None, None)
    with pytest.raises(ValueError, match=r"scale_b is on cpu but a is on meta"):
        m = torch.empty(8, 8, device="meta")
        gemm_mod.check_device(m, m, None, torch.ones(1))


@pytest.mark.parametrize("cap,result", [((9, 0), "sm_90a"), ((10, 0), NotImplementedError),
                                        ((8, 0), NotImplementedError), ((12, 0), NotImplementedError)])
def test_arch_selection(cap, result, monkeypatch):
    monkeypatch.setattr(dispatch, "_device_props", lambda index: (cap, 132, "Some GPU"))
    dev = torch.device("cuda", 0)
    if isinstance(result, str):
        assert dispatch.arch_of(dev) == result
    else:
        with pytest.raises(result, match="Blackwell" if cap[0] == 10 else "need a Hopper GPU"):
            dispatch.arch_of(dev)


# -- torch.library registration -------------------------------------------------------------------------
ALL_OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _opcheck_cases():
    yield "bf16 2-D", (_bf16(32, 48).requires_grad_(), _bf16(24, 48).t().requires_grad_()), {}, ALL_OPCHECKS
    yield "bf16 3-D", (_bf16(2, 32, 48).requires_grad_(), _bf16(2, 48, 24).requires_grad_()), {}, ALL_OPCHECKS
    yield "fp16 -> fp32", (torch.randn(16, 32).to(F16), torch.randn(32, 8).to(F16)), dict(out_dtype=F32), ALL_OPCHECKS
    a, b = _fp8(32, 64), _fp8(24, 64).t()
    # test_schema compares inputs with allclose, which CPU torch does not implement for fp8.
    yield "fp8 rowwise", (a, b, torch.rand(32, 1) + 0.5, torch.rand(1, 24) + 0.5), {}, ALL_OPCHECKS[1:]


@pytest.mark.parametrize("case", list(_opcheck_cases()), ids=lambda c: c[0])
def test_opcheck(case):
    _, args, kwargs, utils = case
    with coda_cute.reference_on_cpu():
        result = torch.library.opcheck(torch.ops.coda.gemm.default, args, kwargs, test_utils=utils)
    assert set(result) == set(utils) and all(v == "SUCCESS" for v in result.values()), result


def test_torch_compile_fullgraph_aot_eager():
    a, w, g = _bf16(40, 64), _bf16(24, 64), _bf16(24)

    def f(a, w, g):
        return torch.relu(coda_cute.gemm(a, w.t()) + g) * 2

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    with coda_cute.reference_on_cpu():
        got = compiled(a, w, g)
        want = f(a, w, g)
    assert got.equal(want)
    assert rel_err(got, torch.relu(a.float() @ w.float().t() + g.float()) * 2) < 1e-2


@pytest.mark.parametrize("batch", [(), (3,)])
def test_autograd_matches_torch(batch):
    x = _bf16(*batch, 48, 64).requires_grad_()
    w = _bf16(*batch, 32, 64).requires_grad_()
    g = _bf16(*batch, 48, 32)
    with coda_cute.reference_on_cpu():
        y = coda_cute.gemm(x, w.transpose(-1, -2))
        y.backward(g)
    xr, wr, gr = x.detach().float(), w.detach().float(), g.float()
    assert y.dtype == BF16 and rel_err(y, xr @ wr.transpose(-1, -2)) < 1e-2
    assert x.grad.dtype == BF16 and rel_err(x.grad, gr @ wr) < 1e-2
    assert rel_err(w.grad, gr.transpose(-1, -2) @ xr) < 1e-2


def test_fp8_has_no_autograd():
    a = _fp8(16, 32).requires_grad_()
    with coda_cute.reference_on_cpu(), pytest.raises(NotImplementedError, match="FP8 inputs have no autograd"):
        coda_cute.gemm(a, _fp8(16, 32).t(), scale_a=torch.ones(1), scale_b=torch.ones(1))


# -- split-K: the K-slice views and the rules (the launch itself is a GPU test) -----------------------
@pytest.mark.parametrize("a_major,b_major", [("k", "k"), ("k", "n"), ("m", "k"), ("m", "n")])
def test_split_k_views_sum_to_the_product(a_major, b_major):
    m, n, k, split = 5, 7, 24, 3
    a = torch.randn(m, k, dtype=torch.float64) if a_major == "k" else torch.randn(k, m, dtype=torch.float64).t()
    b = torch.randn(n, k, dtype=torch.float64).t() if b_major == "k" else torch.randn(k, n, dtype=torch.float64)
    a_s, b_s = gemm_mod.split_k_views(a, b, split)
    assert a_s.shape == (split, m, k // split) and b_s.shape == (split, k // split, n)
    assert a_s.data_ptr() == a.data_ptr() and b_s.data_ptr() == b.data_ptr()  # views, no copies
    assert torch.allclose(torch.bmm(a_s, b_s).sum(0), a @ b)
    assert torch.equal(a_s[1], a[:, k // split: 2 * k // split])


def test_split_k_rules():
    a, b = torch.empty(128, 4096, dtype=torch.bfloat16), torch.empty(4096, 64, dtype=torch.bfloat16)
    gemm_mod.check_split_k(a, b, 4, None)
    gemm_mod.check_split_k(a, b, 8, GemmConfig(128, 128, 64, "pingpong"))
    with pytest.raises(ValueError, match=r"multiple of split_k x tile_k = 192 .*K=4096"):
        gemm_mod.check_split_k(a, b, 3, None)
    with pytest.raises(ValueError, match="positive int"):
        gemm_mod.check_split_k(a, b, 0, None)
    with pytest.raises(ValueError, match="16-bit"):
        gemm_mod.check_split_k(a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn), 2, None)
    with pytest.raises(ValueError, match="2-D"):
        gemm_mod.check_split_k(a[None], b[None], 2, None)


@pytest.mark.parametrize("majors", ["kk", "kn", "mk", "mn"])
def test_split_k_is_one_batched_launch_on_the_slices(majors, hopper_host):
    m, n, k, split = 128, 64, 1024, 4
    a = _bf16(m, k) if majors[0] == "k" else _bf16(k, m).t()
    b = _bf16(n, k).t() if majors[1] == "k" else _bf16(k, n)
    gemm_mod.gemm_impl(a, b, split_k=split)
    (spec, av, bv, dv, sa, sb), = hopper_host
    assert (spec.a_major, spec.b_major, spec.d_dtype) == (majors[0], majors[1], "float32")
    assert spec.config == dispatch.select_config(m, n, k // split, split, False, False, 132)
    assert (av.shape, bv.shape, dv.shape) == ((m, k // split, split), (n, k // split, split), (m, n, split))
    assert av.data_ptr() == a.data_ptr() and bv.data_ptr() == b.data_ptr()  # views, not copies
    # slice s of the kernel's a is columns [s K/split, (s+1) K/split) of a
    assert torch.equal(av[:, :, 2], a[:, 2 * k // split: 3 * k // split])


# -- split tail: host mirror of the scheduler's tail, config rules --------------------------------
def test_tail_split_cuts_only_a_nearly_empty_last_round():
    assert tail_split(2048, 66, 112) == (2, MAX_TAIL_SPLIT)  # 16384 x 4096 x 14336 on 128 x 128, 2x1
    assert tail_split(2048, 66, 32) == (2, 3)  # short K: fewer slices (each costs a read-back)
    assert tail_split(99, 66, 64) == (33, 2)  # two slots per tail tile
    assert tail_split(3072, 66, 112) == (36, 1)  # more than half the slots busy: not split
    assert tail_split(132, 66, 112) == (0, 1)  # full last round
    assert tail_split(68, 66, 5) == (2, 1)  # too few k-tiles to share


def test_split_tail_rules():
    import cutlass

    from coda_cute.kernels.epilogue import nodes as N
    from coda_cute.kernels.sm90.gemm import Sm90Gemm

    with pytest.raises(ValueError, match="split_tail needs the cooperative schedule"):
        GemmConfig(128, 128, 64, "pingpong", split_tail=True)
    tree = N.Epilogue(N.store(N.acc() + N.tile("residual", "bfloat16"), "out", "bfloat16"))
    with pytest.raises(ValueError, match="split_tail kernels take no tile inputs"):
        Sm90Gemm(GemmConfig(128, 128, 64, "cooperative", split_tail=True), cutlass.BFloat16,
                 cutlass.BFloat16, "k", "k", tree, 132)


def test_split_tail_workspace_is_sized_per_launch_only_when_the_tail_splits():
    plan = run_mod.Plan()
    plan.config = GemmConfig(128, 128, 128, "cooperative", 2, 1, split_tail=True)
    run_mod._tail_workspace(plan, 16384, 4096, 14336, 1, 132, torch.device("cpu"))
    assert plan.workspace is None and plan.tail_sizes == (2 * 8 * 2 * 128 * 128, 2 * 2)
    run_mod._tail_workspace(plan, 16384, 6144, 4096, 1, 132, torch.device("cpu"))  # 36 of 66: no split
    assert plan.tail_sizes is None and [t.numel() for t in plan.workspace] == [1, 1]
    plan.config = plan.config.with_(split_tail=False)
    run_mod._tail_workspace(plan, 16384, 4096, 14336, 1, 132, torch.device("cpu"))
    assert plan.workspace is None and plan.tail_sizes is None


def _gemm_bad_cases():
    """The issue's list: what the GPU rejects, the fake (tracing) and CPU reference paths must too."""
    yield "non-contiguous a", lambda t: (t(64, 96).as_strided((64, 48), (96, 2)), t(48, 32)), "one of its last two dimensions"
    yield "K = 100 bf16", lambda t: (t(64, 100), t(100, 32)), "multiples of 16 bytes"
    yield "pointer offset by one element", lambda t: (t(64 * 48 + 1).narrow(0, 1, 64 * 48).view(64, 48), t(48, 32)), "data pointer must be 16-byte aligned"
    yield "N = 12 result rows", lambda t: (t(64, 48), t(12, 48).t()), "the result's strides"


@pytest.mark.parametrize("case", list(_gemm_bad_cases()), ids=lambda c: c[0])
def test_gemm_layout_rules_on_fake_and_reference_paths(case):
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, make, match = case
    with coda_cute.reference_on_cpu(), pytest.raises(ValueError, match=match):
        torch.ops.coda.gemm(*make(lambda *s: torch.randn(*s).to(BF16)))
    with FakeTensorMode(), pytest.raises(ValueError, match=match):
        torch.ops.coda.gemm(*make(lambda *s: torch.empty(*s, dtype=BF16, device="cuda")))


def test_gemm_devices_must_match_on_fake_and_reference_paths():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), pytest.raises(ValueError, match="a is on cuda:0 but b is on cpu"):
        torch.ops.coda.gemm(torch.empty(64, 48, dtype=BF16, device="cuda"), torch.empty(48, 32, dtype=BF16))


@pytest.mark.parametrize("m, n, k", [
    (32768, 8192, 57344),   # gate/up dgrad, d 8192, 32768 tokens: 4.7 GB of operands
    (57344, 8192, 32768),   # its wgrad
])
def test_large_operands_rank_tiles_by_l2_intensity(m, n, k, monkeypatch):
    """Past LARGE_OPERAND_BYTES of 16-bit operands a config's rate is scaled by its L2
    intensity over the densest tile's (cooperative 128 x 256 2x1), which widens ping-pong 128 x
    128's predicted gap there; FP8 predictions do not move (its tables were not measured there)."""
    dense = GemmConfig(128, 256, 64, "cooperative", 2, 1)
    pp = GemmConfig(128, 128, 64, "pingpong", 2, 1)
    assert dispatch.l2_intensity(dense) == max(dispatch.l2_intensity(c) for c in dispatch.config_space(False))
    assert dispatch.select_config(m, n, k, 1, False, False, 132) == dense
    def gap():
        return dispatch.predicted_time(pp, m, n, k, 1, 132, False) / dispatch.predicted_time(dense, m, n, k, 1, 132, False)

    with_rule = gap()
    fp8 = [dispatch.select_config(m, n, k, 1, True, fast, 132) for fast in (False, True)]
    monkeypatch.setattr(dispatch, "LARGE_OPERAND_BYTES", 1 << 60)
    assert [dispatch.select_config(m, n, k, 1, True, fast, 132) for fast in (False, True)] == fp8
    assert with_rule == pytest.approx(gap() * dispatch.l2_intensity(dense) / dispatch.l2_intensity(pp))


#: (fp8 fast accumulation, M, N, K, the pick) on the training steps' GEMMs
CAP_PICKS = [
    # bf16, the 1b step (d 2048): K = 2048 keeps ping-pong, whose other warpgroup hides the epilogue
    *((False, *s, "pp_128x128x64_c2x1_g8") for s in [
        (16384, 3072, 2048), (16384, 16384, 2048), (4096, 128256, 2048), (16384, 8192, 2048)]),
    # from K = 4096 the cooperative 128 x 256 tile's fewer joules per FLOP win
    *((False, *s, "coop_128x256x64_c2x1_g8") for s in [
        (16384, 2048, 8192), (4096, 2048, 128256), (128256, 2048, 4096), (16384, 28672, 4096),
        (4096, 4096, 128256), (28672, 4096, 16384)]),
    # 24 x 8 tiles of 128 x 256 fill 1.45 waves of 132 SMs; 128 x 192 tiles fill them better
    (False, 3072, 2048, 16384, "coop_128x192x64_c2x1_g8"),
    # FP8 fast: K = 4096 (the 8b forward, the SwiGLU's dgrad) and 2048 (the 1b forward) ping-pong
    *((True, *s, "pp_128x128x128_c2x1_g8_fastacc") for s in [
        (16384, 6144, 4096), (16384, 28672, 4096), (16384, 14336, 4096), (16384, 16384, 2048)]),
    # the FP8 weight gradients and the long dgrads: cooperative 128 x 256
    *((True, *s, "coop_128x256x128_c2x1_g8_fastacc") for s in [
        (28672, 4096, 16384), (4096, 14336, 16384), (16384, 4096, 28672), (16384, 4096, 14336),
        (2048, 8192, 16384)]),
]


@pytest.mark.parametrize("fp8, m, n, k, want", CAP_PICKS)
def test_heuristic_picks_the_measured_best_at_the_power_cap(fp8, m, n, k, want):
    """The picks on the training steps' GEMMs (bf16, and FP8 with fast accumulation) are the
    configs that ran fastest back to back at the H200's power cap (scripts/exp_energy_tiles.py and
    its --fp8 run, 2026-12-04: the measured best or within 0.2 % of it on each of these shapes);
    from cool, ping-pong 128 x 128 2x1 had been the pick for all of them."""
    assert dispatch.select_config(m, n, k, 1, fp8, fp8, 132).name == want


def test_coop_epilogue_depth_by_kernel():
    """The exposed-epilogue depth: 16-bit and FP8 fast-accumulation cooperative tiles have their
    fitted ones, ping-pong and the promoted FP8 kernels none."""
    coop = GemmConfig(128, 256, 64, "cooperative", 2, 1)
    assert dispatch.coop_epilogue_k(coop, False) == dispatch.COOP_EPILOGUE_K
    fast = coop.with_(tile_k=128, fp8_fast_accum=True)
    assert dispatch.coop_epilogue_k(fast, True) == dispatch.COOP_EPILOGUE_K_FP8_FAST
    assert dispatch.coop_epilogue_k(coop.with_(tile_k=128), True) == 0
    assert dispatch.coop_epilogue_k(GemmConfig(128, 128, 64, "pingpong", 2, 1), False) == 0
