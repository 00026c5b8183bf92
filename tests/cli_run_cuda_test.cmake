# `kvring run --backend cuda`: where a GPU is visible, the same summary bits
# for prefill chunks of 1, 7 and 512 across muse-glimmer's window edge, and
# `auto` picks CUDA; where none is, a clear refusal.
set(common --model muse-glimmer --hidden 32 --vocab 64 --tokens 2100 --prompt-tokens 2050
    --context 4096 --json)
execute_process(COMMAND ${KVRING} run ${common} --backend cuda --chunk 512
                RESULT_VARIABLE rc OUTPUT_VARIABLE a ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  if(err MATCHES "needs a GPU; none is visible|has no CUDA backend")
    message(STATUS "no GPU: kvring run --backend cuda refused as it should: ${err}")
    return()
  endif()
  message(FATAL_ERROR "kvring run --backend cuda: exit ${rc}: ${err}")
endif()
string(JSON backend GET "${a}" backend)
if(NOT backend STREQUAL "cuda")
  message(FATAL_ERROR "--backend cuda ran on '${backend}'")
endif()
string(JSON sha_a GET "${a}" logits_sha256)
foreach(chunk 1 7)
  execute_process(COMMAND ${KVRING} run ${common} --backend cuda --chunk ${chunk}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE b ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "kvring run --chunk ${chunk}: exit ${rc}: ${err}")
  endif()
  string(JSON sha_b GET "${b}" logits_sha256)
  if(NOT sha_a STREQUAL sha_b)
    message(FATAL_ERROR "chunk ${chunk} gave other logits:\n${a}\n${b}")
  endif()
endforeach()
execute_process(COMMAND ${KVRING} run ${common} --backend auto --chunk 512
                RESULT_VARIABLE rc OUTPUT_VARIABLE c ERROR_VARIABLE err)
string(JSON backend GET "${c}" backend)
if(NOT backend STREQUAL "cuda")
  message(FATAL_ERROR "--backend auto ran on '${backend}' with a GPU visible")
endif()
