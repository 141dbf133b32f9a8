"""CPU tests of scripts/bench_train.py's pure-Python pieces (no GPU, no timing).

The HF config mapping needs transformers, which CI does not install: those tests skip without it.
"""

import importlib.util
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_train.py"


@pytest.fixture(scope="module")
def bt():
    """The benchmark and its two modules (train_models, train_shadow) as one namespace."""
    spec = importlib.util.spec_from_file_location("bench_train", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_train"] = mod  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(mod)
        parts = [sys.modules["train_models"], sys.modules["train_shadow"], mod]
        yield SimpleNamespace(**{k: v for m in parts for k, v in vars(m).items()})
    finally:
        sys.modules.pop("bench_train", None)


# -- arguments ------------------------------------------------------------------------------------
def test_parse_args_defaults(bt):
    a = bt.parse_args([])
    assert a.configs == ["1b", "8b"]
    assert (a.batch, a.seq, a.layers) == (4, 4096, 2)
    assert 10 <= a.rounds <= 20 and a.warmup >= 1
    assert not (a.no_compile or a.no_liger or a.smoke or a.sync_each) and a.json is None


def test_parse_args_flags(bt):
    a = bt.parse_args(["--configs", "8b", "--rounds", "12", "--no-compile", "--no-liger", "--json", "x.json",
                       "--layers", "1", "--batch", "2", "--seq", "1024"])
    assert a.configs == ["8b"] and a.rounds == 12 and a.no_compile and a.no_liger and a.json == "x.json"
    assert (a.batch, a.seq, a.layers) == (2, 1024, 1)
    s = bt.parse_args(["--smoke"])
    assert s.smoke and s.configs == [bt.SMOKE_SPEC.name] and (s.batch, s.seq) == (bt.SMOKE_BATCH, bt.SMOKE_SEQ)
    assert bt.parse_args(["--smoke", "--seq", "16"]).seq == 16
    assert bt.parse_args(["--sync-each"]).sync_each
    assert bt.parse_args(["--cache-folds"]).cache_folds and not bt.parse_args([]).cache_folds


def test_after_sync_syncs_before_the_step(bt, monkeypatch):
    """``--sync-each``: the host syncs, then the step runs (its result passed through)."""
    calls = []
    monkeypatch.setitem(bt._after_sync.__globals__, "sync", lambda device: calls.append(("sync", device)))
    run = bt._after_sync(lambda: calls.append("step") or 7, "cuda")
    assert run() == 7 and calls == [("sync", "cuda"), "step"]


def test_parse_args_fp8_switch(bt):
    from coda_cute.ops import mlp_fp8

    a = bt.parse_args(["--fp8-row-fast", "all", "--fp8-switch", "SIDE_SMS_DOWN_WGRAD=16"])
    assert a.fp8_switch == [(mlp_fp8, "SIDE_SMS_DOWN_WGRAD", 16)] and bt.parse_args([]).fp8_switch == []


def test_smoke_switched_step_is_the_same_model_with_the_switch_set(bt, tmp_path):
    """``--fp8-switch``: a variant of its own, timed in the turns, on the row-wise fast model (a
    scheduling switch leaves the loss bit for bit), the switches in the record."""
    pytest.importorskip("transformers")
    out = tmp_path / "smoke.json"
    assert bt.main(["--smoke", "--fp8-row-fast", "all", "--fp8-switch", "SIDE_SMS_DOWN_WGRAD=16",
                    "attention_fp8.SIDE_SMS_QKV_FORWARD=0", "--json", str(out)]) == 0
    import json
    rec = json.loads(out.read_text())[0]
    assert rec["errors"] == {}
    assert rec["fp8_switches"] == "mlp_fp8.SIDE_SMS_DOWN_WGRAD=16, attention_fp8.SIDE_SMS_QKV_FORWARD=0"
    assert rec["losses"]["coda_fp8_row_fast_switched"] == rec["losses"]["coda_fp8_row_fast"]
    assert rec["coda_fp8_row_fast_switched_ms"] is not None


@pytest.mark.parametrize("argv", [["--configs", "70b"], ["--rounds", "0"], ["--seq", "-1"],
                                  ["--fp8-switch", "SIDE_SMS_DOWN_WGRAD=16"],  # without --fp8-row-fast
                                  ["--fp8-row-fast", "all", "--fp8-switch", "SIDE_SMS_DOWN_WGRAD=x"],
                                  ["--fp8-row-fast", "all", "--fp8-switch", "NOT_A_SWITCH=1"]])
def test_parse_args_rejects(bt, argv, capsys):
    with pytest.raises(SystemExit):
        bt.parse_args(argv)


# -- labels ------------------------------------------------------------------------------------------
def test_shift_labels(bt):
    labels = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    t = bt.shift_labels(labels)
    assert t.tolist() == [[6, 7, 8, -100], [2, 3, 4, -100]]
    assert t.dtype == labels.dtype and labels.tolist()[0] == [5, 6, 7, 8]  # input untouched
    ids = bt.random_tokens(4, 64, 1000)
    assert ids.shape == (4, 64) and torch.equal(ids, bt.random_tokens(4, 64, 1000))  # fixed seed
    assert int(ids.min()) >= 0 and int(ids.max()) < 1000


def test_shifted_targets_give_hf_loss(bt):
    """CE of logits at position s against targets[s] == HF's shift of labels inside the loss."""
    logits, labels = torch.randn(2, 9, 11), torch.randint(0, 11, (2, 9))
    hf = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))
    ours = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), bt.shift_labels(labels).reshape(-1),
                                             ignore_index=-100)
    torch.testing.assert_close(ours, hf)


# -- the shadow's GEMM list -------------------------------------------------------------------------
def test_step_gemms_1b(bt):
    layers, m = 2, 4 * 4096
    c = bt.SPECS["1b"].coda_kwargs(layers)
    gemms = bt.step_gemms(c, m)
    assert len(gemms) == 15 and sum(g.count for g in gemms) == 12 * layers + 3
    d, f, v, qkv = 2048, 8192, 128256, (32 + 2 * 8) * 64
    fwd = {g.linear: (g.m, g.n, g.k) for g in gemms if g.kind == "fwd"}
    assert fwd == {"qkv": (m, qkv, d), "o": (m, d, d), "gate_up": (m, 2 * f, d), "down": (m, d, f),
                   "lm_head": (m, v, d)}
    by = {g.name: g for g in gemms}
    assert (by["down.dgrad"].m, by["down.dgrad"].n, by["down.dgrad"].k) == (m, f, d)  # dY @ W
    assert (by["down.wgrad"].m, by["down.wgrad"].n, by["down.wgrad"].k) == (d, f, m)  # dY.T @ X
    assert by["lm_head.fwd"].count == 1 and by["qkv.wgrad"].count == layers
    assert {g.kind: g.layout for g in gemms} == {"fwd": "x @ W.T", "dgrad": "dY @ W", "wgrad": "dY.T @ X"}
    fwd_flops = layers * 2 * m * d * (qkv + d + 2 * f) + 2 * m * d * f * layers + 2 * m * v * d
    total = sum(g.flops * g.count for g in gemms)
    assert sum(g.flops * g.count for g in gemms if g.kind == "fwd") == fwd_flops
    assert total == 3 * fwd_flops
    for kind in ("dgrad", "wgrad"):
        assert sum(g.flops * g.count for g in gemms if g.kind == kind) == fwd_flops
    assert len([g for g in gemms if g.per_layer]) == 12  # the block ratio's 12 GEMMs of one layer


def test_gemm_fns_layouts(bt):
    c = bt.SMOKE_SPEC.coda_kwargs(1)
    gemms = bt.step_gemms(c, 24)
    fns = bt.gemm_fns(gemms, "cpu", torch.float32)
    assert set(fns) == {g.name for g in gemms}
    for g in gemms:
        assert fns[g.name]().shape == (g.m, g.n), g.name
    attention = bt.attention_fn(c, 2, 8, "cpu", torch.float32)
    attention()  # forward + backward, GQA


# -- profiler grouping --------------------------------------------------------------------------------
def _event(name, us, device=DeviceType.CUDA, cpu_us=0.0):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(elapsed_us=lambda: us),
                           self_cpu_time_total=cpu_us)


def test_kernel_rows(bt):
    events = [_event("gemm_a", 30.0), _event("gemm_a", 30.0), _event("norm", 20.0), _event("memset", 20.0),
              _event("aten::mm", 500.0, DeviceType.CPU, 500.0)]
    out = bt.kernel_rows(events, "cuda", top=2)
    assert out["total_ms"] == pytest.approx(0.1) and out["kernels"] == 3
    assert [r["name"] for r in out["rows"]] == ["gemm_a", "norm"]
    assert out["rows"][0]["calls"] == 2 and out["rows"][0]["share"] == pytest.approx(0.6)
    assert out["rows"][0]["ms"] == pytest.approx(0.06)
    cpu = bt.kernel_rows(events, "cpu")
    assert [r["name"] for r in cpu["rows"]] == ["aten::mm"] and cpu["rows"][0]["share"] == 1.0
    assert bt.kernel_rows([], "cuda") == {"total_ms": 0.0, "kernels": 0, "rows": []}


# -- Liger's global patches: undone, then re-applied around its forward only ------------------------
def test_patch_undo_and_reapply(bt):
    mod = types.ModuleType("fake_modeling")

    def rope(q):
        return "rope"

    class Norm:
        def forward(self):
            return "norm"

    mod.rope, mod.Norm = rope, Norm
    snap = bt._snapshot([mod, Norm])

    def liger_rope(q):
        return "liger"

    mod.rope = liger_rope                       # replaced function
    mod.added = 1                               # new attribute
    Norm.forward = lambda self: "liger norm"    # class attribute
    patches = bt._undo_patches(snap)
    assert {n for _, n, _ in patches} == {"rope", "added", "forward"}
    assert mod.rope is rope and not hasattr(mod, "added") and Norm().forward() == "norm"
    with bt.patched(patches):
        assert mod.rope is liger_rope and mod.added == 1 and Norm().forward() == "liger norm"
    assert mod.rope is rope and not hasattr(mod, "added") and Norm().forward() == "norm"


# -- the HF <-> coda config mapping (needs transformers) --------------------------------------------
@pytest.mark.parametrize("name", ["1b", "3b", "8b", "tiny"])
def test_config_mapping(bt, name):
    pytest.importorskip("transformers")
    spec = bt.SMOKE_SPEC if name == "tiny" else bt.SPECS[name]
    hf = bt.hf_config(spec, 2, 4096)
    assert hf.tie_word_embeddings is False and hf._attn_implementation == "sdpa" and hf.use_cache is False
    assert (hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (
        spec.dim, spec.n_heads, spec.n_kv_heads, spec.head_dim)
    assert bt.hf_rope(hf) == ("default", 500000.0)
    kw = bt.coda_kwargs_from_hf(hf)
    assert kw == spec.coda_kwargs(2, 8192)
    if name == "1b":
        assert (kw["dim"], kw["head_dim"], kw["ffn_dim"], kw["vocab_size"], kw["norm_eps"]) == (
            2048, 64, 8192, 128256, 1e-5)
    if bt.CodaLlamaConfig is not None:
        cfg = bt.coda_config(hf)
        assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_theta) == (
            spec.dim, 2, spec.n_heads, spec.n_kv_heads, spec.head_dim, 500000.0)


def test_config_mapping_rejects(bt):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=False)
    kw = bt.coda_kwargs_from_hf(LlamaConfig(**base))
    assert kw["head_dim"] == 8 and kw["n_kv_heads"] == 2
    scaled = LlamaConfig(**base, rope_scaling={"rope_type": "linear", "factor": 2.0})
    for bad in (scaled, LlamaConfig(**base, attention_bias=True), LlamaConfig(**base, hidden_act="gelu"),
                LlamaConfig(**{**base, "tie_word_embeddings": True})):
        with pytest.raises(ValueError):
            bt.coda_kwargs_from_hf(bad)


def test_build_hf_model_keeps_fp32_inv_freq(bt):
    pytest.importorskip("transformers")
    spec = bt.ModelSpec("t", dim=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64, vocab_size=64)
    model = bt.build_hf_model(bt.hf_config(spec, 1, 16), "cpu")
    rot = model.model.rotary_emb
    assert rot.inv_freq.dtype == torch.float32
    torch.testing.assert_close(rot.inv_freq, bt.hf_inv_freq(8, 500000.0, "cpu"), rtol=0, atol=0)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters()) and model.training
    assert "lm_head.weight" in model.state_dict()


# -- the shadow chain's joules ------------------------------------------------------------------------
def test_chain_joules_reads_the_run_or_records_why_not(bt, monkeypatch):
    from coda_cute.sol import energy

    seen = []
    monkeypatch.setattr(energy, "joules_over_run", lambda fn, ms, device=None: seen.append((ms, device)) or
                        {"j_per_call": 104.5, "watts": 701.0, "ms_per_call": 149.1})
    errors = {}
    assert bt.chain_joules(lambda: None, 149.0, "cuda", errors) == 104.5 and seen == [(149.0, "cuda")] and not errors
    monkeypatch.setattr(energy, "joules_over_run", lambda fn, ms, device=None: None)
    assert bt.chain_joules(lambda: None, 149.0, "cuda", errors) is None and not errors

    def broken(fn, ms, device=None):
        raise RuntimeError("counter gone")
    monkeypatch.setattr(energy, "joules_over_run", broken)
    assert bt.chain_joules(lambda: None, 149.0, "cuda", errors) is None
    assert "counter gone" in errors["shadow_energy"]


def test_run_shadow_measures_the_chain_while_its_pieces_exist(bt, monkeypatch):
    """The non-smoke path, timing and counter faked: the chain's energy run calls the chain,
    which calls every piece, so it must come before the pieces are dropped."""
    from coda_cute.sol import energy

    monkeypatch.setitem(vars(sys.modules["train_shadow"]), "time_fns", lambda fns, *a, **k: {n: 1.0 for n in fns})

    def one_call(fn, ms, device=None):
        fn()
        return {"j_per_call": 0.7, "watts": 700.0, "ms_per_call": ms}
    monkeypatch.setattr(energy, "joules_over_run", one_call)
    args = SimpleNamespace(batch=1, seq=8, layers=1, smoke=False, rounds=1, warmup=0)
    rec, errors = {"coda_ms": None}, {}
    sys.modules["train_shadow"].run_shadow(rec, bt.SMOKE_SPEC.coda_kwargs(1), None, args, "cpu", errors)
    assert not errors and rec["shadow_chain_j"] == 0.7 and rec["shadow_chain_ms"] == 1.0
