#!/usr/bin/env bash
# Liger-Kernel 0.8.5's wheel for a device call, in .wheels/ (git-ignored), without its Ascend NPU
# backend (liger_kernel/ops/backends/_ascend: registered only for NPUs, so a CUDA run imports the
# same modules and runs the same Triton kernels). The full wheel (910 KB) left the carry about
# 0.1 MiB over its 64 MiB beside the DSL pack built with apache-tvm-ffi and the working tree
# (2026-12-07); this one is 792 KB. The pure-Python wheels gpu_session.sh installs come with it.
# By the fiftieth session the tree had grown to 2.4 MB and a call carrying [".dsl", ".wheels"] was
# refused as over 64 MiB again: a call that needs only pytest-xdist carries .wheels without the
# Liger wheel (moved aside), and the training table's Liger column waits for a smaller one.
#
#     bash scripts/liger_wheel.sh      # then carry [".dsl", ".wheels"]
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .wheels
out=$(pwd)/.wheels
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps -d "$work" liger-kernel==0.8.5 pytest-xdist execnet
cp "$work"/pytest_xdist-*.whl "$work"/execnet-*.whl "$out"/
(cd "$work" && mkdir x && cd x && unzip -q ../liger_kernel-0.8.5-py3-none-any.whl \
    && rm -rf liger_kernel/ops/backends/_ascend \
    && zip -q -9 -r "$out/liger_kernel-0.8.5-py3-none-any.whl" liger_kernel liger_kernel-0.8.5.dist-info)
ls -l .wheels
