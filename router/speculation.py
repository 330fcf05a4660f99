"""Speculation: which decoding requests carry draft tokens in a step, their drafts and KV rows, and what rank 0's
verification taught (acceptance counters, per-request back-off). Owned by the Scheduler when
--speculative_algorithm is set; the proposer is chosen once from PROPOSERS.

A speculating request is planned as an extend of 1 + k tokens after its computed prefix: its last sampled token
(whose KV the step writes, as a decode would) and k draft tokens, each with a KV row of its own (`Req.draft_locs`,
outside `computed_len`). Rank 0 scores all of them in one forward and accepts drafts (a greedy request's while each
equals the model's greedy token before it, a sampling request's by speculative sampling: model_infer/spec_verify.py),
then reports how many; `settle` keeps the accepted rows and frees the rest, so a rejected token's row never reaches
the radix cache.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from lightserve.config import SpeculativeAlgorithm
from lightserve.router.ngram_proposer import NgramProposer

if TYPE_CHECKING:
    from lightserve.config import ServerConfig
    from lightserve.router.kv_allocator import KVAllocator
    from lightserve.router.req import Req
    from lightserve.shm.req_pool import ReqPool

class Proposer(Protocol):
    def propose(self, tokens: np.ndarray, k: int) -> np.ndarray:
        """A request's tokens [L] int32 and a draft budget -> at most k draft tokens [k'] int32 (empty: none)."""


class WorkerDrafts:
    """--speculative_algorithm draft and mtp: the router reserves k draft positions and their KV rows, with
    placeholder tokens; every worker rank's drafter writes the drafts there before the served model scores them
    (model_infer/draft_model.py, model_infer/mtp_drafter.py)."""

    def propose(self, tokens: np.ndarray, k: int) -> np.ndarray:
        return np.zeros(k, np.int32)


PROPOSERS: dict[SpeculativeAlgorithm, Callable[[ServerConfig], Proposer]] = {
    SpeculativeAlgorithm.NGRAM: lambda config: NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max),
    SpeculativeAlgorithm.DRAFT: lambda config: WorkerDrafts(),
    SpeculativeAlgorithm.MTP: lambda config: WorkerDrafts(),
}

# Above this many decoding requests no request speculates: a step's rows then cost compute rather than weight reads
# (every draft row is a full row of every GEMM), and the batch already keeps the cores busy.
MAX_SPEC_BATCH = 16
# A request whose lookup finds nothing, or whose drafts were all rejected, skips speculation for a number of its
# steps that doubles up to this, so a workload with nothing to copy runs as plain decodes (and keeps the overlap
# schedule, Scheduler.may_plan_ahead) nearly all the time.
MAX_BACKOFF_STEPS = 32


@dataclass
class SpecRow:
    """One speculating request of a step: `drafts` [k] int32 and `locs` [1 + k] int32, the KV rows of its last
    sampled token (a decode row) and of each draft token."""
    req: Req
    drafts: np.ndarray
    locs: np.ndarray


class Speculation:
    def __init__(self, propose: Proposer, num_tokens: int, pool: ReqPool, max_batch: int = MAX_SPEC_BATCH):
        """`num_tokens`: --num_speculative_tokens, the most drafts a request carries in a step."""
        self.proposer = propose
        self.num_tokens = num_tokens
        self.pool = pool
        self.max_batch = max_batch
        self.counters = dict(spec_drafts_total=0, spec_draft_tokens_total=0, spec_accepted_tokens_total=0)
        self.accepted_at = np.zeros(num_tokens, np.int64)  # [K] drafts accepted at each draft position

    @classmethod
    def from_config(cls, config: ServerConfig, pool: ReqPool) -> Speculation | None:
        if not config.speculates:
            return None
        return cls(PROPOSERS[config.speculative_algorithm](config), config.num_speculative_tokens, pool)

    @staticmethod
    def admits(params: np.void) -> bool:
        """Whether a request's sampling params (a PARAMS_DTYPE record) let it speculate: greedy or sampling
        (temperature, top_p, top_k, min_p; rank 0 verifies the one by argmax, the other by speculative sampling,
        model_infer/spec_verify.py), with nothing that changes or reports the distribution per token. Excluded:
        penalties and a grammar, which depend on the tokens before each position (rank 0 would have to apply them
        to every draft position with the drafts before it as history, and roll a grammar back past a rejection);
        logit bias and allowed ids, which the verify path does not apply (it scores unprocessed logits); top
        logprobs, whose alternatives it does not write. Chosen-token logprobs are fine."""
        return bool(params["grammar_kind"] == 0 and params["top_logprobs"] == 0
                    and params["num_logit_bias"] == 0 and params["num_allowed_token_ids"] == 0
                    and params["repetition_penalty"] == 1.0 and params["presence_penalty"] == 0.0
                    and params["frequency_penalty"] == 0.0)

    def wants(self, req: Req) -> bool:
        """The request would try to speculate at its next decode once its pending token is known (may_plan_ahead)."""
        return (req.spec_ok and req.spec_skip == 0 and req.num_output + req.pending >= req.min_new_tokens
                and req.remaining_new_tokens - req.pending >= 2)

    def may_speculate(self, decoding: list[Req]) -> bool:
        return len(decoding) <= self.max_batch and any(self.wants(r) for r in decoding)

    def plan(self, decodes: list[Req], decode_locs: np.ndarray, allocator: KVAllocator,
             budget: int) -> tuple[list[Req], np.ndarray, list[SpecRow]]:
        """Split the step's decodes [D] (with their reserved rows decode_locs [D]) into plain decodes and speculating
        rows, whose drafts take rows from `allocator` only where they are free (drafts never evict the radix cache
        or pause a request) and tokens from `budget`. Returns (plain decodes, their rows, speculating rows)."""
        if len(decodes) > self.max_batch:
            return decodes, decode_locs, []
        plain: list[int] = []
        spec: list[SpecRow] = []
        max_len = self.pool.max_len
        for i, req in enumerate(decodes):
            drafts = self._drafts(req, max_len, min(budget, allocator.num_free))
            rows = allocator.alloc(drafts.size) if drafts.size else None
            if rows is None:
                plain.append(i)
                continue
            spec.append(SpecRow(req, drafts.astype(np.int32), np.concatenate([decode_locs[i: i + 1], rows])))
            budget -= drafts.size
        if not spec:
            return decodes, decode_locs, []
        return [decodes[i] for i in plain], decode_locs[plain], spec

    def settle(self, req: Req, num_draft: int, num_accepted: int, allocator: KVAllocator) -> None:
        """Rank 0 accepted `num_accepted` of the request's `num_draft` drafts: their rows join its computed KV (their
        tokens are in shm now), the rest go back to the allocator; the counters and the request's back-off learn."""
        self.counters["spec_drafts_total"] += 1
        self.counters["spec_draft_tokens_total"] += num_draft
        self.counters["spec_accepted_tokens_total"] += num_accepted
        self.accepted_at[:num_accepted] += 1
        locs = req.draft_locs
        if locs is None:
            return  # paused while the step ran: its rows went back then (drop_drafts), its KV is recomputed on resume
        assert locs.size == num_draft and 0 <= num_accepted <= num_draft, (locs, num_accepted)
        req.ensure_capacity(req.computed_len + num_accepted + 1)
        req.kv_locs[req.computed_len: req.computed_len + num_accepted] = locs[:num_accepted]
        req.computed_len += num_accepted
        allocator.free(locs[num_accepted:])
        req.draft_locs = None
        if num_accepted:
            req.spec_backoff = 0
        else:
            self._back_off(req)

    def drop_drafts(self, req: Req, allocator: KVAllocator) -> None:
        """The request leaves the running batch (retired, paused) with drafts a step in flight scores: their rows go
        back now (the workers run steps in order, so no later step reads them before that one writes them)."""
        if req.draft_locs is not None:
            allocator.free(req.draft_locs)
            req.draft_locs = None

    def stats(self) -> dict[str, int]:
        """The counters for the pool's stats (shm STATS_FIELDS): totals and acceptances per draft position."""
        return dict(self.counters, **{f"spec_accepted_pos_{i}": int(n) for i, n in enumerate(self.accepted_at)})

    @property
    def acceptance_rate(self) -> float:
        return self.counters["spec_accepted_tokens_total"] / max(self.counters["spec_draft_tokens_total"], 1)

    # ---- helpers ----------------------------------------------------------------------------------------
    def _drafts(self, req: Req, max_len: int, room: int) -> np.ndarray:
        """The request's drafts for this step (empty: decode plainly). Its back-off counts its decodes, planned ahead
        or not, so that the router, planning ahead meanwhile, stops once the request wants to try again (wants). A
        request planned while the step in flight samples its input token (req.pending) cannot look up its own last
        token: it decodes plainly."""
        if not req.spec_ok or req.num_output < req.min_new_tokens:
            return np.zeros(0, np.int32)
        if req.spec_skip:
            req.spec_skip -= 1
            return np.zeros(0, np.int32)
        if req.pending:
            return np.zeros(0, np.int32)
        # A draft token past max_new_tokens or the slot's length could never be published.
        k = min(self.num_tokens, req.remaining_new_tokens - 1, max_len - 1 - req.seq_len, room)
        if k <= 0:
            return np.zeros(0, np.int32)
        drafts = self.proposer.propose(self.pool.token_ids[req.shm_index, : req.seq_len], k)
        if drafts.size == 0:
            self._back_off(req)
        return drafts

    @staticmethod
    def _back_off(req: Req) -> None:
        req.spec_backoff = min(max(2 * req.spec_backoff, 1), MAX_BACKOFF_STEPS)
        req.spec_skip = req.spec_backoff
