# kvring run --save / --resume and kvring pack inspect / verify.
#
# The replay gate across processes: a session saved after its sliding rings
# wrapped (window 32), resumed by a second process and continued, prints the
# same --json summary as a run that never stopped (timing aside), and saves a
# pack byte-identical to that run's pack, which holds the live K/V of every
# plane, the ring states, the token ids and the full last-token logits.
#
# Run with -DKVRING=<kvring binary> -DWORK=<scratch directory>, and
# -DBACKEND=cuda for the same gate on the GPU (a no-op where none is visible).
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
file(WRITE ${WORK}/small.json [=[
{"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
 "sliding_window": 32, "max_position_embeddings": 1024,
 "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]}
]=])

function(kvring out_var expect_rc)
  execute_process(COMMAND ${KVRING} ${ARGN} WORKING_DIRECTORY ${WORK}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL expect_rc)
    message(FATAL_ERROR "kvring ${ARGN}: exit ${rc}, expected ${expect_rc}:\n${out}${err}")
  endif()
  set(${out_var} "${out}${err}" PARENT_SCOPE)
endfunction()

function(expect_match text pattern what)
  if(NOT "${text}" MATCHES "${pattern}")
    message(FATAL_ERROR "${what}: output does not match '${pattern}':\n${text}")
  endif()
endfunction()

# The summary without its timings, which vary run to run.
function(summary out_var json)
  string(JSON stripped REMOVE "${json}" timing)
  set(${out_var} "${stripped}" PARENT_SCOPE)
endfunction()

# A resumed run (its --json output and its saved pack) against one that
# never stopped: the same summary outside timing, byte-identical packs.
function(same_as_straight resumed straight resumed_pack straight_pack what)
  summary(resumed_s "${resumed}")
  summary(straight_s "${straight}")
  if(NOT resumed_s STREQUAL straight_s)
    message(FATAL_ERROR "${what}: the resumed run differs from the run that never stopped:\n${resumed_s}\n${straight_s}")
  endif()
  file(SHA256 ${WORK}/${resumed_pack} resumed_sha)
  file(SHA256 ${WORK}/${straight_pack} straight_sha)
  if(NOT resumed_sha STREQUAL straight_sha)
    message(FATAL_ERROR "${what}: the resumed session's pack differs from the never-stopped session's pack")
  endif()
endfunction()

function(flip_byte file offset)
  file(SHA256 ${file} before)
  foreach(value "\\377" "\\001")
    execute_process(COMMAND sh -c "printf '${value}' | dd of='${file}' bs=1 seek=${offset} conv=notrunc status=none"
                    RESULT_VARIABLE rc)
    file(SHA256 ${file} after)
    if(NOT before STREQUAL after)
      return()
    endif()
  endforeach()
  message(FATAL_ERROR "could not change byte ${offset} of ${file}")
endfunction()

set(session --config small.json --hidden 32 --vocab 64 --prompt-tokens 40 --chunk 7 --no-progress)
set(on_backend "")
if(DEFINED BACKEND)
  set(on_backend --backend ${BACKEND})
  list(APPEND session ${on_backend})
  execute_process(COMMAND ${KVRING} run ${session} --tokens 40 --json WORKING_DIRECTORY ${WORK}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 AND err MATCHES "needs a GPU; none is visible|has no CUDA backend")
    message(STATUS "no GPU: the ${BACKEND} replay gate does not apply here: ${err}")
    return()
  endif()
  string(JSON ran GET "${out}" backend)
  if(NOT ran STREQUAL BACKEND)
    message(FATAL_ERROR "--backend ${BACKEND} ran on '${ran}'")
  endif()
endif()

# --- Self-contained packs -------------------------------------------------
# Saved at 300 tokens: the rings hold [268, 300), origin_physical 268 % 32 = 12.
kvring(first 0 run ${session} --tokens 300 --json --save a.kvpack)
kvring(resumed 0 run ${on_backend} --resume a.kvpack --tokens 600 --json --save b.kvpack)
kvring(straight 0 run ${session} --tokens 600 --json --save c.kvpack)
same_as_straight("${resumed}" "${straight}" b.kvpack c.kvpack "self-contained")
summary(straight_s "${straight}")
string(JSON tokens GET "${resumed}" tokens)
if(NOT tokens EQUAL 600)
  message(FATAL_ERROR "resumed run ended at ${tokens} tokens")
endif()
# Resuming without going further reproduces the saved summary.
kvring(again 0 run ${on_backend} --resume a.kvpack --json)
summary(again_s "${again}")
summary(first_s "${first}")
if(NOT again_s STREQUAL first_s)
  message(FATAL_ERROR "a resumed run with no new tokens differs from the saved one:\n${again_s}\n${first_s}")
endif()
kvring(text 0 run ${on_backend} --resume a.kvpack --tokens 320)
expect_match("${text}" "last logits sha256 [0-9a-f]+" "resume text summary")

# --- A model of sliding layers alone runs past its context ---------------------
# Its rings hold their window (32 rows of 32), so its sequences never stop:
# saved at 100 of a context of 64, resumed to 200, it matches a run that
# never stopped. A ring shorter than its window (64 rows of 72) stops at
# the context, as a full plane does.
file(WRITE ${WORK}/sliding.json [=[
{"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
 "sliding_window": 32, "max_position_embeddings": 1024,
 "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention"]}
]=])
set(sliding --config sliding.json --context 64 --hidden 32 --vocab 64 --prompt-tokens 80 --chunk 7 --no-progress ${on_backend})
kvring(out 0 run ${sliding} --tokens 100 --save s1.kvpack)
kvring(s_resumed 0 run ${on_backend} --resume s1.kvpack --tokens 200 --json --save s2.kvpack)
kvring(s_straight 0 run ${sliding} --tokens 200 --json --save s3.kvpack)
same_as_straight("${s_resumed}" "${s_straight}" s2.kvpack s3.kvpack "sliding-only, past its context")
kvring(out 0 run ${sliding} --tokens 150 --sequences 2)
expect_match("${out}" "sequence 0: seed 1, 150 tokens \\(80 prompt, 70 generated\\)" "sliding-only sequences past the context")
kvring(out 2 run ${session} --context 64 --tokens 100)
expect_match("${out}" "--tokens = 100 exceeds the cache context 64" "a full plane stops at the context")
# Below a context of 32 a full plane holds its 32 least rows, and a run
# takes them.
set(tiny --config small.json --context 8 --hidden 32 --vocab 64 --prompt-tokens 20 --no-progress ${on_backend})
kvring(out 0 run ${tiny} --tokens 32 --save f32.kvpack)
kvring(out 0 run ${on_backend} --resume f32.kvpack)
kvring(out 2 run ${tiny} --tokens 33)
expect_match("${out}" "--tokens = 33 exceeds the cache context 8 \\(32 positions on its full planes\\)"
             "a full plane of 32 rows at a context of 8")
file(READ ${WORK}/sliding.json short_ring)
string(REPLACE "\"sliding_window\": 32" "\"sliding_window\": 72" short_ring "${short_ring}")
file(WRITE ${WORK}/short_ring.json "${short_ring}")
kvring(out 2 run --config short_ring.json --context 64 --hidden 32 --vocab 64 --prompt-tokens 40 --tokens 65 --no-progress ${on_backend})
expect_match("${out}" "--tokens = 65 exceeds the cache context 64" "a ring shorter than its window stops at the context")

# --- Thin packs over a directory store --------------------------------------
kvring(thin_first 0 run ${session} --tokens 300 --json --save ta.kvpack --store dir:store)
kvring(thin_resumed 0 run ${on_backend} --resume ta.kvpack --store dir:store --tokens 600 --json --save tb.kvpack --store dir:store)
summary(thin_s "${thin_resumed}")
if(NOT thin_s STREQUAL straight_s)
  message(FATAL_ERROR "thin resumed run differs:\n${thin_s}\n${straight_s}")
endif()
kvring(out 0 pack verify tb.kvpack --store dir:store)
expect_match("${out}" "ok: tb.kvpack: manifest digest and 6 chunks" "verify thin")
kvring(out 2 pack verify tb.kvpack)
expect_match("${out}" "is a thin pack" "verify thin without store")

# --- inspect and verify ------------------------------------------------------
kvring(out 0 pack inspect a.kvpack)
expect_match("${out}" "version 1, self-contained" "inspect")
expect_match("${out}" "context 1,024, 300 tokens, token ids present, chunk_tokens 256" "inspect")
expect_match("${out}" "0  SlidingRope  token-major  F16Le +32 +32 +268 +12 +1" "inspect plane 0")
expect_match("${out}" "3  FullNope     head-major   F16Le +1024 +300 +0 +0 +2" "inspect plane 3")
expect_match("${out}" "4 +3  \\[256, 300\\) +44 +5,632" "inspect chunk 4")
kvring(out 0 pack verify a.kvpack)
expect_match("${out}" "ok: a.kvpack: manifest digest and 5 chunks" "verify")

file(COPY_FILE ${WORK}/a.kvpack ${WORK}/payload.kvpack)
file(SIZE ${WORK}/payload.kvpack size)
math(EXPR last "${size} - 3")
flip_byte(${WORK}/payload.kvpack ${last})
kvring(out 1 pack verify payload.kvpack)
expect_match("${out}" "payload.kvpack: chunk 4 \\(layer 3, positions \\[256, 300\\)" "verify bad payload")
expect_match("${out}" "1 of 5 chunks are bad" "verify bad payload")
kvring(out 2 run ${on_backend} --resume payload.kvpack --tokens 400)
expect_match("${out}" "chunk 4 \\(layer 3" "resume bad payload")

file(COPY_FILE ${WORK}/a.kvpack ${WORK}/header.kvpack)
flip_byte(${WORK}/header.kvpack 100)
kvring(out 1 pack verify header.kvpack)
expect_match("${out}" "manifest digest at byte" "verify bad header")
kvring(out 2 pack inspect header.kvpack)
expect_match("${out}" "the preamble or manifest is damaged" "inspect bad header")

# A damaged version byte is damage (exit 1), not a newer format (exit 2).
file(COPY_FILE ${WORK}/a.kvpack ${WORK}/version.kvpack)
flip_byte(${WORK}/version.kvpack 9)
kvring(out 1 pack verify version.kvpack)
expect_match("${out}" "at byte 8, flags 0x0000 at byte 10: damaged" "verify damaged version")

execute_process(COMMAND truncate -s 1000 ${WORK}/header.kvpack)
kvring(out 1 pack verify header.kvpack)
expect_match("${out}" "truncated" "verify truncated")

file(GLOB chunk_files ${WORK}/store/*)
list(LENGTH chunk_files n_chunks)
if(n_chunks LESS 6)
  message(FATAL_ERROR "the store holds ${n_chunks} chunks")
endif()
kvring(out 0 pack inspect tb.kvpack)
string(REGEX MATCH "\n +2 +2 +\\[[0-9]+, [0-9]+\\) +[0-9]+ +[0-9,]+ +store +([0-9a-f]+)" row "${out}")
file(REMOVE ${WORK}/store/${CMAKE_MATCH_1})
kvring(out 1 pack verify tb.kvpack --store dir:store)
expect_match("${out}" "tb.kvpack: chunk 2 \\(layer 2, .*is missing" "verify missing chunk")

# --- Bad arguments -------------------------------------------------------------
kvring(out 2 pack)
kvring(out 2 pack frob a.kvpack)
expect_match("${out}" "unknown pack command 'frob'" "pack frob")
kvring(out 2 pack inspect)
expect_match("${out}" "takes one FILE" "inspect without file")
kvring(out 2 pack inspect no-such.kvpack)
expect_match("${out}" "cannot read pack no-such.kvpack: No such file or directory" "inspect missing file")
kvring(out 2 pack verify a.kvpack --store ftp://x)
expect_match("${out}" "unknown chunk store 'ftp://x'" "verify bad store")
kvring(out 2 pack inspect small.json)
expect_match("${out}" "not a kvpack file" "inspect a json file")
kvring(out 2 run ${on_backend} --resume a.kvpack --hidden 64)
expect_match("${out}" "--hidden comes from the pack" "resume with --hidden")
kvring(out 2 run ${on_backend} --resume a.kvpack --tokens 10)
expect_match("${out}" "--tokens = 10 is below the 300 tokens a.kvpack holds" "resume backwards")
kvring(out 2 run ${on_backend} --resume ta.kvpack --tokens 400)
expect_match("${out}" "is a thin pack" "resume thin without store")
kvring(out 2 run ${session} --tokens 50 --store dir:store)
expect_match("${out}" "--store is the chunk store of --save or --resume" "store alone")
kvring(out 2 run ${session} --tokens 50 --save /dev/full)
expect_match("${out}" "/dev/full: it is a character device, not a regular file" "save over a device")
kvring(out 2 run ${on_backend} --resume small.json)
expect_match("${out}" "not a kvpack file" "resume a json file")
