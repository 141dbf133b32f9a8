"""GPU tests of epilogue trees against the torch evaluator of the same tree (run on the H200).

Stores are poisoned with NaN first; inputs are fresh random data; M and N are ragged. The oracle
applies the tree to the fp32 product of the same (rounded) operands, so stores are compared with
the output dtype's tolerance (1e-2 relative for bf16 / fp16, 1e-5 for fp32 plus accumulation-order
noise). Reduction partials are checked against a float64 reduction of the kernel's own fp32
values (stored alongside), to fp32 rounding.
"""

import json
import random

import pytest
import torch

from coda_cute import epilogue as E
from coda_cute.kernels.common.config import GemmConfig
from helpers import rel_err

pytestmark = pytest.mark.gpu

COOP = GemmConfig(128, 256, 64, "cooperative", 2, 1)
PP = GemmConfig(128, 128, 64, "pingpong", 1, 1)
CONFIGS = [COOP, PP]


def operands(m, n, k, dtype=torch.bfloat16, batch=None):
    lead = () if batch is None else (batch,)
    a = (torch.randn(*lead, m, k, device="cuda") / 4).to(dtype)
    w = (torch.randn(*lead, n, k, device="cuda") / 4).to(dtype)
    return a, w.transpose(-1, -2)


def inputs_for(tree, m, n, batch=None):
    lead = () if batch is None else (batch,)
    out = {}
    for i in tree.inputs:
        if i.kind == "row_vec":
            out[i.name] = (torch.randint(-2, n + 2, (*lead, m), device="cuda", dtype=torch.int32)
                           if i.dtype == "int32" else torch.randn(*lead, m, device="cuda").to(getattr(torch, i.dtype)))
        elif i.kind == "col_vec":
            out[i.name] = torch.randn(*lead, n, device="cuda").to(getattr(torch, i.dtype))
        elif i.kind == "tile":
            out[i.name] = torch.randn(*lead, m, n, device="cuda").to(getattr(torch, i.dtype))
        elif i.kind == "row_sum":  # 7 partials per row: not a multiple of the 4 threads sharing it
            out[i.name] = torch.rand(*lead, m, 7, device="cuda") + 0.1
        elif i.kind == "scalar":
            out[i.name] = random.uniform(0.5, 1.5)
        else:
            out[i.name] = torch.rand(1, device="cuda") + 0.5
    return out


def poisoned_stores(tree, m, n, batch=None):
    lead = () if batch is None else (batch,)
    return {o.name: torch.full((*lead, m, n // 2 if o.half else n), float("nan"), device="cuda",
                               dtype=getattr(torch, o.dtype))
            for o in tree.outputs if o.kind == "store"}


def check(tree, cfg, m, n, k, dtype=torch.bfloat16, batch=None, red_tol=1e-4, **kw):
    a, b = operands(m, n, k, dtype, batch)
    ins = inputs_for(tree, m, n, batch)
    outs = E.run(tree, a, b, ins, config=cfg, outputs=poisoned_stores(tree, m, n, batch), **kw)
    ref = E.evaluate(tree, torch.matmul(a.float(), b.float()), ins, (cfg.tile_m, cfg.tile_n))
    for o in tree.outputs:
        got, want = outs[o.name], ref[o.name]
        if o.kind == "store":
            tol = 1e-4 if o.dtype == "float32" else 1.2e-2
            assert rel_err(got, want) < tol, (o.name, rel_err(got, want))
        elif o.kind == "gather":
            assert rel_err(got, want) < 1e-4 or (want.abs().max() == 0 and got.abs().max() == 0), o.name
        elif isinstance(got, tuple):  # lse partials: compare the finalized log-sum-exp
            lse = E.finalize_lse(*got)
            assert torch.allclose(lse, E.finalize_lse(*want), rtol=1e-4, atol=1e-4), o.name
        else:
            assert rel_err(got, want) < red_tol, (o.name, rel_err(got, want))
    return outs, ins


def swiglu_tree():
    z = E.acc() * E.row_vec("r")
    return E.Epilogue(E.store(z, "z"), E.store(E.pairwise(lambda g, u: E.silu(g) * u, z), "out"))


FIXED = {
    "bias_gelu_residual": lambda: E.Epilogue(E.store(E.gelu(E.acc() + E.col_vec("bias")) + E.tile("residual"), "out")),
    "colvec_tile_aux": lambda: E.Epilogue(E.store(E.acc() * E.col_vec("gamma") + E.tile("res"), "out"),
                                          E.store(E.acc(), "aux", "float32")),
    "swiglu": swiglu_tree,
    "rope_pairs": lambda: E.Epilogue(E.store(E.pairwise(
        lambda x, y: (x * E.cos(E.to_float(E.row_index())) - y * E.sin(E.to_float(E.row_index())),
                      x * E.sin(E.to_float(E.row_index())) + y * E.cos(E.to_float(E.row_index()))),
        E.acc()), "out", "float32")),
    "reductions": lambda: E.Epilogue(E.store(E.acc() + E.tile("res"), "y", "float32"),
                                     E.row_reduce(E.acc() + E.tile("res"), "sumsq", "ss"),
                                     E.col_reduce(E.acc() + E.tile("res"), "sum", "cs"),
                                     E.col_reduce(E.acc(), "max", "cm")),
    "lse_gather": lambda: E.Epilogue(E.row_reduce(E.acc() * E.scalar("t"), "lse", "lse"),
                                     E.row_reduce(E.acc(), "max", "mx"),
                                     E.gather(E.acc() * E.scalar("t"), E.row_vec("target", "int32"), "tgt")),
    "row_sum_rstd": lambda: E.Epilogue(E.store(E.acc() * E.rsqrt(E.row_sum("ss") + 1.0), "out", "float32")),
    "int_floordiv_mod": lambda: E.Epilogue(E.store(  # negative operands: floor semantics
        E.to_float((E.col_index() - E.row_index()) % 7) + E.to_float((E.col_index() - E.row_index()) // 5)
        + E.to_float(E.row_vec("shift", "int32") % 3) + 0.0 * E.acc(), "out", "float32")),
    # tile-uniform where()s: the tile pass is compiled once per side (one of them split)
    "tile_split": lambda: E.Epilogue(E.store(E.where(
        E.col_index() < 256, E.acc() * E.rsqrt(E.segment_reduce(E.acc(), "sumsq", 128) + 1.0),
        E.where(E.col_index() >= 512, E.acc() + E.col_vec("b"), E.acc() * 2.0)), "out", "float32")),
    # a segment max as a shift (columns past N left out: N = 272 ends in a part segment); a
    # factor of unknown sign kept inside, an rsqrt taken out, |acc| unmasked past N
    "segment_max_shift": lambda: E.Epilogue(E.store(E.exp(
        E.acc() * E.scalar("t") - E.segment_reduce(E.acc() * E.scalar("t"), "max", 64)), "out", "float32")),
    "segment_max_factor_abs": lambda: E.Epilogue(
        E.store(E.acc() * E.rsqrt(E.row_sum("ss") + 1.0)
                - E.segment_reduce(E.acc() * E.rsqrt(E.row_sum("ss") + 1.0), "max", 64), "out", "float32"),
        E.store(E.acc() / (E.segment_reduce(E.absolute(E.acc()), "max", 128) + 1.0), "amax", "float32")),
    "select_cast_indices": lambda: E.Epilogue(E.store(
        E.where(E.acc() > E.scalar_tensor("thr"), E.cast(E.acc(), "bfloat16"),
                E.to_float(E.col_index() - E.row_index()) / 64.0), "out", "float16")),
}


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("name", list(FIXED))
def test_fixed_trees(name, cfg):
    tree = FIXED[name]()
    for m, n, k in [(300, 272, 136), (1, 528, 64), (257, 1008, 200)]:
        check(tree, cfg, m, n, k)


def test_batched_and_fp8():
    tree = FIXED["colvec_tile_aux"]()
    check(tree, PP, 200, 136, 96, batch=3)
    fp8_tree = E.Epilogue(E.store(E.acc() * E.row_vec("sa") * E.col_vec("sb") + E.col_vec("bias"), "out"),
                          E.row_reduce(E.acc() * E.row_vec("sa") * E.col_vec("sb"), "sum", "s"))
    for cfg in (GemmConfig(128, 192, 128, "cooperative", 2, 1),
                GemmConfig(128, 128, 128, "pingpong", 1, 1, fp8_fast_accum=True)):
        # FP8 partial sums differ from the fp32 oracle by the tensor core's accumulation order.
        check(fp8_tree, cfg, 300, 272, 256, dtype=torch.float8_e4m3fn, red_tol=2e-3,
              use_fast_accum=cfg.fp8_fast_accum)


def test_reduction_partials_match_float64_of_kernel_values():
    x = E.acc() * E.col_vec("c") + E.tile("t", "float32")
    tree = E.Epilogue(E.store(x, "x", "float32"), E.row_reduce(x, "sum", "rs"), E.col_reduce(x, "sumsq", "cq"))
    for cfg in CONFIGS:
        a, b = operands(777, 1000, 320)
        ins = inputs_for(tree, 777, 1000)
        outs = E.run(tree, a, b, ins, config=cfg)
        xs = outs["x"].double()
        tn, tm = cfg.tile_n, cfg.tile_m
        rs = torch.stack([xs[:, j:j + tn].sum(1) for j in range(0, 1000, tn)], 1)
        cq = torch.stack([(xs[i:i + tm] ** 2).sum(0) for i in range(0, 777, tm)], 1)
        assert torch.allclose(outs["rs"].double(), rs, rtol=1e-5, atol=1e-4)
        assert torch.allclose(outs["cq"].double(), cq, rtol=1e-5, atol=1e-4)


def random_tree(rng: random.Random, depth: int):
    leaves = [E.acc, lambda: E.col_vec("c"), lambda: E.row_vec("r"), lambda: E.tile("t"),
              lambda: E.scalar("s"), lambda: E.const(rng.uniform(-2, 2)), lambda: E.scalar_tensor("st")]

    def grow(d):
        if d == 0 or rng.random() < 0.25:
            return rng.choice(leaves)()
        kind = rng.random()
        if kind < 0.4:
            op = rng.choice([E.neg, E.absolute, E.sigmoid, E.silu, E.gelu, E.relu, E.tanh, E.square])
            return op(grow(d - 1))
        if kind < 0.8:
            x, y = grow(d - 1), grow(d - 1)
            return rng.choice([lambda: x + y, lambda: x - y, lambda: x * y, lambda: E.maximum(x, y),
                               lambda: E.minimum(x, y), lambda: x / (E.absolute(y) + 1.0)])()
        return E.where(grow(d - 1) > grow(d - 1), grow(d - 1), grow(d - 1))

    body = E.acc() + grow(depth)  # keep every tree tile-varying
    sinks = [E.store(body, "out", rng.choice(["bfloat16", "float32"])),
             E.row_reduce(body, rng.choice(["sum", "max"]), "rr")]
    if rng.random() < 0.5:
        sinks.append(E.store(E.pairwise(lambda g, u: g * E.sigmoid(u), body), "half"))
    if rng.random() < 0.5:
        sinks.append(E.col_reduce(body, "sum", "cr"))
    return E.Epilogue(*sinks)


@pytest.mark.parametrize("seed", range(6))
def test_random_trees(seed):
    rng = random.Random(seed)
    tree = random_tree(rng, 4)
    check(tree, CONFIGS[seed % 2], 333, 400, 72)


def test_register_op_and_bad_inputs():
    tree = FIXED["bias_gelu_residual"]()
    op = E.register_op("test_bias_gelu_residual", tree)
    a, b = operands(130, 264, 64)
    ins = inputs_for(tree, 130, 264)
    out = op(a, b, ins["bias"], ins["residual"])
    ref = E.evaluate(tree, a.float() @ b.float(), ins)["out"]
    assert rel_err(out, ref) < 1.2e-2
    with pytest.raises(ValueError, match="bias"):
        E.run(tree, a, b, {"bias": torch.randn(263, device="cuda"), "residual": ins["residual"]})
    with pytest.raises(TypeError, match="residual"):
        E.run(tree, a, b, {"bias": ins["bias"], "residual": ins["residual"].float()})
    with pytest.raises(ValueError, match="even N"):
        E.run(swiglu_tree(), *operands(64, 131, 64), {"r": torch.randn(64, device="cuda")})


def test_launching_on_runs_the_gemm_on_its_stream_in_the_current_ones_order(tmp_path):
    """``runner.launching_on(s)``: the GEMM's kernel goes on ``s`` (the profiler's stream of its
    launch is that of a kernel queued on ``s``, not that of one on the current stream), after
    every earlier launch of the current stream (its operand is written there behind a 20 ms spin)
    and before every later one (the current stream reads its poisoned output right after)."""
    from coda_cute.epilogue.runner import launching_on

    tree = FIXED["bias_gelu_residual"]()
    m, n, k = 1000, 528, 192
    a, b = operands(m, n, k)
    ins = inputs_for(tree, m, n)
    late = torch.full_like(a, float("nan"))
    side = torch.cuda.Stream(priority=-1)
    marks = torch.randn(4096, device="cuda")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(20_000_000)  # ~10-20 ms at the H100's / H200's clocks
        late.copy_(a)
        with launching_on(side):
            outs = E.run(tree, late, b, ins, config=PP, outputs=poisoned_stores(tree, m, n))
        got = outs["out"].float()  # on the current stream: must see the GEMM's stores
        marks.neg_()
        with torch.cuda.stream(side):
            torch.cuda._sleep(1000)
        torch.cuda.synchronize()
    ref = E.evaluate(tree, a.float() @ b.float(), ins)["out"]
    assert rel_err(got, ref) < 1.2e-2
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    kernels = sorted((e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
                      if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    stream_of = {}
    for e in kernels:
        name = e["name"]
        role = ("spin" if "spin_kernel" in name else "native" if "at::native" in name else "gemm")
        stream_of.setdefault(role, []).append(e["args"]["stream"])
    spins = stream_of["spin"]  # the current stream's first, then the side one's (after the GEMM)
    assert len(spins) == 2 and spins[0] != spins[1], stream_of
    assert stream_of["gemm"] == [spins[1]], stream_of
    assert spins[0] in stream_of["native"], stream_of
