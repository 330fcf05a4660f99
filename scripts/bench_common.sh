# What the side-by-side server comparisons (scripts/compare_vllm.sh, scripts/compare_llamacpp.sh) share, sourced
# by them before their options are parsed: messages (die, log), one server at a time in its own process group
# (started, waited on GET /health, stopped by its PID on exit), the workloads W1-W3 and the C<n> sweep, and one
# side's runs of scripts/benchmark_serving.py (a discarded warm-up, then RUNS measured runs with their own seeds).
#
# The sourcing script sets REPO before sourcing it; PORT, PYTHON, RUNS, WORKLOADS, START_TIMEOUT and RUN_DIR (where
# server logs and per-run JSONs go; it may change between servers) before calling these functions; MODEL_DIR where
# run_side is given no tokenizer. BENCH_NAME prefixes errors (default: the script's file name). AFTER_WARMUP, when
# set, names a function run_side calls with (side, workload) after each warm-up run, the server still up;
# BENCH_EXTRA_ARGS, more benchmark_serving.py flags for every run.
# shellcheck shell=bash

BENCH_NAME=${BENCH_NAME:-$(basename "$0" .sh)}
BENCH="$REPO/scripts/benchmark_serving.py"

die() { echo "$BENCH_NAME: error: $*" >&2; exit 1; }
log() { echo "[$(date +%H:%M:%S)] $*" >&2; }

# ---- server lifetime: one at a time, in its own process group, stopped by the trap -----------
SERVER_PID=""
BENCH_PID=""
stop_server() {
  [[ -n "$SERVER_PID" ]] || return 0
  local pid=$SERVER_PID
  SERVER_PID=""
  log "stopping server (process group $pid)"
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 60); do
    kill -0 -- "-$pid" 2>/dev/null || break
    sleep 0.5
  done
  if kill -0 -- "-$pid" 2>/dev/null; then
    log "server did not stop in 30 s; killing it"
    kill -KILL -- "-$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
  # The Intel OpenMP that vLLM preloads registers each process in /dev/shm and leaves the file
  # behind when the process is killed: remove those of processes no longer alive.
  local f owner
  for f in /dev/shm/__KMP_REGISTERED_LIB_*; do
    [[ -e "$f" ]] || continue
    owner=${f#/dev/shm/__KMP_REGISTERED_LIB_}
    owner=${owner%%_*}
    kill -0 "$owner" 2>/dev/null || rm -f "$f"
  done
}
cleanup() {
  if [[ -n "$BENCH_PID" ]]; then kill -TERM "$BENCH_PID" 2>/dev/null || true; wait "$BENCH_PID" 2>/dev/null || true; fi
  stop_server
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

port_in_use() {
  "$PYTHON" -c "import socket,sys; s=socket.socket(); s.settimeout(1); sys.exit(0 if s.connect_ex(('127.0.0.1', $PORT)) == 0 else 1)"
}

# start_server LOGFILE ENV... -- CMD...: runs CMD under setsid (a new process group led by
# SERVER_PID, so the engine's child processes are stopped with it) and waits on /health.
start_server() {
  local logfile=$1; shift
  local envs=()
  while [[ "$1" != "--" ]]; do envs+=("$1"); shift; done
  shift
  port_in_use && die "port $PORT is already in use: pick another with --port"
  mkdir -p "$RUN_DIR"
  log "starting: ${envs[*]} $*"
  log "server log: $logfile"
  # Run from the log folder: `python -m` puts the working directory first on sys.path, and the
  # repo root's top-level folders (kernels/, router/, ...) would shadow PyPI packages of the same
  # name (transformers imports `kernels` when it is importable).
  (cd "$RUN_DIR" && exec env ${envs[@]+"${envs[@]}"} setsid "$@" >"$logfile" 2>&1 </dev/null) &
  SERVER_PID=$!
  local t0=$SECONDS
  until curl -sf -o /dev/null --max-time 5 "http://127.0.0.1:$PORT/health"; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      tail -n 40 "$logfile" >&2 || true
      die "server exited during start-up (log: $logfile)"
    fi
    (( SECONDS - t0 < START_TIMEOUT )) || { tail -n 40 "$logfile" >&2; die "server not healthy after ${START_TIMEOUT}s"; }
    sleep 2
  done
  log "server healthy after $((SECONDS - t0)) s"
}

# ---- workloads -------------------------------------------------------------------------------
workload_args() {
  case "$1" in
    W1) echo "--dataset random --num-prompts 128 --input-len-min 128 --input-len-max 512 --output-len 128 --request-rate inf --max-concurrency 64" ;;
    W2) echo "--dataset random --num-prompts 16 --input-len 256 --output-len 64 --max-concurrency 1" ;;
    W3) echo "--dataset shared-prefix --num-prompts 64 --prefix-len 1024 --suffix-len-min 32 --suffix-len-max 64 --output-len 32 --max-concurrency 16" ;;
    # The concurrency sweep (docs/performance.md's plots): 256-token prompts, 64 output tokens, C in flight, 2 C
    # requests (at least 8).
    C[0-9]*) local c=${1#C}
      [[ "$c" =~ ^[1-9][0-9]*$ ]] || die "unknown workload $1"
      echo "--dataset random --num-prompts $(( c * 2 > 8 ? c * 2 : 8 )) --input-len 256 --output-len 64 --max-concurrency $c" ;;
    *) die "unknown workload $1 (W1, W2, W3, or C<concurrency>)" ;;
  esac
}

# workload_context W: the most tokens one request of W holds (prompt + output), as workload_args defines W.
workload_context() {
  case "$1" in
    W1) echo 640 ;;
    W2) echo 320 ;;
    W3) echo 1120 ;;
    C[0-9]*) echo 320 ;;
    *) die "unknown workload $1 (W1, W2, W3, or C<concurrency>)" ;;
  esac
}

# run_side NAME [TOKENIZER]: the workloads against the server now on $PORT (prompts made with TOKENIZER, default
# $MODEL_DIR). Warm-up seed 1000, runs 1..RUNS; files $RUN_DIR/NAME-W-RUN.json.
run_side() {
  local side=$1 tokenizer=${2:-$MODEL_DIR} w run seed out
  for w in ${WORKLOADS//,/ }; do
    for run in warmup $(seq 1 "$RUNS"); do
      if [[ $run == warmup ]]; then seed=1000; else seed=$run; fi
      out="$RUN_DIR/$side-$w-$run.json"
      log "$side $w run $run (seed $seed)"
      # In the background + wait, so a signal to this script runs the trap at once.
      # shellcheck disable=SC2046  # workload_args is a word list on purpose
      "$PYTHON" "$BENCH" --backend openai --base-url "http://127.0.0.1:$PORT" --tokenizer "$tokenizer" \
        $(workload_args "$w") ${BENCH_EXTRA_ARGS:-} --ignore-eos --temperature 0 --seed "$seed" --no-progress \
        --output-json "$out" >"$out.log" 2>&1 &
      BENCH_PID=$!
      wait "$BENCH_PID" || { BENCH_PID=""; cat "$out.log" >&2; die "benchmark failed ($side $w $run)"; }
      BENCH_PID=""
      "$PYTHON" - "$out" <<'EOF' >&2
import json, sys
a = json.load(open(sys.argv[1]))["aggregates"]
print(f"    ok {a['completed']} failed {a['failed']} | {a['duration_s']:.1f} s | out {a['output_throughput']:.1f} tok/s"
      f" | TTFT mean {a['ttft_ms']['mean'] or 0:.1f} ms | TPOT mean {a['tpot_ms']['mean'] or 0:.1f} ms")
EOF
      if [[ $run == warmup && -n "${AFTER_WARMUP:-}" ]]; then "$AFTER_WARMUP" "$side" "$w"; fi
    done
  done
}
