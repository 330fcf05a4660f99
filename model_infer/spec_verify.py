"""Speculative decoding's verification on rank 0: how many of each request's draft tokens the target model accepts.
Called by OutputWriter (output_writer.py) on the logits of a step with BatchPlan.spec_lens. Greedy rows only (the
router speculates no other, router/speculation.py): a draft token is accepted while it equals the model's argmax at
the position before it, so the published tokens are exactly those plain decoding would have produced.
"""
from __future__ import annotations

import numpy as np


def accept_greedy(targets: np.ndarray, drafts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """targets [N] int: the model's greedy token at every scored position, request by request, each request's block
    of counts[r] = 1 + k_r positions (after its last sampled token, then after each draft); drafts [N - R] int: the
    requests' k_r draft tokens back to back. Returns accepted [R] int32: the leading drafts that match, so that
    request r's new tokens are targets[block start : block start + accepted[r] + 1] (the accepted drafts, which equal
    the targets before them, and the model's token after the last)."""
    num_reqs = counts.size
    k = counts - 1                                                        # [R] drafts per request
    width = int(k.max()) if num_reqs else 0
    # Pad to [R, width + 1]: a column of mismatches after every request's last draft ends its run.
    lane = np.arange(width + 1)
    inside = lane[None, :] < k[:, None]                                   # [R, width + 1]
    block = np.cumsum(counts) - counts                                    # [R] first target of each request
    draft_start = np.cumsum(k) - k                                        # [R] first draft of each request
    match = np.zeros((num_reqs, width + 1), bool)
    rows, cols = np.nonzero(inside)
    match[rows, cols] = drafts[draft_start[rows] + cols] == targets[block[rows] + cols]
    return np.argmin(match, axis=1).astype(np.int32)                      # the first mismatch = the run's length
