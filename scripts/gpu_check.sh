#!/usr/bin/env bash
# The GPU check: one run on a bare machine with an NVIDIA GPU and no network, within 9 minutes on an H200.
# Prepare on a machine with network first: `bash scripts/gpu_wheels.sh` puts the wheels the GPU machine
# lacks and SmolLM2's tokenizer files into build/gpu_wheels/ (carry that folder along).
#
#   bash scripts/gpu_check.sh [--device cuda|cpu]
#
# Stages, each under its own time limit (540 s together), results under $OUT (default results/gpu_check):
#   setup  install the wheels offline and lightserve with --no-deps; build random-weight checkpoints
#   (a)    pytest tests/kernels on the device (bf16 dots included)
#   (b)    the model runner against transformers: chunked long prefill, greedy decode, graph replay vs eager
#   (c)    a real server against transformers on 16 prompts, then the W1 load of benchmark_serving.py
#   (d)    timings on Llama-3.1-8B's shape (4 layers)
# --device cpu is the dry run on small shapes (tests/scripts/test_gpu_check.py): no install, stage (a)
# collects the kernel tests without running them.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
[[ "${1:-}" == "--device" ]] && DEVICE=${2:?--device needs cuda or cpu}
OUT=${OUT:-results/gpu_check}
PY=${PY:-python3}
KIT=${KIT:-build/gpu_wheels}
WORK=${WORK:-/tmp/lightserve-gpu-check}
mkdir -p "$OUT" "$WORK"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
FAILED=0
START=$(date +%s)
note() { echo "$*" | tee -a "$SUMMARY"; }

# stage NAME SECONDS CMD...: runs CMD under a time limit, its output in $OUT/NAME.log, one summary line.
stage() {
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s)
    timeout --kill-after=45 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    (( rc == 124 || rc == 137 )) && note "[$name] TIMEOUT after ${limit} s"
    grep -E '^\((b|c|d)\)|^checkpoint' "$OUT/$name.log" | tee -a "$SUMMARY"
    [[ $name == a_* ]] && note "(a) kernel tests: $(grep -E '[0-9]+ (passed|failed|errors?|tests? collected)' "$OUT/$name.log" | tail -1)"
    note "[$name] rc=$rc in $(( $(date +%s) - t0 )) s"
    (( rc == 0 )) || FAILED=1
    return $rc
}

if [[ $DEVICE == cuda ]]; then
    $PY -c "import torch; assert torch.cuda.is_available(); print(torch.cuda.get_device_name(0))" > "$OUT/device.txt" 2>&1 \
        || { cat "$OUT/device.txt"; exit 1; }
    note "device: $(cat "$OUT/device.txt"); $($PY -c 'import torch, triton, transformers as t; print("torch", torch.__version__, "triton", triton.__version__, "transformers", t.__version__)')"
    # Offline: the wheels resolve against each other and what the machine has; lightserve without its deps.
    # (PIP_BREAK_SYSTEM_PACKAGES: the machine is bare and given back after the run.)
    export PIP_BREAK_SYSTEM_PACKAGES=1
    stage install 60 bash -c "$PY -m pip install -q --no-index --find-links '$KIT' pyzmq fastapi uvicorn orjson \
        && $PY -m pip install -q --no-index --no-deps --no-build-isolation -e ." || exit 1
    TOKENIZER=$KIT/tokenizer
else
    TOKENIZER=${TOKENIZER:-$($PY -c "import sys; sys.path.insert(0, 'scripts'); import benchmark_serving as b; print(b.default_model_dir())")}
fi
export PYTHONUNBUFFERED=1

stage checkpoints 90 $PY scripts/gpu_check.py checkpoints --device "$DEVICE" --out "$WORK" --tokenizer "$TOKENIZER" || exit 1

if [[ $DEVICE == cuda ]]; then
    # xdist (installed there) spreads the Triton compiles over the cores.
    stage a_kernels 110 $PY -m pytest tests/kernels -q -p no:cacheprovider -n 8
else
    stage a_kernels 60 $PY -m pytest tests/kernels -p no:cacheprovider --collect-only
fi
stage b_runner 75 $PY scripts/gpu_check.py runner --device "$DEVICE" --model "$WORK/smollm2" --out "$OUT"
stage c_server 140 $PY scripts/gpu_check.py server --device "$DEVICE" --model "$WORK/smollm2" --out "$OUT" \
    --start-timeout 80 --bench-timeout 45
stage d_timings 65 $PY scripts/gpu_check.py timings --device "$DEVICE" --model "$WORK/llama8b" --out "$OUT"

note "total $(( $(date +%s) - START )) s; results in $OUT; $([[ $FAILED == 0 ]] && echo PASS || echo FAIL)"
exit $FAILED
