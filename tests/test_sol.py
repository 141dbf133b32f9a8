"""CPU tests of the speed-of-light reporter: hand-counted FLOPs and bytes, ceilings, CLI output."""

import importlib
import json

import pytest
import torch

import coda_cute
from coda_cute import sol
from coda_cute.cli import main as cli_main
from coda_cute.sol import devices, model
from coda_cute.sol.devices import Ceilings
from coda_cute.sol.registry import register_op

H200 = sol.datasheet("h200")


# -- FLOP and byte counts, written out by hand ------------------------------------------------------
def test_gemm_bf16_llama8b_qkv():
    c = model.gemm(16384, 6144, 4096, "bf16")
    assert c.flops == 2 * 16384 * 6144 * 4096 == 824_633_720_832
    # A (M·K) + B (K·N) in bf16, out (M·N) in bf16
    assert c.bytes == (16384 * 4096 + 4096 * 6144) * 2 + 16384 * 6144 * 2 == 385_875_968
    assert c.epilogue_flops == 0


def test_gemm_fp8_reads_row_and_column_scales():
    c = model.gemm(1024, 512, 256, "fp8")
    assert c.flops == 2 * 1024 * 512 * 256
    # 1-byte operands, bf16 out, one fp32 scale per row of A and per column of B
    assert c.bytes == (1024 * 256 + 256 * 512) * 1 + 1024 * 512 * 2 + 1024 * 4 + 512 * 4 == 1_447_936
    assert c.traffic["scale_a"] == 4096 and c.traffic["scale_b"] == 2048


def test_gemm_fp16_fp32_out():
    c = model.gemm(100, 200, 300, "fp16", out_dtype="fp32")
    assert c.bytes == (100 * 300 + 300 * 200) * 2 + 100 * 200 * 4 == 260_000


def test_residual_norm_stats_llama8b_o():
    c = model.residual_norm_stats(16384, 4096, 4096, "bf16")
    assert c.gemm_flops == 2 * 16384 * 4096 * 4096
    assert c.epilogue_flops == 16384 * 4096 + 2 * 16384 * 4096  # add, square-accumulate
    # a, W, residual x read; y written; p: 4096 / 256 = 16 fp32 partials per row
    assert c.bytes == (16384 * 4096 + 4096 * 4096) * 2 + 16384 * 4096 * 2 * 2 + 16384 * 16 * 4


def test_residual_norm_stats_option_a_stores_y_gamma():
    b = model.residual_norm_stats(64, 512, 128)
    a = model.residual_norm_stats(64, 512, 128, store_scaled=True)
    assert a.bytes - b.bytes == 512 * 2 + 64 * 512 * 2  # gamma read, y*gamma written
    assert a.epilogue_flops - b.epilogue_flops == 64 * 512


def test_scaled_swiglu():
    m, f, d = 128, 256, 512  # d / 256 = 2 stats partials per row
    c = model.scaled_swiglu(m, f, d, "bf16")
    assert (c.m, c.n, c.k) == (128, 512, 512)
    assert c.gemm_flops == 2 * 128 * 512 * 512
    # r: (2 + 2) per row; r-scale 2f per row; silu·u 4 per output
    assert c.epilogue_flops == 128 * 4 + 128 * 512 + 4 * 128 * 256 == 197_120
    # y, W_gu; p; z (M·2f) and out (M·f) in bf16
    assert c.bytes == (128 * 512 + 512 * 512) * 2 + 128 * 2 * 4 + 128 * 512 * 2 + 128 * 256 * 2 == 852_992
    assert model.scaled_swiglu(m, f, d, save_preact=False).bytes == 852_992 - 128 * 512 * 2


def test_scaled_rope_llama8b_shape_and_qknorm():
    m = 16
    c = model.scaled_rope(m, 4096, 32, 8, 128, "bf16")
    assert (c.n, c.k) == (6144, 4096)  # (32 + 2·8)·128
    rotated = 40 * 128
    assert c.epilogue_flops == 16 * 18 + 16 * 6144 + 16 * 64 * 3 + 3 * 16 * rotated
    assert c.bytes == (16 * 4096 + 6144 * 4096) * 2 + 16 * 16 * 4 + 16 * 4 + 16 * 6144 * 2
    q = model.scaled_rope(m, 4096, 32, 8, 128, "bf16", qk_norm=True)
    assert q.op == "scaled_rope_qknorm"
    assert q.epilogue_flops - c.epilogue_flops == 4 * 16 * rotated + 3 * 16 * 40
    assert q.bytes - c.bytes == 2 * 128 * 2


def test_scaled_proj_and_lm_head_ce():
    p = model.scaled_proj(64, 1000, 512, "bf16")
    assert p.epilogue_flops == 64 * (2 + 2) + 64 * 1000
    assert p.bytes == (64 * 512 + 1000 * 512) * 2 + 64 * 2 * 4 + 64 * 1000 * 2
    ce = model.lm_head_ce(64, 1000, 512, "bf16")
    assert ce.epilogue_flops == 64 * 4 + 64 * 1000 + 4 * 64 * 1000
    # logits never written: 1000 / 256 -> 4 tiles of (max, sum) partials, target logit, int64 targets
    assert ce.bytes == (64 * 512 + 1000 * 512) * 2 + 64 * 2 * 4 + 64 * 8 + 2 * 64 * 4 * 4 + 64 * 4


def test_shadow_is_the_plain_gemm():
    c = model.scaled_swiglu(128, 256, 512, "fp8")
    s = c.shadow()
    assert (s.op, s.m, s.n, s.k, s.dtype) == ("gemm", 128, 512, 512, "fp8")
    assert s.flops == c.gemm_flops and s.bytes == model.gemm(128, 512, 512, "fp8").bytes


def test_sol_ms_is_the_larger_term():
    c = model.gemm(1024, 1024, 1024, "bf16")  # 2^31 FLOP, 6·2^20 bytes
    compute_roof = Ceilings("x", bandwidth=1e15, peak={"bf16": 1e12}, source="datasheet")
    memory_roof = Ceilings("x", bandwidth=1e9, peak={"bf16": 1e18}, source="datasheet")
    assert c.sol_ms(compute_roof) == pytest.approx(2**31 / 1e12 * 1e3)
    assert c.bound(compute_roof) == "compute"
    assert c.sol_ms(memory_roof) == pytest.approx(6 * 2**20 / 1e9 * 1e3)
    assert c.bound(memory_roof) == "memory"
    assert c.sol_ms(H200) == pytest.approx(max(2**31 / 989.4e12, 6 * 2**20 / 4.8e12) * 1e3)


# -- devices ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,key", [
    ("NVIDIA H200", "h200"), ("h200", "h200"), ("NVIDIA H200 NVL", "h200-nvl"),
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("h100", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H100 NVL", "h100-nvl"), ("NVIDIA B200", "b200"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"), ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
    ("NVIDIA GH200 480GB", "gh200"),
])
def test_datasheet_lookup(name, key):
    assert sol.datasheet(name) is sol.datasheet(key)


def test_datasheet_values():
    assert H200.peak_flops("bf16") == pytest.approx(989.4e12)
    assert H200.peak_flops("fp8") == pytest.approx(1978.9e12)
    assert H200.bandwidth == pytest.approx(4.8e12)
    assert sol.datasheet("h100-pcie").bandwidth == pytest.approx(2.0e12)
    with pytest.raises(ValueError, match="fp8"):
        sol.datasheet("a100").peak_flops("fp8")
    with pytest.raises(KeyError, match="known"):
        sol.datasheet("NVIDIA GeForce RTX 4090")


def test_measured_ceilings_cached_per_key_and_recalibrated(tmp_path, monkeypatch):
    calls = []

    def fake_calibrate(index=None):
        calls.append(index)
        return Ceilings("fake", 4.2e12 + len(calls), {"bf16": 7e14}, "measured", ("bandwidth", "bf16"))

    monkeypatch.setattr(devices, "calibrate", fake_calibrate)
    monkeypatch.setattr(devices, "device_key", lambda index=None: "fake | driver 1 | torch x | cuda y")
    path = tmp_path / "ceilings.json"
    first = devices.measured_ceilings(path=path)
    again = devices.measured_ceilings(path=path)
    assert first == again and len(calls) == 1
    assert json.loads(path.read_text())["fake | driver 1 | torch x | cuda y"]["bandwidth"] == first.bandwidth
    fresh = devices.measured_ceilings(path=path, recalibrate=True)
    assert len(calls) == 2 and fresh.bandwidth != first.bandwidth


def test_cache_path_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert devices.cache_path() == tmp_path / "coda_cute" / "ceilings.json"


# -- shapes, registry, estimate -----------------------------------------------------------------------
def test_llama_presets():
    assert [s.mnk for s in sol.parse_shapes("llama3-8b")] == [
        (16384, 6144, 4096), (16384, 4096, 4096), (16384, 28672, 4096), (16384, 4096, 14336),
        (16384, 128256, 4096)]
    assert [s.mnk for s in sol.parse_shapes("llama3-1b")] == [
        (16384, 3072, 2048), (16384, 2048, 2048), (16384, 16384, 2048), (16384, 2048, 8192),
        (16384, 128256, 2048)]
    assert [s.mnk for s in sol.parse_shapes("llama3-70b", tokens=4096)] == [
        (4096, 10240, 8192), (4096, 8192, 8192), (4096, 57344, 8192), (4096, 8192, 28672),
        (4096, 128256, 8192)]
    assert sol.parse_shapes(["8192,8192,8192", (1, 2, 3)])[1].mnk == (1, 2, 3)


def test_estimate_default_pairs_each_layer_with_its_fused_op():
    recs = sol.estimate(shapes="llama3-8b", device="h200")
    assert [(r.op, r.layer) for r in recs] == [
        ("gemm", "qkv"), ("scaled_rope", "qkv"), ("gemm", "o"), ("residual_norm_stats", "o"),
        ("gemm", "gate_up"), ("scaled_swiglu", "gate_up"), ("gemm", "down"),
        ("residual_norm_stats", "down"), ("gemm", "lm_head"), ("lm_head_ce", "lm_head")]
    qkv = recs[0]
    assert qkv.sol_ms == pytest.approx(max(824_633_720_832 / 989.4e12, 385_875_968 / 4.8e12) * 1e3)
    assert qkv.shadow_sol_ms == qkv.sol_ms and qkv.time_ms is None


def test_layouts_cost_their_own_product():
    dgrad, wgrad = sol.estimate(["gemm_dgrad", "gemm_wgrad"], [(100, 200, 300)], "fp8")
    assert dgrad.gemm == [100, 300, 200] and wgrad.gemm == [200, 300, 100]
    # dX = dY @ W: dY (100·200) and W (200·300) in fp8, dX (100·300) in bf16, scales
    assert dgrad.bytes == 100 * 200 + 300 * 200 + 100 * 300 * 2 + 100 * 4 + 300 * 4
    assert dgrad.flops == wgrad.flops == 2 * 100 * 200 * 300


def test_register_op_is_one_line():
    register_op("test_double_out", cost=lambda s, dt: model.gemm(s.m, 2 * s.n, s.k, dt, op="test_double_out"))
    try:
        (r,) = sol.estimate(["test_double_out"], "64,64,64")
        assert r.flops == 2 * 64 * 128 * 64
        register_op("test_double_out", build=lambda s, dt, dev: (lambda: None))
        assert sol.OPS["test_double_out"].build is not None
    finally:
        del sol.OPS["test_double_out"]


# -- CLI ----------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the model-only path")
def test_cli_writes_json_and_png(tmp_path, capsys):
    js, png = tmp_path / "sol.json", tmp_path / "sol.png"
    rc = cli_main(["sol", "--device", "h200", "--shapes", "llama3-8b", "1024,512,256", "--dtype", "bf16",
                   "fp8", "--json", str(js), "--plot", str(png)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Speed of light on NVIDIA H200" in out and "scaled_swiglu" in out
    recs = json.loads(js.read_text())
    assert isinstance(recs, list) and len(recs) == 2 * (10 + 1)
    for r in recs:
        keys = {"op", "shape", "dtype", "flops", "bytes", "sol_ms", "time_ms", "pct_sol", "shadow_ratio"}
        assert keys <= r.keys()
        assert r["time_ms"] is None and r["sol_ms"] > 0
    bare = [r for r in recs if r["shape"] == [1024, 512, 256] and r["dtype"] == "bf16"]
    assert [r["op"] for r in bare] == ["gemm"]
    assert bare[0]["flops"] == 2 * 1024 * 512 * 256
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


# -- profile --------------------------------------------------------------------------------------------
def test_profile_attributes_forward_and_backward_gemms_on_cpu():
    x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(96, 128, dtype=torch.bfloat16, requires_grad=True)
    with coda_cute.reference_on_cpu(), sol.profile(device="cpu") as prof:
        y = coda_cute.gemm(x, w.t())
        (y.float().square().sum() + torch.tanh(x.float()).sum()).backward()
    t = prof.ops["coda::gemm"]
    assert t.calls == 3  # forward, dgrad, wgrad
    assert 0 < t.total_ms <= prof.step_ms
    (rec,) = prof.records()
    assert rec["op"] == "coda::gemm" and 0 < rec["pct_of_step"] <= 100


# -- the timed path, on CPU: coda ops through their references, timing faked ---------------------------
@pytest.fixture
def fake_gpu(monkeypatch):
    """measure() and the CLI as on a GPU named H200, with CPU tensors (reference_on_cpu) and a
    timer that reports 2 ms for each op and 1 ms for each shadow."""
    measure_mod = importlib.import_module("coda_cute.sol.measure")  # sol.measure is the function

    calls = []

    def fake_bench(fn):
        fn()
        calls.append(fn)
        return 2.0 if len(calls) % 2 else 1.0

    peak = {"bf16": 700e12, "fp16": 700e12, "fp8": 1200e12, "fp32": 66.9e12}
    measured = Ceilings("NVIDIA H200", 4.24e12, peak, "measured", ("bandwidth", "bf16", "fp16", "fp8"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(measure_mod, "_current_gpu", lambda: torch.device("cpu"))
    monkeypatch.setattr(measure_mod, "bench_ms", fake_bench)
    monkeypatch.setattr(devices, "measured_ceilings", lambda *a, **k: measured)
    with coda_cute.reference_on_cpu():
        yield measured


def test_measure_record_arithmetic(fake_gpu):
    recs = sol.measure(["layouts", "scaled_proj"], "64,32,48", ["bf16", "fp8"])
    assert [(r.op, r.dtype) for r in recs] == [
        (op, dt) for dt in ("bf16", "fp8") for op in ("gemm", "gemm_dgrad", "gemm_wgrad", "scaled_proj")]
    for r in recs:
        if r.op == "scaled_proj":  # no launch registered: model only
            assert r.time_ms is None and r.sol_ms_measured is not None
            continue
        assert (r.time_ms, r.shadow_ms, r.shadow_ratio) == (2.0, 1.0, 2.0)
        assert r.tflops == pytest.approx(r.flops / 2e-3 / 1e12)
        assert r.gbps == pytest.approx(r.bytes / 2e-3 / 1e9)
        assert r.pct_sol == pytest.approx(100 * r.sol_ms / 2.0)
        assert r.pct_sol_measured == pytest.approx(100 * r.sol_ms_measured / 2.0)
        assert r.sol_ms_measured > r.sol_ms  # measured roofs are lower
        assert r.shadow_impl == "torch (cuBLAS)"


def test_cli_timed_path_writes_measured_json_and_png(fake_gpu, tmp_path):
    js, png = tmp_path / "sol.json", tmp_path / "sol.png"
    rc = cli_main(["sol", "--ops", "gemm", "--shapes", "64,32,48", "128,64,96", "--dtype", "bf16", "fp8",
                   "--json", str(js), "--plot", str(png)])
    assert rc == 0
    recs = json.loads(js.read_text())
    assert len(recs) == 4 and all(r["time_ms"] == 2.0 and r["shadow_ratio"] == 2.0 for r in recs)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_coda_block_ops_are_measurable():
    for name in ("residual_norm_stats", "scaled_swiglu", "scaled_rope", "lm_head_ce"):
        assert sol.OPS[name].build is not None, name
    shape = sol.parse_shapes(["llama3-1b"])[0]
    with pytest.raises(NotImplementedError, match="bf16"):
        sol.OPS["scaled_swiglu"].build(shape, "fp8", torch.device("cpu"))


@pytest.mark.parametrize("argv,message", [
    (["--ops", "nope"], "argument --ops: unknown op 'nope'; known: "),
    (["--shapes", "12,x"], "argument --shapes: shape '12,x' is neither a preset"),
    (["--shapes", "0,8,8"], "argument --shapes: shape '0,8,8': M, N and K must be positive"),
    (["--tokens", "-3"], "argument --tokens: must be a positive integer, got -3"),
    (["--tokens", "many"], "argument --tokens: 'many' is not an integer"),
])
def test_cli_bad_arguments_are_argparse_errors(argv, message, capsys):
    """Bad --ops / --shapes / --tokens: a usage error (exit 2) naming the argument, no traceback."""
    with pytest.raises(SystemExit) as exc:
        cli_main(["sol", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_unfused_model_is_gemm_plus_one_pass():
    """The unfused comparison: the plain GEMM writes its output, one pass reads it back with the
    epilogue's other inputs and writes the epilogue's outputs; plain GEMMs have none."""
    from coda_cute.sol import model as SM
    from coda_cute.sol.devices import datasheet

    h200 = datasheet("h200")
    c = SM.residual_norm_stats(4096, 4096, 14336)
    sh = c.shadow()
    out = sh.traffic["out"]
    operands = sh.bytes - out
    assert c.has_epilogue and not SM.gemm(4096, 4096, 14336).has_epilogue
    assert c.unfused_bytes() == sh.bytes + out + c.bytes - operands
    assert c.unfused_sol_ms(h200) == pytest.approx(sh.sol_ms(h200) + (out + c.bytes - operands) / h200.bandwidth * 1e3)
    recs = {(r.op, r.layer): r for r in sol.estimate(["coda", "gemm"], "llama3-8b")}
    assert recs[("gemm", "qkv")].unfused_bytes is None
    lm = recs[("lm_head_ce", "lm_head")]
    assert lm.unfused_bytes > 5 * lm.bytes and lm.unfused_sol_ms > lm.sol_ms  # the logits round trip


def test_block_scaled_fp8_gemms_cost_their_scales_and_are_measurable():
    """The FP8 recipe's GEMMs: 1-byte operands, bf16 out, one fp32 scale per row and k-block of A
    and per 128 x 128 block of B (the wgrad form: per row of B too); fp8 only."""
    c = model.gemm_blockwise(1024, 512, 300)
    assert c.flops == 2 * 1024 * 512 * 300 and c.dtype == "fp8"
    assert c.traffic["scale_a"] == 1024 * 3 * 4 and c.traffic["scale_b"] == 4 * 3 * 4
    assert model.gemm_blockwise(1024, 512, 300, "1x128").traffic["scale_b"] == 512 * 3 * 4
    shape = sol.parse_shapes(["llama3-8b"])[0]  # the qkv layer: M 16384, N 6144, K 4096
    wgrad = sol.OPS["gemm_blockwise_wgrad"].cost(shape, "fp8")
    assert (wgrad.m, wgrad.n, wgrad.k) == (shape.n, shape.k, shape.m)
    from coda_cute.sol.registry import groups

    assert groups()["fp8"] == ["gemm_blockwise", "gemm_blockwise_wgrad"]
    for name in ("gemm_blockwise", "gemm_blockwise_wgrad"):
        with pytest.raises(NotImplementedError, match="fp8"):
            sol.OPS[name].build(shape, "bf16", torch.device("cpu"))
