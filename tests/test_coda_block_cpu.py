"""CPU tests of the CODA Llama-block ops, their references, backward, converters and modules.

No GPU and no kernel compile: the ops run through their torch references under
``coda_cute.reference_on_cpu()``, and their CUDA shapes are checked on fake tensors. Backward
formulas are compared with torch autograd of the references in float64; the block and the model
with the plain (unfused) HF-convention Llama on the same converted weights. Tests of the epilogue
trees themselves (torch evaluator vs reference) run once the lead's row_sum / lookup /
segment_reduce nodes exist.
"""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import coda_cute
from coda_cute import epilogue as E
from coda_cute import reference as R
from coda_cute.epilogue.runner import choose_config
from coda_cute.nn import CodaLlama, LlamaConfig
from coda_cute.nn import convert as C
from coda_cute.ops import lm_head_ce as LH
from coda_cute.ops import proj as PJ
from coda_cute.ops import qkv as QK
from coda_cute.ops import residual as RS
from coda_cute.ops import swiglu as SW
from coda_cute.ops.rmsnorm import norm_inputs
from coda_cute.precision import Fp8Recipe
from coda_block_helpers import block_errors, hf_block, model_state_dict, plain_model_loss, print_ratios, rand
from helpers import generator, rel_err

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
H, HKV, HD, D, EPS, QK_EPS = 4, 2, 16, 64, 1e-5, 1e-6
NQKV = (H + 2 * HKV) * HD
INV_FREQ = R.rope_inv_freq(HD, 10000.0)
NEW_NODES = all(hasattr(E, n) for n in ("row_sum", "lookup", "segment_reduce"))
CFG = LlamaConfig(D, 1, H, HKV, 96, 128, norm_eps=EPS, qk_norm_eps=QK_EPS, rope_theta=10000.0,
                  max_seq_len=64)


def cfg(qk_norm=False, **kw):
    return dataclasses.replace(CFG, qk_norm=qk_norm, **kw)


def norm_args(m=37, n=96, dtype=BF16, tile_n=32):
    """y, w, ss for the norm-consuming ops (ss: partials of y over column tiles of tile_n)."""
    y = rand(m, D, dtype=dtype)
    return y, rand(n, D, dtype=dtype, scale=D ** -0.5), R.norm_stats_partials_ref(y, tile_n)


def qkv_args(m=37, dtype=BF16, qk_norm=True):
    y, w, ss = norm_args(m, NQKV, dtype)
    pos = torch.randint(0, 64, (m,))
    qn = (torch.rand(HD, dtype=F64) + 0.5).to(dtype) if qk_norm else None
    kn = (torch.rand(HD, dtype=F64) + 0.5).to(dtype) if qk_norm else None
    return (y, w, ss, EPS, pos, INV_FREQ, H, HKV, HD, qn, kn, QK_EPS)


def ce_args(m=37, v=50, dtype=BF16, reduction="mean"):
    y, w, ss = norm_args(m, v, dtype)
    t = torch.randint(0, v, (m,))
    t[::5] = -100
    return (y, w, ss, EPS, t, -100, reduction)


def residual_args(m=37, k=32, n=96, dtype=BF16):
    return rand(m, k, dtype=dtype), rand(n, k, dtype=dtype, scale=k ** -0.5), rand(m, n, dtype=dtype)


def to_pairs_cols(x, heads):
    """Columns of x (M, heads * HD) from rotate-half to adjacent-pair order within each head."""
    return C.rotate_half_to_pairs(x.t(), heads, HD).t()


# -- references: the spec's math, and equal to the unfused formulation ----------------------------
def test_rope_sign_convention():
    # theta = pi/2 turns the pair (1, 0) into (0, 1): a' = a cos - b sin, b' = a sin + b cos.
    out = R.rope_pairs_ref(torch.tensor([[1.0, 0.0]]), torch.tensor([1]), torch.tensor([math.pi / 2]), 2)
    assert torch.allclose(out, torch.tensor([[0.0, 1.0]]), atol=1e-7)


def test_rope_inv_freq_and_angles():
    inv = R.rope_inv_freq(4, 100.0)
    assert inv.shape == (2,) and inv.dtype == F32
    assert inv[1].item() == pytest.approx(100.0 ** -0.5)
    c, s = R.rope_cos_sin(torch.tensor([3]), inv, F64)
    assert s[0, 1].item() == pytest.approx(math.sin(3 * 100.0 ** -0.5), rel=1e-7)


def test_residual_ref_equals_tree_evaluator():
    a, w, res = residual_args(m=45, n=200)
    tile_n = 64
    y, ss = R.residual_gemm_norm_stats_ref(a, w, res, tile_n)
    out = E.evaluate(RS.residual_norm_stats_tree(), a.float() @ w.float().t(), {"residual": res}, (128, tile_n))
    assert ss.shape == (45, 4) and y.dtype == BF16
    assert y.equal(out["y"]) and ss.equal(out["ss"])
    assert torch.allclose(ss.sum(1), y.float().square().sum(1), rtol=1e-6)


def test_norm_ops_equal_unfused_math():
    """Folding gamma into the weight and scaling by r afterwards is RMSNorm(y; gamma) @ W.T."""
    y, w, ss = norm_args(dtype=F64, tile_n=24)
    gamma = 1 + rand(D, dtype=F64, scale=0.1)
    normed = R.rms_norm_ref(y, gamma, EPS)
    assert rel_err(R.norm_proj_ref(y, w * gamma, ss, EPS), normed @ w.t()) < 1e-12
    z, h = R.norm_swiglu_ref(y, w * gamma, ss, EPS)
    g, u = (normed @ w[0::2].t()), (normed @ w[1::2].t())
    assert rel_err(z, torch.stack([g, u], -1).flatten(1)) < 1e-12
    assert rel_err(h, F.silu(g) * u) < 1e-12


@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_ref_equals_rotate_half_on_hf_weights(qk_norm):
    """Adjacent-pair RoPE on converted weights = rotate-half RoPE on the HF weights, permuted."""
    m = 30
    p = hf_block(cfg(qk_norm), dtype=F64)
    y = rand(m, D, dtype=F64)
    pos = torch.randint(0, 64, (m,))
    c = C.block_from_hf(p, H, HKV, HD)
    ss = R.norm_stats_partials_ref(y, 16)
    got = R.norm_rope_qkv_ref(y, c["wqkv"] * c["attn_norm"], ss, EPS, pos, INV_FREQ, H, HKV, HD,
                              c.get("q_norm"), c.get("k_norm"), QK_EPS)
    u = R.rms_norm_ref(y, p["input_layernorm.weight"], EPS)
    q = (u @ p["self_attn.q_proj.weight"].t()).reshape(1, m, H, HD)
    k = (u @ p["self_attn.k_proj.weight"].t()).reshape(1, m, HKV, HD)
    if qk_norm:
        q = R.rms_norm_ref(q, p["self_attn.q_norm.weight"], QK_EPS)
        k = R.rms_norm_ref(k, p["self_attn.k_norm.weight"], QK_EPS)
    # rope_rotate_half_ref indexes positions along dim -2: lay the tokens out as the sequence.
    q = R.rope_rotate_half_ref(q.transpose(1, 2), pos, INV_FREQ).transpose(1, 2).reshape(m, -1)
    k = R.rope_rotate_half_ref(k.transpose(1, 2), pos, INV_FREQ).transpose(1, 2).reshape(m, -1)
    v = u @ p["self_attn.v_proj.weight"].t()
    want = torch.cat([to_pairs_cols(q, H), to_pairs_cols(k, HKV), v], 1)
    assert rel_err(got, want) < 1e-12


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_lm_head_ref_equals_cross_entropy(reduction):
    y, w, ss, eps, t, ig, red = ce_args(dtype=F64, reduction=reduction)
    loss, lse = R.lm_head_ce_ref(y, w, ss, eps, t, ig, red)
    logits = R.rms_norm_ref(y, torch.ones(D, dtype=F64), EPS) @ w.t()
    assert rel_err(loss, F.cross_entropy(logits, t, ignore_index=ig, reduction=red)) < 1e-12
    assert rel_err(lse, logits.logsumexp(-1)) < 1e-12


def test_lm_head_all_ignored_mean_is_nan_like_torch():
    y, w, ss, eps, t, ig, _ = ce_args(dtype=F64)
    t[:] = ig
    loss, _ = R.lm_head_ce_ref(y, w, ss, eps, t, ig, "mean")
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(y @ w.t(), t, ignore_index=ig))


# -- the ops on CPU: reference mode, fake tensors, opcheck ------------------------------------------
def op_cases(dtype=BF16):
    a, w, res = residual_args(dtype=dtype)
    yield "residual_gemm_norm_stats", (a, w, res), {}
    y, w, ss = norm_args(dtype=dtype)
    yield "norm_swiglu", (y, w, ss, EPS), {}
    yield "norm_proj", (y, w, ss, EPS), {}
    yield "norm_rope_qkv", qkv_args(dtype=dtype, qk_norm=False)[:10], {}
    yield "norm_rope_qkv+qk_norm", qkv_args(dtype=dtype), {}
    for red in ("mean", "sum", "none"):
        yield f"lm_head_ce[{red}]", ce_args(dtype=dtype, reduction=red), {}


def base(name):
    return name.split("+")[0].split("[")[0]


def op_of(name):
    return getattr(torch.ops.coda, base(name))


REFS = {"residual_gemm_norm_stats": lambda a, w, r: R.residual_gemm_norm_stats_ref(a, w, r, RS.stats_tile_n(a, w)),
        "norm_swiglu": R.norm_swiglu_ref, "norm_proj": R.norm_proj_ref,
        "norm_rope_qkv": R.norm_rope_qkv_ref, "lm_head_ce": R.lm_head_ce_ref}


@pytest.mark.parametrize("case", list(op_cases()), ids=lambda c: c[0])
def test_op_in_reference_mode_is_the_reference(case):
    name, args, _ = case
    with pytest.raises(ValueError, match="reference_on_cpu"):
        op_of(name)(*args)
    with coda_cute.reference_on_cpu():
        got = op_of(name)(*args)
    want = REFS[base(name)](*args)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert g.dtype == w.dtype and g.shape == w.shape and g.equal(w)


def fake_cuda_cases(m=16384, d=4096):
    def t(*shape, dtype=BF16):
        return torch.empty(*shape, dtype=dtype, device="cuda")

    y, ss, pos = t(m, d), t(m, 16, dtype=F32), t(m, dtype=torch.int32)
    inv_freq = t(64, dtype=F32)
    yield ("residual", torch.ops.coda.residual_gemm_norm_stats, (t(m, 14336), t(d, 14336), y),
           [((m, d), BF16), ((m, None), F32)])
    yield ("swiglu", torch.ops.coda.norm_swiglu, (y, t(2 * 14336, d), ss, EPS),
           [((m, 2 * 14336), BF16), ((m, 14336), BF16)])
    yield ("qkv", torch.ops.coda.norm_rope_qkv, (y, t(6144, d), ss, EPS, pos, inv_freq, 32, 8, 128,
                                                 t(128, dtype=F32), t(128, dtype=F32)),
           [((m, 6144), BF16)])
    yield ("proj", torch.ops.coda.norm_proj, (y, t(4096, d), ss, EPS), [((m, 4096), BF16)])
    yield ("ce mean", torch.ops.coda.lm_head_ce, (y, t(32000, d), ss, EPS, t(m, dtype=torch.int64)),
           [((), F32), ((m,), F32)])
    yield ("ce none", torch.ops.coda.lm_head_ce, (y, t(32000, d), ss, EPS, t(m, dtype=torch.int64), -100, "none"),
           [((m,), F32), ((m,), F32)])


@pytest.mark.parametrize("name", ["residual", "swiglu", "qkv", "proj", "ce mean", "ce none"])
def test_fake_cuda_shapes(name):
    with FakeTensorMode():
        _, op, args, want = next(c for c in fake_cuda_cases() if c[0] == name)
        out = op(*args)
    out = out if isinstance(out, tuple) else (out,)
    if name == "residual":  # one partial per column tile of the config the runner will pick
        tile_n = choose_config(RS.residual_norm_stats_tree(), 16384, 4096, 14336, 1, False, False, 132).tile_n
        want[1] = ((16384, -(-4096 // tile_n)), F32)
    assert [(tuple(o.shape), o.dtype, o.device.type) for o in out] == [(s, dt, "cuda") for s, dt in want]


OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("case", list(op_cases()), ids=lambda c: c[0])
def test_opcheck(case):
    name, args, kwargs = case
    args = tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
                 and a is not INV_FREQ else a for a in args)
    with coda_cute.reference_on_cpu():
        result = torch.library.opcheck(op_of(name).default, args, kwargs, test_utils=OPCHECKS)
    assert all(v == "SUCCESS" for v in result.values()), result


# -- backward: the registered autograd vs float64 autograd of the references ----------------------
def autograd_of(ref, args, grad_idx, cots=None):
    """(outputs, cotangents, gradients of sum(out * cotangent) w.r.t. args[grad_idx]) by
    autograd; random cotangents unless given."""
    args = list(args)
    for i in grad_idx:
        args[i] = args[i].detach().clone().requires_grad_()
    out = ref(*args)
    out = out if isinstance(out, tuple) else (out,)
    gen = generator(1)
    if cots is None:
        cots = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in out]
    cots = [c.to(o.dtype) for c, o in zip(cots, out)]
    grads = torch.autograd.grad(sum((o * c).sum() for o, c in zip(out, cots)), [args[i] for i in grad_idx])
    return [o.detach() for o in out], cots, grads


def with_stats_of_y(ref):
    """``ref`` with its ss argument recomputed from y: the ops' gradient convention (ss is y's
    norm statistic, so dL/dy includes the path through it and ss has no gradient of its own)."""
    def f(y, w, ss, *rest):
        return ref(y, w, R.norm_stats_partials_ref(y, 32), *rest)
    return f


@pytest.mark.parametrize("case", list(op_cases()), ids=lambda c: c[0])
def test_op_autograd_bf16(case):
    """The registered backward (bf16 in, bf16 grads, through the backward ops' references) vs
    float64 autograd of the forward reference on the same bf16 inputs: checks the backward
    formulas and that each gradient lands on its argument. ss carries none."""
    name, args, _ = case
    ref = REFS[base(name)]
    residual = base(name) == "residual_gemm_norm_stats"
    idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()
           and a is not INV_FREQ and (residual or i != 2)]
    inputs = [a.detach().clone().requires_grad_() if i in idx else a for i, a in enumerate(args)]
    with coda_cute.reference_on_cpu():
        out = op_of(name)(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        out = out[:1] if residual or base(name) == "lm_head_ce" else out  # ss / LSE: no cotangent
        cots = [torch.randn(o.shape) for o in out]
        got = torch.autograd.grad(sum((o.float() * c).sum() for o, c in zip(out, cots)), [inputs[i] for i in idx])
    args64 = [a.double() if i in idx else a for i, a in enumerate(args)]
    fn = (lambda *a: ref(*a)[:1]) if residual or base(name) == "lm_head_ce" else ref
    _, _, want = autograd_of(fn if residual else with_stats_of_y(fn), args64, idx, cots)
    for g, w, i in zip(got, want, idx):
        assert g.dtype == args[i].dtype and g.shape == args[i].shape
        assert rel_err(g, w) < 2e-2, (i, rel_err(g, w))


# -- converters -------------------------------------------------------------------------------------
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("rope", ["rotate_half", "pairs"])
def test_block_conversion_round_trip_is_exact(qk_norm, rope):
    p = hf_block(cfg(qk_norm))
    c = C.block_from_hf(p, H, HKV, HD, rope)
    assert c["wqkv"].shape == (NQKV, D) and c["w_gu"].shape == (192, D)
    back = C.block_to_hf(c, H, HKV, HD, rope)
    assert back.keys() == p.keys() and all(back[k].equal(p[k]) for k in p)
    concat = C.block_to_hf(c, H, HKV, HD, rope, concat_gate_up=True)
    assert concat["mlp.gate_up_proj.weight"].equal(torch.cat([p["mlp.gate_proj.weight"], p["mlp.up_proj.weight"]]))
    assert C.block_from_hf(concat, H, HKV, HD, rope)["w_gu"].equal(c["w_gu"])


def test_gate_up_interleave():
    g, u = torch.arange(12.0).reshape(3, 4), -torch.arange(12.0).reshape(3, 4)
    w = C.interleave_gate_up(g, u)
    assert w[0::2].equal(g) and w[1::2].equal(u)
    assert C.interleave_gate_up(torch.cat([g, u])).equal(w)
    assert all(a.equal(b) for a, b in zip(C.split_gate_up(w), (g, u)))


def test_head_permutation():
    w = torch.arange(2 * 8).reshape(16, 1)  # 2 heads of head_dim 8
    pairs = C.rotate_half_to_pairs(w, 2, 8).flatten().tolist()
    assert pairs == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    assert C.pairs_to_rotate_half(C.rotate_half_to_pairs(w, 2, 8), 2, 8).equal(w)


def test_rope_outputs_equal_after_conversion():
    """rotate-half RoPE of x @ Wq.T = adjacent-pair RoPE of x @ convert(Wq).T (permuted), and the
    attention scores q.k are the same in both layouts."""
    m = 20
    x = rand(m, D, dtype=F64)
    wq, wk = rand(H * HD, D, dtype=F64), rand(HKV * HD, D, dtype=F64)
    pos = torch.arange(m)

    def half(w, heads):
        q = (x @ w.t()).reshape(1, m, heads, HD).transpose(1, 2)
        return R.rope_rotate_half_ref(q, pos, INV_FREQ).transpose(1, 2).reshape(m, -1)

    def pairs(w, heads):
        return R.rope_pairs_ref(x @ C.rotate_half_to_pairs(w, heads, HD).t(), pos, INV_FREQ, HD)

    assert rel_err(pairs(wq, H), to_pairs_cols(half(wq, H), H)) < 1e-13
    scores = [(q.reshape(m, H, HD)[:, 0] @ k.reshape(m, HKV, HD)[:, 0].t())
              for q, k in ((half(wq, H), half(wk, HKV)), (pairs(wq, H), pairs(wk, HKV)))]
    assert rel_err(scores[1], scores[0]) < 1e-13


def test_converter_rejects_bad_shapes():
    with pytest.raises(ValueError, match="rows"):
        C.fuse_qkv(torch.zeros(10, 4), torch.zeros(8, 4), torch.zeros(8, 4), 1, 1, 8)
    with pytest.raises(ValueError, match="rope"):
        C.fuse_qkv(torch.zeros(8, 4), torch.zeros(8, 4), torch.zeros(8, 4), 1, 1, 8, rope="neox")


# -- the block and the model vs the plain PyTorch Llama ---------------------------------------------
@pytest.mark.parametrize("qk_norm", [False, True])
def test_block_matches_plain_llama_block(qk_norm):
    """On CPU both paths go through torch (the fused one through the ops' fp32 references), so
    this mostly checks the wiring: the fused block's error against the float64 plain block must
    be bf16-sized and no larger than the plain bf16 block's (ratio printed with -s). The norm
    weights' gradients (64 entries, head_dim for the QK norms) are sums of bf16 noise whose
    ratio wanders: over 1050 seeds it reached 1.72 (QK norms) and 1.22 (layer norms), where
    every other tensor's stayed at or below 0.93; their errors stayed below 0.0165."""
    errs = block_errors(cfg(qk_norm), bsz=2, seq=24, ref_dtype=F64)
    print_ratios(errs)
    for key, fused in errs["fused"].items():
        unfused = errs["unfused"][key]
        ratio = 2.0 if key.endswith("norm.weight") else 1.1
        assert fused < 2e-2 and fused <= ratio * unfused, (key, fused, unfused)


def test_model_loads_hf_weights_and_matches_plain_model():
    c = cfg(qk_norm=True, n_layers=2)
    sd = model_state_dict(c)
    model = CodaLlama.from_hf(c, sd)
    back = model.hf_state_dict()
    assert back.keys() == sd.keys() and all(back[k].equal(sd[k]) for k in sd)
    tokens = torch.randint(0, c.vocab_size, (2, 16))
    targets = torch.randint(0, c.vocab_size, (2, 16))
    targets[0, :3] = -100
    with coda_cute.reference_on_cpu():
        loss = model(tokens, targets)
        loss.backward()
        logits = model(tokens)
    ref = plain_model_loss(c, sd, tokens, targets, F64)
    assert abs(loss.item() - ref.item()) < 2e-2 * abs(ref.item())
    assert logits.shape == (2, 16, c.vocab_size)
    assert all(p.grad is not None and torch.isfinite(p.grad.float()).all() for p in model.parameters())


# -- bad input: clear exceptions before launch -------------------------------------------------------
def _bad_cases():
    # Each group binds its own names: the lambdas read them when called.
    a, w, res = residual_args()
    rgn = torch.ops.coda.residual_gemm_norm_stats
    yield "resid K mismatch", lambda: rgn(a, w[:, :24].contiguous(), res), ValueError, "nn.Linear"
    yield "resid residual shape", lambda: rgn(a, w, res[:, :64]), ValueError, "residual must be"
    yield "resid fp32", lambda: rgn(a.float(), w, res), TypeError, "bfloat16"
    a30, w30 = a[:, :30].contiguous(), w[:, :30].contiguous()
    yield "resid K alignment", lambda: rgn(a30, w30, res), ValueError, "multiple of 8"
    yield "resid strided", lambda: rgn(a.t().contiguous().t(), w, res), ValueError, "contiguous"
    y, wn, ss = norm_args()
    yield "swiglu ss rows", lambda: torch.ops.coda.norm_swiglu(y, wn, ss[:5], EPS), ValueError, "ss must be"
    yield "swiglu ss dtype", lambda: torch.ops.coda.norm_swiglu(y, wn, ss.to(BF16), EPS), TypeError, "float32"
    yield "swiglu f alignment", lambda: torch.ops.coda.norm_swiglu(y, wn[:24], ss, EPS), ValueError, "SwiGLU width"
    yield "proj eps", lambda: torch.ops.coda.norm_proj(y, wn, ss, -1.0), ValueError, "eps"
    yield "proj N alignment", lambda: torch.ops.coda.norm_proj(y, wn[:20], ss, EPS), ValueError, "output width"
    q = list(qkv_args())

    def qkv(**kw):
        names = ["y", "w", "ss", "eps", "pos", "inv_freq", "h", "hkv", "hd", "qn", "kn", "qk_eps"]
        args = dict(zip(names, q), **kw)
        return lambda: torch.ops.coda.norm_rope_qkv(*args.values())

    yield "qkv heads", qkv(h=3), ValueError, "multiple of n_kv_heads"
    yield "qkv head_dim", qkv(hd=12), ValueError, "head_dim must be"
    yield "qkv rows", qkv(w=q[1][:-8]), ValueError, "rows"
    yield "qkv inv_freq length", qkv(inv_freq=INV_FREQ[:4]), ValueError, "inv_freq must be"
    yield "qkv inv_freq dtype", qkv(inv_freq=INV_FREQ.double()), TypeError, "inv_freq"
    yield "qkv one norm", qkv(kn=None), ValueError, "both"
    yield "qkv positions dtype", qkv(pos=q[4].float()), TypeError, "positions"
    yield "qkv segment width", lambda: torch.ops.coda.norm_rope_qkv(
        rand(8, D), rand(4 * 56, D), torch.ones(8, 1), EPS, torch.zeros(8, dtype=torch.int32),
        torch.ones(28), 2, 1, 56, torch.ones(56), torch.ones(56)), ValueError, "tile width"
    yc, wc, ssc, eps, t, ig, _ = ce_args()
    ce = torch.ops.coda.lm_head_ce
    yield "ce target range", lambda: ce(yc, wc, ssc, eps, torch.full_like(t, 50)), ValueError, r"\[0, 50\)"
    yield "ce negative target", lambda: ce(yc, wc, ssc, eps, torch.full_like(t, -1)), ValueError, "ignore_index"
    yield "ce reduction", lambda: ce(yc, wc, ssc, eps, t, -100, "avg"), ValueError, "reduction"
    yield "ce target dtype", lambda: ce(yc, wc, ssc, eps, t.float()), TypeError, "targets"
    yield "ce target length", lambda: ce(yc, wc, ssc, eps, t[:-1]), ValueError, "one entry per row"
    yield "ce hidden alignment", lambda: ce(rand(37, 12), rand(50, 12), ssc, eps, t), ValueError, "multiple of 8"


@pytest.mark.parametrize("case", list(_bad_cases()), ids=lambda c: c[0])
def test_bad_input_raises_before_launch(case):
    _, call, exc, match = case
    with coda_cute.reference_on_cpu(), pytest.raises(exc, match=match):
        call()


def test_bad_shapes_rejected_on_fake_cuda_tensors():
    with FakeTensorMode():
        y = torch.empty(64, 64, dtype=BF16, device="cuda")
        w = torch.empty(96, 48, dtype=BF16, device="cuda")
        with pytest.raises(ValueError, match="nn.Linear"):
            torch.ops.coda.norm_proj(y, w, torch.empty(64, 2, device="cuda"), EPS)


def test_ignore_index_rows_are_free():
    y, w, ss, eps, t, ig, _ = ce_args()
    with coda_cute.reference_on_cpu():
        loss, _ = torch.ops.coda.lm_head_ce(y, w, ss, eps, t, ig, "none")
    assert (loss[t == ig] == 0).all() and (loss[t != ig] > 0).all()


# -- the epilogue trees (run when the row_sum / lookup / segment_reduce nodes exist) -----------------
needs_nodes = pytest.mark.skipif(not NEW_NODES, reason="E.row_sum / E.lookup / E.segment_reduce not landed yet")


@needs_nodes
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_tree_evaluates_to_reference(qk_norm):
    args = qkv_args(qk_norm=qk_norm)
    y, w, ss, eps, pos, inv_freq, h, hkv, hd, qn, kn, qk_eps = args
    tree = QK.norm_rope_qkv_tree((h + hkv) * hd, hd, qk_norm)
    inputs = QK.qkv_tree_inputs(y, ss, eps, pos, inv_freq, h, hkv, hd, qn, kn, qk_eps)
    got = E.evaluate(tree, y.float() @ w.float().t(), inputs, (128, 64))["qkv"]
    assert rel_err(got, R.norm_rope_qkv_ref(*args)) < 1e-2


@needs_nodes
def test_norm_trees_evaluate_to_reference():
    y, w, ss = norm_args()
    acc = y.float() @ w.float().t()
    ins = norm_inputs(D, ss, EPS)
    out = E.evaluate(SW.norm_swiglu_tree(), acc, ins, (128, 64))
    z, h = R.norm_swiglu_ref(y, w, ss, EPS)
    assert rel_err(out["z"], z) < 1e-2 and rel_err(out["h"], h) < 1e-2
    assert rel_err(E.evaluate(PJ.norm_proj_tree(), acc, ins, (128, 64))["out"], R.norm_proj_ref(y, w, ss, EPS)) < 1e-2
    y, w, ss, eps, t, ig, _ = ce_args()
    out = E.evaluate(LH.lm_head_ce_tree(), y.float() @ w.float().t(),
                     dict(norm_inputs(D, ss, eps), targets=t.to(torch.int32)), (128, 32))
    loss, lse = R.lm_head_ce_ref(y, w, ss, eps, t, ig, "none")
    got_lse = E.finalize_lse(*out["lse"])
    assert rel_err(got_lse, lse) < 1e-5
    assert rel_err(LH.finalize_ce(got_lse, out["target_logit"], t, ig, "none"), loss) < 1e-5


BAD_CONFIGS = [
    (dict(dim=100, n_heads=3, n_kv_heads=1), "LlamaConfig.dim = 100: must be a multiple of 8"),
    (dict(dim=96, n_heads=5, n_kv_heads=1), "LlamaConfig.dim = 96: must be a multiple of n_heads"),
    (dict(n_kv_heads=3), "LlamaConfig.n_kv_heads = 3: must divide n_heads"),
    (dict(norm_eps=-1e-5), "LlamaConfig.norm_eps = -1e-05: must be a finite number >= 0"),
    (dict(head_dim=12), r"LlamaConfig.head_dim = 12: must be a multiple of 8 in \[8, 256\]"),
    (dict(ffn_dim=100), "LlamaConfig.ffn_dim = 100: must be a multiple of 8"),
    (dict(n_layers=0), "LlamaConfig.n_layers = 0: must be a positive integer"),
    (dict(vocab_size=2.5), "LlamaConfig.vocab_size = 2.5: must be a positive integer"),
    (dict(rope_theta=0.0), "LlamaConfig.rope_theta = 0.0: must be a finite number > 0"),
    (dict(qk_norm=True, head_dim=56), "LlamaConfig.head_dim = 56: with qk_norm must divide a GEMM tile width"),
    (dict(qk_norm="no"), "LlamaConfig.qk_norm = 'no': must be True or False"),
    (dict(qk_norm=1), "LlamaConfig.qk_norm = 1: must be True or False"),
    (dict(norm_eps=True), "LlamaConfig.norm_eps = True: must be a finite number >= 0"),
    (dict(rope_theta=True), "LlamaConfig.rope_theta = True: must be a finite number > 0"),
]


@pytest.mark.parametrize("change,match", BAD_CONFIGS, ids=[m.split(":")[0] for _, m in BAD_CONFIGS])
def test_llama_config_validates_at_construction(change, match):
    base = dict(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=50)
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**{**base, **change})
    assert LlamaConfig(**base).head_dim == 16


def test_from_hf_names_the_missing_or_unknown_key():
    c = cfg(qk_norm=False, n_layers=2)
    sd = model_state_dict(c)
    missing = {k: v for k, v in sd.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"layer 1 has no 'self_attn.k_proj.weight'"):
        CodaLlama.from_hf(c, missing)
    bias = dict(sd, **{"model.layers.0.self_attn.q_proj.bias": torch.zeros(8)})
    with pytest.raises(ValueError, match=r"does not model .*'model.layers.0.self_attn.q_proj.bias'"):
        CodaLlama.from_hf(c, bias)
    deeper = dict(sd, **{k.replace("layers.1.", "layers.2."): v for k, v in sd.items() if ".layers.1." in k})
    with pytest.raises(ValueError, match=r"layers past n_layers=2"):
        CodaLlama.from_hf(c, deeper)
    qk = cfg(qk_norm=True, n_layers=2)
    with pytest.raises(ValueError, match=r"does not model .*q_norm"):
        CodaLlama.from_hf(c, model_state_dict(qk))
    with pytest.raises(ValueError, match=r"layer 0 has no 'self_attn.q_norm.weight'"):
        CodaLlama.from_hf(qk, sd)
    buffers = dict(sd, **{"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)})
    CodaLlama.from_hf(c, buffers)  # HF's old rotary buffers carry no weight


def test_logits_of_a_ragged_vocabulary():
    """A vocabulary of no multiple of 8 (the logits' rows would miss TMA's 16-byte alignment):
    the head pads its weight's rows and slices the logits, which give the loss path's loss (the
    logits path raised that the output width must be a multiple of 8)."""
    cfg = LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=90, head_dim=16)
    model = CodaLlama(cfg)
    tokens = torch.randint(0, 90, (2, 8))
    targets = torch.roll(tokens, -1, 1)
    with coda_cute.reference_on_cpu(), torch.no_grad():
        logits = model(tokens)
        loss = model(tokens, targets)
    assert logits.shape == (2, 8, 90)
    want = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 90), targets.reshape(-1))
    assert abs(float(loss) - float(want)) < 1e-2 * float(want)


def test_model_inputs_are_checked():
    """Targets of another shape but the same count would be flattened onto other tokens; tokens
    must be (B, S) with a token."""
    cfg = LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=96, head_dim=16)
    model = CodaLlama(cfg)
    tokens = torch.randint(0, 96, (2, 8))
    with coda_cute.reference_on_cpu():
        with pytest.raises(ValueError, match=r"targets must have the tokens' shape \(2, 8\), got \(8, 2\)"):
            model(tokens, tokens.t().contiguous())
        for bad in (tokens[0], tokens[:, :0]):
            with pytest.raises(ValueError, match=r"tokens must be a \(B, S\) tensor, neither of them 0"):
                model(bad)


@pytest.mark.parametrize("precision", ["bf16", "fp8", Fp8Recipe(scaling="row")], ids=["bf16", "fp8", "fp8-row"])
def test_compiled_training_step_traces_every_op_and_matches_eager(precision):
    """torch.compile(fullgraph=True) of a whole CodaLlama step (forward + loss.backward(), the
    autograd ops traced) on the reference path (``aot_eager``: every op's fake implementation and
    registered backward in one graph): the eager loss and gradients, bit for bit."""
    import torch._dynamo

    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=96, head_dim=16,
                      qk_norm=True, precision=precision)
    model = CodaLlama(cfg)
    tokens = torch.randint(0, 96, (2, 16))
    targets = torch.roll(tokens, -1, 1)

    def step(tok, tgt):
        loss = model(tok, tgt)
        loss.backward()
        return loss.detach()

    with coda_cute.reference_on_cpu():
        want_loss = step(tokens, targets)
        want = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()
        torch._dynamo.config.trace_autograd_ops = True
        try:
            loss = torch.compile(step, fullgraph=True, backend="aot_eager")(tokens, targets)
        finally:
            torch._dynamo.config.trace_autograd_ops = False
    assert torch.equal(loss, want_loss)
    assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))


def test_model_folds_each_sublayer_weight_just_before_it(monkeypatch):
    """A step's first GEMM waits on the host for what is launched ahead of it: the MLP's γ fold
    comes after the attention sublayer. A layer also takes positions one per token (B*S,), with
    the same result as (S,)."""
    import coda_cute.nn.fold as NF
    import coda_cute.nn.llama as NL

    order = []

    def logged(name, fn):
        def call(*args, **kwargs):
            order.append(name)
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(NF, "fold_gamma", logged("fold", NF.fold_gamma))
    monkeypatch.setattr(NL, "attention_block", logged("attention", NL.attention_block))
    monkeypatch.setattr(NL, "mlp_block", logged("mlp", NL.mlp_block))
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=96, head_dim=16)
    model = CodaLlama(cfg)
    tokens = torch.randint(0, 96, (2, 16))
    with coda_cute.reference_on_cpu():
        model(tokens, torch.roll(tokens, -1, 1))
        assert order == ["fold", "attention", "fold", "mlp"] * 2
        x = torch.randn(2, 16, 64).to(torch.bfloat16)
        ss = x.float().square().sum(-1).reshape(-1, 1)
        layer = model.layers[0]
        a = layer(x, ss, torch.arange(16, dtype=torch.int32), model.rope_inv_freq)
        b = layer(x, ss, torch.arange(16, dtype=torch.int32).repeat(2), model.rope_inv_freq)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_training_after_an_inference_mode_forward():
    """A validation pass under ``torch.inference_mode`` leaves nothing behind that a later
    training step saves for its backward (inference tensors cannot be saved)."""
    cfg = LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=96, head_dim=16)
    model = CodaLlama(cfg)
    tokens = torch.randint(0, 96, (2, 16))
    targets = torch.roll(tokens, -1, 1)
    with coda_cute.reference_on_cpu():
        with torch.inference_mode():
            model(tokens, targets)
        model(tokens, targets).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
