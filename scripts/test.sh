#!/usr/bin/env bash
# The whole test suite from a fresh machine: dependencies, build, tests.
# The CPU exactness gate at muse-glimmer's full geometry carries the label
# "slow" (minutes on two cores); `bash scripts/test.sh --quick` skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
labels=()
if [ "${1:-}" = "--quick" ]; then labels=(-LE slow); fi
bash scripts/setup.sh
bash scripts/build.sh
cd build
ctest --output-on-failure -j"$(nproc)" --timeout 900 "${labels[@]}"
