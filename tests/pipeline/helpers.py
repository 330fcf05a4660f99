"""Shared by the pipeline tests: the float32 settings, leftover-file checks, and the token-exact
greedy check against transformers (teacher-forced, tests/greedy_check.py)."""
from __future__ import annotations

import functools

from tests.e2e.server import (
    MODEL_DIR,
    RUNTIME_DIRS,
    wait_until,  # noqa: F401 - re-exported for the pipeline tests
)
from tests.greedy_check import greedy_mismatch

SETTINGS = {"data_type": "float32", "max_total_token_num": 16384}


def instance_files(instance_id: str) -> list[str]:
    """The shm segments and ipc socket files of one pipeline launch."""
    return sorted(str(p) for d in RUNTIME_DIRS for p in d.glob(f"lightserve-{instance_id}-*"))


@functools.lru_cache(maxsize=1)
def hf_model(model_dir: str):
    """transformers' float32 model of the pipeline's model_dir; for the default model, served from its GGUF (a
    metadata folder beside a link to the file, no weights), its float32 conversion: the same weights dequantized."""
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM
    if any(Path(model_dir).glob("*.gguf")):
        model_dir = str(MODEL_DIR)
    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


def assert_greedy(model_dir: str, prompt_ids: list[int], got: list[int], what: str) -> None:
    """Every token of `got` is transformers' greedy choice after the prompt and the tokens before it,
    or the runner-up of a near-tie; after a near-tie the check goes on from our token (teacher forcing),
    so a later wrong token still fails."""
    problem = greedy_mismatch(hf_model(model_dir), prompt_ids, got)
    assert problem is None, f"{what}: {problem}"
