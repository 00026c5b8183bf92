#!/usr/bin/env bash
# The test suite from a fresh machine: dependencies, build, tests.
# `bash scripts/test.sh --full` also runs the tests labelled "slow" (the CPU
# exactness gate at muse-glimmer's full geometry, tens of minutes on two
# cores).
set -euo pipefail
cd "$(dirname "$0")/.."
labels=(-LE slow)
if [ "${1:-}" = "--full" ]; then labels=(); fi
bash scripts/setup.sh
bash scripts/build.sh
cd build
ctest --output-on-failure -j"$(nproc)" --timeout 900 "${labels[@]}"
