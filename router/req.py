"""Req: the router's private scheduling state of one request. Request data lives in shm."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import numpy as np


class ReqStatus(Enum):
    WAITING = auto()   # queued, never run
    RUNNING = auto()   # in the running batch; holds KV
    PAUSED = auto()    # was running, KV released under pressure; waits at the head of the queue
    DONE = auto()      # retired (finished or aborted); a step still in flight may name it


@dataclass(eq=False, slots=True)
class Req:
    req_id: int
    shm_index: int
    prompt_len: int
    max_new_tokens: int
    status: ReqStatus = ReqStatus.WAITING
    num_output: int = 0            # output tokens published by rank 0 (router's copy)
    pending: int = 0               # tokens sampled by steps planned but not finished (0 or 1: the step in flight)
    computed_len: int = 0          # tokens whose KV is in the cache or written by a planned step
    cached_len: int = 0            # prefix-cache hit at the latest admission
    kv_locs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # [capacity] int32
    prefix_node: Any = None        # radix node locked while running (None without the cache)
    use_cache: bool = True         # False: per-request disable_prompt_cache
    prompt_logprobs: bool = False  # rank 0 needs the logits of every prompt position (never cache-matched
                                   # at first admission; a resume may match: its prompt logprobs are written)
    group_id: int = 0              # != 0: one of n samples of one prompt (see groups.Groups.must_wait)
    prompt_cached: bool = False    # its prompt KV was put in the radix cache once computed (Scheduler._cache_prompt)
    dup_locs: np.ndarray | None = None  # own rows duplicating the tree's after a mid-run prompt insert
    # Speculative decoding (router/speculation.py):
    min_new_tokens: int = 0        # below it eos and stop ids are banned per token: no drafts until it is reached
    spec_ok: bool = False          # its sampling params let it speculate (Speculation.admits)
    spec_skip: int = 0             # decodes left before it tries to speculate again
    spec_backoff: int = 0          # the last skip it was given (doubles while lookups find nothing)
    draft_locs: np.ndarray | None = None  # [k] KV rows of the drafts a step in flight scores; not in computed_len
    # LoRA (router/lora_slots.py):
    lora_id: int = 0               # the adapter it runs under (0: the base model)
    lora_slot: int = -1            # the workers' weight slot of that adapter while it runs (-1: none)

    @property
    def seq_len(self) -> int:
        """Tokens known or being sampled: the prompt, every published output token and the one a step in flight
        samples (its id is rank 0's until that step is done)."""
        return self.prompt_len + self.num_output + self.pending

    @property
    def extend_len(self) -> int:
        """Tokens whose KV still has to be computed before the next token can be sampled."""
        return self.seq_len - self.computed_len

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.max_new_tokens - self.num_output, 0)

    def ensure_capacity(self, n: int) -> None:
        if self.kv_locs.shape[0] < n:
            grown = np.zeros(max(n, 2 * self.kv_locs.shape[0], 64), np.int32)
            grown[: self.kv_locs.shape[0]] = self.kv_locs
            self.kv_locs = grown
