#!/usr/bin/env bash
# Fuzzes the kvpack reader with libFuzzer for a bounded time.
#
#   bash scripts/fuzz.sh [seconds]      (default 120)
#
# Builds fuzz/pack_reader_fuzz.cc and every library it uses with clang
# -fsanitize=fuzzer,address,undefined into build-fuzz/ (Debian's clang and
# libclang-rt-14-dev, which scripts/setup.sh installs), writes a seed corpus
# of valid packs, and runs the fuzzer on all cores for the given time. Exits
# non-zero on a crash, a hang (10 s per input), a leak or a sanitizer report;
# the failing input is left in build-fuzz/ (crash-*, timeout-*, leak-*).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-120}"
case "$seconds" in
  ''|*[!0-9]*) echo "usage: scripts/fuzz.sh [seconds]" >&2; exit 2 ;;
esac
if ! command -v clang++ >/dev/null 2>&1; then
  echo "fuzz: clang++ not found; run scripts/setup.sh first" >&2
  exit 2
fi
out=build-fuzz
CXX=clang++ cmake -S . -B "$out" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVRING_FUZZ=ON \
  -DKVRING_TESTS=OFF -DKVRING_CUDA=OFF >/dev/null
cmake --build "$out" -j"$(nproc)" --target kvring-pack-fuzz kvring-pack-seeds
rm -rf "$out/seeds"
mkdir -p "$out/seeds" "$out/corpus"
"$out/fuzz/kvring-pack-seeds" "$out/seeds"
jobs="$(nproc)"
cd "$out"
rm -f crash-* timeout-* leak-* oom-* slow-unit-*
# -fork runs one fuzzing process per core and stops at the first failure.
# fuzz/regressions holds inputs that once failed; they run first, every time.
set +e
./fuzz/kvring-pack-fuzz -fork="$jobs" -ignore_crashes=0 -ignore_timeouts=0 -ignore_ooms=0 \
  -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=32768 \
  -print_final_stats=1 corpus seeds ../fuzz/regressions 2>&1 | tee fuzz.log |
  grep --line-buffered -E "^#[0-9]+: cov|INFO: fuzzed|ERROR|SUMMARY|runtime error"
status="${PIPESTATUS[0]}"
set -e
if [ "$status" -ne 0 ] || grep -qE "ERROR: (libFuzzer|AddressSanitizer|UndefinedBehaviorSanitizer|LeakSanitizer)|runtime error:" fuzz.log; then
  echo "fuzz: FAILED (exit $status); see $out/fuzz.log and the crash-*/timeout-* input in $out" >&2
  exit 1
fi
echo "fuzz: ${seconds} s on ${jobs} cores, no crash, hang, leak or sanitizer report ($(ls corpus | wc -l) corpus inputs)"
