#!/usr/bin/env bash
# One device call: the CUDA tests, kvring-bench, the handoff bench, the SDPA
# peer and compute-sanitizer over the CUDA tests, each log under $OUT.
#   bash bench/run_device.sh BIN_DIR [STEPS]
# BIN_DIR holds kvring_cuda_tests, kvring-bench and kvring-handoff-cuda-bench
# built with -DKVRING_STATIC_DEPS=ON (and the kvring tool; the handoff pieces
# link libucx's shared libraries unless built with -DKVRING_UCX=OFF); STEPS
# is a subset of "tests bench batch handoff sdpa cli memcheck initcheck ncu
# racecheck" (default: all; "bench" runs every part of kvring-bench, "batch"
# only the many-sequence parts).
set -uo pipefail
bin=$1
steps=${2:-"tests bench handoff sdpa cli memcheck initcheck ncu racecheck"}
# SAN_FILTER (a --gtest_filter=...) overrides the sanitizers' test filter.
# Logs go to a scratch folder, packed into $OUT/logs.tgz after every step
# (few files come back from a device call, and a step may be cut short).
dest=${OUT:-/tmp/out}
out=$(mktemp -d)
mkdir -p "$dest"
here=$(cd "$(dirname "$0")" && pwd)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/device.txt"
# The sweep over 2^32 inputs has no memory traffic to check; sanitizers skip it.
san_filter='--gtest_filter=-*F16ConversionMatchesTheSharedFunctionOnEveryInput*'
for step in $steps; do
  echo "=== $step"
  case $step in
    tests) timeout 200 "$bin/kvring_cuda_tests" 2>&1 | tee "$out/tests.log" | grep -E "^\[  (FAILED|PASSED) |worst|Failure|error" ;;
    bench) timeout 300 "$bin/kvring-bench" --json "$out/bench.json" 2>&1 | tee "$out/bench.log" | tail -40 ;;
    batch) for part in batch step memory; do
             timeout 200 "$bin/kvring-bench" --only $part --json "$out/bench-$part.json" 2>&1 | tee "$out/bench-$part.log"
           done ;;
    handoff) timeout 240 "$bin/kvring-handoff-cuda-bench" --json "$out/handoff.json" 2>&1 | tee "$out/handoff.log" | tail -8 ;;
    cli) timeout 120 cmake -DKVRING="$bin/kvring" -P "$here/../tests/cli_run_cuda_test.cmake" 2>&1 | tee "$out/cli.log" | tail -3
         echo "exit ${PIPESTATUS[0]}"
         "$bin/kvring" run --model muse-glimmer --tokens 2100 --prompt-tokens 2050 --context 4096 --chunk 512 --backend cuda --no-progress 2>&1 | tee -a "$out/cli.log" | tail -12 ;;
    ncu) timeout 120 ncu --clock-control none -k regex:attend_hd128 --launch-skip 30 --launch-count 1 \
           --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
           --section WarpStateStats --section LaunchStats "$bin/kvring-bench" --quick --only decode \
           > "$out/ncu.log" 2>&1; echo "exit $?"; grep -E "Duration|Throughput|Registers|Warp Cycles|Achieved Occupancy|Stall" "$out/ncu.log" | head -30 ;;
    sdpa) PYTHONUNBUFFERED=1 timeout 120 python3 "$here/sdpa_peer.py" --json "$out/sdpa.json" 2>&1 | tee "$out/sdpa.log" ;;
    memcheck|initcheck|racecheck)
      # racecheck tracks shared memory, which only the attention kernels use.
      filter=$san_filter
      [ "$step" = racecheck ] && filter='--gtest_filter=CudaBatch.*'
      filter=${SAN_FILTER:-$filter}
      # racecheck needs about 5 minutes for the attention tests.
      limit=150
      [ "$step" = racecheck ] && limit=450
      KVRING_TEST_QUICK=1 timeout $limit compute-sanitizer --tool "$step" --error-exitcode 9 \
        "$bin/kvring_cuda_tests" "$filter" > "$out/$step.log" 2>&1
      echo "exit $?"; grep -E "ERROR SUMMARY|^\[  (FAILED|PASSED) " "$out/$step.log" | tail -4 ;;
  esac
  tar czf "$dest/logs.tgz" -C "$out" .
done
