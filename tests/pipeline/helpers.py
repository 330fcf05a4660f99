"""Shared by the pipeline tests: the float32 settings, leftover-file checks, and the greedy
comparison that tolerates only a genuine near-tie (batch composition changes float32 rounding)."""
from __future__ import annotations

import functools
from pathlib import Path

from tests.e2e.server import wait_until  # noqa: F401 - re-exported for the pipeline tests

SETTINGS = {"data_type": "float32", "max_total_token_num": 16384}
NEAR_TIE = 1e-4


def instance_files(instance_id: str) -> list[str]:
    return sorted(str(p) for d in (Path("/dev/shm"), Path("/tmp")) for p in d.glob(f"lightserve-{instance_id}*"))


@functools.lru_cache(maxsize=1)
def hf_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


def assert_same_greedy(got: list[int], ref: list[int], prompt_ids: list[int], model_dir: str, what: str) -> None:
    """got == ref, or they part at a step whose top two logits are a near-tie (and got took one of
    them). Tokens of another request (mixed streams) never pass."""
    if got == ref:
        return
    import torch
    k = next((i for i in range(min(len(got), len(ref))) if got[i] != ref[i]), None)
    assert k is not None, f"{what}: {len(got)} tokens vs {len(ref)} (dropped or extra tokens)"
    with torch.no_grad():
        logits = hf_model(model_dir)(torch.tensor([prompt_ids + ref[:k]])).logits[0, -1]
    top2 = torch.topk(logits, 2)
    gap = float(top2.values[0] - top2.values[1])
    assert gap < NEAR_TIE and got[k] in top2.indices.tolist(), f"{what}: differs at token {k} (gap {gap:.3g})"
