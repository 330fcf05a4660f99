"""The default model's held chat prompts, shared by the tests that run SmolLM2 in-process, and the one-thread setting
they run under (an autouse fixture: importing it into a test module applies it there)."""
from __future__ import annotations

import pytest
import torch

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a hash table is in one sentence.",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # NOTE: with 2 OpenMP threads on a 2-core machine shared with other test runs, every small matmul
    # waits for a descheduled thread: measured 10x slower than 1 thread under load. These batch-4
    # shapes gain little from a second thread anyway.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
