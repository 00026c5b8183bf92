# `kvring run --sequences N`: each sequence's line equals a solo run with its
# seed, prompt and token count (tokens, logits and generated ids), the
# summary line counts the sequences, and --save/--resume carry every
# sequence: a batched run saved half-way and resumed equals one that never
# stopped. Sequence i: seed S + i, prompt max(1, P - 3i), tokens max(its
# prompt, T - 2i).
file(MAKE_DIRECTORY ${WORK})
set(config ${WORK}/window16.json)
file(WRITE ${config} [=[
{"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
 "sliding_window": 16, "max_position_embeddings": 512, "sliding_window_pattern": 4}
]=])
set(model --config ${config} --hidden 32 --vocab 64 --chunk 7 --backend cpu)

function(line_fields out_var json)
  foreach(key tokens logits_sha256 generated)
    string(JSON value ERROR_VARIABLE missing GET "${json}" ${key})
    if(missing)
      message(FATAL_ERROR "no '${key}' in ${json}")
    endif()
  endforeach()
  string(JSON t GET "${json}" tokens)
  string(JSON s GET "${json}" logits_sha256)
  string(JSON g GET "${json}" generated)
  set(${out_var} "${t} ${s} ${g}" PARENT_SCOPE)
endfunction()

function(run_lines out_var)
  execute_process(COMMAND ${KVRING} run ${ARGN} --json RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "kvring run ${ARGN}: exit ${rc}: ${err}")
  endif()
  string(STRIP "${out}" out)
  string(REPLACE "\n" ";" lines "${out}")
  set(${out_var} "${lines}" PARENT_SCOPE)
endfunction()

# Line i of `lines` (i < count) equals the solo run of sequence i (seed
# 11 + i, prompt 40 - 3i, 60 - 2i tokens, the model and ARGN); each line's
# fields go to ${prefix}_${i}.
function(expect_solo prefix lines count)
  math(EXPR last "${count} - 1")
  foreach(i RANGE ${last})
    list(GET lines ${i} line)
    line_fields(batched "${line}")
    math(EXPR seed "11 + ${i}")
    math(EXPR prompt "40 - 3 * ${i}")
    math(EXPR tokens "60 - 2 * ${i}")
    run_lines(solo ${model} --seed ${seed} --prompt-tokens ${prompt} --tokens ${tokens} ${ARGN})
    line_fields(alone "${solo}")
    if(NOT batched STREQUAL alone)
      message(FATAL_ERROR "sequence ${i} (${ARGN}) differs from its solo run:\n${batched}\n${alone}")
    endif()
    set(${prefix}_${i} "${batched}" PARENT_SCOPE)
  endforeach()
endfunction()

# Line i of `lines` (i < count) has the fields ${prefix}_${i}.
function(expect_fields prefix lines count)
  math(EXPR last "${count} - 1")
  foreach(i RANGE ${last})
    list(GET lines ${i} line)
    line_fields(r "${line}")
    if(NOT r STREQUAL ${prefix}_${i})
      message(FATAL_ERROR "resumed sequence ${i} differs:\n${r}\n${${prefix}_${i}}")
    endif()
  endforeach()
endfunction()

set(n 5)
run_lines(lines ${model} --sequences ${n} --seed 11 --prompt-tokens 40 --tokens 60)
list(LENGTH lines count)
math(EXPR want "${n} + 1")
if(NOT count EQUAL want)
  message(FATAL_ERROR "expected ${want} lines, got ${count}: ${lines}")
endif()
list(GET lines ${n} summary)
string(JSON sequences GET "${summary}" sequences)
if(NOT sequences EQUAL n)
  message(FATAL_ERROR "summary line says ${sequences} sequences: ${summary}")
endif()
math(EXPR last "${n} - 1")
expect_solo(full "${lines}" ${n})

# Saved at 50 tokens (each sequence to max(prompt, 50 - 2i)), resumed to 60.
run_lines(half ${model} --sequences ${n} --seed 11 --prompt-tokens 40 --tokens 50
          --save ${WORK}/batch.kvpack)
foreach(i RANGE ${last})
  if(NOT EXISTS ${WORK}/batch.${i}.kvpack)
    message(FATAL_ERROR "no pack for sequence ${i}")
  endif()
endforeach()
run_lines(resumed --resume ${WORK}/batch.kvpack --sequences ${n} --tokens 60 --backend cpu)
expect_fields(full "${resumed}" ${n})

# Under the f16 attention numeric too: each line equals its solo run, and a
# batch saved under it resumes under it (a pack of another numeric in the
# batch is refused).
run_lines(lines16 ${model} --sequences 3 --seed 11 --prompt-tokens 40 --tokens 60 --attention f16)
expect_solo(f16 "${lines16}" 3 --attention f16)
foreach(i 0 1 2)
  list(GET lines16 ${i} line)
  string(JSON numeric GET "${line}" attention)
  if(NOT numeric STREQUAL "f16")
    message(FATAL_ERROR "f16 sequence ${i} names attention '${numeric}'")
  endif()
  if(f16_${i} STREQUAL full_${i})
    message(FATAL_ERROR "f16 sequence ${i} has the f32 numeric's summary")
  endif()
endforeach()
run_lines(f16_half ${model} --sequences 3 --seed 11 --prompt-tokens 40 --tokens 50 --attention f16
          --save ${WORK}/f16.kvpack)
run_lines(f16_resumed --resume ${WORK}/f16.kvpack --sequences 3 --tokens 60 --backend cpu)
expect_fields(f16 "${f16_resumed}" 3)
file(COPY_FILE ${WORK}/batch.1.kvpack ${WORK}/f16.1.kvpack)
execute_process(COMMAND ${KVRING} run --resume ${WORK}/f16.kvpack --sequences 3 --backend cpu
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "f16.1.kvpack ran under the f32 attention numeric")
  message(FATAL_ERROR "a pack of another numeric in the batch: exit ${rc}: ${err}")
endif()
# So is a pack of another prefill chunk: one run takes one.
run_lines(c5 --config ${config} --hidden 32 --vocab 64 --chunk 5 --backend cpu --sequences 2 --seed 11
          --prompt-tokens 40 --tokens 50 --save ${WORK}/c5.kvpack)
# mixed.kvpack: batch.0 beside `second` as pack 1; its resume is refused
# with `pattern`.
function(expect_mixed_refused second pattern what)
  file(COPY_FILE ${WORK}/batch.0.kvpack ${WORK}/mixed.0.kvpack)
  file(COPY_FILE ${second} ${WORK}/mixed.1.kvpack)
  execute_process(COMMAND ${KVRING} run --resume ${WORK}/mixed.kvpack --sequences 2 --backend cpu
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0 OR NOT err MATCHES "${pattern}")
    message(FATAL_ERROR "${what} in the batch: exit ${rc}: ${err}")
  endif()
endfunction()
expect_mixed_refused(${WORK}/c5.1.kvpack "mixed.1.kvpack ran with prefill chunks of 5 tokens, .*mixed.0.kvpack with 7"
                     "a pack of another prefill chunk")

# A pack of a model with another RoPE base in the batch is refused (the
# geometry's fingerprint leaves rope_theta out).
set(theta_config ${WORK}/window16-theta.json)
file(WRITE ${theta_config} [=[
{"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
 "sliding_window": 16, "max_position_embeddings": 512, "sliding_window_pattern": 4,
 "rope_theta": 50000}
]=])
run_lines(theta_half --config ${theta_config} --hidden 32 --vocab 64 --chunk 7 --backend cpu
          --sequences 2 --seed 11 --prompt-tokens 40 --tokens 50 --save ${WORK}/theta.kvpack)
expect_mixed_refused(${WORK}/theta.1.kvpack "mixed.1.kvpack holds a session of another model"
                     "a pack of another RoPE base")

# Refusals: a count out of range, a missing pack of the batch.
foreach(bad 0 -1 4097 x)
  execute_process(COMMAND ${KVRING} run ${model} --sequences ${bad} RESULT_VARIABLE rc
                  OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0 OR NOT err MATCHES "sequences")
    message(FATAL_ERROR "--sequences ${bad}: exit ${rc}: ${err}")
  endif()
endforeach()
execute_process(COMMAND ${KVRING} run --resume ${WORK}/batch.kvpack --sequences 7 --backend cpu
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "batch.5.kvpack")
  message(FATAL_ERROR "a missing pack of the batch: exit ${rc}: ${err}")
endif()
