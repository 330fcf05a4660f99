#!/usr/bin/env bash
# Downloads the wheels the GPU check machine lacks (CPython 3.12, manylinux x86-64) into build/gpu_wheels/
# (ignored by git), with SmolLM2's tokenizer files, for scripts/gpu_check.sh to use offline there. That machine has torch, triton,
# transformers, numpy, safetensors, tokenizers, jinja2, aiohttp, httpx, anyio, h11, click, uvloop and
# prometheus-client; lightserve's server imports these too. xgrammar and gguf are imported only for
# structured output and the GGUF model, which the check does not use.
#
#   bash scripts/gpu_wheels.sh [DEST]          fails when the wheels pass 40 MiB (64 MiB travel in all)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-build/gpu_wheels}
PY=${PY:-python3}
LIMIT_MIB=40
# Pinned to the versions lightserve is tested with; one version of each (two would stop the install).
WHEELS=(
    pyzmq==27.3.0
    fastapi==0.165.0
    starlette==1.10.0
    pydantic==2.13.4
    pydantic-core==2.46.4
    annotated-types==0.7.0
    typing-inspection==0.4.2
    annotated-doc==0.0.7
    opentelemetry-api==1.45.2   # fastapi 0.165 requires it (its telemetry module imports it)
    uvicorn==0.54.0
    typing-extensions==4.16.0   # pydantic 2.13 needs >= 4.14.1; pip uses it only if the machine's is older
    orjson==3.11.5          # the oldest line with cp312 wheels; lightserve needs >= 3.8
)
mkdir -p "$DEST"
for spec in "${WHEELS[@]}"; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$DEST" "$spec" 2> >(grep -v "is ignored: it is neither" >&2)
done
# SmolLM2's tokenizer files (3.4 MiB): the check's SmolLM2-shaped checkpoint is built around them there.
MODEL=${MODEL_DIR:-$("$PY" -c "import sys; sys.path.insert(0, 'scripts'); import benchmark_serving as b; print(b.default_model_dir())")}
mkdir -p "$DEST/tokenizer"
for f in tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json; do
    cp "$MODEL/$f" "$DEST/tokenizer/" || { echo "gpu wheels: $MODEL/$f missing (run make model)" >&2; exit 1; }
done
total=$(du -cb "$DEST"/*.whl "$DEST"/tokenizer/* | tail -1 | cut -f1)
ls -1 "$DEST"
echo "gpu wheels: $(ls "$DEST"/*.whl | wc -l) wheels + tokenizer, $((total / 1024)) KiB in $DEST"
if (( total > LIMIT_MIB * 1024 * 1024 )); then
    echo "gpu wheels: over the ${LIMIT_MIB} MiB limit" >&2
    exit 1
fi
