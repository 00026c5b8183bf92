# Runs the kvring tool: the footprint figures, and non-zero exits with a clear
# message for bad arguments.
function(run_expect expect_ok pattern)
  execute_process(COMMAND ${KVRING} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(expect_ok AND NOT rc EQUAL 0)
    message(FATAL_ERROR "kvring ${ARGN}: exit ${rc}: ${err}")
  endif()
  if(NOT expect_ok AND rc EQUAL 0)
    message(FATAL_ERROR "kvring ${ARGN}: expected a failure, got exit 0: ${out}")
  endif()
  if(NOT "${out}${err}" MATCHES "${pattern}")
    message(FATAL_ERROR "kvring ${ARGN}: output does not match '${pattern}':\n${out}${err}")
  endif()
endfunction()

run_expect(TRUE "53,248 B" footprint --model muse-glimmer --context 131072 --slots 4)
run_expect(TRUE "81,788,928 B" footprint --model muse-glimmer --context 131072 --slots 4)
run_expect(TRUE "1,744,830,464 B" footprint --model muse-glimmer --context 131072 --slots 4)
run_expect(TRUE "1,826,619,392 B" footprint --model muse-glimmer --context 131072 --slots 4)
run_expect(TRUE "7,306,477,568 B" footprint --model muse-glimmer --context 131072 --slots 4)
run_expect(TRUE "32,768" footprint --model muse-glimmer)
run_expect(FALSE "unknown model 'gpt-9'" footprint --model gpt-9)
run_expect(FALSE "--context = 0 is outside" footprint --context 0)
run_expect(FALSE "--context = 131073 is outside" footprint --context 131073)
run_expect(FALSE "--slots = 0 is outside" footprint --slots 0)
run_expect(FALSE "--slots must be an integer" footprint --slots 4x)
run_expect(FALSE "cannot read config file" footprint --config /nonexistent/config.json)
run_expect(FALSE "unknown option --bogus" footprint --bogus 1)
run_expect(FALSE "unknown command" frobnicate)

# How many sequences of a length fit in a memory size.
run_expect(TRUE "5 sequences of 131,072 tokens fit" footprint --model muse-glimmer --fit 10GiB --length 131072)
run_expect(TRUE "\"sequences\":738" footprint --model muse-glimmer --fit 141GB --length 8192 --json)
run_expect(TRUE "\"total_bytes\":7306477568" footprint --model muse-glimmer --context 131072 --slots 4 --json)
run_expect(TRUE "\"context\":2048,.*\"context\":32768,.*\"context\":131072,"
           footprint --model muse-glimmer --json)
run_expect(TRUE "blocks of 64 rows" footprint --model muse-glimmer --fit 1GiB --length 100 --block-rows 64)
run_expect(FALSE "go together" footprint --model muse-glimmer --fit 1GiB)
run_expect(FALSE "unknown unit" footprint --model muse-glimmer --fit 1XB --length 10)
run_expect(FALSE "--length = 0 is outside" footprint --model muse-glimmer --fit 1GiB --length 0)
run_expect(FALSE "power of two" footprint --model muse-glimmer --fit 1GiB --length 10 --block-rows 24)

# An error prints nothing on stdout, also for the table of several contexts.
execute_process(COMMAND ${KVRING} footprint --model muse-glimmer --slots 2000000
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT "${out}" STREQUAL "" OR NOT err MATCHES "slots")
  message(FATAL_ERROR "footprint --slots 2000000: exit ${rc}, stdout '${out}', stderr '${err}'")
endif()
