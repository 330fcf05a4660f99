"""KVAllocator: the free pool of kv_locs (rows of the token-granular KV cache tensors).

Owned by the router's Scheduler; RadixCache returns evicted rows here.
"""
from __future__ import annotations

import numpy as np


class KVAllocator:
    """Free kv_locs kept as a stack in one int32 array: alloc pops n rows and free pushes rows back,
    each as one vectorized slice copy, so the cost does not depend on Python per token.

    A row has exactly one owner at a time: this pool, a request (rows it allocated and has not yet
    handed to the prefix cache), or the RadixCache.
    """

    def __init__(self, num_tokens: int, check_double_free: bool = False) -> None:
        """`check_double_free` keeps a per-row flag and asserts on every free that each row was
        allocated and is returned once (debug and tests; costs an extra gather per call)."""
        assert num_tokens > 0, f"num_tokens must be > 0, got {num_tokens}"
        self._num_total = num_tokens
        # Reversed so that a fresh pool hands out 0, 1, 2, ... in order (readable in logs and tests).
        self._stack = np.arange(num_tokens - 1, -1, -1, dtype=np.int32)   # [num_total]; [:_top] are free
        self._top = num_tokens
        self._is_free = np.ones(num_tokens, dtype=bool) if check_double_free else None

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_total(self) -> int:
        return self._num_total

    def alloc(self, n: int) -> np.ndarray | None:
        """Take `n` free kv_locs and return them as a new int32 array the caller owns.
        Returns None, and takes nothing, when fewer than `n` are free (the caller may evict and retry)."""
        assert n >= 0, f"alloc of {n} rows"
        if n > self._top:
            return None
        locs = self._stack[self._top - n: self._top][::-1].copy()   # [n]
        self._top -= n
        if self._is_free is not None:
            self._is_free[locs] = False
        return locs

    def free(self, locs: np.ndarray) -> None:
        """Return rows to the pool. The rows are copied in, so the caller may reuse or drop `locs`.
        Freeing a row twice is a bug; it is caught always when the pool would overflow, and always
        with `check_double_free`."""
        locs = np.asarray(locs, dtype=np.int32).reshape(-1)
        n = len(locs)
        if n == 0:
            return
        if self._is_free is not None:
            self._check_free(locs)
            self._is_free[locs] = True
        assert self._top + n <= self._num_total, (
            f"double free: {n} rows returned with only {self._num_total - self._top} in use")
        self._stack[self._top: self._top + n] = locs
        self._top += n

    def _check_free(self, locs: np.ndarray) -> None:
        assert locs.min() >= 0 and locs.max() < self._num_total, "kv_loc out of range"
        assert len(np.unique(locs)) == len(locs), "the same kv_loc appears twice in one free"
        already = locs[self._is_free[locs]]
        assert len(already) == 0, f"double free of kv_locs {already[:8].tolist()}"
