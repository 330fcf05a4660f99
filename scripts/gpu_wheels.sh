#!/usr/bin/env bash
# The GPU check's kit (`make gpu-kit` runs this after `make model`): into build/gpu_wheels/ (ignored by git), the
# wheels the GPU check machine lacks (CPython 3.12, manylinux x86-64) and SmolLM2's tokenizer files, for
# scripts/gpu_check.sh to use offline there; carry that one folder along. That machine has torch, triton,
# transformers, numpy, safetensors, tokenizers, jinja2, aiohttp, httpx, anyio, h11, click, uvloop and
# prometheus-client; lightserve's server imports these too. xgrammar and gguf are imported only for
# structured output and the GGUF model, which the check does not use.
#
#   bash scripts/gpu_wheels.sh [DEST]          fails when the kit passes 40 MiB (64 MiB travel in all)
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
# Into a fresh folder, then in place of the kit's wheels: a wheel of an earlier pin left beside its successor
# would stop the offline install there.
FRESH=$(mktemp -d "${DEST%/}.download.XXXXXX")
trap 'rm -rf "$FRESH"' EXIT
for spec in "${WHEELS[@]}"; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$FRESH" "$spec" 2> >(grep -v "is ignored: it is neither" >&2)
done
rm -f "$DEST"/*.whl
mv "$FRESH"/*.whl "$DEST"/
# SmolLM2's tokenizer files (3.4 MiB): the check's SmolLM2-shaped checkpoint is built around them there.
MODEL=${MODEL_DIR:-$("$PY" -c "import sys; sys.path.insert(0, 'scripts'); import benchmark_serving as b; print(b.default_model_dir())")}
mkdir -p "$DEST/tokenizer"
for f in tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json; do
    cp "$MODEL/$f" "$DEST/tokenizer/" || { echo "gpu kit: $MODEL/$f missing (run make model)" >&2; exit 1; }
done
total=$(du -sb "$DEST" | cut -f1)
ls -1 "$DEST"
echo "gpu kit: $(ls "$DEST"/*.whl | wc -l) wheels + tokenizer, $((total / 1024)) KiB in $DEST"
if (( total > LIMIT_MIB * 1024 * 1024 )); then
    echo "gpu kit: $DEST is over the ${LIMIT_MIB} MiB limit" >&2
    exit 1
fi
