#!/usr/bin/env bash
# The GPU work of a session on the lent H200, as named stages that each fit one device call
# (10 minutes), so that a session's 30 minutes go to running rather than to writing commands.
#
#   run(command="bash scripts/gpu_session.sh rope backward", carry=[".dsl", ".wheels"])
#
# Every command's output goes to $OUT/<stage>-<what>.log (and its JSON next to it), under a time
# limit of its own, so that one that hangs leaves the next stages their time; the last lines of
# each log are printed at the end. Set-up (once per machine): the DSL pack of
# ../shared/device/pack-dsl (built with --with apache-tvm-ffi==0.1.15.post2), the package
# installed in place, and the pure-Python packages in .wheels/ (Liger-Kernel 0.8.5 without its NPU
# backend, pytest-xdist, execnet, as one xz archive so that they fit the carry: `bash
# scripts/liger_wheel.sh`) on the path.
#
# Stages:
#   rope      the RoPE backward's tuning sweep (bench_rope_backward.py --sweep), its GPU tests
#             (every swept tuning against float64), compute-sanitizer memcheck of every
#             backward kernel (sanitize_backward.py), racecheck and synccheck of the RoPE one
#   rope-tests  the RoPE backward's GPU tests alone (tests/test_rope_backward_gpu.py)
#   rope-bench  bench_rope_backward.py --sweep alone (the op and its kernel's tunings against copy bandwidth)
#   backward  the training-step GPU tests (test_coda_block_gpu, test_train_gpu, test_fold_gpu),
#             then the model's gradients against fp32 with their error ratios printed (-s)
#   hf        the HF integration and embedding GPU tests
#   fp8       the FP8 GPU tests (quantizers, block-scaled GEMM, LM head, MLP, attention)
#   quant     the quantizer GPU tests and the FP8 MLP's (test_fp8_gpu, test_mlp_fp8_gpu),
#             bench_quantize.py, compute-sanitizer memcheck of sanitize_fp8.py (the quantizers, an FP8 model)
#   mlp-fp8   the FP8 MLP's GPU tests, compute-sanitizer memcheck of sanitize_fp8.py, then
#             bench_fp8.py --fast-accum all --profile (the MLP sublayer against its shadows, in
#             turns, and one step's kernels of each)
#   swiglu-fp8  exp_swiglu_epilogues.py --fp8-row-fast: the row-wise FP8 down dgrad without h on
#             the first three spill-free configs, cooperative 128 x 256 2x1 (the plain GEMM's
#             fastest tile at the power cap) and with two store buffers, against _scaled_mm
#   swiglu-fwd-fp8  exp_swiglu_epilogues.py --fp8-row-fast --forward: the row-wise FP8 gate/up GEMM
#             with its RMSNorm + SwiGLU tree (z and h), the same variants and z or h alone
#   train     bench_train.py at both configs (no torch.compile baseline: its compile does not fit)
#   train-compile  the whole table in one run: bench_train.py at one config (TRAIN_CONFIG, default
#             8b) with HF + torch.compile, Liger, HF eager, CODA bf16 and FP8 row-wise fast, in
#             turns (a call of its own: compile takes minutes); TRAIN_SWITCH="NAME=V ..." adds the
#             FP8 step with those switches set (bench_train.py --fp8-switch)
#   train-fp8  bench_train.py at 8b with the FP8 step (row-wise, fast accumulation) next to bf16
#   train-recipes  bench_train.py at 8b: the bf16 step, the block-scaled FP8 step (--fp8) and row-wise
#             fast (--fp8-row-fast all) in turns, HF eager beside them (no compile, no Liger)
#   mlp-gaps  trace_step.py --model mlp-fp8: the FP8 MLP sublayer's idle gaps, host calls and
#             clocks against its shadow's
#   fp8-ncu   ncu of the quantize, amax and transpose kernels of one FP8 MLP step (row-wise, fast
#             accumulation: bench_fp8.py --once)
#   verify    one pass of the GPU tests of the GEMMs, the FP8 ops, the epilogue sinks, the
#             embedding and the CE gradient (12 workers)
#   verify-more  verify-lm-head's tests, memcheck of sanitize_fp8.py
#   perf      the FP8 step (train-fp8), the wave experiment, bench_fp8.py (no profile): the
#             numbers of a session short of device time, most wanted first (verify perf
#             verify-more fits one call)
#   emb       the embedding GPU tests alone (-n 4)
#   verify-rest  the other GPU tests: the block, training, fold, epilogue, FP8 attention and SoL
#             ones (12 workers on the H200, 6 on a card under 100 GB)
#   sol       the SoL reporter's GPU tests, in one process (they time: xdist skips them)
#   verify-lm-head  the LM head's, the block's and the model's tests of test_coda_block_gpu (6 workers)
#   verify-hf  the HF integration's GPU tests (4 workers)
#   wgrad-rates  exp_block_scaled.py --wgrad: every block-scaled config on six weight-gradient
#             shapes (8B- and 1B-like), the rates' check, and the pick with bf16 out against
#             torch's block-wise kernel (bf16 out too)
#   mlp-profile  bench_fp8.py --fast-accum all --profile (the FP8 MLP's kernels against its shadow's)
#   gemm      the GEMM GPU tests (test_gemm_gpu: every config, dtype and ragged shape)
#   rope-ncu  ncu of the RoPE backward launches of bench_rope_backward.py --once --sweep (first
#             shape: head_dim 64)
#   gemm-ncu  ncu of the six GEMMs of one row-wise fast FP8 MLP step, and with GEMM_NCU_SHADOW=1
#             of its shadow's six (stall reasons, DRAM traffic, tensor-pipe use: the details
#             page; each kernel's 40 hottest SASS lines with their stall reasons,
#             scripts/ncu_hot_lines.py): what the gate/up forward's and the down dgrad's
#             epilogues wait on
#   waves     FP8 two-level accumulation in 64-row waves (cooperative 256 x 128): its GEMM and
#             block-scaled GPU tests, then exp_wave_promotion.py --mlp (the MLP's GEMMs, and the
#             sublayer's promoted recipes with and without it, in turns)
#   sinks     the epilogue quantize sinks' GPU tests and the FP8 MLP's with FUSED_QUANT, then
#             bench_fp8.py --profile (the block recipe with and without its quantization fused)
#   card-gemms  the 8b step's bf16 GEMMs on the card this call got (the dispatcher's rates are the
#             H200's; on an H100 the step ran 1.164x its shadow): each launch fused, plain and on
#             cuBLAS with its joules (bench_step_gemms.py --energy), then every candidate tile on
#             the step's plain shapes, in turns and at the cap (exp_energy_tiles.py; --fit on its JSON)
#   wgrad-side  dz''s rows beside the down weight gradient (mlp_fp8.SIDE_SMS_DOWN_WGRAD, off): the
#             FP8 MLP's beside tests, then bench_fp8.py --fast-accum all with it at 8 / 16 / 24 SMs
#             next to the default (in series) and torchao where carried (.wheels-ao), at 8b, then 1b
#   forward-side  the weights' passes beside the first projection (fp8_gemms.first_projection): the
#             row-wise GPU tests of the MLP and attention (-k "beside or halves or row-wise"), then
#             bench_fp8.py --fast-accum all with FORWARD_SMS side SMs (default 0 4 6 8 10; 0: in
#             series) at 8b and 1b, and the attention sublayer's with 0 and 6
#   block-ncu  the block-scaled forward form against torch's block-wise kernel: every promotion
#             variant at the three 8B shapes (exp_block_scaled.py), then ncu of our row-wise GEMM,
#             the block-scaled op and torch's kernel at 16384 x 4096 x 14336 or BLOCK_NCU_SHAPE
#             (stall reasons, hot SASS lines)
#   block-built  the block-scaled forward form's kernel as built on its pick and on 1x2, against
#             torch's block-wise _scaled_mm at the three 8B shapes (exp_block_scaled.py --clusters 1x2)
#   attn-beside  the attention's passes beside its QKV dgrad (attention_fp8.SIDE_SMS_QKV_DGRAD):
#             the sublayer at 1b (d 2048, head_dim 64) and 8b, beside and in series in turns, then the
#             8b training step (no compile, no Liger) with them on 16 SMs and in series, a process each
#   attn-verify  the FP8 attention's GPU tests and the HF integration's FP8 ones, memcheck
#             of sanitize_fp8.py, then the attention sublayer's bench (side-bench-attn)
#   block-carry  the FP8 GPU tests (with GemmConfig.tail_carry, each tile's last promotion group
#             carrying the next tile's first k-tile: bit for bit the kernel without it, and the
#             block MLP with runner.TAIL_CARRY on bit for bit the MLP without it), then
#             compute-sanitizer memcheck of sanitize_fp8.py (the carry on in its block-scaled part)
#   carry-bench  the block-scaled forward form with and without tail_carry against torch's
#             block-wise kernel at the three 8B shapes (and on 1x2)
#   carry-more  the same at five shapes it was not measured on, then bench_fp8.py (the block
#             recipe's MLP sublayer with and without)
#   carry-verify  block-carry's short form for a call of little device time: the carry's tests
#             alone (the plain GEMM's and the block MLP's, -k tail_carry), then memcheck of
#             sanitize_fp8.py: what put runner.TAIL_CARRY on (a check after a kernel edit)
#   carry-mlp  bench_fp8.py alone (the block recipe's MLP sublayer with and without the carry)
#   release   a two-level k-tile's stage freed before its promotion (mainloop.RELEASE_BEFORE_PROMOTION):
#             the two-level FP8 GPU tests (block-scaled, row-wise GEMM, MLP), the cuBLAS kernels
#             torch's _scaled_mm launches per shape (exp_block_scaled.py --kernels), the block-scaled
#             forward form with the release late and with one 64-column store buffer (a sixth
#             stage), in turns against torch, then bench_fp8.py --fast-accum all (the MLP
#             sublayer's targets)
#   release-more  release's second reading: the block recipe's MLP with the tail carry on and off
#             with each kernel's time (bench_fp8.py --profile), then the block-scaled forward form
#             with the release late at the three 8B shapes and two more
#   torchao   bench_fp8.py --fast-accum all with torchao's float8 training + compile in the same turns
#             (carry [".dsl", ".wheels-ao"] from scripts/torchao_wheel.sh: no Liger, no xdist;
#             TORCHAO_VARIANTS a --variants regex, TORCHAO_SIDE --forward-side-sms counts)
#   compile-times  bench_compile.py --rounds 2: the block-scaled kernels' first-call compile on
#             this host's CPU (the FP8 issue's <= 2 s per kernel)
#   block-k   block-built at N = 28672 with K = 2048, 4096 and 8192 (and 6144 x 8192): whether our
#             shortfall at 16384 x 28672 x 4096 is a per-tile cost (shrinking as K grows) or the k-loop's
#   poll      GemmConfig.poll_full (the mainloop's consumers and producer poll mbarrier.try_wait
#             instead of sleeping between polls): its GPU tests (test_gemm_gpu and
#             test_block_scaled_gpu -k poll), then the row-wise FP8 MLP's six GEMMs and the
#             block-scaled forward form polling and sleeping, against torch, in turns, then the FP8
#             MLP's "..., polling" row with each kernel's time (runner.POLL_FULL, bench_fp8.py
#             --poll --profile)
#   block-poll  the block-scaled forward form polling by default: the GPU tests of every op that
#             runs it (block-scaled GEMM, FP8 MLP, attention, LM head), its variants around the
#             pick (exp_block_scaled.py --poll --around: sleeping, 1x2, raster bands, one-buffer
#             epilogue), bench_fp8.py --fast-accum all (the block recipe's row), memcheck of
#             sanitize_fp8.py, then the weight-gradient form's pick polling (--wgrad --poll)
#   block-energy  the block-scaled forward form polling and sleeping against torch's block-wise
#             kernel, in turns and then each back to back with its joules and watts
#             (exp_block_scaled.py --poll --energy): does polling cost power at the cap
#   tiles     the row-wise FP8 short-K GEMMs on wider tiles and clusters than the pick
#             (exp_large_gemms.py --fp8 --variants tile: ping-pong 64 x 256, cooperative 256 x 128
#             and 128 x 256 on 2x2), in turns
#   epi-k     the row-wise FP8 SwiGLU backward tree (down dgrad) at K = 4096, 6144, 8192, 12288:
#             its cost over the plain GEMM as the mainloop per tile grows (exp_swiglu_epilogues.py)
#   epi-k-energy  epi-k's first and third shapes (K 4096, 8192) with each launch's joules, watts and
#             back-to-back time (exp_swiglu_epilogues.py --energy): power-capped tree or stalled one
#   tree-ncu  ncu of the row-wise fast down dgrad at K 4096 and 8192: cuBLAS's plain product, our
#             plain GEMM and the SwiGLU backward tree (exp_swiglu_epilogues.py --once): DRAM bytes,
#             L2 hit rates and the mainloop's stalls, the details page and each kernel's hot lines
#   active-ncu  each SM's cycles holding a CTA (min / avg / max) against the kernel's span: the
#             row-wise fast down dgrad and gate/up forward (cuBLAS, plain, tree) and the
#             block-scaled forward form: do the static schedule's slots finish apart
#   drift     the persistent slots' drift apart: the row-wise FP8 short-K GEMMs' pick on M cut into
#             2, 4 and 8 launches against one (exp_large_gemms.py --fp8 --split), timed in turns,
#             then ncu's DRAM bytes and cycles of each launch
#   cluster22-mlp  runner.FP8_PINGPONG_2X2 in the FP8 MLP: its GPU test (2x2 bit for bit the 2x1
#             op), then bench_fp8.py --fast-accum all --profile (its "..., 2x2 clusters" row in turns)
#   tree-tiles  the 8b step's bf16 trees on the card this call got (the heuristic's charges for a
#             tree were fitted on the H200): each launch on ping-pong 128 x 128 2x1 and cooperative
#             128 x 256 / 192 / 128 2x1 from cool and at the cap (exp_energy_tiles.py --fused), ncu
#             of the LM head's and norm + SwiGLU's launches on both tiles, plain on each and
#             cuBLAS (bench_step_gemms.py --once), then bench_step_gemms.py --cooperative (the
#             plain GEMM on the ping-pong pick's own tile too)
#   card-picks  the H100's card (dispatch.card_of): the block and training GPU tests, the 8b step's
#             launches (bench_step_gemms.py), then the 8b step against its shadow with row-wise fast
#             FP8 beside it (bench_train.py, no compile, no Liger)
#   tree-tiles-more  the same four tiles from cool and at the cap on the 1b step's bf16 trees, the
#             8b step's row-wise fast FP8 trees, and the 3b step's bf16 trees (exp_energy_tiles.py --fused)
#   attn-core  the attention core's outputs, one form for both SDPA backends: its GPU tests (each
#             backend's forward with each one's backward, a graph compiled on one run on the
#             other, the compiled training step, the graphed one; 8 passed on an H100 in 187 s
#             from a cold cache), then
#             compute-sanitizer memcheck of every backward kernel (sanitize_backward.py)
#   coop128   the 8b step's bf16 trees on ping-pong 128 x 128 and cooperative 128 x 256 / 192 / 128
#             2x1, at the cap and from cool (tree-tiles without its ncu), then
#             bench_step_gemms.py --cooperative
#   exp-card  the exp-form logits GEMM on its card's config (lm_head_ce.EXP_CONFIGS: cooperative
#             128 x 128 on an H100): the LM head's GPU tests (its hard rows on both cards'
#             configs), the 8b step's launches (bench_step_gemms.py), then the 8b step against its
#             shadow (bench_train.py, no compile, no Liger, no FP8)
#   swiglu-bwd-ncu  the bf16 SwiGLU backward (16384 x 14336 x 4096, kn; 1.28-1.35x cuBLAS on an
#             H100 on every tile): ncu of its tree, our plain GEMM on its tile and cuBLAS
#             (bench_step_gemms.py --once): DRAM bytes and throughput, the mainloop's and the
#             epilogue's stalls, each kernel's hottest SASS lines
#   swiglu-ring  the same launch with the epilogue's z ring 2 or 4 deep, one or two store buffers,
#             and the A/B stages that leaves (exp_load_ring.py --shapes 8b; measured on the H200
#             only), in turns with our plain GEMM and cuBLAS
#   swiglu-sub  the same launch on its pick with some sinks left out (without h, dz' alone) and
#             with two store buffers, in turns with our plain GEMM and cuBLAS
#             (exp_swiglu_epilogues.py --configs 1, bf16): what each store costs on this card
#   swiglu-raster  the same launch on its pick with raster bands 2, 4, 16, 32, clusters 1x2,
#             2x2, 1x1 and as 2 or 4 launches along M (--split), in turns, then ncu's DRAM bytes, L2 hit rate, cycles and clock of each
#             (--once): how much of its DRAM traffic is the operands' rereads
#   targets   issue 17's three time targets in one call (about 250 s on the H200): the training
#             table at 8b with HF + compile and Liger (train-compile), the FP8 MLP sublayer
#             against its shadows with one profiled step each (mlp-profile), and the block-scaled
#             forward form as built against torch's block-wise kernel (block-built)
#   side-mlp  the FP8 MLP's GPU tests, bench_fp8.py --fast-accum all with the row-wise fast variant's
#             weight-gradient passes beside its dgrads on several side SM counts (--side-sms) and in
#             series, then compute-sanitizer memcheck of sanitize_fp8.py
#   beside-tests  the FP8 MLP's and attention's row-wise GPU tests alone (-k "beside or row-wise": the
#             passes beside the dgrads against in series, the gradients against float64) and
#             runner.launching_on's (the GEMM on the stream it names, in the current one's order)
#   side-bench  bench_fp8.py --fast-accum all with the row-wise fast variant on several side SM counts
#             (SIDE_PAIRS, default 0,0 4,6 6,8 12,12) at 8b, then in series and 4,6 at 1b (d 2048,
#             ffn 8192): the default's pair checked on a shape it was not picked on; then the attention
#             sublayer's row-wise fast variant with its passes beside the QKV dgrad (the default) and in series
#   side-bench-8b  side-bench's first run alone: the 8b sublayer on SIDE_PAIRS (its GEMMs beside the
#             passes on a stream of higher priority, and on the current one: "..., GEMM on the
#             current stream"), with each variant's reserved MiB by stream in its JSON
#   side      exp_side_stream.py: the row-wise FP8 MLP backward's four wgrad-only passes on a side
#             stream beside the gate/up dgrad run on fewer SMs, against the two in series
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
LOGS=()

setup() {
    # a /tmp/coda-site unpacked from an older pack (no TVM-FFI) is stale
    ls -d /tmp/coda-site/tvm_ffi >/dev/null 2>&1 || rm -rf /tmp/coda-site
    # shellcheck disable=SC1091
    source .dsl/env.sh
    python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
    # .wheels (Liger and pytest-xdist) or .wheels-ao (torchao's float8 training), each one xz
    # archive of installed files (scripts/carry_archive.sh): the pack leaves room for one of the two
    local archives
    archives=$(ls .wheels/*.tar.xz .wheels-ao/*.tar.xz 2>/dev/null)
    if [ -n "$archives" ]; then
        # shellcheck disable=SC2086
        python3 -c "import sys, tarfile; [tarfile.open(a).extractall('/tmp/coda-wheels', filter='data') for a in sys.argv[1:]]" $archives
        export PYTHONPATH=$PYTHONPATH:/tmp/coda-wheels
    fi
    nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
    GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1 | tr -dc 0-9)
}

# workers N: N pytest workers on a card of 100 GB or more (the H200 the counts were sized on), half
# on a smaller one (12 workers of verify-rest on an 80 GB H100 ran 17 tests out of memory)
workers() {
    if [ "${GPU_MIB:-0}" -ge 100000 ]; then echo "$1"; else echo $((($1 + 1) / 2)); fi
}

# step NAME SECONDS COMMAND...: COMMAND under a time limit, its output in $OUT/NAME.log
# Every step also ends by the call's deadline (DEADLINE seconds after the script starts, default
# 570: a device call stops at 600), so that the logs are archived even when a stage runs long.
step() {
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    local left=$((${DEADLINE:-570} - SECONDS))
    if [ "$left" -lt 10 ]; then
        echo "== $name: skipped, the call's deadline has passed" > "$OUT/$name.log"
        LOGS+=("$name")
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc $rc, $((SECONDS - t0)) s" >> "$OUT/$name.log"
    LOGS+=("$name")
}

ncu_pages() {
    # an ncu report ($OUT/$1.ncu-rep) is too big to come back: its details page (a step of $2 s),
    # then each kernel's hottest SASS lines and samples by stall reason and opcode ($3 s), the
    # source page kept gzipped and the report removed
    local name=$1
    step "$name-details" "$2" ncu --import "$OUT/$name.ncu-rep" --page details
    step "$name-source" "$3" bash -c "ncu --import '$OUT/$name.ncu-rep' \
        --page source --csv --print-source sass > '$OUT/$name-source.csv' \
        && python3 scripts/ncu_hot_lines.py '$OUT/$name-source.csv' --top 40 \
        && gzip -f '$OUT/$name-source.csv' && rm -f '$OUT/$name.ncu-rep'"
}

stage_rope_tests() {
    step rope-tests 200 python3 -m pytest -q -m gpu -n "$(workers 6)" tests/test_rope_backward_gpu.py
}

stage_rope() {
    step rope-sweep 200 python3 scripts/bench_rope_backward.py --sweep --rounds 20 --json "$OUT/rope.json"
    step rope-tests 200 python3 -m pytest -q -m gpu -n 6 tests/test_rope_backward_gpu.py
    step rope-memcheck 150 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
        --report-api-errors no python3 scripts/sanitize_backward.py
    local t
    for t in racecheck synccheck; do
        step "rope-$t" 100 compute-sanitizer --tool "$t" --report-api-errors no --kernel-name kns=RopeBackward \
            python3 scripts/sanitize_backward.py --rope
    done
}

stage_rope_bench() {
    step rope-bench 150 python3 scripts/bench_rope_backward.py --sweep --rounds 30 --json "$OUT/rope-bench.json"
}

stage_backward() {
    step backward-tests 400 python3 -m pytest -q -m gpu -n 6 tests/test_coda_block_gpu.py tests/test_train_gpu.py \
        tests/test_fold_gpu.py -k "not model_gradients"
    step backward-gradients 150 python3 -m pytest -q -s -m gpu tests/test_coda_block_gpu.py -k model_gradients
}

stage_hf() {
    step hf-tests 500 python3 -m pytest -q -m gpu -n 2 tests/test_hf_gpu.py tests/test_embedding_gpu.py
}

stage_fp8() {
    step fp8-tests 550 python3 -m pytest -q -m gpu -n 6 tests/test_fp8_gpu.py tests/test_block_scaled_gpu.py \
        tests/test_lm_head_fp8_gpu.py tests/test_mlp_fp8_gpu.py tests/test_attention_fp8_gpu.py
}

stage_quant() {
    step quant-tests 300 python3 -m pytest -q -m gpu -n 6 tests/test_fp8_gpu.py tests/test_mlp_fp8_gpu.py
    step quant-bench 200 python3 scripts/bench_quantize.py --rounds 20 --json "$OUT/quant.json"
    step quant-memcheck 250 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
        --report-api-errors no python3 scripts/sanitize_fp8.py
}

stage_mlp_fp8() {
    step mlp-fp8-tests 200 python3 -m pytest -q -m gpu -n 6 tests/test_mlp_fp8_gpu.py
    step mlp-fp8-memcheck 200 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
        --report-api-errors no python3 scripts/sanitize_fp8.py
    step mlp-fp8-bench 300 python3 scripts/bench_fp8.py --fast-accum all --rounds 10 --profile \
        --json "$OUT/mlp-fp8.json"
}

stage_swiglu_fp8() {
    step swiglu-fp8 150 python3 scripts/exp_swiglu_epilogues.py --fp8-row-fast --rounds 6 --configs 3 \
        --also coop_128x256x128_c2x1_g8_fastacc
}

stage_swiglu_fwd_fp8() {
    step swiglu-fwd-fp8 150 python3 scripts/exp_swiglu_epilogues.py --fp8-row-fast --forward --rounds 6 --configs 3
}

stage_train() {
    step train 560 python3 scripts/bench_train.py --configs 8b 1b --no-compile --rounds 6 --json "$OUT/train.json"
}

stage_train_compile() {
    # shellcheck disable=SC2086
    step train-compile 520 python3 scripts/bench_train.py --configs "${TRAIN_CONFIG:-8b}" --rounds 6 --fp8-row-fast all \
        ${TRAIN_SWITCH:+--fp8-switch $TRAIN_SWITCH} --json "$OUT/train-compile.json"
}

stage_train_fp8() {
    step train-fp8 560 python3 scripts/bench_train.py --configs 8b --no-compile --rounds 6 --fp8-row-fast all \
        --json "$OUT/train-fp8.json"
}

stage_train_recipes() {
    step train-recipes 560 python3 scripts/bench_train.py --configs 8b --no-compile --no-liger --rounds 5 --fp8 \
        --fp8-row-fast all --json "$OUT/train-recipes.json"
}

stage_mlp_gaps() {
    step mlp-gaps 400 python3 scripts/trace_step.py --model mlp-fp8 --fast-accum all
}

stage_fp8_ncu() {
    step fp8-ncu 300 ncu --clock-control none --nvtx --nvtx-include "coda-fp8-step" \
        --kernel-name regex:"AbsMax|QuantizeDual|TransposeBytes|QuantizeWholeRows" --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats \
        python3 scripts/bench_fp8.py --once --fast-accum all
}

stage_gemm_ncu() {
    # each GEMM of one row-wise fast step: where the epilogue GEMMs' warps wait (WarpStateStats,
    # SourceCounters' stall sites), their DRAM traffic and tensor-pipe use. No NVTX filter:
    # autograd runs the backward's launches on its own thread, outside the range; the first 6
    # launches are our warm-up step's GEMMs. The shadow's nvjet kernels were profiled on
    # 2026-12-05 (96-99 % tensor pipe): GEMM_NCU_SHADOW=1 adds them (and doubles the stage's time).
    local count=6 shadow=()
    if [ "${GEMM_NCU_SHADOW:-0}" = 1 ]; then count=18; shadow=(--once-shadow); fi
    step gemm-ncu 420 ncu --clock-control none --kernel-name regex:"Sm90Gemm|nvjet" --launch-skip 6 \
        --launch-count "$count" --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats --section SourceCounters \
        --section LaunchStats --section Occupancy --export "$OUT/gemm-ncu" \
        python3 scripts/bench_fp8.py --once "${shadow[@]}" --fast-accum all
    ncu_pages gemm-ncu 120 180
}

stage_waves() {
    step waves-tests 250 python3 -m pytest -q -m gpu -n 6 tests/test_gemm_gpu.py tests/test_block_scaled_gpu.py \
        -k "256x128 or waves"
    step waves-exp 330 python3 scripts/exp_wave_promotion.py --rounds 10 --mlp --mlp-rounds 8
}

stage_sinks() {
    step sinks-tests 300 python3 -m pytest -q -m gpu -n 6 tests/test_epilogue_quantize_gpu.py tests/test_mlp_fp8_gpu.py
    step sinks-bench 280 python3 scripts/bench_fp8.py --rounds 8 --profile --json "$OUT/sinks.json"
}

stage_wgrad_side() {
    step wgrad-side-tests 150 python3 -m pytest -q -m gpu -n "$(workers 6)" tests/test_mlp_fp8_gpu.py -k beside
    step wgrad-side-8b 240 python3 scripts/bench_fp8.py --fast-accum all --rounds 8 \
        --variants "$FWD_VARIANTS|WGRAD|torchao" --json "$OUT/wgrad-side-8b.json" \
        --switch SIDE_SMS_DOWN_WGRAD=8 SIDE_SMS_DOWN_WGRAD=16 SIDE_SMS_DOWN_WGRAD=24
    step wgrad-side-1b 90 python3 scripts/bench_fp8.py --fast-accum all --rounds 8 --dim 2048 --ffn 8192 \
        --variants "$FWD_VARIANTS|WGRAD" --switch SIDE_SMS_DOWN_WGRAD=16 --json "$OUT/wgrad-side-1b.json"
}

# our row-wise fast variant as set, with its weights kept, and with the forward's side SMs varied
FWD_VARIANTS='accum \(all\)($|, weights kept|, forward side)'

stage_forward_side() {
    step forward-side-tests 200 python3 -m pytest -q -m gpu -n "$(workers 6)" tests/test_mlp_fp8_gpu.py \
        tests/test_attention_fp8_gpu.py -k "beside or halves or row-wise"
    # shellcheck disable=SC2086
    step forward-side-8b 200 python3 scripts/bench_fp8.py --fast-accum all --rounds 8 --variants "$FWD_VARIANTS" \
        --forward-side-sms ${FORWARD_SMS:-0 4 6 8 10} --json "$OUT/forward-side-8b.json"
    step forward-side-1b 90 python3 scripts/bench_fp8.py --fast-accum all --rounds 8 --dim 2048 --ffn 8192 \
        --variants "$FWD_VARIANTS" --forward-side-sms 0 6 --json "$OUT/forward-side-1b.json"
    step forward-side-attn 90 python3 scripts/bench_fp8.py --sublayer attention --fast-accum all --rounds 8 \
        --variants "$FWD_VARIANTS" --forward-side-sms 0 6 --json "$OUT/forward-side-attn.json"
}

stage_block_ncu() {
    step block-exp 200 python3 scripts/exp_block_scaled.py --rounds 6
    # our row-wise GEMM, the block-scaled op and torch's block-wise kernel at BLOCK_NCU_SHAPE
    # (default 16384 x 4096 x 14336; the wide, short-K one: BLOCK_NCU_SHAPE=16384,28672,4096)
    step block-ncu 240 ncu --clock-control none --nvtx --nvtx-include "gemms/" \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section SchedulerStats --section WarpStateStats --section SourceCounters --section LaunchStats \
        --section Occupancy --export "$OUT/block-ncu" python3 scripts/exp_block_scaled.py \
        --once "${BLOCK_NCU_SHAPE:-16384,4096,14336}"
    ncu_pages block-ncu 60 90
}

stage_block_built() {
    step block-built 150 python3 scripts/exp_block_scaled.py --clusters 1x2 --rounds 8
}

stage_attn_beside() {
    step attn-beside-1b 120 python3 scripts/bench_fp8.py --sublayer attention --fast-accum all --rounds 6 \
        --dim 2048 --head-dim 64 --json "$OUT/attn-beside-1b.json"
    step attn-beside-8b 120 python3 scripts/bench_fp8.py --sublayer attention --fast-accum all --rounds 6 \
        --json "$OUT/attn-beside-8b.json"
    local side
    for side in 16 0; do
        step "attn-beside-train-$side" 170 python3 -c "import sys; sys.path.insert(0, 'scripts'); \
from coda_cute.ops import attention_fp8; attention_fp8.SIDE_SMS_QKV_DGRAD = int(sys.argv[1]); \
import bench_train; sys.exit(bench_train.main(sys.argv[2:]))" "$side" --configs 8b --no-compile --no-liger \
            --rounds 6 --fp8-row-fast all --json "$OUT/attn-beside-train-$side.json"
    done
}

stage_attn_verify() {
    step attn-verify-tests 200 python3 -m pytest -q -rfE --tb=short -m gpu -n "$(workers 6)" \
        tests/test_attention_fp8_gpu.py
    step attn-verify-hf 150 python3 -m pytest -q -rfE --tb=short -m gpu tests/test_hf_gpu.py -k fp8
    step attn-verify-memcheck 150 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
        --report-api-errors no python3 scripts/sanitize_fp8.py
    step side-bench-attn 150 python3 scripts/bench_fp8.py --sublayer attention --fast-accum all --rounds 6 \
        --json "$OUT/side-bench-attn.json"
}

stage_block_carry() {
    step block-carry-tests 330 python3 -m pytest -q -rfE --tb=short -m gpu -n "$(workers 6)" \
        tests/test_block_scaled_gpu.py tests/test_mlp_fp8_gpu.py tests/test_attention_fp8_gpu.py \
        tests/test_lm_head_fp8_gpu.py tests/test_fp8_gpu.py
    step block-carry-memcheck 200 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
        --report-api-errors no python3 scripts/sanitize_fp8.py
}

stage_carry_bench() {
    step carry-bench 150 python3 scripts/exp_block_scaled.py --around no-carry 1x2 --rounds 8
}

stage_carry_more() {
    step carry-shapes 150 python3 scripts/exp_block_scaled.py --around no-carry --rounds 8 \
        --shapes 16384,14336,4096 16384,4096,28672 16384,4096,4096 8192,28672,4096 16384,16384,2048
    stage_carry_mlp
}

stage_carry_verify() {
    step carry-verify-tests 150 python3 -m pytest -q -rfE --tb=short -m gpu -n "$(workers 6)" \
        tests/test_mlp_fp8_gpu.py tests/test_block_scaled_gpu.py -k tail_carry
    step carry-verify-memcheck 200 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
        --report-api-errors no python3 scripts/sanitize_fp8.py
}

stage_carry_mlp() {
    step carry-mlp 250 python3 scripts/bench_fp8.py --rounds 6 --json "$OUT/carry-mlp.json"
}

stage_release() {
    step release-tests 200 python3 -m pytest -q -rfE --tb=short -m gpu -n "$(workers 6)" \
        tests/test_block_scaled_gpu.py tests/test_mlp_fp8_gpu.py tests/test_gemm_gpu.py -k "fp8 or block or mlp"
    step release-kernels 60 python3 scripts/exp_block_scaled.py --kernels --shapes 16384,6144,4096 \
        16384,28672,4096 16384,4096,14336 16384,14336,4096 8192,28672,4096 16384,28672,8192
    step release-bench 200 python3 scripts/exp_block_scaled.py --rounds 8 \
        --around late-release one-buffer
    step release-mlp 150 python3 scripts/bench_fp8.py --fast-accum all --rounds 8 --json "$OUT/release-mlp.json"
}

stage_release_more() {
    step release-profile 120 python3 scripts/bench_fp8.py --rounds 8 --profile --json "$OUT/release-profile.json"
    step release-shapes 130 python3 scripts/exp_block_scaled.py --around late-release --rounds 8 --shapes \
        16384,6144,4096 16384,28672,4096 16384,4096,14336 16384,14336,4096 8192,28672,4096
}

stage_torchao() {
    # TORCHAO_VARIANTS: a --variants regex (our variants timed beside torchao's; default all)
    step torchao-mlp 540 python3 scripts/bench_fp8.py --fast-accum all --rounds 8 --json "$OUT/torchao-mlp.json" \
        ${TORCHAO_VARIANTS:+--variants "$TORCHAO_VARIANTS"} ${TORCHAO_SIDE:+--forward-side-sms $TORCHAO_SIDE}
}

stage_compile_times() {
    step compile-times 200 python3 scripts/bench_compile.py --rounds 2 --json "$OUT/compile-times.json"
}

stage_block_k() {
    step block-k 180 python3 scripts/exp_block_scaled.py --clusters 1x2 --rounds 8 \
        --shapes 16384,28672,2048 16384,28672,4096 16384,28672,8192 16384,6144,8192
}

stage_poll() {
    step poll-tests 150 python3 -m pytest -q -rfE --tb=short -m gpu -n 4 tests/test_gemm_gpu.py \
        tests/test_block_scaled_gpu.py -k poll
    step poll-gemms 150 python3 scripts/exp_large_gemms.py --fp8 --rounds 5 --variants ours poll
    step poll-block 100 python3 scripts/exp_block_scaled.py --poll --rounds 8
    step poll-mlp 200 python3 scripts/bench_fp8.py --fast-accum all --rounds 6 --poll --profile \
        --json "$OUT/poll-mlp.json"
}

stage_block_poll() {
    step bpoll-tests 240 python3 -m pytest -q -rfE --tb=short -m gpu -n "$(workers 8)" tests/test_block_scaled_gpu.py \
        tests/test_mlp_fp8_gpu.py tests/test_attention_fp8_gpu.py tests/test_lm_head_fp8_gpu.py
    step bpoll-variants 120 python3 scripts/exp_block_scaled.py --poll --around 1x2 g4 g16 one-buffer --rounds 8
    step bpoll-mlp 130 python3 scripts/bench_fp8.py --fast-accum all --rounds 5 --json "$OUT/bpoll-mlp.json"
    step bpoll-memcheck 100 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
        --report-api-errors no python3 scripts/sanitize_fp8.py
    step bpoll-wgrad 200 python3 scripts/exp_block_scaled.py --wgrad --poll --rounds 4
}

stage_block_energy() {
    step block-energy 200 python3 scripts/exp_block_scaled.py --poll --energy --rounds 6
}

stage_tiles() {
    step tiles-time 200 python3 scripts/exp_large_gemms.py --fp8 --rounds 5 --only gate_up.fwd down.dgrad \
        --variants ours tile "cluster 2x2"
}

stage_epi_k() {
    # the SwiGLU backward tree's cost over its plain GEMM as K (the model width) grows: a ping-pong
    # epilogue longer than the other warpgroup's mainloop shows as a cost that shrinks with K
    step epi-k 240 python3 scripts/exp_swiglu_epilogues.py --fp8-row-fast --rounds 5 --configs 1 \
        --shape 16384,4096,14336 --shape 16384,6144,14336 --shape 16384,8192,14336 --shape 8192,12288,14336
}

stage_epi_k_energy() {
    step epi-k-energy 240 python3 scripts/exp_swiglu_epilogues.py --fp8-row-fast --rounds 5 --configs 1 --energy \
        --shape 16384,4096,14336 --shape 16384,8192,14336
}

stage_active_ncu() {
    # how long each SM holds a CTA against the kernel's span (sm__cycles_active min / avg / max
    # against sm__cycles_elapsed.max): a static persistent schedule whose slots drift apart
    # leaves SMs idle at its end. The down dgrad and gate/up forward (row-wise fast: cuBLAS, our
    # plain GEMM, the pick's tree) and the block-scaled forward form at 16384 x 4096 x 14336.
    local m=gpu__time_duration.sum,sm__cycles_elapsed.max,sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max
    step active-ncu-dgrad 120 ncu --clock-control none --nvtx --nvtx-include "gemms/" --metrics "$m" \
        python3 scripts/exp_swiglu_epilogues.py --fp8-row-fast --configs 1 --once --shape 16384,4096,14336
    step active-ncu-fwd 120 ncu --clock-control none --nvtx --nvtx-include "gemms/" --metrics "$m" \
        python3 scripts/exp_swiglu_epilogues.py --fp8-row-fast --forward --configs 1 --once --shape 16384,4096,14336
    step active-ncu-block 120 ncu --clock-control none --nvtx --nvtx-include "gemms/" --metrics "$m" \
        python3 scripts/exp_block_scaled.py --once
}
stage_tree_ncu() {
    step tree-ncu 300 ncu --clock-control none --nvtx --nvtx-include "gemms/" \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section SchedulerStats --section WarpStateStats --section SourceCounters --section LaunchStats \
        --section Occupancy --export "$OUT/tree-ncu" python3 scripts/exp_swiglu_epilogues.py --fp8-row-fast --configs 1 --once \
        --shape 16384,4096,14336 --shape 16384,8192,14336
    ncu_pages tree-ncu 60 90
}

stage_tree_tiles() {
    step tree-tiles-cap 240 python3 scripts/exp_energy_tiles.py --fused --configs 8b --rounds 4 --run-ms 250 \
        --only "pp128x128 2x1" "coop128x256 2x1" "coop128x192 2x1" "coop128x128 2x1" --json "$OUT/tree-tiles-cap.json"
    step tree-tiles-ncu 150 ncu --clock-control none --nvtx --nvtx-include "gemms/" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
        --metrics sm__cycles_elapsed.avg.per_second,dram__bytes_read.sum,dram__bytes_write.sum \
        python3 scripts/bench_step_gemms.py --configs 8b --once --only coda.lm_head_ce coda.norm_swiglu
    step tree-tiles-time 200 python3 scripts/bench_step_gemms.py --configs 8b --cooperative --rounds 5 \
        --json "$OUT/tree-tiles-time.json"
}

stage_card_picks() {
    step card-picks-tests 300 python3 -m pytest -q -rfE --tb=short -m gpu -n "$(workers 8)" \
        tests/test_coda_block_gpu.py tests/test_rope_backward_gpu.py tests/test_train_gpu.py
    step card-picks-gemms 90 python3 scripts/bench_step_gemms.py --configs 8b --rounds 5 --json "$OUT/card-picks-gemms.json"
    step card-picks-train 400 python3 scripts/bench_train.py --configs 8b --no-compile --no-liger --rounds 5 \
        --fp8-row-fast all --json "$OUT/card-picks-train.json"
}

stage_attn_core() {
    step attn-core-tests 300 python3 -m pytest -q -rfE --tb=short -m gpu -n "$(workers 4)" tests/test_coda_block_gpu.py \
        tests/test_train_gpu.py -k "attention_core or compiled_training_step or graphed"
    step attn-core-memcheck 150 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
        --report-api-errors no python3 scripts/sanitize_backward.py
}

stage_coop128() {
    step coop128-cap 240 python3 scripts/exp_energy_tiles.py --fused --configs 8b --rounds 4 --run-ms 250 \
        --only "pp128x128 2x1" "coop128x256 2x1" "coop128x192 2x1" "coop128x128 2x1" --json "$OUT/coop128-cap.json"
    step coop128-time 200 python3 scripts/bench_step_gemms.py --configs 8b --cooperative --rounds 5 \
        --json "$OUT/coop128-time.json"
}

stage_exp_card() {
    step exp-card-tests 220 python3 -m pytest -q -rfE --tb=short -m gpu -n "$(workers 8)" tests/test_coda_block_gpu.py \
        -k "lm_head"
    step exp-card-gemms 90 python3 scripts/bench_step_gemms.py --configs 8b --rounds 5 --json "$OUT/exp-card-gemms.json"
    step exp-card-train 260 python3 scripts/bench_train.py --configs 8b --no-compile --no-liger --rounds 4 \
        --json "$OUT/exp-card-train.json"
}

stage_swiglu_bwd_ncu() {
    step swiglu-bwd-ncu 200 ncu --clock-control none --nvtx --nvtx-include "gemms/" \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section SchedulerStats --section WarpStateStats --section SourceCounters --section LaunchStats \
        --section Occupancy --export "$OUT/swiglu-bwd-ncu" \
        python3 scripts/bench_step_gemms.py --configs 8b --once --only coda.swiglu_backward
    ncu_pages swiglu-bwd-ncu 60 90
}

stage_swiglu_ring() {
    step swiglu-ring 240 env CODA_CUTE_CACHE_DIR=0 python3 scripts/exp_load_ring.py --shapes 8b
}

stage_swiglu_sub() {
    step swiglu-sub 240 python3 scripts/exp_swiglu_epilogues.py --configs 1 --rounds 8 --shape 16384,4096,14336
}

stage_side_mlp() {
    step side-mlp-tests 200 python3 -m pytest -q -m gpu -n "$(workers 6)" tests/test_mlp_fp8_gpu.py
    step side-mlp 200 python3 scripts/bench_fp8.py --fast-accum all --rounds 6 --side-sms 0,0 0,16 4,6 12,12 \
        --json "$OUT/side-mlp.json"
    step side-memcheck 150 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
        --report-api-errors no python3 scripts/sanitize_fp8.py
}

stage_beside_tests() {
    step beside-tests 200 python3 -m pytest -q -m gpu -n "$(workers 6)" tests/test_mlp_fp8_gpu.py \
        tests/test_attention_fp8_gpu.py tests/test_epilogue_gpu.py -k "beside or row-wise or launching_on"
}

stage_side_bench_8b() {
    # shellcheck disable=SC2086
    step side-bench 150 python3 scripts/bench_fp8.py --fast-accum all --rounds 6 --side-sms ${SIDE_PAIRS:-0,0 4,6 6,8 12,12} \
        --json "$OUT/side-bench.json"
}

stage_side_bench() {
    stage_side_bench_8b
    step side-bench-1b 180 python3 scripts/bench_fp8.py --fast-accum all --rounds 6 --dim 2048 --ffn 8192 \
        --side-sms 0,0 4,6 --json "$OUT/side-bench-1b.json"
    step side-bench-attn 150 python3 scripts/bench_fp8.py --sublayer attention --fast-accum all --rounds 6 \
        --json "$OUT/side-bench-attn.json"
}

stage_side() {
    step side 200 python3 scripts/exp_side_stream.py --rounds 8
}

stage_swiglu_raster() {
    local around=(--raster 2 --raster 4 --raster 16 --raster 32 --cluster 1x2 --cluster 2x2 --cluster 1x1
                  --split 2 --split 4)
    step swiglu-raster 200 python3 scripts/exp_swiglu_epilogues.py --configs 1 --rounds 8 \
        --shape 16384,4096,14336 "${around[@]}"
    step swiglu-raster-ncu 150 ncu --clock-control none --nvtx --nvtx-include "gemms/" \
        --metrics gpu__time_duration.sum,sm__cycles_elapsed.max,smsp__cycles_elapsed.avg.per_second,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
        python3 scripts/exp_swiglu_epilogues.py --once --configs 1 --shape 16384,4096,14336 "${around[@]}"
}

stage_tree_tiles_more() {
    local only=("pp128x128 2x1" "coop128x256 2x1" "coop128x192 2x1" "coop128x128 2x1")
    step tree-tiles-1b 170 python3 scripts/exp_energy_tiles.py --fused --configs 1b --rounds 4 --run-ms 250 \
        --only "${only[@]}" --json "$OUT/tree-tiles-1b.json"
    step tree-tiles-fp8 200 python3 scripts/exp_energy_tiles.py --fused --fp8 --configs 8b --rounds 4 --run-ms 250 \
        --only "${only[@]}" --json "$OUT/tree-tiles-fp8.json"
    step tree-tiles-3b 200 python3 scripts/exp_energy_tiles.py --fused --configs 3b --rounds 4 --run-ms 250 \
        --only "${only[@]}" --json "$OUT/tree-tiles-3b.json"
}

stage_drift() {
    step drift-time 200 python3 scripts/exp_large_gemms.py --fp8 --rounds 5 --only gate_up.fwd down.dgrad \
        --variants ours split --split 2 4 8
    step drift-ncu 150 ncu --clock-control none --nvtx --nvtx-include "gemms/" \
        --metrics gpu__time_duration.sum,sm__cycles_elapsed.max,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
        python3 scripts/exp_large_gemms.py --fp8 --only gate_up.fwd down.dgrad --variants ours split --split 4 8 --once
}

stage_cluster22_mlp() {
    step cluster22-mlp-tests 150 python3 -m pytest -q -rfE --tb=short -m gpu tests/test_mlp_fp8_gpu.py -k two_by_two
    step cluster22-mlp 150 python3 scripts/bench_fp8.py --fast-accum all --rounds 6 --profile --json "$OUT/cluster22-mlp.json"
}

stage_card_gemms() {
    step card-gemms-step 250 python3 scripts/bench_step_gemms.py --configs 8b --rounds 6 --energy \
        --json "$OUT/card-gemms-step.json"
    step card-gemms-tiles 250 python3 scripts/exp_energy_tiles.py --configs 8b --rounds 5 --run-ms 300 \
        --json "$OUT/card-gemms-tiles.json"
    step card-gemms-fit 30 python3 scripts/exp_energy_tiles.py --fit "$OUT/card-gemms-tiles.json"
}

stage_verify() {
    step verify-tests 220 python3 -m pytest -q -rfE --tb=short -m gpu -n "$(workers 12)" tests/test_gemm_gpu.py \
        tests/test_block_scaled_gpu.py tests/test_mlp_fp8_gpu.py tests/test_epilogue_quantize_gpu.py \
        tests/test_fp8_gpu.py tests/test_embedding_gpu.py tests/test_lm_head_fp8_gpu.py tests/test_ce_grad_gpu.py
}

stage_verify_more() {
    stage_verify_lm_head
    step verify-memcheck 100 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
        --report-api-errors no python3 scripts/sanitize_fp8.py
}

stage_perf() {
    step train-fp8 180 python3 scripts/bench_train.py --configs 8b --no-compile --rounds 6 --fp8-row-fast all \
        --json "$OUT/train-fp8.json"
    step perf-waves 150 python3 scripts/exp_wave_promotion.py --rounds 6 --mlp --mlp-rounds 5
    step perf-mlp-fp8 60 python3 scripts/bench_fp8.py --fast-accum all --rounds 10 --json "$OUT/mlp-fp8.json"
}

stage_emb() {
    step emb-tests 120 python3 -m pytest -q -rfE --tb=long -m gpu -n 4 tests/test_embedding_gpu.py
}

stage_verify_rest() {
    step verify-rest 450 python3 -m pytest -q -rfE --tb=short -m gpu -n "$(workers 12)" tests/test_coda_block_gpu.py \
        tests/test_rope_backward_gpu.py tests/test_train_gpu.py tests/test_fold_gpu.py tests/test_epilogue_gpu.py tests/test_attention_fp8_gpu.py \
        tests/test_sol_gpu.py
}

stage_sol() {
    step sol-tests 200 python3 -m pytest -q -rfE --tb=short -m gpu tests/test_sol_gpu.py
}

stage_verify_lm_head() {
    step verify-lm-head 150 python3 -m pytest -q -rfE --tb=short -m gpu -n 6 tests/test_coda_block_gpu.py \
        -k "lm_head or model_gradients or plain_llama_block or lse_combine"
}

stage_verify_hf() {
    step verify-hf 150 python3 -m pytest -q -rfE --tb=short -m gpu -n 4 tests/test_hf_gpu.py
}

stage_wgrad_rates() {
    step wgrad-rates 230 env CODA_CUTE_CACHE_DIR=0 python3 scripts/exp_block_scaled.py --wgrad --rounds 6
}

stage_mlp_profile() {
    step mlp-profile 120 python3 scripts/bench_fp8.py --fast-accum all --rounds 6 --profile --json "$OUT/mlp-profile.json"
}

stage_gemm() {
    step gemm-tests 300 python3 -m pytest -q -m gpu -n 6 tests/test_gemm_gpu.py
}

stage_rope_ncu() {
    # the first shape's warm-up launches 2 ops and the swept kernels once each: skip those
    local skip
    skip=$(python3 -c "import sys; sys.path.insert(0, 'scripts'); import bench_rope_backward as b; \
print(2 + sum(len(t) for (q, hd), t in b.SWEEP.items() if hd == b.SHAPES[0][4]))")
    step rope-ncu 500 ncu --clock-control none --kernel-name regex:RopeBackward --launch-skip "$skip" \
        --launch-count "$skip" --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
        python3 scripts/bench_rope_backward.py --once --sweep
}

stage_targets() {
    stage_train_compile
    stage_mlp_profile
    stage_block_built
}

# the stages the header lists, each run by its function stage_<name, - as _>; an unknown one is
# refused before any set-up
STAGES=$(sed -n '/^# Stages:/,/^set -u/s/^#   \([a-z][a-z0-9-]*\) .*/\1/p' "$0" | tr '\n' ' ')
for s in "$@"; do
    case " $STAGES " in
        *" $s "*) ;;
        *) echo "unknown stage $s ($STAGES)"
           exit 2 ;;
    esac
done
setup
for s in "$@"; do
    "stage_${s//-/_}"
done
for name in "${LOGS[@]}"; do
    echo "---------------- $name"
    tail -n 25 "$OUT/$name.log"
done
# at most 8 files come back from a device call: the logs, JSON and CSV go back as one archive
# (nullglob: a run without JSON still archives its logs; ls of the unmatched pattern failed the chain)
(cd "$OUT" && shopt -s nullglob && files=(./*.log ./*.json ./*.csv) && tar czf logs.tgz "${files[@]}" && rm -f "${files[@]}")
