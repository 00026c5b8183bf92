#!/usr/bin/env bash
# The main job from a fresh machine: dependencies, build, then what a user
# wants from kvring: the footprint of the reference model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
echo
./build/kvring footprint --model muse-glimmer
echo
./build/kvring footprint --model muse-glimmer --context 131072 --slots 4
