# Conventions every kvring command follows: COMMAND --help prints that
# command's help on stdout and exits 0; exit 0 success, 1 verification
# failed, 2 a usage error or an unusable input; a save into a store that
# cannot be written is refused before the session is computed; store gc.
#
# Run with -DKVRING=<kvring binary> -DWORK=<scratch directory>.
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})

# Runs kvring with a time limit; checks the exit code and the output.
function(expect rc pattern)
  execute_process(COMMAND ${KVRING} ${ARGN} WORKING_DIRECTORY ${WORK} TIMEOUT 60
                  RESULT_VARIABLE got OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT "${got}" STREQUAL "${rc}")
    message(FATAL_ERROR "kvring ${ARGN}: exit '${got}', expected ${rc}:\n${out}${err}")
  endif()
  if(NOT "${out}${err}" MATCHES "${pattern}")
    message(FATAL_ERROR "kvring ${ARGN}: output does not match '${pattern}':\n${out}${err}")
  endif()
  set(last_out "${out}" PARENT_SCOPE)
  set(last_err "${err}" PARENT_SCOPE)
endfunction()

# Output that cannot be written fails the command (exit 2, a message with
# the reason), never a silent success.
if(EXISTS /dev/full)
  execute_process(COMMAND ${KVRING} config --model muse-glimmer WORKING_DIRECTORY ${WORK} TIMEOUT 60
                  RESULT_VARIABLE got OUTPUT_FILE /dev/full ERROR_VARIABLE err)
  if(NOT "${got}" STREQUAL "2" OR NOT err MATCHES "writing the output failed: No space left on device")
    message(FATAL_ERROR "kvring config > /dev/full: exit '${got}', expected 2 and a message:\n${err}")
  endif()
endif()

# --- Help ----------------------------------------------------------------------
foreach(cmd "footprint" "run" "config" "pack" "pack;inspect" "pack;verify" "store" "store;gc" "handoff"
            "handoff;plan" "handoff;serve" "help")
  string(REPLACE ";" " " name "${cmd}")
  foreach(flag --help -h)
    expect(0 "usage: kvring ${name}" ${cmd} ${flag})
    if(NOT last_err STREQUAL "")
      message(FATAL_ERROR "kvring ${name} ${flag} wrote to stderr: ${last_err}")
    endif()
    if(NOT last_out MATCHES "exit status: 0 success; 1 verification failed")
      message(FATAL_ERROR "kvring ${name} ${flag} does not give the exit codes:\n${last_out}")
    endif()
  endforeach()
endforeach()
# Help wins over other arguments, also invalid ones.
expect(0 "usage: kvring run" run --tokens 0 --help)
expect(0 "pack verify FILE" pack verify no-such.kvpack --help)
expect(0 "store gc dir:PATH" help store gc)
expect(0 "pack inspect FILE.*pack verify FILE" help pack)
expect(0 "commands:.*footprint.*run.*store gc.*exit status" --help)
expect(2 "no help for 'frob'" help frob)
# -h as an option's value is that value (a file named -h), not a request
# for help; after a flag, or as --option=VALUE's neighbour, it asks for help.
expect(2 "cannot read config file -h" config --config -h)
expect(2 "cannot read config file -h" footprint --config -h)
expect(2 "cannot read config file -h" handoff plan --tokens 8 --config -h)
expect(0 "usage: kvring footprint" footprint --json -h)
expect(0 "usage: kvring config" config --config=-h -h)
expect(0 "usage: kvring run" run --save --help)

# --- Exit codes ----------------------------------------------------------------
expect(2 "usage: kvring COMMAND")
expect(2 "unknown command 'frob'" frob)
expect(2 "unknown option --frobs" run --frobs)
# An option given twice with another value is refused, not the first value
# silently replaced; the same value again is taken.
expect(2 "--context is given twice \\('10' and '20'\\)" footprint --context 10 --context 20)
expect(2 "--tokens is given twice" run --tokens 5 --tokens=6)
expect(0 "context 10 tokens, 1 slot" footprint --context 10 --context=10)
expect(2 "--slots = 0 is outside" footprint --slots 0)
# A value left out is not taken from the next option, and is never empty.
expect(2 "--save needs a value, got the option --json" run --save --json)
expect(2 "--store needs a value, got the option --save" run --store --save x.kvpack)
# (An empty value as an argument of its own: HostileFiles.EmptyOptionValuesAreRefused.)
foreach(opt "resume" "save" "config" "model" "backend" "store")
  expect(2 "--${opt} needs a value, got an empty one" run --${opt}=)
endforeach()
expect(2 "config: unexpected argument 'extra'" config extra)
expect(2 "cannot read pack no-such.kvpack" pack verify no-such.kvpack)
expect(2 "usage: kvring store gc" store)
expect(2 "unknown store command 'frob'" store frob)
expect(2 "store gc takes one store" store gc)
foreach(spec "redis://alice:s3cret@127.0.0.1:1" "redis:/alice:s3cret@127.0.0.1:1" "redis:alice:s3cret@h")
  expect(2 "only directory stores" store gc ${spec})
  if(last_err MATCHES "s3cret")
    message(FATAL_ERROR "store gc printed a password: ${last_err}")
  endif()
endforeach()
expect(2 "cannot list" store gc dir:no-such-store)
expect(2 "'/tmp/x' has no scheme; name a directory as dir:/tmp/x" store gc /tmp/x)
expect(2 "'redis:' is not a directory store" store gc redis://h:1)
expect(2 "'dir:' names no directory" store gc dir:)
expect(2 "no scheme this tool knows" store gc "/a/b:pass")
file(WRITE ${WORK}/small.json [=[
{"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
 "sliding_window": 32, "max_position_embeddings": 256, "sliding_window_pattern": 2}
]=])
set(small --config small.json --hidden 16 --vocab 32 --tokens 40 --no-progress)
# --json output is JSON whatever the model's name (a config's path) holds:
# a quote as it is, a backslash and bytes that are not UTF-8 escaped.
string(ASCII 255 byte_ff)
file(COPY_FILE ${WORK}/small.json "${WORK}/q\"uote\\${byte_ff}.json")
foreach(fit "" "--fit;1GiB;--length;100")
  expect(0 "model" footprint --config "q\"uote\\${byte_ff}.json" ${fit} --json)
  string(JSON model ERROR_VARIABLE json_err GET "${last_out}" model)
  if(json_err OR NOT model STREQUAL "q\"uote\\x5c\\xff.json")
    message(FATAL_ERROR "footprint ${fit} --json: not JSON naming the model (${json_err}): ${last_out}")
  endif()
endforeach()
expect(0 "\"model\":\"q\\\\\"uote" run --config "q\"uote\\${byte_ff}.json" --hidden 16 --vocab 32 --tokens 20 --no-progress --json)
# A backend the build or the host lacks (as run finds it) is refused
# before serve listens.
execute_process(COMMAND ${KVRING} run ${small} --backend cuda WORKING_DIRECTORY ${WORK} TIMEOUT 60
                RESULT_VARIABLE got ERROR_VARIABLE run_err OUTPUT_QUIET)
if(run_err MATCHES "has no CUDA backend|needs a GPU; none is visible")
  execute_process(COMMAND ${KVRING} handoff serve --listen unix:${WORK}/no-cuda.sock --tokens 40 --backend cuda
                          --timeout 3 WORKING_DIRECTORY ${WORK} TIMEOUT 60 RESULT_VARIABLE got ERROR_VARIABLE err)
  if(NOT got EQUAL 2 OR err MATCHES "listening" OR NOT err MATCHES "has no CUDA backend|needs a GPU; none is visible")
    message(FATAL_ERROR "handoff serve --backend cuda where run refuses it: exit ${got}: ${err}")
  endif()
endif()
# The text summary names the model as `config` does: the path escaped once.
foreach(cmd "config;--config" "run;--hidden;16;--vocab;32;--tokens;20;--no-progress;--config")
  expect(0 "model +q\"uote\\\\x5c\\\\xff\\.json[ :\n]" ${cmd} "q\"uote\\${byte_ff}.json")
endforeach()
expect(0 "saved" run ${small} --save a.kvpack)
expect(0 "ok: a.kvpack" pack verify a.kvpack)
file(SIZE ${WORK}/a.kvpack size)
math(EXPR near_end "${size} - 3")
execute_process(COMMAND sh -c "printf '\\377\\001' | dd of=a.kvpack bs=1 seek=${near_end} conv=notrunc status=none"
                WORKING_DIRECTORY ${WORK})
expect(1 "chunks are bad" pack verify a.kvpack)
# A store that cannot be reached stops the check: an input error, not a verdict.
expect(0 "saved" run ${small} --save thin.kvpack --store dir:chunks)
if(REDIS)
  expect(2 "redis://127.0.0.1:1: cannot connect" pack verify thin.kvpack --store redis://127.0.0.1:1)
  # A server that answers every chunk with an error checked nothing: exit 2,
  # and no chunk is called bad (where python3 is there to play the server).
  find_program(PYTHON3 python3)
endif()
if(REDIS AND PYTHON3)
  file(WRITE ${WORK}/fake_redis.py [=[
import socket, sys, threading
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(4)
s.settimeout(30)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(s.getsockname()[1]))
import os
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
def serve(c):
    while True:
        d = c.recv(65536)
        if not d:
            return
        up = d.upper()
        c.sendall(b"+PONG\r\n" if b"PING" in up else b"+OK\r\n" if b"HELLO" in up or b"AUTH" in up else b"-ERR nope\r\n")
try:
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
except OSError:
    pass
]=])
  execute_process(COMMAND sh -c "\"$1\" fake_redis.py port & p=$!; for i in $(seq 100); do [ -s port ] && break; sleep 0.1; done; \"$0\" pack verify thin.kvpack --store redis://127.0.0.1:$(cat port)?timeout_ms=2000; rc=$?; kill $p; exit $rc" ${KVRING} ${PYTHON3}
                  WORKING_DIRECTORY ${WORK} TIMEOUT 60 RESULT_VARIABLE got OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT got STREQUAL "2" OR NOT err MATCHES "could not be checked" OR err MATCHES "are bad")
    message(FATAL_ERROR "pack verify against a failing store: exit '${got}', expected 2 and no bad chunks:\n${out}${err}")
  endif()
endif()
if(NOT REDIS)
  expect(2 "this build has no Redis store" pack verify thin.kvpack --store redis://127.0.0.1:1)
endif()
expect(2 "is a thin pack" pack verify thin.kvpack)

# --- Stores are checked before the session is computed ---------------------------
# muse-glimmer at 100000 tokens would run for hours on a CPU: a quick exit 2
# shows the store was refused first.
expect(2 "dir:/proc: cannot write into the store" run --tokens 100000 --backend cpu --save x.kvpack --store dir:/proc)
file(WRITE ${WORK}/plain "x")
expect(2 "cannot create the directory" run --tokens 100000 --backend cpu --save x.kvpack --store dir:plain/sub)
if(EXISTS ${WORK}/x.kvpack)
  message(FATAL_ERROR "a refused save left x.kvpack")
endif()

# A pack name longer than its directory takes is refused before the session
# runs, also where only a later sequence's indexed name is too long, and
# nothing is left behind.
string(REPEAT "b" 246 long_name)
file(GLOB before_long ${WORK}/*)
expect(2 "its name is [0-9]+ bytes, more than the [0-9]+ its directory takes" run ${small} --save ${long_name}.kvpack
       --sequences 11)
string(REPEAT "c" 256 too_long)
expect(2 "its name is [0-9]+ bytes, more than" run ${small} --save ${too_long}.kvpack)
file(GLOB after_long ${WORK}/*)
if(NOT before_long STREQUAL after_long)
  message(FATAL_ERROR "a refused save left files: ${after_long}")
endif()

# --- store gc ----------------------------------------------------------------------
# Temporaries as writers name them (.tmp-<chunk name>-<pid>-<counter>-<clock>);
# a user's file that only starts like one is not the store's.
string(REPEAT "ab" 32 chunk_name)
set(dead ${WORK}/chunks/.tmp-${chunk_name}-1-2-3)
set(fresh ${WORK}/chunks/.tmp-${chunk_name}-1-2-4)
set(users ${WORK}/chunks/.tmp-notes.txt)
file(WRITE ${dead} "partial")
file(WRITE ${fresh} "partial")
file(WRITE ${users} "someone's")
execute_process(COMMAND touch -d "2 hours ago" ${dead} ${users})
expect(0 "removed 1 temporary file of dead writers; kept 1" store gc dir:chunks)
if(EXISTS ${dead} OR NOT EXISTS ${fresh} OR NOT EXISTS ${users})
  message(FATAL_ERROR "store gc removed the wrong temporaries")
endif()
expect(0 "removed 1 temporary file" store gc dir:chunks --min-age 0)
expect(0 "ok: thin.kvpack" pack verify thin.kvpack --store dir:chunks)
expect(2 "--min-age = -1 is outside" store gc dir:chunks --min-age -1)
# A store's name is printed escaped, as paths are: a terminal control byte
# in it shows as \x1b.
string(ASCII 27 esc)
foreach(cmd "run;${small};--save;e.kvpack;--store;dir:s${esc}x" "pack;verify;e.kvpack;--store;dir:s${esc}x"
            "store;gc;dir:s${esc}x")
  expect(0 "dir:s.x1bx" ${cmd})
  string(FIND "${last_out}${last_err}" "${esc}" raw)
  if(NOT raw EQUAL -1)
    message(FATAL_ERROR "kvring ${cmd} printed a raw escape byte:\n${last_out}${last_err}")
  endif()
endforeach()
