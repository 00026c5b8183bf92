#!/usr/bin/env bash
# One device call: the CUDA tests, kvring-bench, the handoff bench, the SDPA
# peer and compute-sanitizer over the CUDA tests, each log under $OUT.
#   bash bench/run_device.sh BIN_DIR [STEPS]
# BIN_DIR holds kvring_cuda_tests, kvring-bench and kvring-handoff-cuda-bench
# built with -DKVRING_STATIC_DEPS=ON (and the kvring tool; the handoff pieces
# link libucx's shared libraries unless built with -DKVRING_UCX=OFF); STEPS
# is a subset of "tests bench batch handoff sdpa cli handoff-cli pair memcheck
# initcheck ncu racecheck racecheck-paths racecheck-sinks" (default: all but
# racecheck-paths and racecheck-sinks;
# "bench" runs every part of kvring-bench, "batch" only the many-sequence
# parts). With UCX built in, LIB_DIR (default BIN_DIR/../lib) may hold
# libucx's shared libraries for a machine that lacks them.
set -uo pipefail
bin=$1
steps=${2:-"tests bench handoff sdpa cli memcheck initcheck ncu racecheck"}
# SAN_FILTER (a --gtest_filter=...) overrides the sanitizers' test filter,
# SAN_LIMIT their time limit in seconds.
# Logs go to a scratch folder, packed into $OUT/logs.tgz after every step
# (few files come back from a device call, and a step may be cut short);
# a later run of this script in the same call packs into logs-2.tgz, and
# so on, never over an earlier run's logs.
dest=${OUT:-/tmp/out}
out=$(mktemp -d)
mkdir -p "$dest"
archive=$dest/logs.tgz
for n in $(seq 2 99); do [ -e "$archive" ] || break; archive=$dest/logs-$n.tgz; done
here=$(cd "$(dirname "$0")" && pwd)
lib=${LIB_DIR:-$bin/../lib}
[ -d "$lib" ] && export LD_LIBRARY_PATH="$(cd "$lib" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/device.txt"
# The sweep over 2^32 inputs has no memory traffic to check, and the test
# that spends the device's memory makes every cudaMalloc fail on purpose
# (each an API error to the sanitizer); sanitizers skip both.
san_filter='--gtest_filter=-*F16ConversionMatchesTheSharedFunctionOnEveryInput*:*WhenMemoryIsSpent*'
for step in $steps; do
  echo "=== $step"
  case $step in
    tests) timeout 300 "$bin/kvring_cuda_tests" 2>&1 | tee "$out/tests.log" | grep -E "^\[  (FAILED|PASSED) |worst|Failure|error" ;;
    bench) timeout 300 "$bin/kvring-bench" --json "$out/bench.json" 2>&1 | tee "$out/bench.log" | tail -40 ;;
    batch) for part in batch step memory; do
             timeout 200 "$bin/kvring-bench" --only $part --json "$out/bench-$part.json" 2>&1 | tee "$out/bench-$part.log"
           done ;;
    handoff) timeout 240 "$bin/kvring-handoff-cuda-bench" --json "$out/handoff.json" 2>&1 | tee "$out/handoff.log" | tail -8 ;;
    cli) timeout 120 cmake -DKVRING="$bin/kvring" -P "$here/../tests/cli_run_cuda_test.cmake" 2>&1 | tee "$out/cli.log" | tail -3
         echo "exit ${PIPESTATUS[0]}"
         "$bin/kvring" run --model muse-glimmer --tokens 2100 --prompt-tokens 2050 --context 4096 --chunk 512 --backend cuda --no-progress 2>&1 | tee -a "$out/cli.log" | tail -12 ;;
    handoff-cli)
      # The serve + run --handoff-to pair across processes, on the GPU, over UCX.
      # UCX=0 for a kvring built without the UCX transport: the pairs over
      # Unix sockets run, those over UCX are skipped (exit 77).
      timeout 200 bash "$here/../tests/handoff_cli_test.sh" "$bin/kvring" "$out/handoff-cli" cuda "${UCX:-1}" \
        > "$out/handoff-cli.log" 2>&1
      echo "exit $?"; tail -5 "$out/handoff-cli.log" ;;
    pair)
      # muse-glimmer at 32768 prompt tokens: the pair across processes prints
      # the summary of one run that never moved.
      m=(--model muse-glimmer --hidden 32 --vocab 64 --seed 11 --prompt-tokens 32768 --context 33000 --backend cuda --no-progress)
      p=$out/pair
      mkdir -p "$p"
      timeout 100 "$bin/kvring" run "${m[@]}" --tokens 32800 --json > "$p/ref.json" 2> "$p/ref.err"
      echo "reference exit $?"
      rm -f "$p/port"
      "$bin/kvring" handoff serve --listen 127.0.0.1:0 --port-file "$p/port" --tokens 32800 --json --backend cuda \
        --timeout 60 > "$p/serve.json" 2> "$p/serve.err" &
      spid=$!
      for _ in $(seq 100); do [ -s "$p/port" ] && break; sleep 0.1; done
      /usr/bin/time -f "sender %e s" timeout 100 "$bin/kvring" run "${m[@]}" --handoff-to "127.0.0.1:$(cat "$p/port")" \
        > "$p/send.out" 2> "$p/send.err"
      echo "sender exit $?"; wait $spid; echo "serve exit $?"
      for f in ref.json serve.json; do grep -o '"logits_sha256":"[0-9a-f]*"\|"generated":\[[^]]*\]' "$p/$f" | tr '\n' ' '; echo; done
      tail -3 "$p/send.err" "$p/serve.err" ;;
    racecheck-paths)
      # The combine-path test's nine paths in parallel processes, and the
      # batch test beside them.
      for path in 0 1 2 3 4 5 6 7 8; do
        KVRING_TEST_QUICK=1 KVRING_COMBINE_PATH=$path timeout 540 stdbuf -oL compute-sanitizer --tool racecheck --error-exitcode 9 \
          "$bin/kvring_cuda_tests" --gtest_filter=CudaBatch.EveryCombinePathGivesTheSameBits > "$out/race-path$path.log" 2>&1 &
      done
      KVRING_TEST_QUICK=1 timeout 540 compute-sanitizer --tool racecheck --error-exitcode 9 \
        "$bin/kvring_cuda_tests" --gtest_filter=CudaBatch.BatchesEqualSoloRunsAndTheCpuBackend > "$out/race-batches.log" 2>&1 &
      wait
      grep -H -E "ERROR SUMMARY|RACECHECK SUMMARY|^\[  (FAILED|PASSED) " "$out"/race-*.log ;;
    racecheck-sinks)
      # The sinks test's six cases in parallel processes.
      for case in tc_gqa8_f32 tc_gqa8_f16 tc_group12_f32 tc_group12_f16 hd64_f32 hd17_f32; do
        KVRING_TEST_QUICK=1 timeout ${SAN_LIMIT:-540} stdbuf -oL compute-sanitizer --tool racecheck --error-exitcode 9 \
          "$bin/kvring_cuda_tests" --gtest_filter="Cases/CudaSinksEveryKernel.*/$case" > "$out/race-sinks-$case.log" 2>&1 &
      done
      wait
      grep -H -E "ERROR SUMMARY|RACECHECK SUMMARY|^\[  (FAILED|PASSED) " "$out"/race-sinks-*.log ;;
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
      limit=${SAN_LIMIT:-$limit}
      # The tests provoke runtime API errors on purpose (forged IPC handles,
      # a caller's failed cudaMalloc left pending) and check every status
      # the store returns; the sanitizer reports the kernels' and copies'
      # accesses.
      KVRING_TEST_QUICK=1 timeout $limit compute-sanitizer --tool "$step" --report-api-errors no --error-exitcode 9 \
        "$bin/kvring_cuda_tests" "$filter" > "$out/$step.log" 2>&1
      echo "exit $?"; grep -E "ERROR SUMMARY|^\[  (FAILED|PASSED) " "$out/$step.log" | tail -4 ;;
  esac
  tar czf "$archive" -C "$out" .
done
