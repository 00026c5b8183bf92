# `kvring run --backend cuda`: where a GPU is visible, the same summary bits
# for prefill chunks of 1, 7 and 512 across muse-glimmer's window edge, and
# `auto` picks CUDA; where none is, a clear refusal.
# `kvring run ARGS...` into `out`; a failure ends the test naming `what`.
function(run_ok out what)
  execute_process(COMMAND ${KVRING} run ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE o ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what}: exit ${rc}: ${err}")
  endif()
  set(${out} "${o}" PARENT_SCOPE)
endfunction()

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
  run_ok(b "kvring run --chunk ${chunk}" ${common} --backend cuda --chunk ${chunk})
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

# A model with attention sinks (a gpt_oss config; the reference model sets
# its sinks on the store): on the GPU, prefill chunks of 1 and 64 give the
# same logits, and the CPU backend generates the same tokens.
set(oss_config "${CMAKE_CURRENT_BINARY_DIR}/cli_run_cuda_gpt_oss.json")
file(WRITE "${oss_config}" [=[{"model_type": "gpt_oss", "num_hidden_layers": 4, "num_attention_heads": 8,
  "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 128, "max_position_embeddings": 4096,
  "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]}]=])
set(oss --config ${oss_config} --hidden 32 --vocab 64 --tokens 300 --prompt-tokens 260 --context 512 --json)
set(oss_sha "")
foreach(chunk 64 1)
  run_ok(o "kvring run of a model with sinks on the GPU, --chunk ${chunk}" ${oss} --backend cuda --chunk ${chunk})
  string(JSON sha GET "${o}" logits_sha256)
  string(JSON gpu_generated GET "${o}" generated)
  if(oss_sha STREQUAL "")
    set(oss_sha "${sha}")
  elseif(NOT sha STREQUAL oss_sha)
    message(FATAL_ERROR "a model with sinks: chunk ${chunk} gave other logits on the GPU")
  endif()
endforeach()
run_ok(o "kvring run of a model with sinks on the CPU" ${oss} --backend cpu --chunk 64)
string(JSON cpu_generated GET "${o}" generated)
if(NOT cpu_generated STREQUAL gpu_generated)
  message(FATAL_ERROR "a model with sinks generated other tokens on the GPU:\n${gpu_generated}\n${cpu_generated}")
endif()
