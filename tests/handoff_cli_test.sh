#!/usr/bin/env bash
# kvring handoff plan | serve and kvring run --handoff-to, on loopback and
# over a Unix socket.
#
# The pair `handoff serve --tokens N --json` + `run --handoff-to` prints the
# same tokens, logits_sha256 and generated as one `run --tokens N --json`
# that never moved, for both schedules; a wrong geometry or score scale is
# refused on both sides; --port-file writes only a regular file; a receiver or a sender killed midway is reported by the other side
# in bounded time; a port where nothing listens fails fast. Ports: the
# receiver binds port 0 and writes the port it got to a file.
#
# usage: handoff_cli_test.sh KVRING WORKDIR [BACKEND [UCX]]
# BACKEND (cpu by default; cuda on a GPU) runs both sides and the reference.
# UCX 0 (a build without the UCX transport): only the plan is checked, and
# the script exits 77 (ctest's skip) where serve and --handoff-to begin.
set -u
K=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
W=$2
B=${3:-cpu}
UCX=${4:-1}
rm -rf "$W"
mkdir -p "$W"
cd "$W" || exit 1
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in *.err; do echo "--- $f"; cat "$f"; done; exit 1; }

cat > small.json <<'JSON'
{"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
 "sliding_window": 32, "max_position_embeddings": 1024,
 "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]}
JSON
cat > wide.json <<'JSON'
{"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
 "sliding_window": 64, "max_position_embeddings": 1024,
 "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]}
JSON
common=(--config small.json --hidden 32 --vocab 64 --seed 3 --backend "$B" --no-progress)

# The fields the pair must agree on.
fields() {
  grep -o '"tokens":[0-9]*' "$1" | head -1
  grep -o '"logits_sha256":"[0-9a-f]*"' "$1"
  grep -o '"generated":\[[^]]*\]' "$1"
}

# await TEST PATH: up to 10 s for `[ TEST PATH ]` to hold.
await() {
  for _ in $(seq 100); do
    [ "$1" "$2" ] && return 0
    sleep 0.1
  done
  return 1
}

# start_serve NAME ARGS...: a receiver on a free port; sets SERVE_PID and PORT.
start_serve() {
  local name=$1
  shift
  rm -f "$name.port"
  "$K" handoff serve --listen 127.0.0.1:0 --port-file "$name.port" --backend "$B" "$@" >"$name.out" 2>"$name.err" &
  SERVE_PID=$!
  pids+=("$SERVE_PID")
  await -s "$name.port" || fail "$name: the receiver wrote no port"
  PORT=$(cat "$name.port")
}

# start_unix_serve SOCK OUT ARGS...: a receiver on the Unix socket
# $W/SOCK.sock, its output in OUT.out and OUT.err; sets SERVE_PID.
start_unix_serve() {
  local sock=$1 out=$2
  shift 2
  rm -f "$sock.sock"
  "$K" handoff serve --listen "unix:$W/$sock.sock" --backend "$B" "$@" >"$out.out" 2>"$out.err" &
  SERVE_PID=$!
  pids+=("$SERVE_PID")
  await -S "$sock.sock"
}

# The payload figure of muse-glimmer at 130815 tokens.
"$K" handoff plan --model muse-glimmer --tokens 130815 --json >plan.json 2>plan.err || fail "handoff plan"
for want in '"payload_bytes":1823184896' '"full_bytes":1741395968' '"sliding_bytes":81788928'; do
  grep -q "$want" plan.json || fail "handoff plan: no $want"
done
"$K" handoff plan --model muse-glimmer --tokens 130815 --schedule swa-first >plan.txt 2>plan.err || fail "plan swa-first"
grep -q "1,823,184,896" plan.txt || fail "plan text: no payload figure"

# Rates and latencies past their bounds are named, not overflowed.
"$K" handoff plan --model muse-glimmer --tokens 1000 --rate 1e300 2>bound.err && fail "plan --rate 1e300"
grep -q -- "--rate = 1e300 is past its bound" bound.err || fail "plan --rate bound: $(cat bound.err)"
"$K" handoff plan --model muse-glimmer --tokens 1000 --ack-latency-us 1e308 2>bound.err && fail "plan --ack-latency-us"
grep -q -- "--ack-latency-us = 1e308 is past its bound" bound.err || fail "plan ack bound: $(cat bound.err)"
"$K" handoff plan --model muse-glimmer --tokens 1000 --rate 1e-9 --prefill-tps 0.01 --message 1 >slow.txt 2>bound.err ||
  fail "a slow plan: $(cat bound.err)"
# Numbers are decimal, as the integer options: no hexadecimal, no blanks.
for v in 0x10 " 5" "5 " inf; do
  "$K" handoff plan --model muse-glimmer --tokens 1000 --rate "$v" 2>bound.err && fail "plan --rate '$v'"
  grep -q -- "--rate must be a positive number, got '$v'" bound.err || fail "plan --rate '$v': $(cat bound.err)"
done
# Rates so small that the handoff would outlast any deadline are refused
# before anything runs, by plan and by a sender.
for opt in "--rate 1e-300" "--prefill-tps 1e-300"; do
  "$K" handoff plan --model muse-glimmer --tokens 1000 $opt 2>bound.err && fail "plan $opt"
  grep -q "past the 1e+12 s a plan may take" bound.err || fail "plan $opt: $(cat bound.err)"
done
"$K" run "${common[@]}" --prompt-tokens 20 --handoff-to "unix:$W/none.sock" --handoff-rate 1e-300 2>bound.err &&
  fail "run --handoff-rate 1e-300"
grep -q "past the 1e+12 s a plan may take" bound.err || fail "run --handoff-rate 1e-300: $(cat bound.err)"
# plan --json writes its messages as it goes: a plan of 524,288 messages
# (1,024 layers of 512 one-MiB messages) prints its 121 MB of JSON in
# 512 MiB of address space; as one JSON tree it took 800 MB, and a refused
# allocation ended the tool with an abort, not a message.
cat > plan_wide.json <<'JSON'
{"num_hidden_layers": 1024, "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 1024,
 "max_position_embeddings": 4096}
JSON
bash -c 'ulimit -v 524288 && exec "$0" "$@"' "$K" handoff plan --config plan_wide.json --tokens 2049 --message 1 \
  --credits 1 --json >plan_wide.json.out 2>plan_wide.err || fail "plan of 524,288 messages under ulimit -v: exit $?"
[ "$(grep -o '"ack_s"' plan_wide.json.out | wc -l)" = 524288 ] || fail "plan of 524,288 messages: not every message"
tail -c 2 plan_wide.json.out | grep -q '^}$' || fail "plan of 524,288 messages: the JSON does not end"
rm -f plan_wide.json.out
# The sender's bound on the receiver: a rate of at least 0, with --handoff-to.
"$K" run "${common[@]}" --prompt-tokens 20 --handoff-to "unix:$W/none.sock" --handoff-min-rate -1 2>bound.err &&
  fail "run --handoff-min-rate -1"
grep -q "handoff-min-rate" bound.err || fail "run --handoff-min-rate -1: $(cat bound.err)"
"$K" run "${common[@]}" --prompt-tokens 20 --handoff-min-rate 0 2>bound.err && fail "--handoff-min-rate without --handoff-to"
grep -q "needs --handoff-to" bound.err || fail "--handoff-min-rate without --handoff-to: $(cat bound.err)"
# A prompt past the context is named as such (a sender takes no --tokens).
"$K" run "${common[@]}" --prompt-tokens 2000 --handoff-to "unix:$W/none.sock" 2>bound.err && fail "a prompt past the context"
grep -q -- "--prompt-tokens = 2000 exceeds the cache context 1024" bound.err || fail "long prompt: $(cat bound.err)"

# The pair over a Unix socket (every build has it) equals one run; serve
# refuses a port file with it.
"$K" run "${common[@]}" --prompt-tokens 100 --chunk 7 --tokens 140 --json >uref.json 2>uref.err || fail "reference run"
start_unix_serve serve unix --tokens 140 --json --timeout 20
"$K" run "${common[@]}" --prompt-tokens 100 --chunk 7 --handoff-to "unix:$W/serve.sock" >usend.out 2>usend.err ||
  fail "run --handoff-to unix:"
wait "$SERVE_PID" || fail "handoff serve on unix: exited $?"
[ "$(fields unix.out)" = "$(fields uref.json)" ] || fail "unix: summaries differ: $(fields unix.out) vs $(fields uref.json)"
[ -e serve.sock ] && fail "serve left its socket file"
# A model of sliding layers alone, whose rings hold their window, hands off
# and decodes past its context as one run does.
cat >sliding.json <<'JSON'
{"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
 "sliding_window": 32, "max_position_embeddings": 1024,
 "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention"]}
JSON
sl=(--config sliding.json --context 64 --hidden 32 --vocab 64 --seed 3 --backend "$B" --no-progress --chunk 7)
"$K" run "${sl[@]}" --prompt-tokens 80 --tokens 150 --json >sref.json 2>sref.err || fail "sliding-only reference run"
start_unix_serve sserve sliding --tokens 150 --json --timeout 20
"$K" run "${sl[@]}" --prompt-tokens 80 --handoff-to "unix:$W/sserve.sock" >ssend.out 2>ssend.err || fail "sliding-only run --handoff-to"
wait "$SERVE_PID" || fail "sliding-only serve exited $?"
[ "$(fields sliding.out)" = "$(fields sref.json)" ] || fail "sliding-only: $(fields sliding.out) vs $(fields sref.json)"
# Its header carries the prompt's token ids: at most 2^24 of them.
"$K" run "${sl[@]}" --prompt-tokens 16777217 --handoff-to "unix:$W/none.sock" 2>bound.err && fail "a prompt past 2^24"
grep -q -- "--prompt-tokens = 16777217 exceeds the 16777216 a handoff carries" bound.err || fail "2^24: $(cat bound.err)"
"$K" handoff plan --config sliding.json --context 64 --tokens 16777217 2>bound.err && fail "a plan past 2^24"
grep -q "a prompt of 16777217 tokens exceeds the 16777216 a handoff carries" bound.err || fail "plan 2^24: $(cat bound.err)"
# Many small messages (3,000 of 1 KiB) under serve's default 64 MiB of credits: the
# sender reads acknowledgements as it goes, so neither end blocks on a
# full socket (it used to time out at both ends).
f=full_attention
cat >full8.json <<EOF
{"num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 32,
 "max_position_embeddings": 4096, "layer_types": ["$f", "$f", "$f", "$f", "$f", "$f", "$f", "$f"]}
EOF
start_unix_serve many many --tokens 3000 --json --timeout 5
"$K" run --config full8.json --hidden 32 --vocab 64 --seed 3 --backend "$B" --no-progress --prompt-tokens 3000 \
  --handoff-message 1 --handoff-to "unix:$W/many.sock" >many_send.out 2>many_send.err || fail "many small messages"
wait "$SERVE_PID" || fail "many small messages: serve exited $?"
# The model a run names is the sender's choice: serve bounds it by --max-mib
# at the header, before any row moves, and the sender hears why.
start_unix_serve big big --tokens 140 --json --timeout 20 --max-mib 1
"$K" run --config small.json --hidden 256 --vocab 1024 --seed 3 --backend "$B" --no-progress --prompt-tokens 100 \
  --handoff-to "unix:$W/big.sock" >big_send.out 2>big_send.err && fail "serve --max-mib 1 took a 7 MB model"
wait "$SERVE_PID" && fail "serve --max-mib 1 exited 0"
grep -q "reference model (hidden 256, vocab 1024) takes .* (--max-mib)" big.err || fail "big model: $(cat big.err)"
grep -q "refused the session" big_send.err || fail "big model, sender: $(cat big_send.err)"
# It is bounded by the memory serve may use too (here ulimit -v 2 GiB, of
# which half may go to weights), at the header though --max-mib would take
# it: 1.16 GB of weights. On the CPU only: a CUDA context wants more
# address space than that. (A sender on a machine too small for the model
# is refused by the same bound before it connects.)
cat >heavy.json <<'EOF'
{"num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 128,
 "sliding_window": 32, "max_position_embeddings": 256, "sliding_window_pattern": 4}
EOF
if [ "$B" = cpu ]; then
  rm -f heavy.sock
  bash -c 'ulimit -v 2097152 && exec "$0" "$@"' "$K" handoff serve --listen "unix:$W/heavy.sock" --tokens 4 \
    --timeout 20 --max-mib 4096 >heavy.out 2>heavy.err &
  SERVE_PID=$!
  pids+=("$SERVE_PID")
  await -S heavy.sock || fail "heavy: no socket"
  "$K" run --config heavy.json --vocab 64 --no-progress --prompt-tokens 2 \
    --handoff-to "unix:$W/heavy.sock" >heavy_send.out 2>heavy_send.err && fail "serve under ulimit -v took a 1.16 GB model"
  if grep -q "refused the session" heavy_send.err; then
    wait "$SERVE_PID" && fail "serve under ulimit -v exited 0"
    grep -q "would take 1,157,955,584 B .*more than half the 2,147,483,648 B" heavy.err || fail "heavy model: $(cat heavy.err)"
  else
    grep -q "this process may use" heavy_send.err || fail "heavy model, sender: $(cat heavy_send.err)"
    kill "$SERVE_PID" 2>/dev/null
  fi
fi
# A receiver whose model has the session's geometry and another score scale
# refuses it, naming both scales; one of another geometry (whose default
# scale differs too) names the geometry; the sender hears why and keeps its
# session. The same model with the run's scale (head_dim, written out)
# takes it.
sed 's/"head_dim": 16,/"head_dim": 16, "query_pre_attn_scalar": 24,/' small.json >scaled.json
sed 's/"head_dim": 16,/"head_dim": 16, "query_pre_attn_scalar": 16,/' small.json >same.json
sed 's/"head_dim": 16,/"head_dim": 32,/' small.json >hd32.json
for variant in "scaled.json scores_q_._k_/_sqrt(16),_this_receiver's_model_q_._k_/_sqrt(24)" \
  "hd32.json differs_from_this_store" "same.json -"; do
  set -- $variant
  cfg=$1 says=${2//_/ }
  start_unix_serve scale scale --tokens 140 --json --timeout 20 --config "$cfg"
  if [ "$says" != - ]; then
    "$K" run "${common[@]}" --prompt-tokens 100 --chunk 7 --handoff-to "unix:$W/scale.sock" >scale_send.out \
      2>scale_send.err && fail "serve --config $cfg took the session"
    wait "$SERVE_PID" && fail "serve --config $cfg decoded the session"
    grep -qF "$says" scale_send.err || fail "--config $cfg: the sender did not hear '$says': $(cat scale_send.err)"
    grep -q "prefilled tokens are not kept" scale_send.err || fail "the sender's error does not say its prefilled tokens are lost"
  else
    "$K" run "${common[@]}" --prompt-tokens 100 --chunk 7 --handoff-to "unix:$W/scale.sock" >scale_send.out \
      2>scale_send.err || fail "serve --config $cfg refused the run: $(cat scale_send.err)"
    wait "$SERVE_PID" || fail "handoff serve --config $cfg exited $?"
    [ "$(fields scale.out)" = "$(fields uref.json)" ] || fail "--config $cfg: summaries differ"
  fi
done
"$K" handoff serve --listen "unix:$W/pf.sock" --port-file p --tokens 5 2>args.err && fail "--port-file with unix:"
grep -q "goes with --listen HOST:PORT" args.err || fail "args: $(cat args.err)"
for rate in -1 nan 1e300; do
  "$K" handoff serve --listen "unix:$W/mr.sock" --tokens 5 --min-rate "$rate" 2>args.err && fail "--min-rate $rate"
  grep -q -- "--min-rate" args.err || fail "--min-rate $rate: $(cat args.err)"
done

if [ "$UCX" = 0 ]; then
  echo "cli_handoff: this build has no UCX transport; serve and --handoff-to over UCX skipped"
  exit 77
fi

# --port-file writes a regular file or nothing: a FIFO, a directory or a
# link there is refused, and a link planted at a temporary's name is never
# followed.
mkfifo pf.fifo
mkdir -p pf.dir
echo keep >pf.victim
ln -s "$W/pf.victim" pf.link
ln -s "$W/pf.victim" pf.tmp
for f in pf.fifo pf.dir pf.link; do
  "$K" handoff serve --listen 127.0.0.1:0 --port-file "$f" --tokens 40 --timeout 1 2>pf.err && fail "--port-file $f"
  grep -q "not a regular file" pf.err || fail "--port-file $f: $(cat pf.err)"
done
"$K" handoff serve --listen 127.0.0.1:0 --port-file pf --tokens 40 --timeout 2 2>pf.err &  # nobody connects
pf_pid=$!
await -s pf || fail "--port-file pf: no port written"
[ -f pf ] && [ ! -L pf ] && grep -qE '^[0-9]+$' pf || fail "--port-file pf: $(cat pf 2>&1)"
wait $pf_pid && fail "serve with nobody connecting succeeded"
[ ! -e pf ] || fail "--port-file pf stays after serve gave up: $(cat pf)"
[ "$(cat pf.victim)" = keep ] || fail "a link at the port file's temporary name was followed"
# A serve ended by a signal removes its port file too, unless another
# process has written it since.
for other in "" other; do
  "$K" handoff serve --listen 127.0.0.1:0 --port-file pf --tokens 40 --timeout 60 2>pf.err &
  pf_pid=$!
  pids+=("$pf_pid")
  await -s pf || fail "--port-file pf: no port written"
  [ -z "$other" ] || echo "$other" >pf
  kill -TERM $pf_pid
  wait $pf_pid
  rc=$?
  [ $rc -eq 143 ] || fail "serve ended by SIGTERM exits $rc: $(cat pf.err)"
  if [ -z "$other" ]; then
    [ ! -e pf ] || fail "--port-file pf stays after SIGTERM: $(cat pf)"
  else
    [ "$(cat pf)" = other ] || fail "another's port file was removed on SIGTERM"
    rm -f pf
  fi
done

# The pair equals one run, for both schedules and two chunkings.
for variant in "paced 7" "swa-first 512" "paced 1"; do
  set -- $variant
  sched=$1 chunk=$2
  "$K" run "${common[@]}" --prompt-tokens 100 --chunk "$chunk" --tokens 140 --json >ref.json 2>ref.err || fail "reference run"
  start_serve pair --tokens 140 --json --timeout 20
  "$K" run "${common[@]}" --prompt-tokens 100 --chunk "$chunk" --handoff-to "127.0.0.1:$PORT" \
    --handoff-schedule "$sched" >send.out 2>send.err || fail "run --handoff-to ($variant)"
  wait "$SERVE_PID" || fail "handoff serve ($variant) exited $?"
  [ "$(fields pair.out)" = "$(fields ref.json)" ] || fail "($variant) summaries differ: $(fields pair.out) vs $(fields ref.json)"
  [ -n "$(fields ref.json)" ] || fail "no fields in the reference"
done

# A receiver that knows its model refuses another geometry; the sender hears why.
start_serve geometry --tokens 140 --config wide.json --timeout 20
if "$K" run "${common[@]}" --prompt-tokens 100 --handoff-to "127.0.0.1:$PORT" >geo.out 2>geo_send.err; then
  fail "a session of another geometry was accepted"
fi
wait "$SERVE_PID" && fail "serve accepted another geometry"
grep -q "refused" geo_send.err || fail "the sender did not report the refusal"
grep -q "differs from this store" geometry.err || fail "the receiver did not name the mismatch"

# A receiver that could not decode the session to its --tokens (below the
# prompt, past the context) refuses it at the header: the sender hears why
# and fails, saying its prefilled tokens are not kept, and no row moves.
for tok in 90 5000; do
  start_serve short --tokens "$tok" --timeout 20
  "$K" run "${common[@]}" --prompt-tokens 100 --handoff-to "127.0.0.1:$PORT" >short.out 2>short_send.err &&
    fail "a session serve could not decode to --tokens $tok was handed over"
  wait "$SERVE_PID" && fail "serve --tokens $tok decoded a session it could not"
  grep -q "refused the session: --tokens = $tok" short_send.err || fail "sender, --tokens $tok: $(cat short_send.err)"
  grep -q "prefilled tokens are not kept" short_send.err || fail "the sender's error does not say its prefilled tokens are lost"
done

# A slow stream of small messages (about 6 s), to kill either side midway.
slow=(--prompt-tokens 600 --chunk 8 --handoff-message 1 --handoff-rate 0.000015 --handoff-timeout 5)

# The receiver dies: the sender reports it, in bounded time.
start_serve rkill --tokens 700 --timeout 20
"$K" run "${common[@]}" "${slow[@]}" --handoff-to "127.0.0.1:$PORT" >rkill_send.out 2>rkill_send.err &
send_pid=$!
pids+=("$send_pid")
sleep 2
kill -9 "$SERVE_PID"
start=$SECONDS
wait "$send_pid" && fail "the sender did not notice the receiver's death"
[ $((SECONDS - start)) -le 15 ] || fail "the sender took $((SECONDS - start)) s to notice"
grep -q "receiver" rkill_send.err || fail "the sender's error does not name the receiver"
grep -q "prefilled tokens are not kept" rkill_send.err || fail "the sender's error does not say its prefilled tokens are lost"

# The sender dies: the receiver reports it, installs nothing, and exits.
start_serve skill --tokens 700 --timeout 5
"$K" run "${common[@]}" "${slow[@]}" --handoff-to "127.0.0.1:$PORT" >skill_send.out 2>skill_send.err &
send_pid=$!
pids+=("$send_pid")
sleep 2
kill -9 "$send_pid"
start=$SECONDS
wait "$SERVE_PID" && fail "the receiver did not notice the sender's death"
[ $((SECONDS - start)) -le 15 ] || fail "the receiver took $((SECONDS - start)) s to notice"
grep -q "nothing installed" skill.err || fail "the receiver's error: $(cat skill.err)"

# A port where nothing listens (port 1 is privileged; no test binds it).
start=$SECONDS
"$K" run "${common[@]}" --prompt-tokens 50 --handoff-to 127.0.0.1:1 --handoff-timeout 3 >none.out 2>none.err &&
  fail "a handoff to a port where nothing listens succeeded"
[ $((SECONDS - start)) -le 10 ] || fail "the sender took $((SECONDS - start)) s to fail"
grep -q "handoff to 127.0.0.1:1 failed" none.err || fail "no error for a closed port: $(cat none.err)"

# A receiver nobody connects to gives up at its timeout.
"$K" handoff serve --listen 127.0.0.1:0 --tokens 10 --timeout 1 >idle.out 2>idle.err && fail "an idle serve succeeded"
grep -q "no sender connected.*\|nothing installed" idle.err || fail "idle serve: $(cat idle.err)"

# An address this host cannot listen on (192.0.2.1 is TEST-NET-1, nobody's
# own; a port taken) is refused with the system's reason, and UCX says
# nothing of it.
"$K" handoff serve --listen 192.0.2.1:0 --tokens 5 >bind.out 2>bind.err && fail "a serve on a foreign address"
grep -q "cannot listen on 192.0.2.1:0: Cannot assign requested address" bind.err || fail "bind: $(cat bind.err)"
start_serve held --tokens 5 --timeout 20
"$K" handoff serve --listen "127.0.0.1:$PORT" --tokens 5 >taken.out 2>taken.err && fail "a serve on a taken port"
grep -q "cannot listen on 127.0.0.1:$PORT: Address already in use" taken.err || fail "taken: $(cat taken.err)"
kill -9 "$SERVE_PID"
grep -q "UCX" bind.err taken.err && fail "UCX logged on stderr: $(cat bind.err taken.err)"

# A port file that cannot be written fails serve and leaves no temporary.
mkdir -p pdir
"$K" handoff serve --listen 127.0.0.1:0 --tokens 5 --port-file pdir >pf.out 2>pf.err && fail "a port file onto a directory"
grep -q "cannot write --port-file pdir" pf.err || fail "port file: $(cat pf.err)"
[ -e pdir.tmp ] && fail "serve left pdir.tmp"

# Argument errors.
"$K" run "${common[@]}" --handoff-to 127.0.0.1:9 --tokens 5 2>args.err && fail "--tokens with --handoff-to"
grep -q "does not go with --handoff-to" args.err || fail "args: $(cat args.err)"
"$K" handoff serve --listen nowhere --tokens 5 2>args.err && fail "a bad --listen"
grep -q "not HOST:PORT" args.err || fail "args: $(cat args.err)"

echo "cli_handoff: 19 passed, 0 failed"
