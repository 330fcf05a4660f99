#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: kernel tests run natively, kernel micro-benchmarks,
# a server smoke test on the default model, and a throughput benchmark with and without CUDA graphs.
# Every figure goes to one results folder (default results/gpu_check). Budget: under 8 minutes on an H200.
#
#   bash scripts/gpu_check.sh [RESULTS_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/gpu_check}
mkdir -p "$OUT"
PY=${PY:-python}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" \
    > "$OUT/device.txt" 2>&1 || { cat "$OUT/device.txt"; exit 1; }
note "device: $(cat "$OUT/device.txt")"
$PY -c "import triton, torch; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$SUMMARY"

# Make sure the package and the model are there (no-ops when they are).
make -s model >/dev/null 2>&1 || $PY -m lightserve.model_prep >/dev/null

# 1. Kernel tests, natively on the GPU (bf16 dot paths included there).
t0=$(date +%s)
timeout 240 $PY -m pytest tests/kernels -q -p no:cacheprovider > "$OUT/kernel_tests.txt" 2>&1
note "kernel tests: rc=$? $(tail -1 "$OUT/kernel_tests.txt") ($(( $(date +%s) - t0 )) s)"

# 2. Kernel micro-benchmarks: time, GB/s, TFLOP/s and fraction of the device's peak.
timeout 120 $PY scripts/bench_kernels.py --json "$OUT/kernels.json" > "$OUT/kernels.txt" 2>&1
note "kernel bench: rc=$? (see kernels.txt)"
cat "$OUT/kernels.txt" >> "$SUMMARY"

# 3 + 4. Server smoke test and throughput, with and without CUDA graphs.
PORT=${PORT:-18123}
run_server() {  # $1 = label, rest = extra flags
    local label=$1; shift
    $PY -m lightserve.launch_server --device cuda --port "$PORT" "$@" > "$OUT/server_$label.log" 2>&1 &
    local pid=$!
    for _ in $(seq 1 180); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
        kill -0 $pid 2>/dev/null || break
        sleep 1
    done
    local smoke
    smoke=$(curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
        -d '{"messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":16,"temperature":0}')
    note "[$label] smoke: $smoke"
    timeout 150 $PY scripts/benchmark_serving.py --backend openai --base-url "http://127.0.0.1:$PORT" \
        --dataset random --num-prompts 256 --input-len-min 128 --input-len-max 512 --output-len 128 \
        --max-concurrency 128 --warmup 8 --no-progress --output-json "$OUT/throughput_$label.json" \
        > "$OUT/throughput_$label.txt" 2>&1
    note "[$label] throughput (256 prompts of 128-512 tokens, 128 out, 128 in flight):"
    grep -E "throughput|TPOT|ITL|TTFT" "$OUT/throughput_$label.txt" | head -12 | tee -a "$SUMMARY"
    timeout 60 $PY scripts/benchmark_serving.py --backend openai --base-url "http://127.0.0.1:$PORT" \
        --dataset random --num-prompts 8 --input-len 256 --output-len 256 --max-concurrency 1 --no-progress \
        --output-json "$OUT/decode_bs1_$label.json" > "$OUT/decode_bs1_$label.txt" 2>&1
    note "[$label] batch-1 decode:"
    grep -E "TPOT|ITL" "$OUT/decode_bs1_$label.txt" | head -4 | tee -a "$SUMMARY"
    kill -TERM $pid 2>/dev/null
    wait $pid 2>/dev/null
}
run_server cudagraph
run_server eager --disable_cudagraph
note "results in $OUT"
