# Runs `kvring run`: the JSON summary has its keys, is the same bits for any
# prefill chunk size and for repeated runs, and bad arguments fail clearly.
function(run_json out_var)
  execute_process(COMMAND ${KVRING} run ${ARGN} --json RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "kvring run ${ARGN}: exit ${rc}: ${err}")
  endif()
  foreach(key tokens logits_sha256 generated)
    string(JSON value ERROR_VARIABLE missing GET "${out}" ${key})
    if(missing)
      message(FATAL_ERROR "kvring run ${ARGN}: no '${key}' in ${out}")
    endif()
  endforeach()
  string(JSON sha GET "${out}" logits_sha256)
  string(JSON gen GET "${out}" generated)
  string(JSON tokens GET "${out}" tokens)
  set(${out_var} "${tokens} ${sha} ${gen}" PARENT_SCOPE)
endfunction()

function(run_fail pattern)
  execute_process(COMMAND ${KVRING} run ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0)
    message(FATAL_ERROR "kvring run ${ARGN}: expected a failure")
  endif()
  if(NOT "${err}" MATCHES "${pattern}")
    message(FATAL_ERROR "kvring run ${ARGN}: stderr does not match '${pattern}': ${err}")
  endif()
endfunction()

# A window of 32: the prompt wraps the sliding rings three times, so the
# chunkings place rows at different ring rotations.
file(MAKE_DIRECTORY ${WORK})
set(config ${WORK}/window32.json)
file(WRITE ${config} [=[
{"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
 "sliding_window": 32, "max_position_embeddings": 1024, "sliding_window_pattern": 4}
]=])
set(common --config ${config} --hidden 32 --vocab 64 --tokens 120 --prompt-tokens 100 --backend cpu)
run_json(a ${common} --chunk 1)
run_json(b ${common} --chunk 7)
run_json(c ${common} --chunk 512)
run_json(d ${common} --chunk 7)
if(NOT a STREQUAL b OR NOT a STREQUAL c OR NOT b STREQUAL d)
  message(FATAL_ERROR "summaries differ:\n${a}\n${b}\n${c}\n${d}")
endif()
if(NOT a MATCHES "^120 [0-9a-f]+ ")
  message(FATAL_ERROR "unexpected summary ${a}")
endif()
run_json(e ${common} --chunk 7 --seed 2)
if(a STREQUAL e)
  message(FATAL_ERROR "another seed gave the same summary")
endif()

# The f16 attention numeric: the same bits for any chunking (a prefilled
# token equals a decoded one), its own bits against the f32 numeric, and
# the numeric in the summary; saved and resumed, it continues bit for bit.
run_json(f1 ${common} --chunk 1 --attention f16)
run_json(f2 ${common} --chunk 7 --attention f16)
run_json(f3 ${common} --chunk 512 --attention f16)
if(NOT f1 STREQUAL f2 OR NOT f1 STREQUAL f3)
  message(FATAL_ERROR "f16 summaries differ across chunkings:\n${f1}\n${f2}\n${f3}")
endif()
if(f1 STREQUAL a)
  message(FATAL_ERROR "the f16 numeric gave the f32 numeric's summary")
endif()
execute_process(COMMAND ${KVRING} run ${common} --chunk 7 --attention f16 --json OUTPUT_VARIABLE out RESULT_VARIABLE rc)
string(JSON numeric GET "${out}" attention)
if(NOT numeric STREQUAL "f16")
  message(FATAL_ERROR "the summary names attention '${numeric}'")
endif()
set(half ${common})
list(REMOVE_ITEM half --tokens 120)
execute_process(COMMAND ${KVRING} run ${half} --tokens 110 --chunk 7 --attention f16 --save ${WORK}/f16.kvpack
                RESULT_VARIABLE rc ERROR_VARIABLE err OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "saving an f16 run: ${err}")
endif()
run_json(f4 --resume ${WORK}/f16.kvpack --tokens 120 --backend cpu)
if(NOT f4 STREQUAL f1)
  message(FATAL_ERROR "the resumed f16 run differs from the run that never stopped:\n${f4}\n${f1}")
endif()
run_fail("--attention comes from the pack" --resume ${WORK}/f16.kvpack --attention f32)

# A score scale other than 1/sqrt(head_dim) (query_pre_attn_scalar): its own
# bits, the same for any chunking, and a saved session resumes under it.
set(scaled_config ${WORK}/window32-scaled.json)
file(WRITE ${scaled_config} [=[
{"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
 "sliding_window": 32, "max_position_embeddings": 1024, "sliding_window_pattern": 4,
 "query_pre_attn_scalar": 24}
]=])
set(scaled --config ${scaled_config} --hidden 32 --vocab 64 --prompt-tokens 100 --backend cpu)
run_json(s1 ${scaled} --tokens 120 --chunk 1)
run_json(s2 ${scaled} --tokens 120 --chunk 7)
if(NOT s1 STREQUAL s2)
  message(FATAL_ERROR "scaled summaries differ across chunkings:\n${s1}\n${s2}")
endif()
if(s1 STREQUAL a)
  message(FATAL_ERROR "query_pre_attn_scalar 24 gave the usual scale's summary")
endif()
execute_process(COMMAND ${KVRING} run ${scaled} --tokens 110 --chunk 7 --save ${WORK}/scaled.kvpack
                RESULT_VARIABLE rc ERROR_VARIABLE err OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "saving a scaled run: ${err}")
endif()
run_json(s3 --resume ${WORK}/scaled.kvpack --tokens 120 --backend cpu)
if(NOT s3 STREQUAL s1)
  message(FATAL_ERROR "the resumed scaled run differs from the run that never stopped:\n${s3}\n${s1}")
endif()
run_fail("--attention: unknown attention numeric 'fp8'" ${common} --attention fp8)
run_fail("--attention does not go with --handoff-to" ${half} --attention f16 --handoff-to 127.0.0.1:1)

run_fail("unknown model" --model nope)
run_fail("is a directory, not a regular file" --save ${WORK})
run_fail("no/such/dir/.tmp-x.kvpack.*: No such file or directory" --save ${WORK}/no/such/dir/x.kvpack)
run_fail("/dev/null: it is a character device" --save /dev/null)
# A name as long as the file system takes is saved (its temporary keeps
# only the name's first 100 bytes).
string(REPEAT "n" 248 long_name)
execute_process(COMMAND ${KVRING} run ${common} --save ${WORK}/${long_name}.kvpack
                RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT EXISTS ${WORK}/${long_name}.kvpack)
  message(FATAL_ERROR "a save under a 255-byte name: exit ${rc}: ${err}")
endif()
run_fail("--tokens = 320 \\(the default\\) exceeds the cache context 200 .*; give --tokens"
         --config ${config} --hidden 32 --vocab 64 --context 200)
# Every pack of --sequences is checked before the sessions run, and nothing
# is written or made (a store directory) for a run refused.
file(MAKE_DIRECTORY ${WORK}/many.1.kvpack)
run_fail("many.1.kvpack: it is a directory" --sequences 2 --tokens 40 --save ${WORK}/many.kvpack)
if(EXISTS ${WORK}/many.0.kvpack)
  message(FATAL_ERROR "a refused --sequences save wrote many.0.kvpack")
endif()
run_fail("--tokens = 999999 exceeds" --tokens 999999 --save ${WORK}/s.kvpack --store dir:${WORK}/never-made)
run_fail("unknown backend" --backend bogus --save ${WORK}/s.kvpack --store dir:${WORK}/never-made)
if(EXISTS ${WORK}/never-made)
  message(FATAL_ERROR "a refused run made its store's directory")
endif()
run_fail("weights would take" --hidden 16384 --vocab 1048576)
# The reference model a config file or a pack's run record chooses is bounded
# by half the memory the process may use, here its address space (ulimit -v
# 2 GiB): the geometry below takes 1.16 GB of weights at hidden 256. Run,
# saved and resumed without the limit; refused under it, before any weight
# is made.
set(wide ${WORK}/wide.json)
file(WRITE ${wide} [=[
{"num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 128,
 "sliding_window": 32, "max_position_embeddings": 256, "sliding_window_pattern": 4}
]=])
set(wide_run --config ${wide} --vocab 64 --tokens 4 --prompt-tokens 2 --no-progress)
execute_process(COMMAND ${KVRING} run ${wide_run} --save ${WORK}/wide.kvpack
                RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
if(rc EQUAL 2 AND err MATCHES "more than half the .* this process may use")
  # A machine (or cgroup) under 2.3 GB: the bound itself refused the run.
  message(STATUS "the wide model does not fit this machine, its ulimit cases skipped: ${err}")
elseif(NOT rc EQUAL 0)
  message(FATAL_ERROR "the wide model's run: exit ${rc}: ${err}")
else()
foreach(args "${wide_run}" "--resume;${WORK}/wide.kvpack;--no-progress")
  execute_process(COMMAND bash -c "ulimit -v 2097152 && exec \"$0\" \"$@\"" ${KVRING} run ${args}
                  RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
  if(NOT rc EQUAL 2 OR NOT err MATCHES "would take 1,157,955,584 B .*more than half the 2,147,483,648 B")
    message(FATAL_ERROR "run ${args} under ulimit -v: exit ${rc}: ${err}")
  endif()
endforeach()
execute_process(COMMAND ${KVRING} run --resume ${WORK}/wide.kvpack --no-progress
                RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the wide model's resume: exit ${rc}: ${err}")
endif()
endif()
run_fail("use smaller chunks" --vocab 1048576 --hidden 8 --prompt-tokens 4000 --tokens 4000 --chunk 4000 --context 4096)
run_fail("--tokens = 0 is outside" --tokens 0)
run_fail("--prompt-tokens = 9 exceeds --tokens = 8" --tokens 8 --prompt-tokens 9)
run_fail("--chunk = 0 is outside" --chunk 0)
run_fail("--chunk must be an integer" --chunk seven)
run_fail("exceeds the cache context" --tokens 5000 --context 4096)
run_fail("exceeds the model's maximum" --context 131073)
run_fail("unknown backend" --backend tpu)
run_fail("cannot read config file" --config /nonexistent.json)
run_fail("unknown option --frobs" --frobs)
