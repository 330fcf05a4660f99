"""Token-exact greedy checks against transformers by teacher forcing: one forward of prompt + our
output gives transformers' next-token logits at every step of our sequence, so each of our tokens
must be its argmax. That is the same criterion as comparing with `generate` (transformers would
produce our sequence token by token) at the cost of one forward instead of one per token.

Batching changes float32 rounding, so a token may instead be the runner-up of a genuine near-tie
(top-two gap below NEAR_TIE); anything else fails, naming the step."""
from __future__ import annotations

import torch

NEAR_TIE = 1e-4


def greedy_mismatch(hf_model, prompt_ids: list[int], got: list[int]) -> str | None:
    """None when every token of `got` is transformers' greedy choice (or a near-tie's runner-up)."""
    if not got:
        return "no tokens"
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + got])).logits[0, len(prompt_ids) - 1: -1].float()  # [n, V]
    top2 = logits.topk(2, dim=-1)
    for k, token in enumerate(got):
        best, second = top2.indices[k].tolist()
        gap = float(top2.values[k, 0] - top2.values[k, 1])
        if token == best or (token == second and gap < NEAR_TIE):
            continue
        return f"token {k}: got {token}, transformers' greedy choice {best} (top-two gap {gap:.3g})"
    return None
