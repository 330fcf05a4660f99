"""NgramProposer: prompt-lookup drafts (--speculative_algorithm ngram). Called by router/speculation.py with a
request's tokens in shm; it needs no model, so the router proposes and the workers only verify.
"""
from __future__ import annotations

import numpy as np


class NgramProposer:
    """Finds the request's last n tokens (n from max_n down to min_n) earlier in its prompt + output and proposes
    the tokens that followed them there: text that is being copied (code under edit, a quoted document, a list
    written out again) continues as it did before."""

    def __init__(self, min_n: int, max_n: int):
        assert 1 <= min_n <= max_n, (min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: np.ndarray, max_tokens: int) -> np.ndarray:
        """tokens [L] int32: the request's prompt and outputs so far. Returns up to `max_tokens` draft tokens (int32,
        possibly fewer, empty where no n-gram of at least min_n tokens recurs): those after the most recent earlier
        occurrence of the longest suffix that recurs."""
        n_tokens = tokens.shape[0]
        if max_tokens <= 0 or n_tokens <= self.min_n:
            return tokens[:0]
        # The earlier positions j that end a match of length 1 (tokens[j] == the last token), then filtered one
        # token further back at a time: a recurring stretch is rare among all positions, so after the first compare
        # only a few candidates remain.
        ends = np.flatnonzero(tokens[: n_tokens - 1] == tokens[-1])       # [M]
        best = ends if self.min_n <= 1 else ends[:0]
        for n in range(2, min(self.max_n, n_tokens - 1) + 1):
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[n_tokens - n]]   # the match extends to n tokens
            if ends.size == 0:
                break
            if n >= self.min_n:
                best = ends
        if best.size == 0:
            return tokens[:0]
        start = int(best[-1]) + 1                                         # after the most recent occurrence
        return tokens[start: start + max_tokens]
