#!/usr/bin/env bash
# torchao 0.17.0's float8 training for a device call that also carries the DSL pack, in
# .wheels-ao/ (git-ignored), so that bench_fp8.py times torchao in the same turns as ours. The
# full wheel (3.2 MB: two CUDA extensions of 13.5 MB unpacked, which float8 training never loads;
# torchao only warns that they are missing) does not fit beside the pack and the working tree in
# a call's 64 MiB. This one keeps the Python sources torchao imports for float8 training (the
# tensor-wise and row-wise recipes): everything outside torchao/prototype, and of the prototypes
# the ones the package's __init__ imports. Its prototype block-wise recipe is left out: beside our
# DSL 4.8.1 it does not import (its quantizers import torchao's CuTe DSL kernels wherever cutlass
# imports, and those need a module 4.8.1 lacks), so bench_fp8.py leaves its row out either way.
# Its files travel as one xz archive (carry_archive.sh); the script prints what the carry leaves.
#
#     bash scripts/torchao_wheel.sh    # then carry [".dsl", ".wheels-ao"]: no Liger in that call
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/carry_archive.sh
source scripts/carry_archive.sh
version=0.17.0
wheel=torchao-$version-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
rm -rf .wheels-ao && mkdir -p .wheels-ao
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps -d "$work" "torchao==$version"
(cd "$work" && mkdir x site && cd x && unzip -q "../$wheel" \
    && { find torchao -name '*.py' \( -not -path 'torchao/prototype/*' \
            -o -path 'torchao/prototype/__init__.py' -o -path 'torchao/prototype/custom_fp_utils.py' \
            -o -path 'torchao/prototype/quantization/*' \); \
         find "torchao-$version.dist-info" -type f; } | tar cf - -T - | tar xf - -C ../site)
archive_site "$work/site" ".wheels-ao/torchao-$version-site.tar.xz"
ls -l .wheels-ao
carry_report .wheels-ao
