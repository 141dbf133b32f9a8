#!/usr/bin/env bash
# Liger-Kernel 0.8.5 for a device call, in .wheels/ (git-ignored): its installed files as one xz
# archive (carry_archive.sh), without its Ascend NPU backend (liger_kernel/ops/backends/_ascend:
# registered only for NPUs, so a CUDA run imports the same modules and runs the same Triton
# kernels), with pytest-xdist and execnet beside it. As zip wheels the three took 0.88 MB and a
# call carrying them with the DSL pack and the 2.4 MB tree was refused as over 64 MiB (2026-12-07);
# the archive is 0.41 MB.
#
#     bash scripts/liger_wheel.sh      # then carry [".dsl", ".wheels"]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/carry_archive.sh
source scripts/carry_archive.sh
rm -rf .wheels && mkdir -p .wheels
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps -d "$work" liger-kernel==0.8.5 pytest-xdist==3.8.0 execnet==2.1.2
python3 -m pip install -q --no-deps --no-compile --target "$work/site" "$work"/*.whl
rm -rf "$work/site/liger_kernel/ops/backends/_ascend" "$work/site/bin"
archive_site "$work/site" .wheels/liger-xdist-site.tar.xz
ls -l .wheels
carry_report .wheels
