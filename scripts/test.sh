#!/usr/bin/env bash
# The whole test suite from a fresh machine: dependencies, build, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
cd build
ctest --output-on-failure -j"$(nproc)" --timeout 900
