#!/usr/bin/env bash
# The GPU check: one run on a bare machine with an NVIDIA GPU and no network, at most 540 s of stages.
# Prepare on a machine with network first: `make gpu-kit` (scripts/gpu_wheels.sh) puts the wheels the GPU machine
# lacks and SmolLM2's tokenizer files into build/gpu_wheels/ (git-ignored; carry that folder along).
#
#   bash scripts/gpu_check.sh [--device cuda|cpu]
#
# Stages, each under its own hard limit (timeout --kill-after), 540 s together (a later stage gets what is left):
#   install      30 s  the wheels offline, lightserve with --no-deps (GPU only)
#   checkpoints  40 s  random-weight checkpoints built with transformers
#   (a)          80 s  the Triton kernel tests on the device, bf16 dots included; no C kernels (see below)
#   (b)         150 s  the model runner against transformers: ~20 cold Triton compiles and graph capture at start,
#                      an 8120-token prefill in 2k chunks, 64 greedy decode steps, graph replay vs eager, the
#                      transformers reference (it prints the time of each phase)
#   (c)         120 s  a real server against transformers on 16 prompts, then the W1 load (start <= 70 s, W1 <= 30 s)
#   (d)         120 s  timings on Llama-3.1-8B's shape (4 layers): its own ~20 cold compiles (head_dim 128) and
#                      20 graph captures at start; the Triton kernels that serving would compile after warm-up
# Every stage prints one verdict line, `(x) PASS|FAIL|TIMEOUT ...`, and the run ends with `verdict ...: PASS|FAIL`.
# Results: $OUT (default results/gpu_check) gets two files, summary.txt and gpu_check.tar.gz (every log and JSON;
# also left unpacked in $WORK/results). $WORK (default /tmp/lightserve-gpu-check) holds the checkpoints.
#
# A stage's processes share the process group `timeout` makes; a server runs in its own session, and stage (c)
# appends its group id to $WORK/server.pgid. After every stage, and at the start of a run (a killed run's
# leftovers), each group recorded there is sent SIGTERM, then SIGKILL, so no server keeps 85% of the GPU's memory.
#
# Stage (a) runs tests/kernels with LIGHTSERVE_NO_C_KERNELS=1 (library() returns None, so nothing calls gcc, not
# even the skipif conditions at collection) and `-k "not cpu and not c_kernel"` (the C kernels' tests are named
# so; without the library they would fail, not skip). It fails if a C kernel build appears in its cache folder.
#
# --device cpu is the dry run (tests/scripts/test_gpu_check.py): the same stages on small shapes, on the GPU code
# path under Triton's interpreter (--kernel_backend triton), no install, and stage (a) only collects its tests.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
while (( $# )); do
    case $1 in
        --device) DEVICE=${2:-}; shift 2 || shift ;;
        *) echo "usage: bash scripts/gpu_check.sh [--device cuda|cpu]" >&2; exit 2 ;;
    esac
done
[[ $DEVICE == cuda || $DEVICE == cpu ]] || { echo "--device: cuda or cpu, got '$DEVICE'" >&2; exit 2; }
OUT=${OUT:-results/gpu_check}
PY=${PY:-python3}
KIT=${KIT:-build/gpu_wheels}
WORK=${WORK:-/tmp/lightserve-gpu-check}
RES=$WORK/results                 # every log and JSON; archived into $OUT/gpu_check.tar.gz
BUDGET_S=540
KILL_AFTER_S=10                   # SIGTERM at a stage's limit, SIGKILL this much later
PGID_FILE=$WORK/server.pgid
mkdir -p "$OUT" "$WORK"
rm -rf "$RES" "$OUT/gpu_check.tar.gz"
mkdir -p "$RES"
SUMMARY=$RES/summary.txt
: > "$SUMMARY"
START=$(date +%s)
DEADLINE=$((START + BUDGET_S))
BAD=()                            # "x VERDICT" of every stage that did not pass
STAGE_PGID=""
export PYTHONUNBUFFERED=1

note() { echo "$*" | tee -a "$SUMMARY"; }

# group_alive PGID: whether a live (not zombie) process of that group is left; only a python one counts, so a
# group id that a later, unrelated process reused is never signalled.
group_alive() {
    ps -eo pgid=,stat=,args= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ && /python/ { found = 1 } END { exit !found }'
}

# kill_group PGID: SIGTERM to the group, SIGKILL once 8 s have passed with a process of it left.
kill_group() {
    local pgid=$1 i
    [[ $pgid =~ ^[0-9]+$ ]] && (( pgid > 1 )) || return 0
    group_alive "$pgid" || return 0
    kill -TERM -- "-$pgid" 2>/dev/null
    for i in $(seq 16); do sleep 0.5; group_alive "$pgid" || return 0; done
    note "  process group $pgid still alive 8 s after SIGTERM: SIGKILL"
    kill -KILL -- "-$pgid" 2>/dev/null
    for i in $(seq 10); do sleep 0.5; group_alive "$pgid" || return 0; done
}

# stop_servers: kill every server group recorded in $PGID_FILE (this run's, or a killed run's), then forget them.
stop_servers() {
    [[ -f $PGID_FILE ]] || return 0
    local pgid
    while read -r pgid; do kill_group "$pgid"; done < "$PGID_FILE"
    rm -f "$PGID_FILE"
}

gpu_memory() {
    [[ $DEVICE == cuda ]] && command -v nvidia-smi > /dev/null \
        && note "  GPU memory used: $(nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader | head -1)"
}

archive() {
    cp "$SUMMARY" "$OUT/summary.txt"
    tar -czf "$OUT/gpu_check.tar.gz" -C "$WORK" results 2>/dev/null
}

# On SIGTERM or Ctrl-C (a caller's own limit): end the running stage and any server, keep what was written.
on_signal() {
    trap - TERM INT
    [[ -n $STAGE_PGID ]] && kill -TERM -- "-$STAGE_PGID" 2>/dev/null
    stop_servers
    note "verdict after $(( $(date +%s) - START )) s: FAIL (stopped by a signal)"
    archive
    exit 143
}
trap on_signal TERM INT

# verdict KEY VERDICT TEXT: the stage's one verdict line.
verdict() {
    note "($1) $2 $3"
    [[ $2 == PASS ]] || BAD+=("$1 $2")
}

# stage KEY NAME LIMIT CMD...: CMD under a hard limit (no more than the budget left), its output in $RES/NAME.log,
# the lines it prints starting with "(KEY) " copied to the summary, then one verdict line. Returns CMD's status.
stage() {
    local key=$1 name=$2 limit=$3; shift 3
    local left=$(( DEADLINE - $(date +%s) ))
    (( left < limit )) && limit=$left
    if (( limit < 5 )); then
        verdict "$key" TIMEOUT "not run: the ${BUDGET_S} s budget is spent"
        return 124
    fi
    local t0 rc took
    t0=$(date +%s)
    # In the background so that a signal to this script is handled at once (see on_signal); timeout makes its own
    # process group, whose id is its pid, and on the limit signals that whole group.
    timeout --kill-after="$KILL_AFTER_S" "$limit" "$@" > "$RES/$name.log" 2>&1 &
    STAGE_PGID=$!
    wait "$STAGE_PGID"
    rc=$?
    STAGE_PGID=""
    stop_servers
    took=$(( $(date +%s) - t0 ))
    grep -E "^\($key\) " "$RES/$name.log" | sed 's/^/  /' | tee -a "$SUMMARY"
    if (( (rc == 124 || rc == 137) && took >= limit )); then
        verdict "$key" TIMEOUT "after ${took} s (limit ${limit} s); see $name.log"
    elif (( rc == 0 )); then
        verdict "$key" PASS "in ${took} s (limit ${limit} s)"
    else
        verdict "$key" FAIL "rc=$rc in ${took} s (limit ${limit} s): $(grep -E -v '^\s*$' "$RES/$name.log" \
            | tail -1 | cut -c1-200); see $name.log"
    fi
    gpu_memory
    return $rc
}

# not_run KEY WHY: the verdict line of a stage that cannot run.
not_run() { verdict "$1" FAIL "not run: $2"; }

stop_servers   # a killed run's servers would hold the GPU's memory
if [[ $DEVICE == cuda ]]; then
    $PY -c "import torch, triton, transformers as t; assert torch.cuda.is_available(), 'no CUDA device'
print(torch.cuda.get_device_name(0) + '; torch', torch.__version__, 'triton', triton.__version__, 'transformers',
      t.__version__)" > "$RES/device.txt" 2>&1 \
        || { note "$(tail -1 "$RES/device.txt")"; note "verdict after 0 s: FAIL (no usable CUDA device)"; archive; exit 1; }
    note "device: $(cat "$RES/device.txt")"
    gpu_memory
    # Offline: the wheels resolve against each other and what the machine has; lightserve without its deps.
    # (PIP_BREAK_SYSTEM_PACKAGES: the machine is bare and given back after the run.)
    export PIP_BREAK_SYSTEM_PACKAGES=1
    stage install install 30 bash -c "$PY -m pip install -q --no-index --find-links '$KIT' pyzmq fastapi uvicorn \
        orjson && $PY -m pip install -q --no-index --no-deps --no-build-isolation -e ."
    INSTALLED=$?
    TOKENIZER=$KIT/tokenizer
else
    export TRITON_INTERPRET=1   # the GPU code path in Triton's interpreter (the server's launcher sets it itself)
    note "device: cpu (dry run: the GPU code path under Triton's interpreter, small shapes)"
    INSTALLED=0
    TOKENIZER=${TOKENIZER:-$($PY -c "import sys; sys.path.insert(0, 'scripts'); import benchmark_serving as b; print(b.default_model_dir())")}
fi

if (( INSTALLED == 0 )); then
    stage checkpoints checkpoints 40 $PY scripts/gpu_check.py checkpoints --device "$DEVICE" --out "$WORK" \
        --tokenizer "$TOKENIZER"
    CHECKPOINTS=$?
    # Stage (a) in its own cache folder, where a C kernel build (which must not happen) would show.
    rm -rf "$WORK/a_cache"
    PYTEST=(env LIGHTSERVE_NO_C_KERNELS=1 LIGHTSERVE_CACHE="$WORK/a_cache" $PY -m pytest tests/kernels
            -p no:cacheprovider -k "not cpu and not c_kernel" --junitxml "$RES/stage_a.xml")
    if [[ $DEVICE == cpu ]]; then
        PYTEST+=(--collect-only)
    else
        # xdist (installed there) spreads the Triton compiles over the cores.
        $PY -c "import xdist" 2> /dev/null && PYTEST+=(-n 8)
        PYTEST+=(--timeout 60)
    fi
    stage a a_kernels 80 bash -c '
        log=$1 cache=$2; shift 2
        "$@"; rc=$?
        echo "(a) kernel tests: $(grep -E "[0-9]+ (passed|failed|errors?)|tests? collected" "$log" | tail -1)"
        if [[ -e $cache/kernels ]]; then echo "(a) C kernels were built in $cache: the stage must not build them"; exit 1; fi
        exit $rc' _ "$RES/a_kernels.log" "$WORK/a_cache" "${PYTEST[@]}"
    if (( CHECKPOINTS == 0 )); then
        stage b b_runner 150 $PY scripts/gpu_check.py runner --device "$DEVICE" --model "$WORK/smollm2" --out "$RES"
        stage c c_server 120 $PY scripts/gpu_check.py server --device "$DEVICE" --model "$WORK/smollm2" --out "$RES" \
            --start-timeout 70 --bench-timeout 30 --pgid-file "$PGID_FILE"
        stage d d_timings 120 $PY scripts/gpu_check.py timings --device "$DEVICE" --model "$WORK/llama8b" --out "$RES"
    else
        for key in b c d; do not_run $key "the checkpoints failed"; done
    fi
else
    for key in checkpoints a b c d; do not_run $key "the install failed"; done
fi

if (( ${#BAD[@]} == 0 )); then
    note "verdict after $(( $(date +%s) - START )) s: PASS"
else
    note "verdict after $(( $(date +%s) - START )) s: $(printf '%s, ' "${BAD[@]}")FAIL"
fi
archive
echo "results: $OUT/summary.txt, $OUT/gpu_check.tar.gz (unpacked in $RES)"
(( ${#BAD[@]} == 0 ))
