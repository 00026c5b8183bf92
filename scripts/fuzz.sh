#!/usr/bin/env bash
# Fuzzes the kvpack reader, the config parser and the handoff receiver with
# libFuzzer for a bounded time each.
#
#   bash scripts/fuzz.sh [seconds] [pack|config|handoff|all]   (default 120 s, all)
#
# Builds fuzz/pack_reader_fuzz.cc, fuzz/config_fuzz.cc and
# fuzz/handoff_receiver_fuzz.cc and every library they use with clang
# -fsanitize=fuzzer,address,undefined into build-fuzz/ (Debian's clang and
# libclang-rt-14-dev, which scripts/setup.sh installs).
# The pack reader starts from a seed corpus of valid and hostile packs
# (fuzz/make_seed_corpus.cc), the config parser from fuzz/config_seeds/,
# the handoff receiver from a recorded session that its inputs edit;
# fuzz/regressions/ and fuzz/config_regressions/ hold inputs that once
# failed, which run first, every time.
# Each target runs on all cores for the given time. Exits non-zero on a
# crash, a hang (10 s per input), a leak or a sanitizer report; the failing
# input is left in build-fuzz/<target>/ (crash-*, timeout-*, leak-*).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-120}"
which="${2:-all}"
case "$seconds" in
  ''|*[!0-9]*) echo "usage: scripts/fuzz.sh [seconds] [pack|config|handoff|all]" >&2; exit 2 ;;
esac
case "$which" in
  pack|config|handoff|all) ;;
  *) echo "usage: scripts/fuzz.sh [seconds] [pack|config|handoff|all]" >&2; exit 2 ;;
esac
if ! command -v clang++ >/dev/null 2>&1; then
  echo "fuzz: clang++ not found; run scripts/setup.sh first" >&2
  exit 2
fi
out=build-fuzz
CXX=clang++ cmake -S . -B "$out" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVRING_FUZZ=ON \
  -DKVRING_TESTS=OFF -DKVRING_CUDA=OFF >/dev/null
cmake --build "$out" -j"$(nproc)" --target kvring-pack-fuzz kvring-pack-seeds kvring-config-fuzz kvring-handoff-fuzz
jobs="$(nproc)"
root="$(pwd)"

# run_target NAME BINARY MAX_LEN SEED_DIR...: fuzzes into build-fuzz/NAME/.
run_target() {
  local name="$1" binary="$2" max_len="$3"
  shift 3
  mkdir -p "$out/$name/corpus"
  (
    cd "$out/$name"
    rm -f crash-* timeout-* leak-* oom-* slow-unit-*
    # -fork runs one fuzzing process per core and stops at the first failure.
    set +e
    "$root/$out/fuzz/$binary" -fork="$jobs" -ignore_crashes=0 -ignore_timeouts=0 -ignore_ooms=0 \
      -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len="$max_len" \
      -print_final_stats=1 corpus "$@" 2>&1 | tee fuzz.log |
      grep --line-buffered -E "^#[0-9]+: cov|INFO: fuzzed|ERROR|SUMMARY|runtime error"
    status="${PIPESTATUS[0]}"
    set -e
    if [ "$status" -ne 0 ] || grep -qE "ERROR: (libFuzzer|AddressSanitizer|UndefinedBehaviorSanitizer|LeakSanitizer)|runtime error:" fuzz.log; then
      echo "fuzz: $name FAILED (exit $status); see $out/$name/fuzz.log and the crash-*/timeout-* input in $out/$name" >&2
      exit 1
    fi
    echo "fuzz: $name: ${seconds} s on ${jobs} cores, no crash, hang, leak or sanitizer report ($(ls corpus | wc -l) corpus inputs)"
  )
}

if [ "$which" = pack ] || [ "$which" = all ]; then
  rm -rf "$out/pack/seeds"
  mkdir -p "$out/pack/seeds"
  "$out/fuzz/kvring-pack-seeds" "$out/pack/seeds"
  run_target pack kvring-pack-fuzz 32768 seeds "$root/fuzz/regressions"
fi
if [ "$which" = config ] || [ "$which" = all ]; then
  run_target config kvring-config-fuzz 16384 "$root/fuzz/config_seeds" "$root/fuzz/config_regressions"
fi
if [ "$which" = handoff ] || [ "$which" = all ]; then
  # Inputs are edits to a recorded session (fuzz/handoff_receiver_fuzz.cc).
  run_target handoff kvring-handoff-fuzz 4096
fi
