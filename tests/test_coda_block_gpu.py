"""GPU tests of the CODA Llama-block ops, forward and backward, and of the model (on the H200).

Each op on fresh bf16 data with ragged M against its torch reference on the same CUDA inputs
(bf16 outputs to 1e-2 relative, fp32 statistics tighter); every backward op against its float64
reference; the registered autograd against float64 autograd of the forward references (ss
recomputed from y: the ops' convention); the LM head's memory; the block's and the model's
gradients against an fp32 plain Llama, with the fused path's error no larger than the plain
bf16 path's (run with -s to see the ratios); determinism; no fp32 GEMM operands in a step.

Every test but the two of the deterministic flag allocates poisoned memory (``conftest``'s
``poisoned_allocations``: each uninitialized allocation is filled with NaN), so an op output
that a kernel leaves partly unwritten (a missed tile of a ragged edge, a skipped chunk) is NaN
and fails its comparison, instead of holding a value a previous test left there.
"""

import dataclasses

import pytest
import torch

from coda_cute import dispatch
from coda_cute import reference as R
from coda_cute.epilogue.runner import choose_config
from coda_cute.nn import CodaLlama, LlamaConfig
from coda_cute.ops import lm_head_ce as LH
from coda_cute.ops import attention
from coda_cute.ops.attention import attention_backward, attention_forward, qkv_heads
from coda_cute.ops.residual import stats_tile_n
from coda_cute.ops.swiglu import zdz_tile_n
from coda_block_helpers import (block_errors, coda_grads_as_hf, model_state_dict, plain_model_loss,
                                print_ratios, rand)
from helpers import rel_err

pytestmark = pytest.mark.gpu

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
CFG = LlamaConfig(dim=1024, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=2816, vocab_size=32003,
                  rope_theta=500000.0, max_seq_len=4096)
MS = [1000, 4133]
EPS = CFG.norm_eps


def cuda(*shape, dtype=BF16, scale=1.0):
    return rand(*shape, dtype=dtype, scale=scale, device="cuda")


def norm_args(m, n, d=CFG.dim):
    y = cuda(m, d)
    return y, cuda(n, d, scale=d ** -0.5), R.norm_stats_partials_ref(y, 128)


def qkv_args(m, qk_norm):
    c, hd = CFG, CFG.head_dim
    y, w, ss = norm_args(m, (c.n_heads + 2 * c.n_kv_heads) * hd)
    inv_freq = R.rope_inv_freq(hd, c.rope_theta, "cuda")
    pos = torch.randint(0, c.max_seq_len, (m,), device="cuda", dtype=torch.int32)
    qn = (1 + cuda(hd, scale=0.1)) if qk_norm else None
    kn = (1 + cuda(hd, scale=0.1)) if qk_norm else None
    return (y, w, ss, EPS, pos, inv_freq, c.n_heads, c.n_kv_heads, hd, qn, kn, 1e-6)


def ce_args(m, reduction="mean", gamma=True):
    y, w, ss = norm_args(m, CFG.vocab_size)
    t = torch.randint(0, CFG.vocab_size, (m,), device="cuda")
    t[::7] = -100
    g = (1 + cuda(CFG.dim, scale=0.1)) if gamma else None
    return (y, w, ss, EPS, t, -100, reduction, g)


def cases(m):
    f = CFG.ffn_dim
    yield "residual", torch.ops.coda.residual_gemm_norm_stats, (cuda(m, f), cuda(CFG.dim, f, scale=f ** -0.5), cuda(m, CFG.dim))
    yield "swiglu", torch.ops.coda.norm_swiglu, norm_args(m, 2 * CFG.ffn_dim) + (EPS,)
    yield "proj", torch.ops.coda.norm_proj, norm_args(m, 1024) + (EPS,)
    yield "qkv", torch.ops.coda.norm_rope_qkv, qkv_args(m, False)[:10]
    yield "qkv+qk_norm", torch.ops.coda.norm_rope_qkv, qkv_args(m, True)
    for red in ("mean", "sum", "none"):
        yield f"ce[{red}]", torch.ops.coda.lm_head_ce, ce_args(m, red)


REFS = {"residual": lambda a, w, r: R.residual_gemm_norm_stats_ref(a, w, r, stats_tile_n(a, w)),
        "swiglu": R.norm_swiglu_ref, "proj": R.norm_proj_ref, "qkv": R.norm_rope_qkv_ref,
        "ce": R.lm_head_ce_ref}
NAMES = ["residual", "swiglu", "proj", "qkv", "qkv+qk_norm", "ce[mean]", "ce[sum]", "ce[none]"]


def ref_of(name):
    return REFS[name.split("+")[0].split("[")[0]]


def get_case(name, m):
    return next(c for c in cases(m) if c[0] == name)


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("name", NAMES)
def test_op_matches_reference(name, m):
    _, op, args = get_case(name, m)
    got = op(*args)
    want = ref_of(name)(*args)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        # bf16 stores: one rounding apart; fp32 statistics (LSE, losses): accumulation order only.
        assert rel_err(g, w) < (1e-2 if g.dtype == BF16 else 1e-4), (name, rel_err(g, w))
    if name == "residual":  # the partials are exactly the squares of the stored y, per tile
        y, ss = got
        assert rel_err(ss, R.norm_stats_partials_ref(y, stats_tile_n(*args[:2]))) < 1e-5


def _stats_of_y(ref):
    def f(y, w, ss, *rest):
        return ref(y, w, R.norm_stats_partials_ref(y, 128), *rest)
    return f


@pytest.mark.parametrize("name", NAMES)
def test_op_backward_matches_autograd_of_reference(name):
    """The registered backward (our backward kernels) vs fp32 autograd of the forward reference
    with ss recomputed from y (ss carries no gradient; y's includes the norm's)."""
    _, op, args = get_case(name, 1000)
    residual, ce = name == "residual", name.startswith("ce")
    skip = {5} if name.startswith("qkv") else set()  # inv_freq: a constant
    if not residual:
        skip.add(2)  # ss
    idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()
           and i not in skip]
    ins = [a.detach().clone().requires_grad_() if i in idx else a for i, a in enumerate(args)]
    out = op(*ins)
    out = out if isinstance(out, tuple) else (out,)
    out = out[:1] if residual or ce else out
    cots = [torch.randn(o.shape, device="cuda") for o in out]
    got = torch.autograd.grad(sum((o.float() * c).sum() for o, c in zip(out, cots)), [ins[i] for i in idx])
    full = ref_of(name)
    ref = (lambda *a: full(*a)[:1]) if residual or ce else full
    ref = ref if residual else _stats_of_y(ref)
    ref_ins = [a.detach().float().requires_grad_() if i in idx else a for i, a in enumerate(args)]
    ref_out = ref(*ref_ins)
    ref_out = ref_out if isinstance(ref_out, tuple) else (ref_out,)
    want = torch.autograd.grad(sum((o.float() * c).sum() for o, c in zip(ref_out, cots)), [ref_ins[i] for i in idx])
    for i, g, w in zip(idx, got, want):
        assert g.dtype == args[i].dtype and rel_err(g, w) < 2e-2, (name, i, rel_err(g, w))


# -- backward ops against their float64 references -------------------------------------------------
def _close(got, want, tol, what):
    for g, w in zip(got, want):
        if w is None:
            continue
        assert g.shape == w.shape and g.dtype == w.dtype, (what, g.shape, w.shape, g.dtype, w.dtype)
        assert rel_err(g, w) < tol, (what, rel_err(g, w))


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("f", [CFG.ffn_dim, 1352])
def test_swiglu_backward_op(m, f):
    """Also at f = 1352, a last column tile that straddles f (128- and 64-wide tiles alike): its
    zdz sums add the columns past f unmasked (``kernels.epilogue.edges``), which must add zero."""
    d = CFG.dim
    dy, w_down = cuda(m, d), cuda(d, f, scale=f ** -0.5)
    z = cuda(m, 2 * f)
    ss = R.norm_stats_partials_ref(cuda(m, d), 128)
    got = torch.ops.coda.swiglu_backward(dy, w_down, z, ss, EPS)
    assert all(a.equal(b) for a, b in zip(got, torch.ops.coda.swiglu_backward(dy, w_down, z, ss, EPS)))  # no atomics
    want = R.swiglu_backward_ref(dy.double(), w_down.double(), z, ss, EPS, zdz_tile_n(dy, w_down))
    _close(got[:2], [want[0], want[1]], 1e-2, "dz, h")
    assert rel_err(got[2].sum(1), want[2].sum(1).float()) < 1e-4


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("residual", [False, True])
def test_norm_backward_op(m, residual):
    d, n = CFG.dim, 2 * CFG.ffn_dim
    g, w, y = cuda(m, n, scale=0.1), cuda(n, d, scale=n ** -0.5), cuda(m, d)
    ss = R.norm_stats_partials_ref(y, 128)
    zdz = cuda(m, 5, dtype=F32)
    dres = cuda(m, d) if residual else None
    got = torch.ops.coda.norm_backward(g, w, y, ss, zdz, EPS, dres)
    assert got.equal(torch.ops.coda.norm_backward(g, w, y, ss, zdz, EPS, dres))  # deterministic
    want = R.norm_backward_ref(g.double(), w.double(), y.double(), ss, zdz, EPS,
                               dres.double() if residual else None)
    assert rel_err(got, want) < 1e-2


#: the SDPA backends the attention core runs on, as ``torch.nn.attention.SDPBackend`` names
SDPA_BACKENDS = ["CUDNN_ATTENTION", "FLASH_ATTENTION"]


def _on_backend(name):
    """A context running SDPA on that backend alone; skips the test where this GPU's torch
    would not pick it for the core's shapes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, name)
    with sdpa_kernel([backend]):
        if attention._backend(*qkv_heads(cuda(128, 12 * 64), 1, 8, 2, 64)[:2]) != int(backend.value):
            pytest.skip(f"SDPA does not run {name} here")
    return sdpa_kernel([backend])


@pytest.mark.parametrize("forward_on", SDPA_BACKENDS)
@pytest.mark.parametrize("backward_on", SDPA_BACKENDS)
def test_attention_core_matches_reference(forward_on, backward_on):
    """Each backend's forward, then each backend's backward from it: the outputs' shapes and
    layouts are the same whichever kernel ran (a traced graph holds them), and either
    backward takes either forward's log-sum-exp."""
    b, s, h, hkv, hd = 2, 300, 8, 2, 64
    q, k, v = qkv_heads(cuda(b * s, (h + 2 * hkv) * hd), b, h, hkv, hd)
    with _on_backend(forward_on):
        o, lse = attention_forward(q, k, v)
    o_ref, lse_ref = R.attention_ref(q, k, v)
    assert lse.shape == (b, h, s) and lse.dtype == F32 and lse.is_contiguous()
    assert rel_err(o, o_ref) < 1e-2 and rel_err(lse, lse_ref) < 1e-4
    # o laid out (B, S, H, hd): the out-proj reads it as (B * S, H * hd) without a copy
    assert o.transpose(1, 2).is_contiguous()
    do = cuda(b, h, s, hd)
    with _on_backend(backward_on):
        got = attention_backward(do, q, k, v, o, lse)
    want = R.attention_backward_ref(do, q, k, v)
    _close(got, want, 2e-2, "dq, dk, dv")


def test_attention_core_compiled_on_one_backend_runs_on_the_other():
    """A graph traced while cuDNN runs SDPA, then run while flash does (and back): the fake
    shapes inductor asserts hold for both kernels' outputs."""
    b, s, h, hkv, hd = 2, 256, 8, 2, 64
    q, k, v = qkv_heads(cuda(b * s, (h + 2 * hkv) * hd), b, h, hkv, hd)
    do = cuda(b, h, s, hd)

    def core(q, k, v, do):
        o, lse = torch.ops.coda.attention_forward(q, k, v)
        return (o, lse, *torch.ops.coda.attention_backward(do, q, k, v, o, lse))

    compiled = torch.compile(core, fullgraph=True, dynamic=False)
    want = R.attention_ref(q, k, v) + R.attention_backward_ref(do, q, k, v)
    for name in SDPA_BACKENDS + SDPA_BACKENDS[:1]:
        with _on_backend(name):
            got = compiled(q, k, v, do)
        _close(got[:1] + got[2:], want[:1] + want[2:], 2e-2, f"o, dq, dk, dv on {name}")
        assert rel_err(got[1], want[1]) < 1e-4, name


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("gamma", [False, True])
@pytest.mark.parametrize("d,fraction,acc", [(1024, None, None), (256, 0.9, F32), (1024, 0.3, BF16)])
def test_lm_head_train_op(m, reduction, gamma, d, fraction, acc, monkeypatch):
    """The training op's gradients in one chunk and in several, dW accumulated in fp32 and in
    bf16 (the chunk budget set to a fraction of all the logits)."""
    v = CFG.vocab_size
    y = cuda(m, d)
    w, ss = cuda(v, d, scale=d ** -0.5), R.norm_stats_partials_ref(y, 128)
    t = torch.randint(0, v, (m,), device="cuda")
    t[::7] = -100
    g = (1 + cuda(d, scale=0.1)) if gamma else None
    if fraction is not None:
        monkeypatch.setattr(LH, "CHUNK_BYTES", int(fraction * m * 2 * (-(-v // 8) * 8)))
    if m == 4133:  # both accumulation modes run (the plan at m = 1000 differs)
        assert LH.plan_chunks(m, v, d)[1] == acc
    dloss = torch.tensor(0.37, device="cuda")
    want = R.lm_head_ce_grad_ref(y.double(), w.double(), ss, EPS, t, -100, reduction,
                                 g.double() if gamma else None, dloss=dloss)
    want_loss, want_lse = R.lm_head_ce_ref(y, w, ss, EPS, t, -100, reduction, g)
    ins = [y.clone().requires_grad_(), w.clone().requires_grad_()] + ([g.clone().requires_grad_()] if gamma else [])
    out = torch.ops.coda.lm_head_ce_train(ins[0], ins[1], ss, EPS, t, -100, reduction, ins[2] if gamma else None)
    assert rel_err(out[0], want_loss) < 1e-4 and rel_err(out[1], want_lse) < 1e-4
    (out[0] * dloss).backward()
    for i, wt in zip(ins, want):
        assert i.grad.dtype == i.dtype and rel_err(i.grad, wt) < 2e-2, rel_err(i.grad, wt)
    again = [i.detach().clone().requires_grad_() for i in ins]
    out2 = torch.ops.coda.lm_head_ce_train(again[0], again[1], ss, EPS, t, -100, reduction, again[2] if gamma else None)
    (out2[0] * dloss).backward()
    assert out2[0].equal(out[0]) and all(a.grad.equal(i.grad) for a, i in zip(again, ins))  # deterministic


@pytest.mark.parametrize("exp_card", sorted(LH.EXP_CONFIGS))
def test_lm_head_train_op_on_confident_and_far_rows(exp_card, monkeypatch):
    """The exp form's hard rows end to end: targets 15 and 25 nats up (1 - p_t down to 1e-11,
    kept by the others' share at the target), and rows with a logit 70 or 150 nats above the
    target (past EXP_GUARD: their tiles rescale in the row step), next to ordinary and ignored
    rows; loss, LSE and gradients against float64. With the logits GEMM on each card's config,
    whichever card runs the test."""
    monkeypatch.setattr(LH, "exp_config", lambda card: LH.EXP_CONFIGS[exp_card])
    m, d, v = 1000, 256, CFG.vocab_size
    y = cuda(m, d)
    w, ss = cuda(v, d, scale=d ** -0.5), R.norm_stats_partials_ref(y, 128)
    t = torch.randint(0, v, (m,), device="cuda")
    r = R.rms_rstd_ref(ss, d, EPS)
    yf = y.float()
    # a weight row along y_m sets row m's logit at that column: logit = r (y_m . w_j)
    for rows, nats, other in ((range(1, m, 9), 15.0, 0), (range(2, m, 9), 25.0, 0),
                              (range(3, m, 9), 70.0, 5003), (range(4, m, 9), 150.0, 129)):
        for i in rows:
            col = (int(t[i]) + other) % v
            base = r[i] * (yf[i] @ w[int(t[i])].float())
            w[col] = (yf[i] * ((base + nats) / (r[i] * (yf[i] @ yf[i])))).to(BF16)
    t[::7] = -100
    want = R.lm_head_ce_grad_ref(y.double(), w.double(), ss, EPS, t, -100, "mean")
    want_loss, want_lse = R.lm_head_ce_ref(y, w, ss, EPS, t, -100, "mean")
    ins = [y.clone().requires_grad_(), w.clone().requires_grad_()]
    out = torch.ops.coda.lm_head_ce_train(ins[0], ins[1], ss, EPS, t, -100, "mean")
    assert rel_err(out[0], want_loss) < 1e-4 and rel_err(out[1], want_lse) < 1e-4
    out[0].backward()
    for i, wt in zip(ins, want):
        assert rel_err(i.grad, wt) < 2e-2, rel_err(i.grad, wt)


def test_exp_combine_kernel_matches_the_reference():
    """The row step (kernels.elementwise.exp_combine) on the logits epilogue's reference output:
    e' to bf16 rounding (bitwise where no rescale runs), LSE and rs to fp32 rounding; rows with a
    logit 70 or 150 nats above the target (their tiles' K recovered from u and w, the others
    rescaled), confident rows, ignored rows, a target in the ragged last tile; nothing written
    past column V - 1 (NaN-poisoned padding)."""
    from coda_cute.elementwise_lm_head import exp_combine_
    m, v, d, tile, guard = 1003, 32003, 256, LH.EXP_TILE, LH.EXP_GUARD
    u, w = cuda(m, d), cuda(v, d, scale=3 * d ** -0.5)
    r = torch.rand(m, device="cuda") + 0.5
    t = torch.randint(0, v, (m,), device="cuda")
    t[5] = v - 1
    uf = u.double()

    def logits():
        return (r.double()[:, None] * (uf @ w.double().t())).float()

    base = logits()
    for i in range(2, m, 50):  # a weight row along u_i sets row i's logit in that column
        col, up = ((int(t[i]), 25.0), ((int(t[i]) + 1000) % v, 150.0), ((int(t[i]) + 3) % v, 70.0))[i % 3]
        w[col] = (uf[i] * ((float(base[i, t[i]]) + up) / (float(r[i]) * float(uf[i] @ uf[i])))).to(BF16)
    t[::7] = -100
    lg = logits()
    tl = R.target_logits_ref(u, w, t, r)
    e, se = R.exp_logits_ref(lg, tl, tile, guard)
    coef = R.ce_coef(t, -100, "mean")
    want = R.exp_combine_ref(e, se, u, w, tl, t, coef, r, tile, guard)
    buf = torch.full((m, -(-v // 8) * 8), float("nan"), dtype=BF16, device="cuda")
    got_e = buf[:, :v]
    got_e.copy_(e)
    lse = torch.full((m,), float("nan"), device="cuda")
    rs = exp_combine_(got_e, se, u, w, tl, t.to(torch.int32), coef, r, tile, guard, lse)
    # rescaled values to one bf16 rounding (subnormals far below any p apart)
    torch.testing.assert_close(got_e.float(), want[0].float(), rtol=2 ** -7, atol=1e-30)
    assert buf[:, v:].isnan().all()
    # rows that need no rescale keep every stored value but the target's, bit for bit
    rows = torch.arange(m, device="cuda")
    plain = (R.exp_tile_k_ref(e, se, u, w, tl, r, tile, guard) == tl.double()[:, None]).all(1)
    untouched = torch.ones_like(e, dtype=torch.bool)
    valid = t != -100
    untouched[rows[valid], t[valid]] = False
    assert m // 2 < plain.sum() < m and torch.equal(got_e[plain & valid][untouched[plain & valid]],
                                                    e[plain & valid][untouched[plain & valid]])
    # the recovered K: its logit recomputed in fp32 by the warp (the reference: float64), which
    # rows with a recovered tile carry into the LSE and rs (simulated: up to 7e-5 at d 256)
    torch.testing.assert_close(lse, want[1], rtol=0, atol=3e-4)
    torch.testing.assert_close(rs, want[2], rtol=3e-4, atol=0)


def test_target_logits_and_row_finish_kernels_match_their_references():
    """kernels.elementwise.target_logits (clamped targets, ragged M, d 4096) and lm_head_rows
    (dy in place, the wgrad operand) against float64; poisoned outputs."""
    from coda_cute.elementwise_lm_head import lm_head_rows_, target_logits
    m, d, v = 1003, 4096, 5000
    u, w = cuda(m, d), cuda(v, d, scale=d ** -0.5)
    t = torch.randint(0, v, (m,), device="cuda", dtype=torch.int32)
    t[::7] = -100
    t[3] = v + 9  # clamped like an ignored row's
    r = torch.rand(m, device="cuda") + 0.5
    out = torch.full((m,), float("nan"), device="cuda")
    got = target_logits(u, w, t, r, out=out)
    torch.testing.assert_close(got, R.target_logits_ref(u, w, t, r), rtol=1e-5, atol=1e-5)

    y, dy0 = cuda(m, d), cuda(m, d)
    gamma = 1 + cuda(d, scale=0.1)
    zdz, rs = torch.randn(m, device="cuda") * d, torch.rand(m, device="cuda")
    want_dy, want_us = R.lm_head_rows_ref(dy0, y, gamma, r, zdz, rs)
    dy = dy0.clone()
    us = lm_head_rows_(dy, y, gamma, r, zdz, rs)
    # one bf16 rounding each (the fp32 product may land on the other side of a rounding boundary)
    torch.testing.assert_close(dy.float(), want_dy.float(), rtol=2 ** -7, atol=1e-6)
    torch.testing.assert_close(us.float(), want_us.float(), rtol=2 ** -7, atol=1e-6)


def test_lm_head_bf16_accumulator_refuses_a_second_backward(monkeypatch):
    """The in-place last-chunk wgrad (coda.lm_head_ce_dw_) bumps the accumulator's version on the
    GPU path too: a retained graph's second backward raises."""
    m, d, v = 4133, 1024, CFG.vocab_size
    y, w = cuda(m, d).requires_grad_(), cuda(v, d, scale=d ** -0.5).requires_grad_()
    ss = R.norm_stats_partials_ref(y.detach(), 128)
    monkeypatch.setattr(LH, "CHUNK_BYTES", int(0.3 * m * 2 * (-(-v // 8) * 8)))
    assert LH.plan_chunks(m, v, d)[1] == BF16
    loss = LH.cross_entropy(y, w, ss, EPS, torch.randint(0, v, (m,), device="cuda"))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("m", MS)
def test_lm_head_recompute_backward(m):
    """reduction="none" with a gradient on LSE too: the loss-only op's recomputing backward."""
    y, w, ss, eps, t, ig, _, g = ce_args(m, "none")
    dloss, dlse = torch.randn(m, device="cuda"), torch.randn(m, device="cuda") * 0.1
    lse = R.lm_head_ce_ref(y, w, ss, eps, t, ig, "none", g)[1]
    got = torch.ops.coda.lm_head_ce_backward(y, w, ss, eps, t, lse, dloss, dlse, ig, "none", g)
    want = R.lm_head_ce_grad_ref(y.double(), w.double(), ss, eps, t, ig, "none", g.double(), dloss, dlse)
    _close(got[:2], [w.to(BF16) for w in want[:2]], 2e-2, "dy, dw")
    assert rel_err(got[2].float(), want[2].float()) < 2e-2


def test_lm_head_backward_refuses_targets_outside_the_vocabulary():
    """Its kernels never index with a target: one outside [0, V) would lose its -1 silently.
    The check is read back after the launches; the context stays usable."""
    y, w, ss, eps, t, ig, _, g = ce_args(300, "none")
    m = y.shape[0]
    lse = R.lm_head_ce_ref(y, w, ss, eps, t, ig, "none", g)[1]
    bad = t.clone()
    bad[m // 2] = w.shape[0]
    with pytest.raises(ValueError, match=rf"targets must lie in \[0, {w.shape[0]}\)"):
        torch.ops.coda.lm_head_ce_backward(y, w, ss, eps, bad, lse, torch.randn(m, device="cuda"),
                                           torch.zeros(m, device="cuda"), ig, "none", g)
    torch.cuda.synchronize()


def test_lm_head_loss_only_op_backward_through_autograd(monkeypatch):
    """The loss-only op under autograd with gradients on both outputs: a backward of
    loss.sum() + c * lse.sum() hands the op expanded (stride-0) dloss and dlse, in several chunks."""
    y, w, ss, eps, t, ig, _, g = ce_args(1000, "none")
    monkeypatch.setattr(LH, "CHUNK_BYTES", 256 * 2 * (-(-CFG.vocab_size // 8) * 8))  # 256-row chunks
    ins = [y.clone().requires_grad_(), w.clone().requires_grad_(), g.clone().requires_grad_()]
    loss, lse = torch.ops.coda.lm_head_ce(ins[0], ins[1], ss, eps, t, ig, "none", ins[2])
    (loss.sum() + 0.1 * lse.sum()).backward()
    m = y.shape[0]
    want = R.lm_head_ce_grad_ref(y.double(), w.double(), ss, eps, t, ig, "none", g.double(),
                                 torch.ones(m, device="cuda"), torch.full((m,), 0.1, device="cuda"))
    for i, wt in zip(ins, want):
        assert rel_err(i.grad, wt) < 2e-2, rel_err(i.grad, wt)


def test_lm_head_memory_is_lean():
    """The training op's forward holds one chunk of bf16 logits beyond its inputs and outputs
    (the dW accumulator too, when dW accumulates in fp32)."""
    m, d, v = 8192, 1024, 32768
    y = cuda(m, d).requires_grad_()
    w = cuda(v, d, scale=d ** -0.5).requires_grad_()
    ss = R.norm_stats_partials_ref(y.detach(), 128)
    t = torch.randint(0, v, (m,), device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = LH.cross_entropy(y, w, ss, 1e-5, t)
    loss.backward()
    peak = torch.cuda.max_memory_allocated() - base
    outputs = (m * d + v * d) * 2 * 2  # the saved gradients, and the returned ones
    rows, acc = LH.plan_chunks(m, v, d)
    chunk = rows * v * 2 + (4 * v * d if acc == F32 else 0)
    print(f"peak beyond inputs {peak / 2**20:.1f} MiB (gradients {outputs / 2**20:.0f}, chunk {chunk / 2**20:.0f})")
    assert peak < outputs + chunk + 64 * 2**20


# -- the block and the model --------------------------------------------------------------------------
@pytest.mark.parametrize("qk_norm", [False, True])
def test_block_matches_plain_llama_block(qk_norm):
    """The issue's criterion: against the fp32 plain block, the fused block's error (output, dx,
    every weight gradient) is no larger than the plain bf16 block's."""
    cfg = dataclasses.replace(CFG, qk_norm=qk_norm)
    errs = block_errors(cfg, bsz=2, seq=512, ref_dtype=F32, device="cuda")
    print_ratios(errs)
    worse = {k: (f, errs["unfused"][k]) for k, f in errs["fused"].items() if f > errs["unfused"][k]}
    assert not worse, worse


def _model_and_batch(cfg, seq=512, bsz=2):
    sd = model_state_dict(cfg, device="cuda")
    model = CodaLlama.from_hf(cfg, sd, device="cuda")
    tokens = torch.randint(0, cfg.vocab_size, (bsz, seq), device="cuda")
    targets = torch.roll(tokens, -1, dims=1)
    targets[:, -1] = -100
    targets[0, :7] = -100
    return sd, model, tokens, targets


def test_model_gradients_vs_fp32_reference():
    """Loss and every gradient of the CODA model against the fp32 plain model on the same
    weights: no larger than the plain bf16 model's error (ratios printed with -s)."""
    cfg = dataclasses.replace(CFG, n_layers=2, max_seq_len=512)
    sd, model, tokens, targets = _model_and_batch(cfg)

    def plain(dtype):
        p = {k: v.detach().to(dtype).requires_grad_() for k, v in sd.items()}
        loss = plain_model_loss(cfg, p, tokens, targets, dtype)
        loss.backward()
        return loss.detach(), {k: v.grad for k, v in p.items()}

    ref_loss, ref = plain(F32)
    bf_loss, bf = plain(BF16)
    loss = model(tokens, targets)
    loss.backward()
    grads = coda_grads_as_hf(model)
    worse = {}
    print(f"loss: coda {abs(loss.item() - ref_loss.item()):.2e} bf16 {abs(bf_loss.item() - ref_loss.item()):.2e}")
    for k in ref:
        e, u = rel_err(grads[k], ref[k]), rel_err(bf[k], ref[k])
        print(f"{k:48s} coda {e:.2e} bf16 {u:.2e} ratio {e / u:.2f}")
        if e > u:
            worse[k] = (e, u)
    flat = {name: torch.cat([g[k].float().flatten() for k in ref]) for name, g in (("coda", grads), ("bf16", bf))}
    ref_flat = torch.cat([ref[k].flatten() for k in ref])
    e, u = rel_err(flat["coda"], ref_flat), rel_err(flat["bf16"], ref_flat)
    print(f"all gradients together: coda {e:.2e} bf16 {u:.2e} ratio {e / u:.2f}")
    assert not worse, worse


@pytest.mark.unpoisoned
def test_training_step_is_deterministic():
    """Two steps on the same model and batch give bitwise equal loss and gradients with
    torch.use_deterministic_algorithms(True) (the attention core is torch's; our own kernels,
    the embedding backward included, use no atomics)."""
    cfg = dataclasses.replace(CFG, n_layers=2, max_seq_len=512)
    _, model, tokens, targets = _model_and_batch(cfg)
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            loss = model(tokens, targets)
            loss.backward()
            runs.append((loss.detach().clone(), [p.grad.clone() for p in model.parameters()]))
    finally:
        torch.use_deterministic_algorithms(False)
    assert runs[0][0].equal(runs[1][0])
    assert all(a.equal(b) for a, b in zip(runs[0][1], runs[1][1]))


@pytest.mark.unpoisoned
def test_our_gradients_are_deterministic_without_the_flag():
    """Without torch.use_deterministic_algorithms, every gradient that torch's SDPA backward
    (atomics) does not feed is bitwise equal over two steps: the LM head's, the final norm's and
    the last layer's MLP and out-proj, all from our kernels."""
    cfg = dataclasses.replace(CFG, n_layers=2, max_seq_len=512)
    _, model, tokens, targets = _model_and_batch(cfg)
    ours = {"head.weight", "head.norm", "layers.1.ffn_norm", "layers.1.w_gu", "layers.1.w_down", "layers.1.wo"}
    assert not torch.are_deterministic_algorithms_enabled()
    runs = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = model(tokens, targets)
        loss.backward()
        runs.append((loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters() if n in ours}))
    assert len(runs[0][1]) == len(ours)
    assert runs[0][0].equal(runs[1][0])
    assert all(runs[0][1][n].equal(runs[1][1][n]) for n in ours), [n for n in ours if not runs[0][1][n].equal(runs[1][1][n])]


#: aten's matrix products: a step's GEMM that is not ours runs through one of these
_ATEN_GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::matmul",
               "aten::linear", "aten::mv", "aten::addmv", "aten::dot", "aten::_scaled_mm"}
_SIXTEEN_BIT = {"c10::BFloat16", "c10::Half", "c10::Float8_e4m3fn", "c10::Float8_e5m2"}


def wide_gemms(events):
    """(name, input dtypes) of the profiled aten GEMMs whose two matrix operands are not all
    16-bit or FP8 (the add- forms' first input is the added term; _scaled_mm's scales are fp32)."""
    def operands(e):
        return e.input_dtypes[1:3] if e.name.startswith("aten::add") or e.name == "aten::baddbmm" else e.input_dtypes[:2]
    return [(e.name, e.input_dtypes) for e in events
            if e.name in _ATEN_GEMMS and any(t and t not in _SIXTEEN_BIT for t in operands(e))]


def test_training_step_has_no_fp32_gemm():
    """Profile one training step: every matrix product torch runs (aten's GEMM ops, by their
    recorded input dtypes) takes 16-bit or FP8 operands, and no GPU kernel is a cuBLAS / CUTLASS
    fp32 or tf32 GEMM by name (simt sgemm, f32f32 xmma); ours take bf16 by construction."""
    cfg = dataclasses.replace(CFG, n_layers=2, max_seq_len=512)
    _, model, tokens, targets = _model_and_batch(cfg)
    model(tokens, targets).backward()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
        model(tokens, targets).backward()
        torch.cuda.synchronize()
    wide = wide_gemms(prof.events())
    assert not wide, wide
    names = {e.key for e in prof.key_averages()}
    fp32 = [n for n in names if any(s in n.lower() for s in ("sgemm", "f32f32", "gemm_f32", "tf32"))]
    assert not fp32, fp32


def test_compiled_training_step_matches_eager():
    """torch.compile(fullgraph=True) of a whole step (forward + loss.backward()) runs and gives
    the eager loss and gradients."""
    import torch._dynamo

    cfg = dataclasses.replace(CFG, n_layers=2, max_seq_len=512)
    _, model, tokens, targets = _model_and_batch(cfg)

    def step(tok, tgt):
        loss = model(tok, tgt)
        loss.backward()
        return loss.detach()

    loss = step(tokens, targets)
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch._dynamo.config.trace_autograd_ops = True
    try:
        got_loss = torch.compile(step, fullgraph=True)(tokens, targets)
    finally:
        torch._dynamo.config.trace_autograd_ops = False
    assert rel_err(got_loss, loss) < 1e-3
    for p, w in zip(model.parameters(), want):
        assert rel_err(p.grad, w) < 1e-2


def test_small_model_trains():
    cfg = dataclasses.replace(CFG, n_layers=2, max_seq_len=512)
    sd, model, tokens, targets = _model_and_batch(cfg)
    loss = model(tokens, targets)
    ref = plain_model_loss(cfg, sd, tokens, targets, F32)
    assert abs(loss.item() - ref.item()) < 1e-2 * ref.item()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(10):
        opt.zero_grad()
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


def test_lm_head_config_choices_do_not_spill():
    """The training LM head's GEMMs at the benchmark's chunk shapes (4096 rows, d 2048 and 4096):
    the exp-form logits tree on its fixed config and the dgrad tree on the runner's pick build
    without spills for this device's SM count and card."""
    from coda_cute.compiler import KernelSpec, get_gemm, spill_bytes

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    card = dispatch.card_of(torch.device("cuda", 0))
    for d in (2048, 4096):
        for tree, cfg, majors in ((LH.exp_logits_tree(), LH.exp_config(card), "kk"),
                                  (LH.exp_dgrad_tree(True), choose_config(LH.exp_dgrad_tree(True), 4096, d, 128256,
                                                                          1, False, False, sms, card=card), "kn")):
            spec = KernelSpec.of("bfloat16", "bfloat16", *majors, cfg, tree, "sm_90a", sms)
            assert spill_bytes(get_gemm(spec)) == 0, (d, cfg)


# rows: one CTA's four and a ragged count; tiles: one, the 128- and 256-wide tile counts at V 128256
@pytest.mark.parametrize("m, t", [(4, 1), (4133, 1002), (1000, 501)])
def test_lse_combine_kernel_matches_the_reference(m, t):
    """The LM head's LSE from its partials: the torch reference's value (within fp32 rounding of a
    float64 evaluation), every row written (NaN-poisoned output), and the reference's rules for
    rows of -inf (-inf), +inf (inf) and NaN partials (NaN)."""
    from coda_cute.elementwise import lse_combine
    from coda_cute.epilogue import finalize_lse

    mx = 20 * torch.randn(m, t, device="cuda")
    se = torch.rand(m, t, device="cuda") * 100 + 1
    mx[1] = float("-inf")
    se[1] = 0.0
    mx[2, t // 2] = float("inf")
    mx[3, 0] = float("nan")
    out = torch.full((m,), float("nan"), device="cuda")
    lse_combine(mx, se, out)
    want = finalize_lse(mx.double(), se.double())
    assert torch.isneginf(out[1]) and torch.isinf(out[2]) and out[2] > 0 and torch.isnan(out[3])
    keep = torch.ones(m, dtype=torch.bool, device="cuda")
    keep[1:4] = False
    assert torch.isfinite(out[keep]).all()
    assert ((out[keep].double() - want[keep]).abs() <= 2e-6 * want[keep].abs() + 1e-6).all()
    torch.testing.assert_close(out[keep], finalize_lse(mx, se)[keep], rtol=2e-6, atol=1e-5)
