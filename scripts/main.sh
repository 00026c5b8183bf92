#!/usr/bin/env bash
# The main job from a fresh machine: dependencies, build, then what a user
# wants from kvring: the footprint of the reference geometry and a session of
# the reference model over a kvring cache (on the GPU where one is visible).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
echo
./build/kvring footprint --model muse-glimmer
echo
./build/kvring footprint --model muse-glimmer --context 131072 --slots 4
echo
./build/kvring run --model muse-glimmer --tokens 320 --prompt-tokens 256 --chunk 128
