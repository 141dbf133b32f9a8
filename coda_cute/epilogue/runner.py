"""Running a GEMM with an epilogue tree on torch tensors.

    outputs = run(tree, a, b, inputs)        # a @ b with ``tree`` applied to the accumulator

Everything a call derives from its arguments' metadata (validation, views, output shapes, the
config and the compiled kernel) is a *plan*, built once per call signature; repeated calls only
re-check data pointers, allocate outputs and launch.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch

from .. import dispatch
from ..compiler import KernelSpec, get_gemm, spill_bytes
from ..kernels.common.config import GemmConfig, pipeline_stages, tail_carry_rule
from ..kernels.epilogue import nodes as N
from ..operands import check_operands, check_pointer_aligned, dtype_name, mn_view, operand_view, tma_view
from ..precision import BLOCK
from ..reference import dequantize_blocks_ref
from .block_scales import B_BLOCKS, check_block_scaled, scale_view, tma_block_scales
from .reference import evaluate, torch_dtype

_MAX_PLANS = 4096
_plans: dict = {}


def tree_smem_bytes(tree: N.Epilogue, cfg: GemmConfig, ab_bytes: int = 2) -> int:
    """Shared memory of the tree's epilogue buffers on ``cfg`` (A/B elements of ``ab_bytes``)."""
    from ..kernels.sm90.epilogue import Sm90TreeEpilogue

    return Sm90TreeEpilogue(tree, cfg, ab_bytes).smem_bytes()


def fits(tree: N.Epilogue, cfg: GemmConfig, ab_bytes: int) -> bool:
    """Whether ``cfg`` keeps at least 2 A/B stages next to the tree's shared memory and its tile
    width is a multiple of every ``segment_reduce`` width."""
    if any(cfg.tile_n % w for w in segment_widths(tree)):
        return False
    try:
        return pipeline_stages(cfg.with_(stages=0), ab_bytes, tree_smem_bytes(tree, cfg, ab_bytes)) >= 2
    except ValueError:
        return False


def quantizes(tree: N.Epilogue) -> bool:
    return any(o.quantizes for o in tree.outputs)


def quantize_config(cfg: GemmConfig) -> bool:
    """Configs a quantize sink runs on: cooperative 128-row tiles whose width is whole 128-column
    blocks; the epilogue's sub-tile is then one block wide (``kernels.sm90.epilogue``), so each
    row's block amax is its quad's (a 4-lane shuffle)."""
    return cfg.schedule == "cooperative" and cfg.tile_m == 128 and cfg.tile_n % N.QUANT_BLOCK == 0


def segment_widths(tree: N.Epilogue) -> set:
    return {n.width for s in tree.sinks for n in N.walk(s.x) if isinstance(n, N.SegmentReduce)}


#: The k-loop lengths (elements of K) a tree adds to a cooperative 16-bit tile's exposed epilogue
#: (on top of ``dispatch.COOP_EPILOGUE_K``, a plain store's): cooperative warpgroups run the
#: epilogue after their mainloop with the tensor cores idle, where ping-pong's other warpgroup
#: covers it. ``COOP_TREE_K`` for a tree that computes more than a scaled store (:func:`computes`),
#: ``COOP_TILE_INPUT_K`` for each tile it streams from memory. Fitted at the H200's power cap over
#: the 8b step's 17 distinct fused bf16 launches on five configs each (``scripts/exp_energy_tiles.py
#: --fused``, 2026-12-04). With the rates fixed to ``dispatch._RATES_16`` these depths pick configs
#: within 0.2 % of the least joules measured per launch, where the one-depth model (a tile input
#: 300, measured from cool, and no tree depth) was 2.6 % over; the free fit (``--fit``: 200 for the
#: plain epilogue, 200 per tree, 125 per tile input, 3.0 % rms) makes the same picks on the 1b and
#: 8b steps. The logits GEMM of the LM head (an exp per element, three sinks) spent 1.09-1.10x
#: cuBLAS's joules on cooperative tiles and 0.98x on ping-pong 128 x 128 2x1; the norm + SwiGLU
#: GEMM 1.05x against 1.02x.
COOP_TREE_K = 175
COOP_TILE_INPUT_K = 175
#: Node kinds of a scaled store's per-element values (its row-uniform factors, such as an RMSNorm's
#: r, may be computed in any way: once per row).
_SCALED_STORE_KINDS = frozenset({"acc", "col_vec", "cast"})


def computes(tree: N.Epilogue) -> bool:
    """Whether the tree does more than one store of acc times scale factors (the plain GEMM's
    epilogue, or an RMSNorm's r applied to it): per-element work beyond a product with column
    vectors and row-uniform values."""
    if len(tree.sinks) != 1 or tree.sinks[0].kind != "store":
        return True
    return any(n.domain is not None and n.kind not in _SCALED_STORE_KINDS
               and not (n.kind == "binary" and n.op == "mul") for n in N.walk(tree.sinks[0].x))


#: The promoted FP8 kernels' relative extra time per tile input on cooperative configs (the
#: block-scaled kernel, and the row-wise recipe without fast accumulation): a factor measured from
#: cool, one GEMM at a time at K >= 4096, as their rates and epilogue depth (0) were. The fast-
#: accumulation kernels take the 16-bit depths instead (:func:`_epilogue_factor`).
COOP_TILE_INPUT_COST = 0.07
#: The extra a double-width tile input costs the FP8 kernels' cooperative configs, whose
#: mainloop runs twice as fast, as a share of their time. Measured on the block-scaled kernel on
#: the H200 (``scripts/exp_block_scaled_trees.py``, in turns): the SwiGLU backward (a double-width
#: z, heavy arithmetic) ran on cooperative 128x128 2x1 at 1.17x / 1.11x / 1.04x the time of
#: ping-pong 64x128 2x1 (16384 x 8192 x 2048 / 16384 x 14336 x 4096 / 8192 x 28672 x 8192), whose
#: plain rate is 1.47x lower: 1.53-1.71x its predicted time. Trees with plain tile inputs stay on
#: cooperative, as ``COOP_TILE_INPUT_COST`` ranks them: the residual tree ran there at 0.73-0.77x
#: ping-pong's time, the norm backward at 0.77x (8b). The plain FP8 kernel with fast accumulation
#: (the row-wise recipe's trees) takes it on top of its depths: at the cap its SwiGLU backward
#: spent 1.36x ``_scaled_mm``'s joules on ping-pong 128 x 128 against 1.58-1.65x on cooperative
#: tiles (:func:`_epilogue_factor`).
COOP_WIDE_TILE_INPUT_COST_FP8 = 0.6
#: The depth (elements of K) a double-width tile input adds to a 16-bit cooperative tile, by card
#: (``dispatch.card_of``); cards not named take ``COOP_TILE_INPUT_K``, as any tile input. On an H100
#: at the cap (``scripts/exp_energy_tiles.py --fused``, 2026-12-06) the bf16 SwiGLU backward took
#: 1.21x / 1.12x / 1.05x on cooperative 128 x 192 2x1 the time of ping-pong 128 x 128 2x1 at
#: 16384 x 8192 x 2048 / 16384 x 8192 x 3072 / 16384 x 14336 x 4096: with that card's rates, a depth
#: of 1140-1430 in all, falling as K grows (a cost per tile, not a share of the k-loop), of which
#: the tree and its epilogue hold 350. With 950 the 1b, 3b and 8b steps' picks keep it on ping-pong.
COOP_WIDE_TILE_INPUT_K_16 = {"h100": 950}


def _epilogue_factor(tree, cfg: GemmConfig, k: int, fp8: bool = False,
                     card: str = dispatch.DEFAULT_CARD) -> float:
    """The tree's share of a cooperative config's time (1 for ping-pong). 16-bit and FP8 with fast
    accumulation: its depths over the plain tile's (``k`` + ``dispatch.coop_epilogue_k``):
    ``COOP_TREE_K`` for a tree that computes, ``COOP_TILE_INPUT_K`` per plain tile input; a
    double-width one adds ``COOP_WIDE_TILE_INPUT_K_16`` on ``card`` (16-bit) or
    ``COOP_WIDE_TILE_INPUT_COST_FP8`` to the factor (FP8). The promoted FP8 kernels: their tile
    inputs' factors (``COOP_TILE_INPUT_COST``, ``COOP_WIDE_TILE_INPUT_COST_FP8``).

    The fast kernels' depths are the 16-bit ones, not fitted again: at the cap (8b step in the
    row-wise recipe with fast accumulation, ``scripts/exp_energy_tiles.py --fused --fp8``,
    2026-12-04: 14 distinct FP8 launches, each with its tree, on six configs) they pick configs
    spending 26.10 J over the step's launches against 26.01 J for the least per launch, where
    the promoted kernels' factors picked 26.61 J (the norm backward at K = 28672 on ping-pong at
    1.049x ``_scaled_mm``'s joules, against 0.954x on cooperative 128 x 256). The SwiGLU
    backward's double-width z kept ping-pong there (1.36x; cooperative 128 x 128 1.65x,
    128 x 192 1.58x; 128 x 256 spills). At 1b (not measured with trees) the same rule moves
    the norm backward at K = 16384 to cooperative 128 x 256, as at 8b."""
    if cfg.schedule != "cooperative":
        return 1.0
    tiles = [i for i in tree.inputs if i.kind == "tile"]
    n_wide = sum(1 for i in tiles if i.wide)
    if fp8 and not cfg.fp8_fast_accum:
        return 1.0 + n_wide * COOP_WIDE_TILE_INPUT_COST_FP8 + (len(tiles) - n_wide) * COOP_TILE_INPUT_COST
    wide_k, wide_share = (0, COOP_WIDE_TILE_INPUT_COST_FP8) if fp8 else \
        (COOP_WIDE_TILE_INPUT_K_16.get(card, COOP_TILE_INPUT_K), 0.0)
    extra = COOP_TREE_K * computes(tree) + (len(tiles) - n_wide) * COOP_TILE_INPUT_K + n_wide * wide_k
    return 1.0 + extra / (k + dispatch.coop_epilogue_k(cfg, fp8)) + n_wide * wide_share


#: Candidates, in the heuristic's order, whose builds :func:`choose_config` inspects for spills.
SPILL_CHECKS = 8

#: Experiment switch, off (``bench_fp8.py``'s "..., 2x2 clusters" row): an FP8 fast-accumulation
#: ping-pong pick on a 2x1 cluster takes a 2x2 one (both operands multicast: a third less of each
#: CTA's k-tile read from L2) where that build does not spill. On an H100 (2026-12-05) the 8b
#: gate/up forward with its RMSNorm + SwiGLU tree (16384 x 28672 x 4096) ran 2.899 ms on 2x2
#: against 3.162 on 2x1, outputs bit-identical; the 1b one (16384 x 16384 x 2048) 0.944 against
#: 0.933; the row-wise SwiGLU backward's build spills on 2x2. In the 8b FP8 MLP sublayer it gained
#: 0.14-0.63 ms in eight of nine H100 runs (2026-12-06 and 07) and lost 0.70 on the H200
#: (2026-12-06); in the 1b one (d 2048, ffn 8192, an H100, 2026-12-07) it lost 0.08 ms; in the
#: whole 8b FP8 step on an H100 (2026-12-07, two runs each) 129.58 and 129.96 ms against 130.08
#: and 129.47 off: nothing a step sees, and a rule by card and K would be fitted to the benchmark's
#: two shapes, so none.
FP8_PINGPONG_2X2 = False
#: Every pick with ``GemmConfig.poll_full`` (its mainloop polls its stage barriers instead of
#: sleeping between polls; the block-scaled forward form's picks always do): an experiment switch,
#: ``bench_fp8.py``'s "..., polling" row. In the row-wise FP8 MLP (three H100s, 2026-12-06) it
#: moved the step by -0.3 % and +0.5 %, its ping-pong short-K GEMMs by -5 % to +3 %: no rule.
POLL_FULL = False
#: The block-scaled forward form's picks carry each tile's last promotion group into the next
#: tile (``GemmConfig.tail_carry``) where K allows: :func:`_carried`. On three H100 runs
#: (2026-12-07, in turns) +0.9 to +1.9 %, +0.6 to +0.9 % and -0.2 to +0.3 % at the three 8B
#: shapes, +0.1 to +1.7 % at five shapes it was not tuned on; the block recipe's MLP sublayer
#: (8b, in turns) +1.4 %, 0.0 % and, at d 2048, -1.1 % in time, its 8b training step 138.8
#: against 138.4 ms (two processes each): a small gain in the plain GEMM, none a step sees. A
#: fourth 8b sublayer run (2026-12-07, with the stage freed before each promotion) read +4.2 % in
#: turns, +1.8 % back to back; which tree loses is unprofiled (``gpu_session.sh release-more``). The
#: plain GEMM's output and the block MLP's forward and backward (its norm + SwiGLU, residual and
#: norm-backward trees carry) are bit for bit those without it, memcheck clean (GPU tests,
#: ``sanitize_fp8.py``, an H100).
TAIL_CARRY = True


def ranked_configs(tree, m, n, k, batch, fp8, fast_accum, sms, block_scaled: bool = False,
                   b_rows: bool = False, card: str = dispatch.DEFAULT_CARD) -> list:
    """The configs whose shared memory the tree leaves room for, fastest first by the GEMM's
    predicted time (``dispatch.predicted_time`` on ``card``'s rates), cooperative configs charged
    for the tree's work (:func:`_epilogue_factor`); ``block_scaled``: those of
    :func:`dispatch.block_scaled_config_space`, ``b_rows`` on the weight-gradient form's rates."""
    space = dispatch.block_scaled_config_space(b_rows) if block_scaled else dispatch.config_space(fp8)
    if any(i.kind == "tile" for i in tree.inputs):  # a split tail's load warp cannot skip tile loads
        space = [c.with_(split_tail=False) for c in space]
    cands = [c for c in space if (not fp8 or c.fp8_fast_accum == fast_accum) and fits(tree, c, 1 if fp8 else 2)
             and (not quantizes(tree) or quantize_config(c))]
    if not cands:
        raise N.EpilogueError(f"{tree!r}: no GEMM config leaves room for this epilogue's shared memory")
    return sorted(cands, key=lambda c: dispatch.predicted_time(c, m, n, k, batch, sms, fp8, b_rows, card)
                  * _epilogue_factor(tree, c, k, fp8, card))


def spills(tree: N.Epilogue, cfg: GemmConfig, fp8: bool, sms: int, block_scaled: bool = False,
           b_rows: bool = False) -> bool:
    """Whether ptxas spills registers in the tree's build on ``cfg`` (K-major bf16 or e4m3
    operands: the consumers' code, where the tree runs, does not depend on majors or on which
    16-bit or 8-bit type). Compiles the kernel, or takes it from the compiler's caches."""
    dt = "float8_e4m3fn" if fp8 else "bfloat16"
    return spill_bytes(get_gemm(KernelSpec.of(dt, dt, "k", "k", cfg, tree, "sm_90a", sms,
                                              block_scaled=block_scaled, b_rows=b_rows))) > 0


def choose_config(tree, m, n, k, batch, fp8, fast_accum, sms, block_scaled: bool = False,
                  b_rows: bool = False, card: str = dispatch.DEFAULT_CARD) -> GemmConfig:
    """The heuristic's config for the tree: the first of :func:`ranked_configs` whose build does
    not spill (among the first ``SPILL_CHECKS``), else the first. Spills follow no register count
    the heuristic could predict (an accumulator plus a few values per row spills on some tile
    shapes and not on larger ones), so the builds themselves are asked. Where a candidate can
    carry (:func:`_carried`), its carried build is asked first and, spill-free, is the pick: the
    build without the carry is compiled only where the carried one spills, so that an op's first
    call compiles the kernel it launches and no other (each block-scaled build takes seconds).
    Deterministic for a given build of the kernels and card (``dispatch.card_of``), which the fake
    implementations rely on: they call this to size per-tile outputs."""
    ranked = ranked_configs(tree, m, n, k, batch, fp8, fast_accum, sms, block_scaled, b_rows, card)
    pick = ranked[0]
    for c in ranked[:SPILL_CHECKS]:
        carried = _carried(c, k, fp8, block_scaled, b_rows)
        if carried is not None and not spills(tree, carried, fp8, sms, block_scaled, b_rows):
            pick = carried
            break
        if not spills(tree, c, fp8, sms, block_scaled, b_rows):
            pick = _two_by_two(tree, c, fp8, fast_accum, sms)
            break
    return pick.with_(poll_full=True) if POLL_FULL else pick


def _carried(cfg: GemmConfig, k: int, fp8: bool, block_scaled: bool, b_rows: bool) -> Optional[GemmConfig]:
    """``cfg`` with ``tail_carry`` where :data:`TAIL_CARRY` is on and its rule takes this K
    (``config.tail_carry_rule``: the block-scaled forward form, cooperative, K of whole promotion
    groups), else None."""
    if not (TAIL_CARRY and block_scaled and cfg.schedule == "cooperative" and not cfg.split_tail):
        return None
    carried = cfg.with_(tail_carry=True)
    return None if tail_carry_rule(carried, k, fp8, block_scaled, b_rows) is not None else carried


def _check_tail_carry(config: Optional[GemmConfig], k: int, fp8: bool, blocked: bool, b_rows: bool, op: str):
    """An explicit config's ``tail_carry`` on a launch its rule refuses (``config.tail_carry_rule``)."""
    why = None if config is None else tail_carry_rule(config, k, fp8, blocked, b_rows)
    if why is not None:
        raise ValueError(f"{op}: config {config.name}: {why}")


def _two_by_two(tree, cfg: GemmConfig, fp8: bool, fast_accum: bool, sms: int) -> GemmConfig:
    """``cfg`` on a 2x2 cluster under ``FP8_PINGPONG_2X2`` (an FP8 fast-accumulation ping-pong
    pick on 2x1 whose 2x2 build does not spill), else ``cfg``."""
    if not (FP8_PINGPONG_2X2 and fp8 and fast_accum and cfg.schedule == "pingpong"
            and (cfg.cluster_m, cfg.cluster_n) == (2, 1)):
        return cfg
    wide = cfg.with_(cluster_n=2)
    return cfg if spills(tree, wide, fp8, sms) else wide


def config_on(device, tree, m, n, k, batch, fp8, fast_accum, sms, block_scaled: bool = False,
              b_rows: bool = False, card: str = dispatch.DEFAULT_CARD) -> GemmConfig:
    """The config whose tile sizes an op's outputs take on ``device`` (a ``card``,
    ``dispatch.card_of``): :func:`choose_config` for CUDA tensors, real or fake (tracing must size
    per-tile partials exactly as the launch will);
    on the CPU reference path, which runs no kernel, the first of :func:`ranked_configs`, so
    that no build is compiled to ask ptxas about spills (about 2 s per op and process on a
    machine without a GPU). The two differ only where that first candidate spills."""
    if getattr(device, "type", device) == "cpu":
        return ranked_configs(tree, m, n, k, batch, fp8, fast_accum, sms, block_scaled, b_rows, card)[0]
    return choose_config(tree, m, n, k, batch, fp8, fast_accum, sms, block_scaled, b_rows, card)


class Plan:
    """One call signature's validated launch recipe."""

    __slots__ = ("tree", "op", "device", "batched", "out_allocs", "a_view", "b_view", "in_views", "block_form",
                 "scalar_names", "out_views", "kernel", "empty", "config", "workspace", "tail_sizes")

    def launch(self, a, b, inputs: dict, outputs: Optional[dict] = None, block_scales=None) -> dict:
        for name, t in (("a", a), ("b", b)):
            if t.data_ptr() % 16:  # real tensors here: the per-call check stays one modulo
                check_pointer_aligned(t, name, self.op)
        result, out_args = {}, []
        outputs = _flat_outputs(outputs, self.tree)
        for name, shape, dtype, fill, view, kind in self.out_allocs:
            t = outputs.get(name) if outputs else None
            if t is None:
                if isinstance(view, str):
                    raise ValueError(view)
                t = (torch.zeros if fill else torch.empty)(shape, dtype=dtype, device=self.device)
                out_args.append(_words(t, kind).as_strided(*view))
            else:
                out_args.append(_given_output(t, name, shape, dtype, view, kind, self.op))
            result[name] = t
        if self.empty:
            return _group(result, self.tree)
        ins = tuple(_padded(_words(inputs[name], wide), pad).as_strided(*view)
                    for name, view, pad, wide in self.in_views) or None
        scalars = tuple(float(inputs[name]) for name in self.scalar_names) or None
        workspace = self.workspace
        if self.tail_sizes is not None:  # a split tail: fresh partials, zeroed counters per launch
            parts, counters = self.tail_sizes
            workspace = (torch.empty(parts, dtype=torch.float32, device=self.device),
                         torch.zeros(counters, dtype=torch.int32, device=self.device))
        scales = None
        if self.block_form is not None:  # (rows-major A scales, B's as the form has them)
            scales = tuple(scale_view(tma_block_scales(t, rows), rows)
                           for t, rows in zip(block_scales, (True, self.block_form == "1x128")))
        args = (a.as_strided(*self.a_view), b.as_strided(*self.b_view), ins, tuple(out_args), scalars, workspace,
                scales)
        stream = getattr(_launch_stream, "stream", None)
        if stream is None:
            self.kernel(*args)
        else:
            cur = torch.cuda.current_stream(self.device)
            stream.wait_stream(cur)
            with torch.cuda.stream(stream):
                self.kernel(*args)
            cur.wait_stream(stream)
        return _group(result, self.tree)


#: the stream :func:`launching_on` has set for this thread's launches (autograd runs a backward on
#: a thread of its own: one thread's setting is not another's)
_launch_stream = threading.local()


@contextlib.contextmanager
def launching_on(stream: Optional["torch.cuda.Stream"]):
    """Inside: every GEMM this thread launches through :func:`run` goes on ``stream`` rather than
    the current one, ordered as if it were on the current one (``stream`` waits for the current
    stream before the launch, the current stream for ``stream`` after it). Its outputs and
    workspace are still allocated on the current stream, so the caching allocator's blocks stay in
    that stream's pool. What changes is the stream's priority: ``ops.beside`` launches its GEMM on
    a stream of higher priority than its side passes', so that the GPU places the persistent
    GEMM's CTAs first when both become ready together. ``None``: the current stream."""
    before = getattr(_launch_stream, "stream", None)
    _launch_stream.stream = stream
    try:
        yield
    finally:
        _launch_stream.stream = before


def _tail_workspace(plan: Plan, m, n, k, batch, sms, device) -> None:
    """What a ``split_tail`` kernel takes for its workspace. With a split last round:
    ``plan.tail_sizes``, the (fp32 partials, int32 counters) to allocate per launch, a whole fp32
    tile per (tail tile, K slice, CTA of the cluster) and a counter per (tail tile, CTA). Without
    one: ``plan.workspace``, two one-element tensors made once, which the kernel never touches
    (no allocation or memset per call)."""
    config = plan.config
    plan.workspace = plan.tail_sizes = None
    if not config.split_tail:
        return
    rem, split = config.tail(m, n, k, batch, sms)
    if split > 1:
        ctas = config.cluster_m * config.cluster_n
        plan.tail_sizes = rem * split * ctas * config.tile_m * config.tile_n, rem * ctas
    else:
        plan.workspace = (torch.empty(1, dtype=torch.float32, device=device),
                          torch.empty(1, dtype=torch.int32, device=device))


def _words(t: torch.Tensor, wide) -> torch.Tensor:
    """A double-width tensor (``wide`` true or "wide") as the kernel's 32-bit column pairs, a
    quantize sink's FP8 values as its 16-bit ones."""
    if wide == "quantize":
        return t.view(torch.int16)
    return t.view(torch.float32) if wide in (True, "wide") else t


def _given_output(t, name, shape, dtype, view, kind, op):
    """The kernel view of a preallocated output: contiguous, or for stores any row-major tensor
    whose row stride and data pointer TMA accepts (e.g. a column slice of a padded buffer)."""
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise ValueError(f"{op}: {name} must be a {dtype} tensor of shape {shape}, got "
                         f"{t.dtype} {tuple(t.shape)}")
    if t.is_contiguous() and not isinstance(view, str):
        return _words(t, kind).as_strided(*view)
    if kind not in ("store", "wide", "quantize", "quantize_t") or t.stride(-1) != 1:
        raise ValueError(f"{op}: {name} must be contiguous" + ("" if kind not in ("store", "wide", "quantize", "quantize_t")
                         else f" or row-major (stride 1 along {_dims(kind)[1]})") + f", got strides {tuple(t.stride())}")
    return tma_view(mn_view(_words(t, kind)), name, True, _dims(kind), op)


def _padded(t: torch.Tensor, cols: Optional[int]) -> torch.Tensor:
    """A column vector zero-padded to ``cols`` entries (the kernels read column vectors up to the
    last column of the last cluster's tiles, unclamped: no bounds arithmetic per column)."""
    return t if cols is None else torch.nn.functional.pad(t, (0, cols - t.shape[-1]))


def _flat_outputs(outputs: Optional[dict], tree: N.Epilogue) -> Optional[dict]:
    """Preallocated outputs by kernel output name: a quantize sink's (values, scales) pair as
    ``name`` and ``name.scale``."""
    if not outputs:
        return outputs
    flat = dict(outputs)
    for o in tree.outputs:
        if o.quantizes and o.name in flat:
            pair = flat.pop(o.name)
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise ValueError(f"quantize output {o.name!r} is preallocated as a (values, scales) pair")
            flat[o.name], flat[o.name + ".scale"] = pair
    return flat


def _group(result: dict, tree: N.Epilogue) -> dict:
    """lse reductions return (max partials, sum-of-exp partials) under their name."""
    for o in tree.outputs:
        if o.kind == "row_reduce" and o.op == "lse" and o.name + ".max" in result:
            result[o.name] = (result.pop(o.name + ".max"), result.pop(o.name + ".sumexp"))
        elif o.quantizes and o.name + ".scale" in result:
            result[o.name] = (result.pop(o.name), result.pop(o.name + ".scale"))
    return result


def _meta(t):
    if isinstance(t, torch.Tensor):
        return (t.shape, t.stride(), t.dtype, t.device)
    return type(t)


def run(tree: N.Epilogue, a: torch.Tensor, b: torch.Tensor, inputs: dict, *,
        config: Optional[GemmConfig] = None, use_fast_accum: bool = False,
        outputs: Optional[dict] = None, op: str = "coda.gemm_epilogue", block_scales=None,
        b_block: str = "128x128", sms: Optional[int] = None) -> dict:
    """``a @ b`` with ``tree`` in the epilogue. ``inputs`` binds the tree's named inputs;
    ``outputs`` may pass preallocated outputs by name. ``block_scales``: FP8 ``a`` (M, K) and
    ``b`` (K, N) K-major with (a's 1 x 128 scales (M, ceil(K / 128)), b's 128 x 128 scales
    (ceil(N / 128), ceil(K / 128)); ``b_block="1x128"``: b's per column of b, (N, ceil(K / 128)),
    the weight-gradient form), fp32, promoted per k-block in the mainloop
    (``kernels.sm90.block_scales``). ``sms``: the SMs the persistent grid may hold (default: every
    SM of the device); fewer leave the rest to work on another stream (``coda_cute.ops.beside``).
    Returns the outputs by name."""
    if not isinstance(tree, N.Epilogue):
        raise TypeError(f"{op}: tree must be a coda_cute.epilogue.Epilogue, got {type(tree).__name__}")
    # len(inputs): a call with an extra, unknown input must miss the cache and be rejected.
    key = (id(tree), _meta(a), _meta(b), tuple(_meta(inputs.get(i.name)) for i in tree.inputs),
           len(inputs), config, use_fast_accum, FP8_PINGPONG_2X2, POLL_FULL, TAIL_CARRY,
           None if block_scales is None else (tuple(_meta(t) for t in block_scales), b_block), sms)
    plan = _plans.get(key)
    if plan is None:
        if b_block not in B_BLOCKS:
            raise ValueError(f"{op}: b_block must be one of {B_BLOCKS}, got {b_block!r}")
        b_rows = b_block == "1x128"
        if a.device.type == "cpu" and dispatch.reference_on_cpu_enabled():
            _check_sms(sms, dispatch.num_sms_or_default(a.device), op)  # what the GPU path rejects
            return _reference_run(tree, a, b, inputs, config, outputs, op, block_scales, b_rows)
        plan = _make_plan(tree, a, b, inputs, config, use_fast_accum, op, block_scales, b_rows, sms)
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    return plan.launch(a, b, inputs, outputs, block_scales)


def output_shapes(tree: N.Epilogue, m, n, batch, batched: bool, config: GemmConfig):
    """(name, shape, dtype, zero-filled) of every output tensor, in the kernel's order."""
    lead = (batch,) if batched else ()
    out = []
    for o in tree.outputs:
        if o.kind == "store":
            cols = n // 2 if o.half else (2 * n if o.wide else n)
            out.append((o.name, lead + (m, cols), torch_dtype(o.dtype), False))
        elif o.kind == "row_reduce":
            t = -(-n // config.tile_n)
            names = (o.name + ".max", o.name + ".sumexp") if o.op == "lse" else (o.name,)
            out += [(nm, lead + (m, t), torch.float32, False) for nm in names]
        elif o.kind == "col_reduce":
            out.append((o.name, lead + (n, -(-m // config.tile_m)), torch.float32, False))
        elif o.kind == "quantize":  # values, and one scale per row and 128-column block
            cols = 2 * n if o.wide else n
            out += [(o.name, lead + (m, cols), torch_dtype(o.dtype), False),
                    (o.name + ".scale", lead + (m, -(-cols // N.QUANT_BLOCK)), torch.float32, False)]
        elif o.kind == "quantize_t":  # x^T, and one scale per column and 128-row block
            rows = n // 2 if o.half else (2 * n if o.wide else n)
            out += [(o.name, lead + (rows, m), torch_dtype(o.dtype), False),
                    (o.name + ".scale", lead + (rows, -(-m // N.QUANT_BLOCK)), torch.float32, False)]
        else:
            out.append((o.name, lead + (m,), torch.float32, True))
    return out


def _make_plan(tree, a, b, inputs, config, use_fast_accum, op, block_scales=None, b_rows=False,
               sms: Optional[int] = None) -> Plan:
    m, n, k, batch, fp8 = check_operands(a, b, op)
    batched = a.dim() == 3
    _check_inputs(a, b, inputs, tree, op)
    blocked = block_scales is not None
    if blocked:
        check_block_scaled(a, b, block_scales, fp8, use_fast_accum, config, op, b_rows)
    arch = dispatch.arch_of(a.device)
    _check_half_width(tree, n, op)
    check_quantize(tree, m, n, config, op)
    plan = Plan()
    plan.tree = tree
    plan.op = op
    plan.device = a.device
    plan.batched = batched
    sms = _check_sms(sms, dispatch.num_sms(a.device), op)
    if config is None:
        config = choose_config(tree, m, n, k, batch, fp8, use_fast_accum, sms, blocked, b_rows,
                               dispatch.card_of(a.device))
    elif fp8 and use_fast_accum != config.fp8_fast_accum:
        config = config.with_(fp8_fast_accum=use_fast_accum)
    if not fp8:
        config = config.with_(fp8_fast_accum=False)
    _check_tail_carry(config, k, fp8, blocked, b_rows, op)
    if not fits(tree, config, 1 if fp8 else 2):
        raise N.EpilogueError(f"{op}: config {config.name} leaves no room for this epilogue's "
                              "shared memory, or its tile width is no multiple of a segment_reduce "
                              f"width {sorted(segment_widths(tree))}")
    plan.config = config
    _tail_workspace(plan, m, n, k, batch, sms, a.device)
    plan.empty = _check_extents(m, n, k, batch, op)
    if not plan.empty:
        (a_view, a_major), (b_view, b_major) = _operand_views(a, b, fp8, op)
    plan.out_allocs = []
    for name, shape, dtype, fill in output_shapes(tree, m, n, batch, batched, config):
        kind = _out_kind(name, tree)
        plan.out_allocs.append((name, shape, dtype, fill, _out_view(name, shape, dtype, kind, op), kind))
    # A store whose dense layout TMA cannot write (a row of N values not 16-byte aligned) needs
    # a preallocated output with padded rows: its error is raised only when none is given.
    if plan.empty:
        return plan
    plan.a_view = (tuple(a_view.shape), a_view.stride())
    plan.b_view = (tuple(b_view.shape), b_view.stride())
    # Column vectors are read up to the last column of the last tile a CTA visits: the scheduler
    # rounds the tile count up to whole clusters, so a 1x2 cluster can hold a tile past N.
    n_tiles = -(-n // (config.tile_n * config.cluster_n)) * config.tile_n * config.cluster_n
    plan.in_views = [(i.name, _input_view(i, inputs, m, n, batch, batched, op, n_tiles),
                      n_tiles if i.kind == "col_vec" and n_tiles != n else None, i.wide)
                     for i in tree.inputs if i.kind != "scalar"]
    plan.scalar_names = _check_scalars(tree, inputs, op)
    plan.block_form = ("1x128" if b_rows else "128x128") if blocked else None
    spec = KernelSpec.of(dtype_name(a.dtype), dtype_name(b.dtype), a_major, b_major, config, tree,
                         arch, sms, block_scaled=blocked, b_rows=b_rows)
    plan.kernel = get_gemm(spec).fn
    return plan


def _check_sms(sms: Optional[int], device_sms: int, op: str) -> int:
    """The SMs a launch's persistent grid may hold: ``sms``, else all ``device_sms``; an int from 2
    (one cluster of two CTAs) to ``device_sms``."""
    if sms is None:
        return device_sms
    if isinstance(sms, bool) or not isinstance(sms, int) or not 2 <= sms <= device_sms:
        raise ValueError(f"{op}: sms must be an int from 2 to the device's {device_sms} SMs, got {sms!r}")
    return sms


def check_launch(tree, a, b, inputs, op, config=None, block_scales=None, b_rows=False, outputs=None):
    """The argument rules a launch of ``tree`` on ``a @ b`` checks while it builds its plan
    (operands and their TMA layouts, inputs, block scales, quantize and half-width rules, the
    outputs' layouts, given or allocated), without running anything: the CPU reference path and
    the fake (tracing) path of an op raise what its GPU path raises. Returns (M, N, K, batch,
    is_fp8, the config the outputs are sized for: ``config``, else the first of
    :func:`ranked_configs`, no build compiled)."""
    m, n, k, batch, fp8 = check_operands(a, b, op)
    batched = a.dim() == 3
    _check_inputs(a, b, inputs, tree, op)
    if block_scales is not None:
        check_block_scaled(a, b, block_scales, fp8, False, config, op, b_rows)
    _check_half_width(tree, n, op)
    check_quantize(tree, m, n, config, op)
    if not _check_extents(m, n, k, batch, op):
        _operand_views(a, b, fp8, op)
    for i in tree.inputs:
        if i.kind != "scalar":
            _input_view(i, inputs, m, n, batch, batched, op, n)
    _check_scalars(tree, inputs, op)
    _check_tail_carry(config, k, fp8, block_scales is not None, b_rows, op)
    if config is None:
        config = config_on("cpu", tree, m, n, k, batch, fp8, False, dispatch.num_sms_or_default(a.device),
                           block_scales is not None, b_rows)
    given = _flat_outputs(outputs, tree) or {}
    for name, shape, dtype, _fill in output_shapes(tree, m, n, batch, batched, config):
        kind = _out_kind(name, tree)
        view = _out_view(name, shape, dtype, kind, op)
        if name in given:
            _given_output(given[name], name, shape, dtype, view, kind, op)
        elif isinstance(view, str):  # what the launch raises without a padded output
            raise ValueError(view)
    return m, n, k, batch, fp8, config


def _reference_run(tree, a, b, inputs, config, outputs, op, block_scales=None, b_rows=False) -> dict:
    """:func:`run` on CPU tensors inside ``reference_on_cpu()``: the launch's argument rules
    (:func:`check_launch`), then the torch evaluator on the fp32 product (block-scaled: of the
    dequantized operands; no kernel); preallocated outputs are filled."""
    m, n, k, batch, fp8, config = check_launch(tree, a, b, inputs, op, config, block_scales, b_rows, outputs)
    if block_scales is None:
        product = torch.matmul(a.float(), b.float())
    else:
        product = (dequantize_blocks_ref(a, block_scales[0], (1, BLOCK))
                   @ dequantize_blocks_ref(b.t(), block_scales[1], (1, BLOCK) if b_rows else (BLOCK, BLOCK)).t())
    out = _flat_outputs(evaluate(tree, product, inputs, (config.tile_m, config.tile_n)), tree)
    for name, t in (_flat_outputs(outputs, tree) or {}).items():
        out[name] = t.copy_(out[name])
    return _group(out, tree)


def check_quantize(tree, m: int, n: int, config, op):
    """A quantize sink's rules: its rows of N FP8 values (a transposed one's of M) start on
    16-byte boundaries (TMA), and an explicit config is one it runs on (:func:`quantize_config`)."""
    if not quantizes(tree):
        return
    if n % 2 and any(o.kind == "quantize_t" and o.half for o in tree.outputs):
        raise ValueError(f"{op}: pairwise (half-width) outputs need an even N, got N={n}")
    if any(o.kind == "quantize" and n * (2 if o.wide else 1) % 16 for o in tree.outputs):
        raise ValueError(f"{op}: quantized outputs need rows of a multiple of 16 FP8 values (N, or 2N for a "
                         f"double-width value: rows start on 16-byte boundaries), got N={n}")
    if m % 16 and any(o.kind == "quantize_t" for o in tree.outputs):
        raise ValueError(f"{op}: transposed quantized outputs need M a multiple of 16 (their rows of M "
                         f"FP8 values start on 16-byte boundaries), got M={m}")
    if config is not None and not quantize_config(config):
        raise ValueError(f"{op}: config {config.name} cannot quantize in its epilogue (it needs the "
                         f"cooperative schedule, tile_m 128 and tile_n a multiple of {N.QUANT_BLOCK})")


def _check_half_width(tree, n: int, op):
    if any(o.kind == "store" and o.half for o in tree.outputs) and n % 2:
        raise ValueError(f"{op}: pairwise (half-width) outputs need an even N, got N={n}")


def _check_extents(m, n, k, batch, op) -> bool:
    """Whether the product is empty; K = 0 with outputs to write is an error."""
    if k == 0 and m and n and batch:
        raise ValueError(f"{op}: K = 0 gives an all-zero accumulator; run the epilogue in "
                         "torch instead (coda_cute.epilogue.evaluate)")
    return m == 0 or n == 0 or batch == 0 or k == 0


def _operand_views(a, b, fp8: bool, op):
    """((a view, a major), (b view, b major)): the layouts TMA reads, FP8 only K-major."""
    a_view, a_major = operand_view(a, "a", False, "m", op)
    b_view, b_major = operand_view(b, "b", True, "n", op)
    if fp8 and (a_major != "k" or b_major != "k"):
        raise ValueError(
            f"{op}: FP8 operands must be K-major (FP8 WGMMA reads K-contiguous tiles): a "
            "row-major (stride (K, 1)) and b column-major (b = w.t() of a row-major w), as for "
            f"torch._scaled_mm; got a strides {tuple(a.stride())}, b strides {tuple(b.stride())}"
        )
    return (a_view, a_major), (b_view, b_major)


def _check_scalars(tree, inputs, op) -> list:
    names = [i.name for i in tree.inputs if i.kind == "scalar"]
    for name in names:
        if not isinstance(inputs.get(name), (int, float)) or isinstance(inputs.get(name), bool):
            raise TypeError(f"{op}: scalar input {name!r} must be a Python number")
    return names


def _check_inputs(a, b, inputs, tree, op):
    if a.device != b.device:
        raise ValueError(f"{op}: a is on {a.device} but b is on {b.device}")
    for i in tree.inputs:
        if i.name not in inputs:
            raise ValueError(f"{op}: missing epilogue input {i.name!r} ({i.kind}, {i.dtype})")
        t = inputs[i.name]
        if i.kind != "scalar":
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{op}: epilogue input {i.name!r} must be a tensor ({i.kind})")
            if t.device != a.device:
                raise ValueError(f"{op}: epilogue input {i.name!r} is on {t.device} but a is on {a.device}")
    extra = set(inputs) - {i.name for i in tree.inputs}
    if extra:
        raise ValueError(f"{op}: unknown epilogue inputs {sorted(extra)}; the tree reads "
                         f"{[i.name for i in tree.inputs]}")


def _input_view(spec: N.InputSpec, inputs, m, n, batch, batched, op, n_tiles: int):
    """(shape, strides) the kernel sees an input as; column vectors as ``n_tiles`` long (the
    launch pads them when N is no multiple of the cluster's tile width)."""
    t = inputs[spec.name]
    want = torch_dtype(spec.dtype) if spec.kind != "scalar_tensor" else torch.float32
    if t.dtype != want:
        raise TypeError(f"{op}: epilogue input {spec.name!r} ({spec.kind}) must be {want}, got {t.dtype}")
    if spec.kind == "scalar_tensor":
        if t.numel() != 1:
            raise ValueError(f"{op}: {spec.name!r} must hold exactly one number, got shape {tuple(t.shape)}")
        return ((1,), (1,))
    if spec.kind == "row_sum":
        ok = [(m, t.shape[-1])] + ([(batch, m, t.shape[-1])] if batched else [])
        if t.dim() not in (2, 3) or tuple(t.shape) not in ok:
            raise ValueError(f"{op}: row_sum {spec.name!r} must be (M, T)" + (" or (L, M, T)" if batched else "")
                             + f" with M = {m}, got {tuple(t.shape)}")
        if t.numel() and t.stride(-1) != 1:  # an empty one is never read: any strides
            raise ValueError(f"{op}: row_sum {spec.name!r} must be contiguous along T, got strides {tuple(t.stride())}")
        v = t.unsqueeze(0).permute(1, 2, 0) if t.dim() == 2 else t.permute(1, 2, 0)
        return (tuple(v.shape), v.stride())
    if spec.kind == "lookup":
        if t.dim() != 2 or t.stride(-1) != 1 or t.shape[0] == 0 or t.shape[1] == 0:
            raise ValueError(f"{op}: lookup table {spec.name!r} must be a non-empty 2-D tensor, "
                             f"contiguous along its last dim; got shape {tuple(t.shape)}, strides {tuple(t.stride())}")
        return (tuple(t.shape), t.stride())
    if spec.kind in ("row_vec", "col_vec"):
        extent = m if spec.kind == "row_vec" else n
        what = "M (rows of a)" if spec.kind == "row_vec" else "N (columns of b)"
        ok = [(extent,)] + ([(batch, extent)] if batched else [])
        if tuple(t.shape) not in ok:
            raise ValueError(f"{op}: {spec.kind} {spec.name!r} must have shape "
                             f"{' or '.join(map(str, ok))} (one per {what}), got {tuple(t.shape)}")
        if extent > 1 and t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{op}: {spec.name!r} must be contiguous, got strides {tuple(t.stride())}")
        l_stride = t.stride(0) if t.dim() == 2 else 0
        if spec.kind == "col_vec" and n_tiles != n:
            extent, l_stride = n_tiles, n_tiles if t.dim() == 2 else 0
        return ((extent, batch), (1, l_stride))
    cols = 2 * n if spec.wide else n
    what = "wide tile" if spec.wide else "tile"
    ok = [(batch, m, cols)] if batched else [(m, cols)]
    if tuple(t.shape) not in ok:
        raise ValueError(f"{op}: {what} {spec.name!r} must have shape {' or '.join(map(str, ok))}"
                         + (" (two columns per output column)" if spec.wide else "")
                         + f", got {tuple(t.shape)}")
    v = mn_view(_words(t, spec.wide))
    if not t.numel():  # never read
        return (tuple(v.shape), v.stride())
    if cols > 1 and t.stride(-1) != 1:
        raise ValueError(f"{op}: {what} {spec.name!r} must be row-major (stride 1 along N), "
                         f"got strides {tuple(t.stride())}")
    v = tma_view(v, spec.name, True, ("M", "N", "batch"), op)
    return (tuple(v.shape), v.stride())


def _out_kind(name: str, tree: N.Epilogue) -> str:
    """An output's kind, "wide" for a double-width store, "quantize" for a quantize sink's values
    and "row_reduce" for its scales (laid out like row partials)."""
    o = next(o for o in tree.outputs if name.split(".")[0] == o.name)
    if o.quantizes and name.endswith(".scale"):
        return "row_reduce" if o.kind == "quantize" else "col_reduce"
    return "wide" if o.kind == "store" and o.wide else o.kind


def _dims(kind: str) -> tuple:
    """The names of an output's dimensions, for messages (a transposed quantize sink's are N, M)."""
    return ("N", "M", "batch") if kind == "quantize_t" else ("M", "N", "batch")


def _out_view(name, shape, dtype, kind, op):
    """(shape, strides) of the kernel's view of a dense output; for a store TMA cannot write
    densely, the message of the ValueError saying why (raised at launch unless a padded output
    is given). A message, not the exception: a cached plan holding the exception would hold its
    traceback, whose frames hold their callers' (the first step's model forward and its
    activations, and with them the parameters' AccumulateGrad nodes: a CUDA-graph capture after
    an eager step then synced with the default stream and failed)."""
    meta = torch.empty(shape, dtype=dtype, device="meta")
    if kind in ("store", "wide", "quantize", "quantize_t"):
        v = mn_view(_words(meta, kind))
        if meta.numel():  # an empty output is never stored: TMA's rules do not apply to it
            try:
                v = tma_view(v, name, True, _dims(kind), op)
            except ValueError as e:
                return str(e)
    elif kind == "gather":
        v = (meta.unsqueeze(0) if meta.dim() == 1 else meta).t()
    else:  # partials (L?, rows, tiles) -> (rows, tiles, L)
        v = mn_view(meta)
    return (tuple(v.shape), v.stride())
