"""GPU correctness of coda.gemm against the fp32 torch reference (run on the H200).

Every dtype x operand layout x schedule, on ragged sizes, with the output poisoned with NaN so an
unwritten tile fails. Bounds: bf16/fp16 operands 1e-2 relative (the error is output rounding,
~2e-3); FP8 with two-level accumulation 1e-2, with fast accumulation 2e-2 (the reference uses the
same FP8 inputs, so the error is accumulation + output rounding only).
"""

import pytest
import torch

import coda_cute
from coda_cute.kernels.common.config import GemmConfig
from coda_cute.ops.gemm import gemm_impl
from coda_cute.reference import gemm_ref
from helpers import rel_err

pytestmark = pytest.mark.gpu

COOP = GemmConfig(128, 256, 64, "cooperative", 1, 1)
COOP_C21 = GemmConfig(128, 256, 64, "cooperative", 2, 1)
COOP_C12 = GemmConfig(256, 128, 64, "cooperative", 1, 2)
PP = GemmConfig(128, 128, 64, "pingpong", 1, 1)
PP_C21 = GemmConfig(128, 128, 64, "pingpong", 2, 1)
PP64 = GemmConfig(64, 256, 64, "pingpong", 1, 1)
PP64x64 = GemmConfig(64, 64, 64, "pingpong", 1, 1)
#: 2x2 clusters: both operands multicast, on ragged edges where a cluster's CTAs straddle M and N
COOP_C22 = GemmConfig(128, 256, 64, "cooperative", 2, 2)
PP_C22 = GemmConfig(128, 128, 64, "pingpong", 2, 2)
CONFIGS16 = [COOP, COOP_C21, COOP_C12, PP, PP_C21, PP64, PP64x64, COOP_C22, PP_C22]

FP8_CONFIGS = [
    GemmConfig(128, 256, 128, "cooperative", 2, 1, fp8_fast_accum=True),
    GemmConfig(128, 192, 128, "cooperative", 2, 1),
    GemmConfig(128, 160, 128, "cooperative", 2, 1),
    GemmConfig(128, 128, 128, "pingpong", 1, 1, fp8_fast_accum=True),
    GemmConfig(64, 192, 128, "pingpong", 1, 1),
    GemmConfig(64, 64, 128, "pingpong", 1, 1),
    # two-level with paired k-tiles (three accumulators fit): both schedules, odd and even k-tiles
    GemmConfig(128, 128, 128, "cooperative", 1, 1),
    GemmConfig(64, 128, 128, "pingpong", 2, 1),
    # two-level in 64-row waves (a whole second accumulator does not fit), with and without the
    # split tail's fixup
    GemmConfig(256, 128, 128, "cooperative", 2, 1),
    GemmConfig(256, 128, 128, "cooperative", 1, 1, split_tail=True),
    # the FP8 MLP's ping-pong pick with both operands multicast (scripts/exp_large_gemms.py)
    GemmConfig(128, 128, 128, "pingpong", 2, 2, fp8_fast_accum=True),
    # the FP8 MLP's ping-pong pick polling its stage barriers (GemmConfig.poll_full, an experiment)
    GemmConfig(128, 128, 128, "pingpong", 2, 1, fp8_fast_accum=True, poll_full=True),
]


#: relative error bounds on 16-bit operands' products by output dtype: the output's rounding
#: (bf16 ~2e-3, fp16 ~3e-4), for fp32 the accumulation order's alone (a store rounded through
#: bf16 would read ~1.7e-3 and fail it)
OUT_BOUND = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}


def make_a(m, k, dtype, major, batch=None):
    """A (M, K) with the given major: "k" row-major, "m" a transposed view (wgrad's dY.T)."""
    lead = () if batch is None else (batch,)
    if major == "k":
        return torch.randn(*lead, m, k, device="cuda").to(dtype)
    return torch.randn(*lead, k, m, device="cuda").to(dtype).transpose(-1, -2)


def make_b(k, n, dtype, major, batch=None):
    """B (K, N): "k" is W.T of a row-major (N, K) weight (forward), "n" row-major (dgrad's W)."""
    lead = () if batch is None else (batch,)
    if major == "k":
        return torch.randn(*lead, n, k, device="cuda").to(dtype).transpose(-1, -2)
    return torch.randn(*lead, k, n, device="cuda").to(dtype)


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


def aligned(extent, dtype):
    return extent * torch.tensor([], dtype=dtype).element_size() % 16 == 0


CASES16 = [(torch.bfloat16, cfg) for cfg in CONFIGS16] + [(torch.float16, COOP), (torch.float16, PP)]


@pytest.mark.parametrize("layout", ["kk", "kn", "mk", "mn"])
@pytest.mark.parametrize("dtype,cfg", CASES16, ids=lambda x: getattr(x, "name", str(x)))
def test_gemm16_ragged(dtype, layout, cfg):
    for m, n, k in [(1, 8, 16), (17, 1000, 4104), (4095, 1000, 16), (4095, 8, 4104), (17, 8, 16),
                    (1, 1000, 4104)]:
        a = make_a(m, k, dtype, layout[0])
        b = make_b(k, n, dtype, layout[1])
        if (layout[0] == "m" and m > 1 and not aligned(m, dtype)) or \
                (layout[1] == "n" and not aligned(n, dtype)):
            with pytest.raises(ValueError, match="16 bytes"):
                gemm_impl(a, b, config=cfg)
            continue
        out = poisoned((m, n), dtype)
        gemm_impl(a, b, config=cfg, out=out)
        err = rel_err(out, gemm_ref(a, b, round_output=False))
        assert err < 1e-2, (m, n, k, err)


@pytest.mark.parametrize("cfg", [COOP, PP], ids=lambda c: c.name)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_gemm16_out_dtypes_batched(cfg, out_dtype):
    a = make_a(300, 520, torch.bfloat16, "k", batch=3)
    b = make_b(520, 264, torch.bfloat16, "n", batch=3)
    out = poisoned((3, 300, 264), out_dtype)
    gemm_impl(a, b, out_dtype=out_dtype, config=cfg, out=out)
    assert rel_err(out, gemm_ref(a, b, round_output=False)) < OUT_BOUND[out_dtype]


@pytest.mark.parametrize("layout", ["kk", "kn", "mk", "mn"])
@pytest.mark.parametrize("split", [2, 4])
def test_split_k(layout, split):
    """K split into slices run as one batched launch and summed: ragged M and N, K = split x 1024
    + 0 (whole k-tiles per slice), poisoned output in every out dtype."""
    for m, n, out_dtype in [(1, 264, torch.bfloat16), (128, 1000, torch.float32), (333, 4096, torch.bfloat16)]:
        k = split * 1024
        a = make_a(m, k, torch.bfloat16, layout[0])
        b = make_b(k, n, torch.bfloat16, layout[1])
        if (layout[0] == "m" and m > 1 and not aligned(m, torch.bfloat16)) or \
                (layout[1] == "n" and not aligned(n, torch.bfloat16)):
            continue
        out = poisoned((m, n), out_dtype)
        gemm_impl(a, b, out_dtype=out_dtype, out=out, split_k=split)
        assert rel_err(out, gemm_ref(a, b, round_output=False)) < OUT_BOUND[out_dtype], (m, n, layout)
        fresh = gemm_impl(a, b, split_k=split, config=PP64x64)
        assert fresh.dtype == torch.bfloat16 and rel_err(fresh, gemm_ref(a, b, round_output=False)) < 1e-2


def fp8_operands(m, n, k, a_dt, b_dt, scale_kind, batch=None):
    lead = () if batch is None else (batch,)
    a32 = torch.randn(*lead, m, k, device="cuda")
    w32 = torch.randn(*lead, n, k, device="cuda")
    if scale_kind == "row":
        sa = a32.abs().amax(-1, keepdim=True) / 448.0
        sb = (w32.abs().amax(-1, keepdim=True) / 448.0).transpose(-1, -2)
    else:
        sa = a32.abs().amax().reshape(1) / 448.0
        sb = w32.abs().amax().reshape(1) / 448.0
    a = (a32 / sa).to(a_dt)
    b = (w32 / sb.transpose(-1, -2) if scale_kind == "row" else w32 / sb).to(b_dt).transpose(-1, -2)
    return a, b, sa.contiguous(), sb.contiguous()


E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
# Every config with e4m3 row-wise scales; the other dtype pairs and per-tensor scales on two.
CASES8 = [(E4, E4, "row", cfg) for cfg in FP8_CONFIGS] + [
    (a, b, kind, cfg)
    for a, b, kind in [(E5, E4, "row"), (E5, E5, "row"), (E4, E4, "tensor")]
    for cfg in (FP8_CONFIGS[0], FP8_CONFIGS[1])
]


@pytest.mark.parametrize("a_dt,b_dt,scale_kind,cfg", CASES8, ids=lambda x: getattr(x, "name", str(x)))
def test_gemm_fp8_ragged(a_dt, b_dt, scale_kind, cfg):
    # k-tiles of 128: one (a single promotion); 33 (16 pairs + a single); 32, 12 (pairs only); 11 (pairs + a single)
    for m, n, k in [(1, 16, 16), (17, 1000, 4112), (4095, 1008, 4096), (4095, 16, 16),
                    (257, 520, 1424), (33, 272, 1296)]:
        a, b, sa, sb = fp8_operands(m, n, k, a_dt, b_dt, scale_kind)
        out = poisoned((m, n), torch.bfloat16)
        gemm_impl(a, b, sa, sb, use_fast_accum=cfg.fp8_fast_accum, config=cfg, out=out)
        err = rel_err(out, gemm_ref(a, b, sa, sb, round_output=False))
        assert err < (2e-2 if cfg.fp8_fast_accum else 1e-2), (m, n, k, err)


def test_gemm_fp8_batched_rowwise():
    a, b, sa, sb = fp8_operands(200, 272, 384, torch.float8_e4m3fn, torch.float8_e4m3fn, "row", batch=2)
    out = coda_cute.gemm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    # fp32 out: the accumulation's error only (the FP8 tensor cores' within each promoted k-tile);
    # a store rounded through bf16 would read 1.7e-3
    assert rel_err(out, gemm_ref(a, b, sa, sb, round_output=False)) < 5e-4


def test_gemm_fp8_matches_scaled_mm():
    a, b, sa, sb = fp8_operands(1024, 2048, 4096, torch.float8_e4m3fn, torch.float8_e4m3fn, "row")
    ours = coda_cute.gemm(a, b, scale_a=sa, scale_b=sb)
    theirs = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    ref = gemm_ref(a, b, sa, sb, round_output=False)
    assert rel_err(ours, ref) <= 1.1 * rel_err(theirs, ref) + 1e-4


def test_default_heuristic_and_autograd():
    x = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(768, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = coda_cute.gemm(x, w.t())
    g = torch.randn_like(y)
    y.backward(g)
    xr, wr = x.detach().float(), w.detach().float()
    assert rel_err(y, xr @ wr.t()) < 1e-2
    assert rel_err(x.grad, g.float() @ wr) < 1e-2
    assert rel_err(w.grad, g.float().t() @ xr) < 1e-2


def test_torch_compile_fullgraph():
    f = torch.compile(lambda a, b: torch.ops.coda.gemm(a, b) * 2, fullgraph=True)
    a = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)
    assert rel_err(f(a, b), 2 * gemm_ref(a, b, round_output=False)) < 1e-2


def test_misaligned_pointer_rejected():
    a = torch.randn(64, 65, device="cuda", dtype=torch.bfloat16)[:, 1:]
    b = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="aligned"):
        coda_cute.gemm(a, b)


# Split tail: 2x1 clusters of 128 x 128 tiles on 132 SMs give 66 slots. (M, N, K, batch) and the
# (tail tiles, K slices) it must produce: 68 cluster tiles -> 2 tail tiles in 7 slices (79 k-tiles,
# ragged M, N and K); batched, 2 x 34 -> 2 x 2; 99 -> 33 x 2 (two slots per tail tile); 10 k-tiles
# -> one slice (the tail is not split); 66 tiles -> no tail.
SPLIT_CASES = [((1000, 2136, 10000, None), (2, 7)), ((512, 2176, 2560, 2), (2, 2)),
               ((2304, 1408, 4096, None), (33, 2)), ((1024, 2176, 1280, None), (2, 1)),
               ((1536, 1400, 512, None), (0, 1))]


def _tail_of(m, n, k, batch, cfg):
    return cfg.tail(m, n, k, batch or 1, 132)


@pytest.mark.parametrize("fast", [False, True], ids=["two_level", "fast_accum"])
def test_gemm_fp8_split_tail(fast):
    if torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the cases are sized for 132 SMs")
    cfg = GemmConfig(128, 128, 128, "cooperative", 2, 1, fp8_fast_accum=fast, split_tail=True)
    for (m, n, k, batch), tail in SPLIT_CASES:
        assert _tail_of(m, n, k, batch, cfg) == tail
        a, b, sa, sb = fp8_operands(m, n, k, torch.float8_e4m3fn, torch.float8_e4m3fn, "row", batch=batch)
        out = poisoned(((batch,) if batch else ()) + (m, n), torch.bfloat16)
        gemm_impl(a, b, sa, sb, use_fast_accum=fast, config=cfg, out=out)
        err = rel_err(out, gemm_ref(a, b, sa, sb, round_output=False))
        assert err < (2e-2 if fast else 1e-2), (m, n, k, batch, err)
        again = poisoned(out.shape, torch.bfloat16)
        gemm_impl(a, b, sa, sb, use_fast_accum=fast, config=cfg, out=again)
        assert torch.equal(out, again), "the owner adds the partials in a fixed order"


def test_gemm_bf16_split_tail():
    if torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the case is sized for 132 SMs")
    cfg = GemmConfig(128, 256, 64, "cooperative", 2, 1, split_tail=True)
    m, n, k = 2048, 2200, 5120  # 8 x 9 = 72 cluster tiles on 66 slots: 6 tail tiles in 8 slices
    assert _tail_of(m, n, k, None, cfg) == (6, 8)
    a, b = make_a(m, k, torch.bfloat16, "k"), make_b(k, n, torch.bfloat16, "k")
    out = poisoned((m, n), torch.bfloat16)
    gemm_impl(a, b, config=cfg, out=out)
    assert rel_err(out, gemm_ref(a, b, round_output=False)) < 1e-2
