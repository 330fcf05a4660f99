"""Fixtures for the HTTP front tests: the bundled SmolLM2 tokenizer and a fresh FakeEngine."""
from __future__ import annotations

import time
from typing import Any

import pytest

from .helpers import FakeEngine

TOKENIZER_WAIT_S = 120


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from lightserve.model_prep import COMPLETE_MARKER, default_cache_root
    folder = default_cache_root() / "SmolLM2-135M-Instruct"
    deadline = time.monotonic() + TOKENIZER_WAIT_S
    while not (folder / COMPLETE_MARKER).is_file():
        if time.monotonic() > deadline:
            pytest.skip(f"{folder} is not prepared (run python -m lightserve.model_prep)")
        time.sleep(2)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()
