"""CPU tests of the epilogue's quantize sink (``E.quantize``: a GEMM output in FP8 with 1 x 128
block scales, written by the GEMM that produces it): the reference path against
``reference.quantize_blocks_ref``, the registered op's fake and CPU paths, the rules on every path,
and the sm_90a builds (spill-free, one FP8 pair conversion per two values, one scale store per row
the thread holds and per block, the values' TMA store)."""

import re
from collections import Counter

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import coda_cute
from coda_cute import epilogue as E
from coda_cute.compiler import KernelSpec, compile_gemm, spill_bytes
from coda_cute.epilogue.runner import ranked_configs
from coda_cute.kernels.common.config import GemmConfig
from coda_cute.reference import quantize_blocks_ref
from helpers import generator, on_path

FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def _tree(dtype="float8_e4m3fn", pow2=False):
    """y = acc * c + residual, stored bf16 and quantized (the MLP residual's output)."""
    y = E.acc() * E.col_vec("c") + E.tile("res")
    return E.Epilogue(E.store(y, "y"), E.quantize(y, "y_q", dtype, pow2))


def _operands(m, n, k, seed):
    g = generator(seed)
    a = torch.randn(m, k, generator=g).bfloat16()
    b = (torch.randn(k, n, generator=g) / k ** 0.5).bfloat16()
    inputs = {"c": torch.rand(n, generator=g) + 0.5, "res": torch.randn(m, n, generator=g).bfloat16()}
    return a, b, inputs


def _bits(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("m, n", [(64, 256), (77, 272), (5, 16)])  # whole, ragged last block, one partial block
def test_reference_path_is_quantize_blocks_ref_of_the_value(dtype, pow2, m, n):
    a, b, inputs = _operands(m, n, 96, m + n)
    with coda_cute.reference_on_cpu():
        out = E.run(_tree(dtype, pow2), a, b, inputs)
    x = (a.float() @ b.float()) * inputs["c"] + inputs["res"].float()
    q, s = out["y_q"]
    want_q, want_s = quantize_blocks_ref(x, (1, 128), FP8[dtype], pow2)
    assert q.dtype == FP8[dtype] and q.shape == (m, n) and s.shape == (m, -(-n // 128))
    assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(s, want_s)
    torch.testing.assert_close(out["y"], x.bfloat16(), rtol=0, atol=0)


def test_preallocated_outputs_are_filled_as_a_pair():
    a, b, inputs = _operands(40, 144, 64, 3)
    q = torch.full((40, 144), float("nan")).to(torch.float8_e4m3fn)
    s = torch.full((40, 2), float("nan"))
    with coda_cute.reference_on_cpu():
        out = E.run(_tree(), a, b, inputs, outputs={"y_q": (q, s)})
    assert out["y_q"][0] is q and out["y_q"][1] is s and not s.isnan().any()
    with coda_cute.reference_on_cpu(), pytest.raises(ValueError, match=r"y_q.scale must be a torch.float32 tensor of shape \(40, 2\)"):
        E.run(_tree(), a, b, inputs, outputs={"y_q": (q, torch.empty(40, 3))})
    with coda_cute.reference_on_cpu(), pytest.raises(ValueError, match="preallocated as a .values, scales. pair"):
        E.run(_tree(), a, b, inputs, outputs={"y_q": q})


def test_registered_op_fake_and_cpu_outputs_agree():
    op = E.register_op("test_quantize_sink", _tree())
    a, b, inputs = _operands(70, 272, 64, 4)
    with coda_cute.reference_on_cpu():
        real = op(a, b, inputs["c"], inputs["res"])
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = op(a, b, inputs["c"], inputs["res"])
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
    assert [t.dtype for t in real] == [torch.bfloat16, torch.float8_e4m3fn, torch.float32]


@pytest.mark.parametrize("path", ["cpu", "fake"])
def test_widths_that_are_no_multiple_of_16_are_refused(path):
    op = E.register_op(f"test_quantize_width_{path}", _tree())
    a, b, inputs = _operands(32, 144, 64, 5)
    with on_path(path), pytest.raises(ValueError, match=r"quantized outputs need rows of a multiple of 16 FP8 values .*got N=136"):
        op(a[:, :64], b[:, :136], inputs["c"][:136], inputs["res"][:, :136].contiguous())


def test_configs_a_quantize_sink_cannot_run_on_are_refused():
    a, b, inputs = _operands(64, 256, 64, 6)
    pp = GemmConfig(128, 128, 64, "pingpong", 2, 1)
    with coda_cute.reference_on_cpu(), pytest.raises(ValueError, match="cannot quantize in its epilogue"):
        E.run(_tree(), a, b, inputs, config=pp)
    cands = ranked_configs(_tree(), 16384, 4096, 14336, 1, False, False, 132)
    assert cands and all(c.schedule == "cooperative" and c.tile_m == 128 and c.tile_n % 128 == 0 for c in cands)


@pytest.mark.parametrize("bad, match", [
    (lambda: E.quantize(E.pairwise(lambda u, v: u * v, E.acc()), "q"), "quantize full-width values"),
    (lambda: E.quantize(E.acc(), "q", "bfloat16"), "dtype must be one of"),
])
def test_bad_sinks_raise(bad, match):
    with pytest.raises(E.EpilogueError, match=match):
        bad()


def _ptx_counts(tree, cfg, fp8=False):
    dt = "float8_e4m3fn" if fp8 else "bfloat16"
    k = compile_gemm(KernelSpec.of(dt, dt, "k", "k", cfg, tree, block_scaled=fp8), keep_artifacts=True)
    ops = Counter(re.findall(r"\b(cvt\.rn\.satfinite\.e[45]m[23]x2\.f32|st\.global\.b32|st\.shared\.b16|"
                             r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta)", k.ptx))
    return spill_bytes(k), ops


def _quantize_only(dtype, pow2):
    return E.Epilogue(E.quantize(E.acc() * E.col_vec("c"), "y_q", dtype, pow2))


@pytest.mark.parametrize("cfg, fp8, dtype, pow2, tree", [
    (GemmConfig(128, 128, 64, "cooperative", 2, 1), False, "float8_e4m3fn", False, _tree),
    (GemmConfig(128, 128, 64, "cooperative", 2, 1), False, "float8_e4m3fn", True, _tree),
    (GemmConfig(128, 128, 64, "cooperative", 1, 1), False, "float8_e5m2", False, _tree),
    # 128 x 256 keeps 128 accumulator registers: the quantized value alone builds spill-free
    # (with a bf16 store next to it ptxas spills, and the heuristic's spill check moves on)
    (GemmConfig(128, 256, 64, "cooperative", 2, 1), False, "float8_e4m3fn", True, _quantize_only),
    (GemmConfig(128, 128, 128, "cooperative", 2, 1), True, "float8_e4m3fn", False, _tree),  # block-scaled FP8
], ids=["bf16-128x128", "bf16-128x128-pow2", "bf16-e5m2", "bf16-128x256-pow2", "block-scaled-fp8"])
def test_builds_are_spill_free_with_their_conversions_and_scale_stores(cfg, fp8, dtype, pow2, tree):
    spills, ops = _ptx_counts(tree(dtype, pow2), cfg, fp8)
    assert spills == 0
    values = 128 * 128 // 256  # per thread and 128-column sub-tile (two warpgroups)
    subtiles = cfg.tile_n // 128
    kind = "e4m3x2" if dtype == "float8_e4m3fn" else "e5m2x2"
    assert ops[f"cvt.rn.satfinite.{kind}.f32"] == subtiles * values // 2  # from fp32: one rounding
    assert ops["st.shared.b16"] == subtiles * values // 2  # the FP8 pairs staged for TMA
    assert ops["st.global.b32"] == subtiles * 2  # a thread's two rows' scales per block
    assert ops["cp.async.bulk.tensor.3d.global.shared::cta"] >= 1  # the FP8 values' TMA store


# -- the transposed sink: x^T in blocks of 128 rows of x -------------------------------------------


def _both(dtype="float8_e4m3fn", pow2=False):
    """y stored, and quantized both ways in the same pass (the wgrad operand and the dgrad one)."""
    y = E.acc() * E.col_vec("c") + E.tile("res")
    return E.Epilogue(E.store(y, "y"), E.quantize(y, "y_q", dtype, pow2), E.quantize(y, "y_t", dtype, pow2, True))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("m, n", [(256, 128), (272, 144), (16, 64)])  # whole, ragged last row block
def test_transposed_reference_path_is_quantize_blocks_ref_of_the_transpose(dtype, pow2, m, n):
    a, b, inputs = _operands(m, n, 96, m * n)
    with coda_cute.reference_on_cpu():
        out = E.run(_both(dtype, pow2), a, b, inputs)
    x = (a.float() @ b.float()) * inputs["c"] + inputs["res"].float()
    qt, st = out["y_t"]
    want_q, want_s = quantize_blocks_ref(x.t(), (1, 128), FP8[dtype], pow2)
    assert qt.shape == (n, m) and st.shape == (n, -(-m // 128))
    assert torch.equal(_bits(qt), _bits(want_q)) and torch.equal(st, want_s)
    q, s = out["y_q"]
    assert torch.equal(_bits(q), _bits(quantize_blocks_ref(x, (1, 128), FP8[dtype], pow2)[0]))


@pytest.mark.parametrize("path", ["cpu", "fake"])
def test_transposed_rows_need_m_a_multiple_of_16(path):
    op = E.register_op(f"test_quantize_t_rows_{path}", _both())
    a, b, inputs = _operands(40, 128, 64, 7)
    with on_path(path), pytest.raises(ValueError, match=r"transposed quantized outputs need M a multiple of 16 .*got M=40"):
        op(a, b, inputs["c"], inputs["res"])


@pytest.mark.parametrize("cfg, tree, subtiles", [
    (GemmConfig(128, 128, 64, "cooperative", 2, 1),
     lambda: E.Epilogue(E.quantize(E.acc() * E.col_vec("c"), "y_t", transposed=True)), 4),
    (GemmConfig(128, 256, 64, "cooperative", 2, 1),
     lambda: E.Epilogue(E.quantize(E.acc() * E.col_vec("c"), "y_t", transposed=True)), 8),
    (GemmConfig(128, 128, 64, "cooperative", 2, 1), _both, 1),  # both layouts: 128-column sub-tiles
], ids=["t-128x128", "t-128x256", "both-128x128"])
def test_transposed_builds_are_spill_free_with_one_byte_store_per_value(cfg, tree, subtiles):
    k = compile_gemm(KernelSpec.of("bfloat16", "bfloat16", "k", "k", cfg, tree()), keep_artifacts=True)
    ops = Counter(re.findall(r"\b(cvt\.rn\.satfinite\.e4m3x2\.f32|st\.shared\.b8|st\.shared\.b32|st\.global\.b32|"
                             r"bar\.sync|xor\.b32)\b", k.ptx))
    assert spill_bytes(k) == 0
    both = subtiles == 1
    per_thread = 128 * cfg.tile_n // 256  # the tile's values per epilogue thread
    assert ops["st.shared.b8"] == per_thread  # each value at its transposed place
    # ... in 128B-swizzled rows of x^T (the address's 16-byte chunk XORed with its row), where
    # unswizzled rows put each store's 4 rows in the same two banks: without the swizzle the
    # kernel has a handful of XORs, with it about one per byte store
    assert ops["xor.b32"] >= per_thread // 2, ops
    assert ops["cvt.rn.satfinite.e4m3x2.f32"] == per_thread // 2 * (2 if both else 1)
    # per sub-tile: one column scale (threads < its width), plus two row scales with both layouts
    assert ops["st.global.b32"] == subtiles * (3 if both else 1)
    assert ops["bar.sync"] >= 2 * subtiles  # the column amax's two barriers per sub-tile
    # the warp's amax of each column the thread holds (its two row halves combined first), and
    # 1 / s of the thread's own column: per sub-tile, half the thread's values + 1
    assert ops["st.shared.b32"] == subtiles * (per_thread // subtiles // 2 + 1)


# -- double-width values (a column pair per output column: the SwiGLU backward's dz') ------------


def _pairs():
    """dz' = interleave(dg, du)-like: (acc * c, acc + res) per output column, rounded to bf16."""
    dz = E.cast(E.interleave(E.acc() * E.col_vec("c"), E.acc() + E.tile("res")), "bfloat16")
    return E.Epilogue(E.store(dz, "dz"), E.quantize(dz, "dz_q"))


@pytest.mark.parametrize("m, n", [(64, 128), (77, 72), (5, 8)])  # whole blocks, a partial last block
def test_double_width_reference_path_is_quantize_blocks_ref_of_the_pairs(m, n):
    a, b, inputs = _operands(m, n, 96, 11 * m + n)
    with coda_cute.reference_on_cpu():
        out = E.run(_pairs(), a, b, inputs)
    q, s = out["dz_q"]
    want_q, want_s = quantize_blocks_ref(out["dz"].float(), (1, 128))
    assert q.shape == (m, 2 * n) and s.shape == (m, -(-2 * n // 128))
    assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(s, want_s)


def test_double_width_rules():
    a, b, inputs = _operands(32, 68, 64, 12)
    with coda_cute.reference_on_cpu(), pytest.raises(ValueError, match=r"rows of a multiple of 16 FP8 values .*got N=68"):
        E.run(_pairs(), a, b, inputs)
    with pytest.raises(ValueError, match="either full-width or double-width"):
        E.Epilogue(E.quantize(E.acc(), "q"), E.quantize(E.interleave(E.acc(), E.acc()), "q2"))
    with pytest.raises(E.EpilogueError, match="half-width ones only transposed"):
        E.quantize(E.pairwise(lambda u, v: u * v, E.acc()), "q")


@pytest.mark.parametrize("cfg, fp8", [(GemmConfig(128, 128, 64, "cooperative", 2, 1), False),
                                      (GemmConfig(128, 256, 64, "cooperative", 2, 1), False),
                                      (GemmConfig(128, 128, 128, "cooperative", 2, 1), True)],
                         ids=["bf16-128x128", "bf16-128x256", "block-scaled-fp8"])
def test_double_width_builds_are_spill_free_in_64_column_sub_tiles(cfg, fp8):
    """64-column sub-tiles (128 values per row); one conversion per column pair, the pairs staged
    as 16-bit words (vectorized two at a time), one scale store per row the thread holds and block.
    The SwiGLU backward with its gradient quantized instead of stored bf16 builds spill-free too."""
    tree = E.Epilogue(E.quantize(E.interleave(E.acc() * E.col_vec("c"), E.acc()), "dz_q"))
    dt = "float8_e4m3fn" if fp8 else "bfloat16"
    k = compile_gemm(KernelSpec.of(dt, dt, "k", "k", cfg, tree, block_scaled=fp8), keep_artifacts=True)
    ops = Counter(re.findall(r"\b(cvt\.rn\.satfinite\.e4m3x2\.f32|st\.global\.b32|st\.shared\.v2\.b16)", k.ptx))
    subtiles = cfg.tile_n // 64
    assert spill_bytes(k) == 0
    assert ops["cvt.rn.satfinite.e4m3x2.f32"] == subtiles * 128 * 64 // 256  # a pair per element
    assert ops["st.shared.v2.b16"] == subtiles * 128 * 64 // 256 // 2
    assert ops["st.global.b32"] == subtiles * 2
    from coda_cute.ops.swiglu import swiglu_backward_tree

    bt = swiglu_backward_tree()
    fused = E.Epilogue(bt.sinks[1], bt.sinks[2], E.quantize(E.cast(bt.sinks[0].x, "bfloat16"), "dz_q"))
    if cfg.tile_n == 128:
        k = compile_gemm(KernelSpec.of(dt, dt, "k", "k", cfg, fused, block_scaled=fp8))
        assert spill_bytes(k) == 0



# -- transposed half- and double-width values (h^T and dz'^T: the MLP's weight-gradient operands) --


def _transposed_widths():
    """h = g * u per column pair and dz' = (dg, du) per column, each rounded to bf16, stored and
    quantized transposed."""
    h = E.cast(E.pairwise(lambda g, u: g * u, E.acc() * E.col_vec("c")), "bfloat16")
    dz = E.cast(E.interleave(E.acc() * E.col_vec("c"), E.acc() + E.tile("res")), "bfloat16")
    return E.Epilogue(E.store(h, "h"), E.quantize(h, "h_t", transposed=True),
                      E.store(dz, "dz"), E.quantize(dz, "dz_t", transposed=True))


@pytest.mark.parametrize("m, n", [(256, 128), (144, 272)])
def test_transposed_half_and_double_width_reference_paths(m, n):
    a, b, inputs = _operands(m, n, 64, 5 * m + n)
    with coda_cute.reference_on_cpu():
        out = E.run(_transposed_widths(), a, b, inputs)
    for name, stored in (("h_t", out["h"]), ("dz_t", out["dz"])):
        q, s = out[name]
        want_q, want_s = quantize_blocks_ref(stored.float().t(), (1, 128))
        assert q.shape == (stored.shape[1], m) and s.shape == (stored.shape[1], -(-m // 128))
        assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(s, want_s)


@pytest.mark.parametrize("cfg, fp8", [(GemmConfig(128, 128, 64, "cooperative", 2, 1), False),
                                      (GemmConfig(128, 128, 128, "cooperative", 2, 1), True)],
                         ids=["bf16-128x128", "block-scaled-fp8"])
def test_transposed_half_and_double_width_builds_are_spill_free(cfg, fp8):
    """The norm_swiglu tree's h and the SwiGLU backward's dz' quantized transposed in their own
    GEMMs' epilogues (the down-proj and gate/up weight gradients' operands): spill-free builds with
    one byte store per value (h: half of the elements; dz': two per element)."""
    from coda_cute.ops.swiglu import norm_swiglu_tree, swiglu_backward_tree

    dt = "float8_e4m3fn" if fp8 else "bfloat16"
    fwd = norm_swiglu_tree()
    h = next(s for s in fwd.sinks if s.name == "h").x
    bwd = swiglu_backward_tree()
    dz = E.cast(bwd.sinks[0].x, "bfloat16")
    per_thread = 128 * cfg.tile_n // 256
    for tree, stores in ((E.Epilogue(*fwd.sinks, E.quantize(E.cast(h, "bfloat16"), "h_t", transposed=True)),
                          per_thread // 2),
                         (E.Epilogue(bwd.sinks[1], bwd.sinks[2], E.quantize(dz, "dz_t", transposed=True)),
                          2 * per_thread)):
        k = compile_gemm(KernelSpec.of(dt, dt, "k", "k", cfg, tree, block_scaled=fp8), keep_artifacts=True)
        assert spill_bytes(k) == 0
        assert Counter(re.findall(r"\bst\.shared\.b8\b", k.ptx))["st.shared.b8"] == stores
    for x, columns in ((E.pairwise(lambda g, u: g * u, E.acc()), 4), (E.interleave(E.acc(), 2 * E.acc()), 16)):
        # per 32-column sub-tile: one amax partial per column of x the thread holds (h: a value
        # per column pair, dz': two per column; each over its two row halves), and a 1 / s
        k = compile_gemm(KernelSpec.of(dt, dt, "k", "k", cfg, E.Epilogue(E.quantize(x, "x_t", transposed=True)),
                                       block_scaled=fp8), keep_artifacts=True)
        assert Counter(re.findall(r"\bst\.shared\.b32\b", k.ptx))["st.shared.b32"] == 4 * (columns + 1)
