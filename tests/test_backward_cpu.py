"""CPU tests of the backward ops and the sublayer ops (no GPU: the reference path, fake tensors).

* The backward references (the analytic formulas the kernels implement) against float64
  autograd of the forward references, with ss recomputed from y (the ops' convention: ss is
  y's norm statistic and carries no gradient of its own).
* Every new op in ``reference_on_cpu`` mode is its reference; fake shapes on fake CUDA tensors;
  ``torch.library.opcheck``; bad input raises a clear error before any launch, also on the fake
  path.
"""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import coda_cute
from coda_cute import reference as R
from coda_cute.ops import lm_head_ce as LH
from coda_cute.ops.attention import qkv_heads
from coda_cute.ops.swiglu import zdz_tile_n
from coda_block_helpers import rand
from helpers import generator, rel_err

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
B, S, H, HKV, HD, D, FF, V, EPS = 2, 19, 4, 2, 16, 64, 48, 50, 1e-5
M, NQKV, NQK = B * S, (H + 2 * HKV) * HD, (H + HKV) * HD
INV_FREQ = R.rope_inv_freq(HD, 10000.0)
VW = 56  # a vocabulary of whole 16-byte rows
OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def stats(y):
    return R.norm_stats_partials_ref(y, 16)


def grads(fn, args, idx, cot=None):
    args = [a.detach().clone().requires_grad_() if i in idx else a for i, a in enumerate(args)]
    out = fn(*args)
    cot = torch.randn(out.shape, dtype=out.dtype, generator=generator(3)) if cot is None else cot
    return out.detach(), cot, torch.autograd.grad((out * cot).sum(), [args[i] for i in idx])


# -- the backward references vs float64 autograd -----------------------------------------------------
def test_mlp_backward_refs_equal_autograd():
    """swiglu_backward_ref + norm_backward_ref (+ the wgrads) = d/d(y, W_gu, W_down) of
    y2 = y + SwiGLU(RMSNorm(y) W_gu^T) W_down^T."""
    y, w_gu, w_down = rand(M, D, dtype=F64), rand(2 * FF, D, dtype=F64, scale=0.2), rand(D, FF, dtype=F64, scale=0.2)

    def mlp(y, w_gu, w_down):
        z, h = R.norm_swiglu_ref(y, w_gu, stats(y), EPS)
        return y + h @ w_down.t()

    _, c, (gy, ggu, gd) = grads(mlp, [y, w_gu, w_down], [0, 1, 2])
    ss = stats(y)
    z, h = R.norm_swiglu_ref(y, w_gu, ss, EPS)
    dzp, h2, zdz = R.swiglu_backward_ref(c, w_down, z, ss, EPS, 16)
    assert rel_err(h2, h) < 1e-12 and zdz.shape == (M, 3)
    assert rel_err(R.norm_backward_ref(dzp, w_gu, y, ss, zdz, EPS, c), gy) < 1e-10
    assert rel_err(dzp.t() @ y, ggu) < 1e-10 and rel_err(c.t() @ h, gd) < 1e-10


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_backward_ref_equals_autograd(qk_norm):
    y, w = rand(M, D, dtype=F64), rand(NQKV, D, dtype=F64, scale=0.2)
    pos = torch.arange(S).repeat(B)
    qn = (torch.rand(HD, dtype=F64) + 0.5) if qk_norm else None
    kn = (torch.rand(HD, dtype=F64) + 0.5) if qk_norm else None

    def qkv(y, w, qn, kn):
        return R.norm_rope_qkv_ref(y, w, stats(y), EPS, pos, INV_FREQ, H, HKV, HD, qn, kn, 1e-6)

    idx = [0, 1] + ([2, 3] if qk_norm else [])
    out, cot, want = grads(qkv, [y, w, qn, kn], idx)
    ss = stats(y)
    r = R.rms_rstd_ref(ss, D, EPS)
    pre = (r.unsqueeze(1) * (y @ w.t())) if qk_norm else None
    dq, dk, dv = qkv_heads(cot, B, H, HKV, HD)  # the cotangent in the attention core's layout
    g, zdz, dqn, dkn = R.rope_backward_ref(dq, dk, dv, out, r, pos, INV_FREQ, pre, qn, kn, 1e-6)
    assert rel_err(R.norm_backward_ref(g, w, y, ss, zdz, EPS), want[0]) < 1e-10
    assert rel_err(g.t() @ y, want[1]) < 1e-10
    if qk_norm:
        assert rel_err(dqn, want[2]) < 1e-10 and rel_err(dkn, want[3]) < 1e-10


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("gamma", [False, True])
def test_lm_head_grad_ref_equals_autograd(reduction, gamma):
    y, w = rand(M, D, dtype=F64), rand(V, D, dtype=F64, scale=0.3)
    g = (1 + rand(D, dtype=F64, scale=0.1)) if gamma else None
    t = torch.randint(0, V, (M,))
    t[::5] = -100
    dlse = rand(M, dtype=F64, scale=0.1)

    def loss_fn(y, w, g):
        loss, lse = R.lm_head_ce_ref(y, w, stats(y), EPS, t, -100, reduction, g)
        return loss, lse

    ins = [y.clone().requires_grad_(), w.clone().requires_grad_(), g.clone().requires_grad_() if gamma else None]
    loss, lse = loss_fn(*ins)
    dloss = rand(*loss.shape, dtype=F64) if reduction == "none" else torch.tensor(0.7, dtype=F64)
    total = (loss * dloss).sum() + (lse * dlse).sum()
    want = torch.autograd.grad(total, [i for i in ins if i is not None])
    got = R.lm_head_ce_grad_ref(y, w, stats(y), EPS, t, -100, reduction, g, dloss, dlse)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-10


def test_attention_ref_is_causal_gqa_sdpa():
    q, k, v = qkv_heads(rand(M, NQKV, dtype=F64), B, H, HKV, HD)
    o, lse = R.attention_ref(q, k, v)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert rel_err(o, want) < 1e-12
    s = (q @ k.repeat_interleave(H // HKV, 1).transpose(-1, -2)) * HD ** -0.5
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    assert rel_err(lse, s.logsumexp(-1)) < 1e-12


# -- the ops: reference mode, fake tensors, opcheck ----------------------------------------------------
def cases():
    x = rand(B, S, D)
    ss = stats(x.reshape(M, D))
    w_qkv, w_o = rand(NQKV, D, scale=D ** -0.5), rand(D, H * HD, scale=(H * HD) ** -0.5)
    pos = torch.arange(S, dtype=torch.int32).repeat(B)
    qn, kn = 1 + rand(HD, scale=0.1), 1 + rand(HD, scale=0.1)
    attn = (x, ss, w_qkv, w_o, pos, INV_FREQ, EPS, H, HKV, HD)
    yield "attention_block", attn, {}
    yield "attention_block+qk_norm", attn + (qn, kn, 1e-6), {}
    y = x.reshape(M, D).contiguous()
    w_gu, w_down = rand(2 * FF, D, scale=D ** -0.5), rand(D, FF, scale=FF ** -0.5)
    yield "mlp_block", (y, ss, w_gu, w_down, EPS), {}
    z = rand(M, 2 * FF)
    yield "swiglu_backward", (rand(M, D), w_down, z, ss, EPS), {}
    yield "norm_backward", (rand(M, 2 * FF), w_gu, y, ss, rand(M, 3, dtype=F32), EPS, rand(M, D)), {}
    q, k, v = qkv_heads(rand(M, NQKV), B, H, HKV, HD)
    qkv = rand(M, NQKV)
    r = torch.rand(M) + 0.5
    yield "rope_backward", (q, k, v, qkv, r, pos, INV_FREQ), {}
    yield "rope_backward+qk_norm", (q, k, v, qkv, r, pos, INV_FREQ, rand(M, NQKV), qn, kn, 1e-6), {}
    w_lm = rand(V, D, scale=D ** -0.5)
    t = torch.randint(0, V, (M,))
    t[::5] = -100
    g = 1 + rand(D, scale=0.1)
    yield "lm_head_ce_train", (y, w_lm, ss, EPS, t, -100, "mean", g), {}
    yield "lm_head_ce_train[sum]", (y, w_lm, ss, EPS, t, -100, "sum", None), {}
    lse = torch.randn(M)
    yield "lm_head_ce_backward", (y, w_lm, ss, EPS, t, lse, torch.randn(M), torch.randn(M), -100, "none", g), {}


def base(name):
    return name.split("+")[0].split("[")[0]


def ref_call(name, args):
    """The op's outputs from the references alone."""
    b = base(name)
    if b == "mlp_block":
        y, ss, w_gu, w_down, eps = args
        z, h = R.norm_swiglu_ref(y, w_gu, ss, eps)
        y2, ss2 = R.residual_gemm_norm_stats_ref(h, w_down, y, 64)
        return y2, z
    if b == "swiglu_backward":
        dy, w_down = args[:2]
        return R.swiglu_backward_ref(*args, zdz_tile_n(dy, w_down))
    if b == "norm_backward":
        return (R.norm_backward_ref(*args),)
    if b == "rope_backward":
        return tuple(o for o in R.rope_backward_ref(*args) if o is not None)
    if b == "lm_head_ce_train":  # one chunk at these sizes: no accumulator, the whole dl' deferred
        y, w, ss, eps, t, ig, red, g = args
        dy, _, dg = R.lm_head_ce_grad_ref(*args)
        r = R.rms_rstd_ref(ss, D, eps).unsqueeze(1)
        dl = (R.ce_dlogits_ref(*args)[1] * r).to(y.dtype)
        # the reference path's last-chunk operands: dl' itself and u = y * gamma
        return (*R.lm_head_ce_ref(*args), dy, *((dg,) if dg is not None else ()), dl, R.scale_columns_ref(y, g))
    if b == "lm_head_ce_backward":
        y, w, ss, eps, t, lse, dloss, dlse, ig, red, g = args
        dy, dw, dg = R.lm_head_ce_grad_ref(y, w, ss, eps, t, ig, red, g, dloss, dlse)
        return dy, dw, dg.to(g.dtype)  # the gradient of gamma in gamma's dtype
    return None


@pytest.mark.parametrize("case", list(cases()), ids=lambda c: c[0])
def test_op_in_reference_mode_is_the_reference(case):
    name, args, _ = case
    op = getattr(torch.ops.coda, base(name))
    with pytest.raises(ValueError, match="reference_on_cpu"):
        op(*args)
    with coda_cute.reference_on_cpu():
        got = op(*args)
    got = got if isinstance(got, tuple) else (got,)
    want = ref_call(name, args)
    if want is None:  # the attention block: its pieces' references, composed
        assert got[0].shape == args[0].shape and got[0].dtype == BF16
        return
    if base(name) == "mlp_block":
        got = (got[0], got[2])
    got = [g for g in got if g.numel()]  # empty weight gradients without QK-norm / gamma
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        assert rel_err(g, w) < 1e-6


@pytest.mark.parametrize("bad", [V, -1])
def test_lm_head_backward_targets_outside_the_vocabulary_are_refused(bad):
    """As the forward's: a target outside [0, V) that is not the ignore_index (the GPU path reads
    the same check back; its kernels would silently drop the target's -1 in dlogits)."""
    name, args, _ = next(c for c in cases() if c[0] == "lm_head_ce_backward")
    args = list(args)
    args[4] = args[4].clone()
    args[4][7] = bad
    with pytest.raises(ValueError, match=rf"coda.lm_head_ce_backward: targets must lie in \[0, {V}\) "
                                         rf"\(or -100, the ignore_index\); found {bad}"), coda_cute.reference_on_cpu():
        torch.ops.coda.lm_head_ce_backward(*args)


def zero_width_norm_calls():
    """Each norm op with d = 0 (the RMS norm's width): (op, arguments, what the message names)."""
    y0, w0, ss = torch.zeros(M, 0, dtype=BF16), torch.zeros(2 * FF, 0, dtype=BF16), stats(rand(M, D))
    yield "norm_swiglu", (y0, w0, ss, EPS), "columns of y"
    yield "mlp_block", (y0, ss, w0, torch.zeros(0, FF, dtype=BF16), EPS), "columns of y"
    yield "swiglu_backward", (y0, torch.zeros(0, FF, dtype=BF16), rand(M, 2 * FF).to(BF16), ss, EPS), "columns of dy"
    yield "norm_backward", (rand(M, 2 * FF).to(BF16), w0, y0, ss, stats(rand(M, D)), EPS), "columns of w"
    yield "lm_head_ce", (y0, torch.zeros(V, 0, dtype=BF16), ss, EPS, torch.randint(0, V, (M,))), "columns of y"


@pytest.mark.parametrize("path", ["cpu", "fake"])
@pytest.mark.parametrize("op, args, what", list(zero_width_norm_calls()), ids=lambda c: c if isinstance(c, str) else "")
def test_a_norm_of_no_columns_is_refused(path, op, args, what):
    """The GPU path divided by d (a raw ZeroDivisionError) where these paths answered shapes."""
    from helpers import on_path
    with pytest.raises(ValueError, match=rf"coda.{op}: the RMS norm's width d \({what}\) must be >= 1, got 0"), \
            on_path(path):
        getattr(torch.ops.coda, op)(*args)


def test_attention_block_reference_is_the_plain_composition():
    name, args, _ = next(c for c in cases() if c[0] == "attention_block+qk_norm")
    x, ss, w_qkv, w_o, pos, inv_freq, eps, h, hkv, hd, qn, kn, qk_eps = args
    with coda_cute.reference_on_cpu():
        y = torch.ops.coda.attention_block(*args)[0]
    x2 = x.reshape(M, D)
    qkv = R.norm_rope_qkv_ref(x2, w_qkv, ss, eps, pos, inv_freq, h, hkv, hd, qn, kn, qk_eps)
    o, _ = R.attention_ref(*qkv_heads(qkv, B, h, hkv, hd))
    want, _ = R.residual_gemm_norm_stats_ref(o.transpose(1, 2).reshape(M, -1), w_o, x2, 64)
    assert y.reshape(M, D).equal(want)


def fake_args(name):
    """(op, arguments (fake CUDA tensors: call inside FakeTensorMode), output shapes, None where
    the heuristic's tile decides) at Llama-3-8B's sizes, 16384 tokens."""
    m, d, f, v = 16384, 4096, 14336, 128256

    def t(*shape, dtype=BF16):
        return torch.empty(*shape, dtype=dtype, device="cuda")

    ss, y = t(m, 32, dtype=F32), t(m, d)
    if name == "attention_block":
        return torch.ops.coda.attention_block, (t(4, 4096, d), ss, t(6144, d), t(d, 4096), t(m, dtype=torch.int32),
                                                t(64, dtype=F32), EPS, 32, 8, 128), \
            [(4, 4096, d), (m, None), (m, 6144), (4, 32, 4096, 128), (4, 32, 4096)]
    if name == "mlp_block":
        return torch.ops.coda.mlp_block, (y, ss, t(2 * f, d), t(d, f), EPS), [(m, d), (m, None), (m, 2 * f)]
    if name == "swiglu_backward":
        return torch.ops.coda.swiglu_backward, (y, t(d, f), t(m, 2 * f), ss, EPS), [(m, 2 * f), (m, f), (m, None)]
    if name == "norm_backward":
        return torch.ops.coda.norm_backward, (t(m, 2 * f), t(2 * f, d), y, ss, t(m, 7, dtype=F32), EPS, y), [(m, d)]
    return torch.ops.coda.lm_head_ce_train, (y, t(v, d), ss, EPS, t(m, dtype=torch.int64), -100, "mean", t(d)), \
        [(), (m,), (m, d), (d,), (v, d), (None, v)]


@pytest.mark.parametrize("name", ["attention_block", "mlp_block", "swiglu_backward", "norm_backward", "lm_head_ce_train"])
def test_fake_cuda_shapes(name):
    with FakeTensorMode():
        op, args, want = fake_args(name)
        out = op(*args)
    out = out if isinstance(out, tuple) else (out,)
    for o, shape in zip(out, want):
        assert o.device.type == "cuda"
        assert o.dim() == len(shape) and all(s is None or a == s for a, s in zip(o.shape, shape)), (o.shape, shape)


@pytest.mark.parametrize("case", list(cases()), ids=lambda c: c[0])
def test_opcheck(case):
    name, args, kwargs = case
    skip = {id(INV_FREQ)}
    args = tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
                 and id(a) not in skip and base(name) in ("mlp_block", "attention_block", "lm_head_ce_train")
                 else a for a in args)
    with coda_cute.reference_on_cpu():
        result = torch.library.opcheck(getattr(torch.ops.coda, base(name)).default, args, kwargs,
                                       test_utils=OPCHECKS)
    assert all(v == "SUCCESS" for v in result.values()), result


def core_cases():
    """The ops the sublayers and the LM-head training op call inside: the attention core forward
    and backward, and the deferred last-chunk wgrad (with an fp32 and a bf16 accumulator of the
    other chunks, without one, without gamma)."""
    q, k, v = (rand(B, n, S, HD) for n in (H, HKV, HKV))
    with coda_cute.reference_on_cpu():
        o, lse = torch.ops.coda.attention_forward(q, k, v)
    yield "attention_forward", torch.ops.coda.attention_forward, (q, k, v)
    yield "attention_backward", torch.ops.coda.attention_backward, (rand(B, H, S, HD), q, k, v, o, lse)
    # a vocabulary whose dl rows are whole 16-byte words (opcheck re-creates inputs contiguous;
    # the training op passes a column slice of a padded buffer otherwise)
    dl, y, g, scale = rand(M, VW), rand(M, D), 1 + rand(D, scale=0.1), torch.tensor(0.37)
    dw = torch.ops.coda.lm_head_ce_dw
    yield "lm_head_ce_dw[fp32]", dw, (dl, y, g, rand(VW, D, dtype=F32), scale)
    yield "lm_head_ce_dw[bf16]", dw, (dl, y, g, rand(VW, D), scale)
    yield "lm_head_ce_dw[one chunk]", dw, (dl, y, None, torch.empty(0, dtype=BF16), scale)
    yield "lm_head_ce_dw_[in place]", torch.ops.coda.lm_head_ce_dw_, (dl, y, g, rand(VW, D), scale)


@pytest.mark.parametrize("case", list(core_cases()), ids=lambda c: c[0])
def test_core_ops_opcheck_and_reference(case):
    """opcheck, and the reference mode: attention against the float64 SDPA-math reference, the
    dW ops against dl^T (y gamma) + acc, times the scale (the in-place one in its accumulator)."""
    name, op, args = case
    in_place = name.startswith("lm_head_ce_dw_")
    with coda_cute.reference_on_cpu():
        result = torch.library.opcheck(op.default, args, test_utils=OPCHECKS)
        if in_place:
            acc = args[3].clone()
            assert op(*args) is None
            got, args = args[3], args[:3] + (acc,) + args[4:]
        else:
            got = op(*args)
    assert all(v == "SUCCESS" for v in result.values()), result
    if name == "attention_forward":
        want = R.attention_ref(*args)[0]
        assert got[0].shape == want.shape and rel_err(got[0], want) < 1e-2
    elif name == "attention_backward":
        for g, w in zip(got, R.attention_backward_ref(*args[:4])):
            assert g.shape == w.shape and g.dtype == BF16 and rel_err(g, w) < 1e-2
    else:
        dl, y, g, acc, scale = args
        u = y.double() * (g.double() if g is not None else 1)
        want = (dl.double().t() @ u + (acc.double() if acc.numel() else 0)) * float(scale)
        assert got.shape == (VW, D) and got.dtype == BF16 and rel_err(got, want) < 1e-2


@pytest.mark.parametrize("case", list(cases()), ids=lambda c: c[0])
def test_reference_ops_compile_no_kernel(case, monkeypatch):
    """The CPU reference path of every op runs no kernel and asks no build about spills (a
    compile of about 2 s per op and process on a machine without a GPU)."""
    from coda_cute.epilogue import runner
    from coda_cute.ops import rmsnorm

    def no_build(*a, **k):
        raise AssertionError("the CPU reference path asked a kernel build about spills")
    monkeypatch.setattr(runner, "spills", no_build)
    rmsnorm._tile_n_on.cache_clear()
    name, args, _ = case
    with coda_cute.reference_on_cpu():
        getattr(torch.ops.coda, base(name))(*args)


def test_lm_head_bf16_accumulator_refuses_a_second_backward(monkeypatch):
    """With a bf16 dW accumulator the last chunk's wgrad turns it into the gradient in place: a
    retained graph's second backward raises (autograd's version check) instead of adding to a
    changed sum."""
    m = 1000
    y, w = rand(m, D).requires_grad_(), rand(V, D, scale=D ** -0.5).requires_grad_()
    monkeypatch.setattr(LH, "CHUNK_BYTES", int(0.3 * m * 2 * 56))
    assert LH.plan_chunks(m, V, D)[1] == BF16
    with coda_cute.reference_on_cpu():
        loss = LH.cross_entropy(y, w, stats(y.detach()), EPS, torch.randint(0, V, (m,)))
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_lm_head_chunk_plan():
    """The benchmark shape: 4 chunks of 4096 rows (a power of two times 128) within 1.5 GiB, dW
    in bf16; small problems one chunk (no accumulation); fp32 accumulation where it fits next to
    a chunk."""
    rows, acc = LH.plan_chunks(16384, 128256, 2048)
    assert rows == 4096 and rows * 128256 * 2 <= LH.CHUNK_BYTES and acc == BF16
    assert LH.plan_chunks(4133, 32003, 1024) == (4133, None)
    whole = 4133 * 2 * 32008  # bytes of all the logits
    assert LH.plan_chunks(4133, 32003, 256, budget=int(0.9 * whole)) == (2048, F32)
    assert LH.plan_chunks(4133, 32003, 1024, budget=int(0.3 * whole)) == (1024, BF16)
    assert LH.plan_chunks(100, 32003, 1024, budget=1000) == (100, None)  # below one 128-row chunk


# -- bad input -------------------------------------------------------------------------------------------
def _bad():
    c = dict((n, a) for n, a, _ in cases())
    y, ss, w_gu, w_down, eps = c["mlp_block"]
    yield "mlp w_down shape", lambda: torch.ops.coda.mlp_block(y, ss, w_gu, w_down[:, :40].contiguous(), eps), ValueError, r"w_down must be \(d, f\)"
    dy, wd, z, ss_, eps = c["swiglu_backward"]
    yield "swiglu_bwd z shape", lambda: torch.ops.coda.swiglu_backward(dy, wd, z[:, :48].contiguous(), ss_, eps), ValueError, r"z must be the saved pre-activation \(M, 2f\)"
    yield "swiglu_bwd dy dtype", lambda: torch.ops.coda.swiglu_backward(dy.float(), wd, z, ss_, eps), TypeError, "dy must be"
    g, w, yy, ss2, zdz, eps, dres = c["norm_backward"]
    yield "norm_bwd w rows", lambda: torch.ops.coda.norm_backward(g, w[:40], yy, ss2, zdz, eps), ValueError, "out_features = the consumer.s output width N"
    yield "norm_bwd residual shape", lambda: torch.ops.coda.norm_backward(g, w, yy, ss2, zdz, eps, dres[:5]), ValueError, "residual_grad must be"
    yield "norm_bwd zdz rows", lambda: torch.ops.coda.norm_backward(g, w, yy, ss2, zdz[:5], eps), ValueError, "zdz must be"
    q, k, v, qkv, r, pos, inv = c["rope_backward"]
    rb = torch.ops.coda.rope_backward
    yield "rope_bwd pre without weights", lambda: rb(q, k, v, qkv, r, pos, inv, qkv), ValueError, "pre .* goes with"
    yield "rope_bwd dk heads", lambda: rb(q, k[:, :1], v, qkv, r, pos, inv), ValueError, "dv must be"
    yield "rope_bwd qkv shape", lambda: rb(q, k, v, qkv[:, :64].contiguous(), r, pos, inv), ValueError, "qkv must be"
    yield "rope_bwd strided head_dim", lambda: rb(q.transpose(2, 3), k, v, qkv, r, pos, inv), ValueError, "contiguous head_dim"
    args = c["lm_head_ce_train"]
    yield "train reduction none", lambda: torch.ops.coda.lm_head_ce_train(*args[:6], "none", args[7]), ValueError, "reduction must be one of"
    yield "train gamma shape", lambda: torch.ops.coda.lm_head_ce_train(*args[:7], args[7][:8]), ValueError, r"gamma must be \(d,\)"
    yield "train target range", lambda: torch.ops.coda.lm_head_ce_train(args[0], args[1], args[2], EPS, torch.full((M,), V)), ValueError, r"\[0, 50\)"
    dl, y_, g_, acc, scale = next(a for n, _, a in core_cases() if n == "lm_head_ce_dw[bf16]")
    dw, dw_ = torch.ops.coda.lm_head_ce_dw, torch.ops.coda.lm_head_ce_dw_
    yield "dw dl dtype", lambda: dw(dl.float(), y_, g_, acc, scale), TypeError, "dl must be a 2-D bfloat16"
    yield "dw dl column-major", lambda: dw(dl.t().contiguous().t(), y_, g_, acc, scale), ValueError, "dl must be row-major"
    yield "dw dl unpadded rows", lambda: dw(dl[:, :V].contiguous(), y_, g_, acc[:V], scale), ValueError, "row stride that is a multiple of 8"
    yield "dw dl padded rows", lambda: dw(dl[:, :V], y_, g_, acc[:V].contiguous(), scale).shape, None, None
    yield "dw y rows", lambda: dw(dl, y_[:5], g_, acc, scale), ValueError, "one row per row of dl"
    yield "dw gamma shape", lambda: dw(dl, y_, g_[:8], acc, scale), ValueError, r"gamma must be \(d,\)"
    yield "dw acc shape", lambda: dw(dl, y_, g_, acc[:7], scale), ValueError, "dw must be the .V, d. accumulator"
    yield "dw scale dtype", lambda: dw(dl, y_, g_, acc, scale.double()), ValueError, "scale must be one float32"
    yield "dw_ fp32 accumulator", lambda: dw_(dl, y_, g_, acc.float(), scale), TypeError, "dw must be torch.bfloat16"
    yield "dw_ empty accumulator", lambda: dw_(dl, y_, g_, acc[:0], scale), ValueError, "dw must be the .V, d. accumulator"
    a = c["attention_block"]
    yield "attention w_o shape", lambda: torch.ops.coda.attention_block(a[0], a[1], a[2], a[3][:, :32].contiguous(), *a[4:]), ValueError, "w_o must be"
    yield "attention x 2-D", lambda: torch.ops.coda.attention_block(a[0].reshape(M, D), *a[1:]), ValueError, "x must be 3-D"
    # 16-byte alignment (the GPU kernels assume it), rejected at the forward already where the
    # forward's backward needs it
    inv1 = _misaligned(INV_FREQ)
    yield "attention inv_freq misaligned", lambda: torch.ops.coda.attention_block(*a[:5], inv1, *a[6:]), ValueError, "inv_freq's data pointer must be 16-byte aligned"
    yield "rope_bwd inv_freq misaligned", lambda: rb(q, k, v, qkv, r, pos, inv1), ValueError, "inv_freq's data pointer must be 16-byte aligned"
    q1, k1, v1 = qkv_heads(_misaligned(torch.cat([q, k, v], 1).transpose(1, 2).reshape(M, NQKV)), B, H, HKV, HD)
    yield "rope_bwd dq misaligned", lambda: rb(q1, k, v, qkv, r, pos, inv), ValueError, "dq's data pointer must be 16-byte aligned"
    yield "rope_bwd dk misaligned", lambda: rb(q, k1, v, qkv, r, pos, inv), ValueError, "dk's data pointer must be 16-byte aligned"
    yield "rope_bwd dv misaligned", lambda: rb(q, k, v1, qkv, r, pos, inv), ValueError, "dv's data pointer must be 16-byte aligned"
    mlp = torch.ops.coda.mlp_block
    yield "mlp w_down column-major", lambda: mlp(y, ss, w_gu, w_down.t().contiguous().t(), EPS), ValueError, "coda.mlp_block: w_down must be contiguous"
    yield "mlp w_down misaligned", lambda: mlp(y, ss, w_gu, _misaligned(w_down), EPS), ValueError, "coda.mlp_block: w_down's data pointer must be 16-byte aligned"
    yield "mlp w_down fp32", lambda: mlp(y, ss, w_gu, w_down.float(), EPS), TypeError, "coda.mlp_block: w_down must be torch.bfloat16"
    dl1 = torch.empty(M, VW + 8, dtype=BF16)[:, 1:VW + 1].copy_(dl)  # rows of 64 values, 2 bytes in
    yield "dw dl misaligned", lambda: dw(dl1, y_, g_, acc, scale), ValueError, "dl's data pointer must be 16-byte aligned"
    yield "dw_ dl misaligned", lambda: dw_(dl1, y_, g_, acc, scale), ValueError, "dl's data pointer must be 16-byte aligned"
    lb, la = torch.ops.coda.lm_head_ce_backward, c["lm_head_ce_backward"]
    y3, w3, ss3, eps3, t3, lse3, dloss3, dlse3 = la[:8]

    def lm_bwd(lse=lse3, dloss=dloss3, dlse=dlse3, reduction="none"):
        return lambda: lb(y3, w3, ss3, eps3, t3, lse, dloss, dlse, -100, reduction, la[10])
    yield "lm_bwd lse rows", lm_bwd(lse=torch.randn(M + 5)), ValueError, r"lse must be the forward's log-sum-exp, one per row of y \(38,\)"
    yield "lm_bwd lse dtype", lm_bwd(lse=lse3.bfloat16()), TypeError, "lse must be torch.float32"
    yield "lm_bwd lse strided", lm_bwd(lse=torch.randn(2 * M)[::2]), ValueError, "lse must be contiguous"
    yield "lm_bwd dloss shape", lm_bwd(dloss=dloss3[0]), ValueError, r"dloss must be the loss's gradient \(reduction 'none'\) \(38,\)"
    yield "lm_bwd dloss shape mean", lm_bwd(reduction="mean"), ValueError, r"dloss must be the loss's gradient \(reduction 'mean'\) \(\)"
    yield "lm_bwd dloss dtype", lm_bwd(dloss=dloss3.double()), TypeError, "dloss must be a float32 tensor"
    yield "lm_bwd dlse rows", lm_bwd(dlse=dlse3[:5]), ValueError, r"dlse must be the log-sum-exp's gradient"
    yield "lm_bwd dlse dtype", lm_bwd(dlse=dlse3.bfloat16()), TypeError, "dlse must be a float32 tensor"
    yield "lm_bwd dlse expanded", lambda: lm_bwd(dlse=torch.tensor(0.5).expand(M))()[0].shape, None, None
    yield "lm_bwd scalar dloss", lambda: lm_bwd(dloss=torch.tensor(0.5), reduction="sum")()[0].shape, None, None
    ab = torch.ops.coda.attention_backward
    do, cq, ck, cv, co, clse = next(args for n, _, args in core_cases() if n == "attention_backward")

    def att_bwd(do=do, o=co, lse=clse):
        return lambda: ab(do, cq, ck, cv, o, lse)
    yield "attention_bwd do fp32", att_bwd(do=do.float()), TypeError, "do must be a 4-D bf16 tensor"
    yield "attention_bwd do shape", att_bwd(do=do[:, :, :-1]), ValueError, r"do must be \(B, H, S, hd\) like q"
    yield "attention_bwd o fp32", att_bwd(o=co.float()), TypeError, "o must be a 4-D bf16 tensor"
    yield "attention_bwd o strided head_dim", att_bwd(o=co.transpose(2, 3).contiguous().transpose(2, 3)), ValueError, "o must be contiguous along head_dim"
    yield "attention_bwd lse shape", att_bwd(lse=torch.randn(B, H, S + 1)), ValueError, r"lse must be the forward's log-sum-exp, \(B, H, S\) = \(2, 4, 19\)"
    yield "attention_bwd lse 4-D", att_bwd(lse=clse.unsqueeze(-1)), ValueError, r"lse must be the forward's log-sum-exp, \(B, H, S\) = \(2, 4, 19\), got \(2, 4, 19, 1\)"
    yield "attention_bwd lse dtype", att_bwd(lse=clse.bfloat16()), TypeError, "lse must be a float32 tensor"
    yield "attention_bwd lse strided", att_bwd(lse=torch.randn(B, S, H).transpose(1, 2)), ValueError, "lse must be contiguous"
    yield "attention_bwd do strided", lambda: att_bwd(do=do.transpose(1, 2).contiguous().transpose(1, 2))()[0].shape, None, None


def _misaligned(t):
    """A copy of ``t`` (contiguous) whose data pointer lies one element past a 16-byte boundary."""
    return torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape).copy_(t)


@pytest.mark.parametrize("case", list(_bad()), ids=lambda c: c[0])
def test_bad_input_raises_before_launch(case):
    """Each rule's violation raises naming the argument; the control cases (exc None) pass."""
    _, call, exc, match = case
    with coda_cute.reference_on_cpu():
        if exc is None:
            call()
            return
        with pytest.raises(exc, match=match):
            call()


def _bad_fake():
    """The same rules on the fake (tracing) path: (id, a call that builds its fake CUDA arguments
    and runs the op (inside FakeTensorMode), exception, message)."""
    def t(*shape, dtype=BF16, device="cuda"):
        return torch.empty(*shape, dtype=dtype, device=device)

    def off(*shape, dtype=BF16):
        """A fake CUDA tensor one element past a 16-byte boundary (its storage offset)."""
        n = 1
        for x in shape:
            n *= x
        return t(n + 1, dtype=dtype).narrow(0, 1, n).view(shape)  # (indexing a fake CUDA tensor needs CUDA)

    def ss():
        return t(M, 4, dtype=F32)

    def pos():
        return t(M, dtype=torch.int32)

    def attention_block(inv):
        return torch.ops.coda.attention_block(t(B, S, D), ss(), t(NQKV, D), t(D, H * HD), pos(), inv, EPS, H, HKV, HD)
    aligned = "inv_freq's data pointer must be 16-byte aligned"
    yield "attention inv_freq misaligned", lambda: attention_block(off(HD // 2, dtype=F32)), ValueError, aligned
    yield "attention inv_freq aligned", lambda: attention_block(t(HD // 2, dtype=F32)), None, None
    yield "qkv inv_freq misaligned", lambda: torch.ops.coda.norm_rope_qkv(
        t(M, D), t(NQKV, D), ss(), EPS, pos(), off(HD // 2, dtype=F32), H, HKV, HD), ValueError, aligned

    def rope_bwd(heads, inv=None):
        q, k, v = qkv_heads(heads, B, H, HKV, HD)
        inv = t(HD // 2, dtype=F32) if inv is None else inv
        return torch.ops.coda.rope_backward(q, k, v, t(M, NQKV), t(M, dtype=F32), pos(), inv)
    yield "rope_bwd dq misaligned", lambda: rope_bwd(off(M, NQKV)), ValueError, "dq's data pointer must be 16-byte aligned"
    yield "rope_bwd inv_freq misaligned", lambda: rope_bwd(t(M, NQKV), off(HD // 2, dtype=F32)), ValueError, aligned
    yield "rope_bwd aligned", lambda: rope_bwd(t(M, NQKV)), None, None

    def rope_bwd_qk(qn_device="cuda"):
        q, k, v = qkv_heads(t(M, NQKV), B, H, HKV, HD)
        return torch.ops.coda.rope_backward(q, k, v, t(M, NQKV), t(M, dtype=F32), pos(), t(HD // 2, dtype=F32),
                                            t(M, NQKV), t(HD, device=qn_device), t(HD), 1e-6)
    yield "rope_bwd q_norm_w on the host", lambda: rope_bwd_qk("cpu"), ValueError, "all tensors must be on one device"
    yield "rope_bwd qk-norm", lambda: rope_bwd_qk(), None, None

    def mlp(w_down):
        return torch.ops.coda.mlp_block(t(M, D), ss(), t(2 * FF, D), w_down, EPS)
    yield "mlp w_down column-major", lambda: mlp(t(FF, D).t()), ValueError, "coda.mlp_block: w_down must be contiguous"
    yield "mlp w_down misaligned", lambda: mlp(off(D, FF)), ValueError, "coda.mlp_block: w_down's data pointer must be 16-byte aligned"
    yield "mlp w_down", lambda: mlp(t(D, FF)), None, None

    def dw(dl, in_place=False):
        if in_place:
            return torch.ops.coda.lm_head_ce_dw_(dl, t(M, D), None, t(VW, D), t((), dtype=F32))
        return torch.ops.coda.lm_head_ce_dw(dl, t(M, D), None, t(0), t((), dtype=F32))
    padded = "dl's data pointer must be 16-byte aligned"
    yield "dw dl misaligned", lambda: dw(t(M, VW + 8).narrow(1, 1, VW)), ValueError, padded
    yield "dw_ dl misaligned", lambda: dw(t(M, VW + 8).narrow(1, 1, VW), True), ValueError, padded
    yield "dw dl padded rows", lambda: dw(t(M, VW + 8).narrow(1, 0, VW)), None, None

    def lm_bwd(lse=None, dloss=None, dlse=None):
        lse, dloss, dlse = (t(M, dtype=F32) if a is None else a for a in (lse, dloss, dlse))
        return torch.ops.coda.lm_head_ce_backward(t(M, D), t(V, D), ss(), EPS, t(M, dtype=torch.int64), lse, dloss,
                                                  dlse, -100, "none", None)
    yield "lm_bwd lse on the host", lambda: lm_bwd(lse=t(M, dtype=F32, device="cpu")), ValueError, "all tensors must be on one device"
    yield "lm_bwd dlse on the host", lambda: lm_bwd(dlse=t(M, dtype=F32, device="cpu")), ValueError, "all tensors must be on one device"
    yield "lm_bwd lse rows", lambda: lm_bwd(lse=t(M + 5, dtype=F32)), ValueError, "lse must be the forward's log-sum-exp"
    yield "lm_bwd dloss rows", lambda: lm_bwd(dloss=t((), dtype=F32)), ValueError, "dloss must be the loss's gradient"
    yield "lm_bwd", lambda: lm_bwd(), None, None

    def attention_bwd(do=None, o=None, lse=None):
        q, k, v = t(B, H, S, HD), t(B, HKV, S, HD), t(B, HKV, S, HD)
        o_, lse_ = torch.ops.coda.attention_forward(q, k, v)
        do = t(B, H, S, HD) if do is None else do
        return torch.ops.coda.attention_backward(do, q, k, v, o_ if o is None else o, lse_ if lse is None else lse)
    yield "attention_bwd do on the host", lambda: attention_bwd(do=t(B, H, S, HD, device="cpu")), ValueError, "all tensors must be on one device"
    yield "attention_bwd do fp32", lambda: attention_bwd(do=t(B, H, S, HD, dtype=F32)), TypeError, "do must be a 4-D bf16 tensor"
    yield "attention_bwd o shape", lambda: attention_bwd(o=t(B, H, S + 1, HD)), ValueError, r"o must be \(B, H, S, hd\) like q"
    yield "attention_bwd lse shape", lambda: attention_bwd(lse=t(B, H, S + 1, dtype=F32)), ValueError, "lse must be the forward's log-sum-exp"
    yield "attention_bwd lse fp16", lambda: attention_bwd(lse=t(B, H, S, dtype=torch.float16)), TypeError, "lse must be a float32 tensor"
    yield "attention_bwd", lambda: attention_bwd(), None, None


@pytest.mark.parametrize("case", list(_bad_fake()), ids=lambda c: c[0])
def test_bad_input_raises_on_the_fake_path(case):
    """The checks run on the fake implementations too (tracing, torch.compile): the same errors
    as the GPU path would raise before its launch; the control cases (exc None) pass."""
    _, call, exc, match = case
    with FakeTensorMode():
        if exc is None:
            call()
            return
        with pytest.raises(exc, match=match):
            call()


@pytest.mark.parametrize("op", ["lm_head_ce_dw", "lm_head_ce_dw_"])
def test_dw_ops_on_cpu_need_the_reference_switch(op):
    """Both last-chunk wgrad ops refuse CPU tensors outside ``reference_on_cpu`` with their own
    name (the in-place one has its own guard; it left its accumulator untouched)."""
    dl, y, g, acc, scale = next(a for n, _, a in core_cases() if n == "lm_head_ce_dw_[in place]")
    before = acc.clone()
    with pytest.raises(ValueError, match=rf"coda\.{op} runs on CUDA tensors .*reference_on_cpu"):
        getattr(torch.ops.coda, op)(dl, y, g, acc, scale)
    assert acc.equal(before)


@pytest.mark.parametrize("layout", ["view of qkv", "contiguous"])
def test_attention_core_outputs_do_not_depend_on_the_backend(layout):
    """The attention core's outputs have one shape, dtype and layout whichever SDPA kernel runs
    (the aten ops' meta implementations, which the fake one shares): the backend is process
    state that a traced graph and inductor's cache key do not hold."""
    from coda_cute.ops import attention as A
    if layout == "contiguous":
        q, k, v = (torch.empty(B, n, S, HD, dtype=BF16, device="meta") for n in (H, HKV, HKV))
    else:
        q, k, v = qkv_heads(torch.empty(M, NQKV, dtype=BF16, device="meta"), B, H, HKV, HD)
    meta = lambda t: (tuple(t.shape), t.stride(), t.dtype)  # noqa: E731
    outs = [tuple(map(meta, A._core(q, k, v, backend))) for backend in (A.CUDNN, A.FLASH)]
    assert outs[0] == outs[1]
    assert outs[0][1] == ((B, H, S), (H * S, S, 1), torch.float32)


def test_attention_backward_ref_equals_autograd():
    q, k, v = (t.detach().requires_grad_() for t in qkv_heads(rand(M, NQKV, dtype=F64), B, H, HKV, HD))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    do = torch.randn_like(o)
    want = torch.autograd.grad(o, (q, k, v), do)
    for g, w in zip(R.attention_backward_ref(do, q.detach(), k.detach(), v.detach()), want):
        assert rel_err(g, w) < 1e-10


@pytest.mark.parametrize("fraction,acc", [(None, None), (0.7, F32), (0.3, BF16)])
def test_lm_head_train_gradients_through_autograd(fraction, acc, monkeypatch):
    """cross_entropy's training op, its deferred last-chunk wgrad and dloss: the gradients equal
    the reference's (times dloss) for one chunk and for several (fp32 / bf16 accumulation)."""
    m, d = 1000, 64
    y, w, g = rand(m, d), rand(V, d, scale=d ** -0.5), 1 + rand(d, scale=0.1)
    ss, t = stats(y), torch.randint(0, V, (m,))
    t[::5] = -100
    if fraction is not None:
        monkeypatch.setattr(LH, "CHUNK_BYTES", int(fraction * m * 2 * 56))
    assert LH.plan_chunks(m, V, d)[1] == acc
    ins = [y.clone().requires_grad_(), w.clone().requires_grad_(), g.clone().requires_grad_()]
    with coda_cute.reference_on_cpu():
        loss = LH.cross_entropy(ins[0], ins[1], ss, EPS, t, gamma=ins[2])
        (loss * 0.37).backward()
    want = R.lm_head_ce_grad_ref(y, w, ss, EPS, t, -100, "mean", g, dloss=torch.tensor(0.37))
    for i, wt in zip(ins, want):
        assert rel_err(i.grad, wt) < 1e-2, (rel_err(i.grad, wt))


@pytest.mark.parametrize("case", [c for c in cases() if base(c[0]) in ("mlp_block", "attention_block",
                                                                        "lm_head_ce_train")],
                         ids=lambda c: c[0])
def test_ops_under_autocast_take_fp32_master_weights(case):
    """Inside torch.autocast the sublayer and LM-head ops take fp32 activations and weights (the
    fp32 statistics and frequencies stay fp32), compute as with bf16 inputs, and return the
    gradients to the fp32 leaves in fp32."""
    name, args, _ = case
    op = getattr(torch.ops.coda, base(name))
    skip = {id(INV_FREQ)}
    wide = [a.float().requires_grad_() if isinstance(a, torch.Tensor) and a.dtype == BF16 and id(a) not in skip
            else a for a in args]
    narrow = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.dtype == BF16 else a
              for a in args]
    with coda_cute.reference_on_cpu():
        with pytest.raises(TypeError, match="must be torch.bfloat16"):
            op(*wide)  # outside autocast: the dtype rule
        with torch.autocast("cpu", dtype=torch.float16):  # whatever the region's dtype: bf16
            got = op(*wide)
        want = op(*narrow)
        got[0].float().sum().backward()
        want[0].float().sum().backward()
    assert got[0].dtype == want[0].dtype and torch.equal(got[0], want[0])
    for w, n in zip(wide, narrow):
        if isinstance(w, torch.Tensor) and w.requires_grad and n.grad is not None:
            assert w.grad.dtype == F32 and rel_err(w.grad, n.grad.float()) < 1e-2


def test_gemm_under_autocast_casts_16_and_32_bit_operands_only():
    a, b = torch.randn(16, 32), torch.randn(32, 24)
    with coda_cute.reference_on_cpu(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.ops.coda.gemm(a, b)
    assert out.dtype == BF16 and rel_err(out, a.bfloat16().float() @ b.bfloat16().float()) < 1e-2
