#!/usr/bin/env bash
# Shared-prefix TTFT through sglang-router: --policy cache_aware against round_robin, on loopback.
#
# For each policy: start REPLICAS fresh lightserve replicas (empty prefix caches) and the router,
# run scripts/benchmark_serving.py through the router on the shared-prefix workload, stop all.
# The workload is NUM_PREFIXES long prefixes (one system prompt per tenant, say) used in turn; each
# replica's KV cache (KV tokens) holds about half of them. cache_aware keeps each prefix on one
# replica, so it stays cached there; round_robin sends every prefix to every replica, whose LRU
# cache then holds the prefixes of the requests least likely to come next. NUM_PREFIXES is odd so
# that round robin cannot pin a prefix to a replica by accident (request i uses prefix i mod k and
# goes to replica i mod 2).
#
#   bash scripts/bench_router.sh                                  # the measured run
#   NUM_PROMPTS=14 PREFIX_LEN=128 KV=1024 OUTPUT_LEN=4 bash scripts/bench_router.sh   # a quick check
#
# Writes OUT_DIR/router_<policy>.json (benchmark_serving's result) and prints both TTFTs and their
# ratio. Needs the test extras (sglang-router). Only loopback addresses are used.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python}
REPLICAS=${REPLICAS:-2}
NUM_PREFIXES=${NUM_PREFIXES:-7}
PREFIX_LEN=${PREFIX_LEN:-1024}
NUM_PROMPTS=${NUM_PROMPTS:-64}
OUTPUT_LEN=${OUTPUT_LEN:-16}
CONCURRENCY=${CONCURRENCY:-8}
KV=${KV:-6144}
POLICIES=${POLICIES:-"cache_aware round_robin"}
OUT_DIR=${OUT_DIR:-.benchmarks/router}
SERVER_ARGS=${SERVER_ARGS:-}
ROUTER_ARGS=${ROUTER_ARGS:-}  # more sglang-router flags, e.g. "--balance-abs-threshold 2"
mkdir -p "$OUT_DIR"

pids=()
stop_all() {
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$pid" 2>/dev/null || true
    done
    pids=()
}
trap stop_all EXIT

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

wait_http() {  # url, what
    for _ in $(seq 1 600); do
        if "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" 2>/dev/null; then
            return 0
        fi
        sleep 0.5
    done
    echo "$2 not ready at $1" >&2
    return 1
}

for policy in $POLICIES; do
    urls=()
    for i in $(seq 1 "$REPLICAS"); do
        port=$(free_port)
        # shellcheck disable=SC2086
        "$PY" -m lightserve.launch_server --port "$port" --max_total_token_num "$KV" --shutdown_grace_s 5 \
            $SERVER_ARGS >"$OUT_DIR/replica${i}_${policy}.log" 2>&1 &
        pids+=($!)
        urls+=("http://127.0.0.1:$port")
    done
    for url in "${urls[@]}"; do wait_http "$url/health" replica; done
    rport=$(free_port)
    # shellcheck disable=SC2086
    "$PY" -m sglang_router.launch_router --host 127.0.0.1 --port "$rport" --worker-urls "${urls[@]}" \
        --policy "$policy" --prometheus-host 127.0.0.1 --prometheus-port "$(free_port)" \
        --shutdown-grace-period-secs 1 --log-level warn $ROUTER_ARGS >"$OUT_DIR/router_${policy}.log" 2>&1 &
    pids+=($!)
    wait_http "http://127.0.0.1:$rport/v1/models" router
    sleep 1  # the worker registration finishes just after /v1/models answers
    "$PY" scripts/benchmark_serving.py --backend openai --base-url "http://127.0.0.1:$rport" \
        --dataset shared-prefix --num-prefixes "$NUM_PREFIXES" --prefix-len "$PREFIX_LEN" \
        --suffix-len-min 32 --suffix-len-max 64 --num-prompts "$NUM_PROMPTS" --output-len "$OUTPUT_LEN" \
        --max-concurrency "$CONCURRENCY" --seed 0 --no-progress --output-json "$OUT_DIR/router_${policy}.json"
    stop_all
done

"$PY" - "$OUT_DIR" "$CONCURRENCY" $POLICIES <<'EOF'
# "after the first wave": the first CONCURRENCY requests start together on empty caches, each
# prefix's first sight; what follows is the steady state a long-running deployment sees.
import json, statistics, sys
out, wave, policies = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rows = {}
for policy in policies:
    result = json.load(open(f"{out}/router_{policy}.json"))
    agg = result["aggregates"]
    later = sorted(result["requests"], key=lambda r: r["start"])[wave:]
    later_ms = [1000 * r["ttft"] for r in later if r["success"]]
    rows[policy] = {"p50": agg["ttft_ms"]["p50"], "mean": agg["ttft_ms"]["mean"],
                    "later p50": statistics.median(later_ms), "later mean": statistics.fmean(later_ms)}
    print(f"{policy:<12} TTFT p50 {agg['ttft_ms']['p50']:9.1f} ms  mean {agg['ttft_ms']['mean']:9.1f} ms  "
          f"after the first wave: p50 {rows[policy]['later p50']:9.1f} ms  mean {rows[policy]['later mean']:9.1f} ms  "
          f"cached input tokens {agg['cached_input_tokens']}  completed {agg['completed']}  failed {agg['failed']}")
if {"cache_aware", "round_robin"} <= rows.keys():
    for k in ("p50", "mean", "later p50", "later mean"):
        print(f"TTFT {k}: cache_aware / round_robin = {rows['cache_aware'][k] / rows['round_robin'][k]:.2f}")
EOF
