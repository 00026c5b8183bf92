#!/usr/bin/env bash
# Installs kvring's build and test dependencies from Debian's packages
# (Debian 12). Does nothing when they are already there.
set -euo pipefail

packages=(
  cmake ninja-build g++ pkg-config
  libgtest-dev          # tests
  nlohmann-json3-dev    # config.json parsing
  libssl-dev            # SHA-256 (OpenSSL)
  libhiredis-dev        # Redis chunk store
  redis-server          # Redis chunk store tests (started on loopback)
  libucx-dev            # handoff transport between processes (UCX)
  ucx-utils             # ucx_perftest: the transport's own throughput (docs/PERFORMANCE.md)
  clang libclang-rt-14-dev  # libFuzzer target for the pack reader
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "setup: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
