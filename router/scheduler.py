"""Scheduler: continuous batching over the KV allocator and the radix prefix cache.

`plan_step` chooses the next step's requests (decodes first, then prefill chunks, then newly admitted
requests, within --batch_max_tokens and --prefill_join_tokens) and their KV rows, plan_builder.build_plan
turns them into a BatchPlan, and the planned rows count as computed from then on; `finish_step` takes the
finish statuses rank 0 reported and retires finished requests.

Steps may be planned one ahead (the router's overlap schedule): step N+1 is planned while step N runs, so it
decodes N's requests without their new token, which rank 0 fills in (BatchPlan.pending_inputs), and a request
that N finishes by eos or a stop id runs one row more, which rank 0 drops. This is sound because the workers run
the steps in order: a KV row a plan names is written by an earlier step or by that one before any later step
reads it, so the rows of a planned step can go into the radix cache, back to the allocator or to another request
at once. Their token ids are known then too: the scheduler plans, finishes and aborts with at most one step in
flight, and only that step's sampled tokens (past every request's computed_len) are not yet in shm. What has to
wait is a request slot: the router releases it only once no step in flight names it.

With --speculative_algorithm, `Speculation` (speculation.py) turns some decodes into extends of 1 + k tokens (the
last token and k draft tokens); their draft rows stay outside computed_len until `finish_step` hears from rank 0 how
many were accepted. Such a step must be finished before the next is planned (`may_plan_ahead`): the next plan needs
to know each request's length, and a request that may speculate needs its last token to look up.

The n samples of one prompt are held by `Groups` (groups.py). Every
state change of a Req happens in one named method here. No sockets: the router process (process.py)
moves messages; tests drive this class directly.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lightserve.config import ServerConfig
from lightserve.log import get_logger
from lightserve.messages import BatchPlan, FinishReason
from lightserve.router.admission import Admission
from lightserve.router.groups import Groups
from lightserve.router.kv_allocator import KVAllocator
from lightserve.router.lora_slots import LoraSlots
from lightserve.router.plan_builder import build_plan
from lightserve.router.req import Req, ReqStatus
from lightserve.router.speculation import SpecRow, Speculation
from lightserve.shm.req_pool import Owner, ReqPool

if TYPE_CHECKING:
    from lightserve.router.radix_cache import RadixCache

logger = get_logger(__name__)


# A waiting request that shares this many not-yet-cached prompt tokens with a prompt being computed
# waits for that prompt to reach the cache (Scheduler._prefix_in_flight) rather than compute them too.
SHARED_PREFIX_HOLD = 32


@dataclass
class StepRecord:
    """What the router remembers of a step in flight."""
    plan: BatchPlan
    reqs: list[Req]


@dataclass
class Limits:
    max_running: int
    batch_max_tokens: int
    chunk_size: int
    max_req_total_len: int
    # Prompt tokens at which a step stops taking in another prompt (None: batch_max_tokens, no limit of its
    # own). One prompt chunk may still fill the step; see ServerConfig.prefill_join_tokens.
    join_tokens: int | None = None

    def __post_init__(self) -> None:
        self.join_tokens = self.join_tokens or self.batch_max_tokens


class Scheduler:
    def __init__(self, pool: ReqPool, allocator: KVAllocator, cache: RadixCache | None,
                 admission: Admission, limits: Limits, speculation: Speculation | None = None,
                 lora: LoraSlots | None = None):
        """`lora`: the adapter slots with --enable_lora (requests of an adapter run only while it holds one)."""
        self.pool = pool
        self.lora = lora
        self.speculation = speculation
        self._spec_step = 0  # the last step planned with drafts
        self.allocator = allocator
        self.cache = cache
        self.admission = admission
        self.limits = limits
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []          # in admission order: the newest are paused first
        self.by_slot: dict[int, Req] = {}
        self.step = 0             # the last step planned
        self.finished_step = 0    # the last step finish_step took in
        self._unreleased: deque[tuple[int, int]] = deque()  # (step, slot): released once that step is finished
        self.released: list[tuple[int, int, FinishReason]] = []  # aborts the detokenizer must hear of
        self.groups = Groups()
        self.counters = dict(pauses_total=0, resumes_total=0, prompt_tokens_total=0,
                             prompt_tokens_cached_total=0, generation_tokens_total=0, max_batch_size=0,
                             last_batch_size=0)

    @classmethod
    def from_config(cls, config: ServerConfig, pool: ReqPool, kv_size: int) -> Scheduler:
        from lightserve.router.radix_cache import RadixCache

        allocator = KVAllocator(kv_size)
        cache = None if config.disable_prompt_cache else RadixCache(allocator)
        limits = Limits(max_running=config.running_max_req_size, batch_max_tokens=config.batch_max_tokens,
                        chunk_size=config.chunked_prefill_size or config.batch_max_tokens,
                        max_req_total_len=config.max_req_total_len, join_tokens=config.prefill_join_tokens)
        lora = LoraSlots(config.max_loras, dict(enumerate(config.lora_paths, start=1))) if config.enable_lora else None
        return cls(pool, allocator, cache, Admission(config.admission_policy), limits,
                   Speculation.from_config(config, pool), lora)

    # ---- requests in and out ---------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add_req(self, shm_index: int, req_id: int) -> None:
        if int(self.pool.req_id[shm_index]) != req_id or shm_index in self.by_slot:
            logger.error("AddReq for slot %d req %d does not match the pool; dropped", shm_index, req_id)
            return
        params = self.pool.params[shm_index]
        req = Req(req_id=req_id, shm_index=shm_index, prompt_len=int(self.pool.prompt_len[shm_index]),
                  max_new_tokens=int(params["max_new_tokens"]),
                  use_cache=self.cache is not None and not bool(params["disable_prompt_cache"]),
                  group_id=int(params["group_id"]), prompt_logprobs=int(params["prompt_logprobs"]) >= 0,
                  min_new_tokens=int(params["min_new_tokens"]),
                  spec_ok=self.speculation is not None and Speculation.admits(params),
                  lora_id=int(params["lora_id"]))
        if req.lora_id and (self.lora is None or not self.lora.known(req.lora_id)):
            # The front names only adapters it registered here first (on the same socket): not reached.
            logger.error("request %d names LoRA adapter %d, which this router does not know; dropped", req_id,
                         req.lora_id)
            self.released.append((shm_index, req_id, FinishReason.ABORT))
            self.pool.release(Owner.ROUTER, shm_index)
            return
        if req.group_id and req.use_cache and not req.prompt_logprobs:
            self.groups.join(req)
        else:
            req.group_id = 0  # without the cache the samples cannot share the prompt: run them alone
        self.pool.cached_len[shm_index] = 0
        self.by_slot[shm_index] = req
        self.waiting.append(req)
        if self.lora is not None:
            self.lora.on_arrival(req.lora_id)

    def abort_req(self, shm_index: int, req_id: int, reason: FinishReason) -> None:
        """Between plan_step and finish_step calls, possibly with a step in flight: its rows stay valid (see the
        top), and the slot waits for it."""
        req = self.by_slot.get(shm_index)
        if req is None or req.req_id != req_id:
            return  # already finished: nothing to do
        if req.status is ReqStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._retire(req)
        if reason is FinishReason.ABORT:
            self.released.append((shm_index, req_id, reason))

    # ---- planning -----------------------------------------------------------------------------------
    def plan_step(self) -> StepRecord | None:
        """Pick this step's requests and KV rows. Returns None when there is nothing to run."""
        budget = self.limits.batch_max_tokens
        decodes = self._decoding()
        if not self._reserve_decode_rows(decodes):
            decodes = self._decoding()  # some were paused
        chunks: list[tuple[Req, int]] = []
        fills: list[Req] = []
        budget -= len(decodes)
        # Prompt tokens this step takes in; once they reach the join limit no further prompt joins. The
        # first chunk may still fill the budget: a step that gathers many short prompts runs as long
        # as one long prompt, and every prompt arriving meanwhile waits for it and then for its own.
        join = self.limits.join_tokens
        prompt_tokens = 0
        # Decode rows first; they were reserved above so these allocations cannot fail.
        decode_locs = self.allocator.alloc(len(decodes)) if decodes else np.zeros(0, np.int32)
        assert decode_locs is not None
        spec: list[SpecRow] = []
        if self.speculation is not None and decodes:
            decodes, decode_locs, spec = self.speculation.plan(decodes, decode_locs, self.allocator, budget)
            budget -= sum(row.drafts.size for row in spec)
        # Requests in the middle of a chunked prefill continue before new ones start.
        for req in self.running:
            if req.extend_len > 1 and budget > 0 and prompt_tokens < join:
                n = min(req.extend_len, self.limits.chunk_size, budget)
                if not self._grow(req, n):
                    break
                chunks.append((req, n))
                budget -= n
                prompt_tokens += n
        # Admit waiting (paused requests sit at the head) while the budget and KV allow. Reserve
        # the rows running prefills still need beyond this step's chunk too: without them, two
        # long prompts admitted together could each hold half the KV, neither able to grow, and
        # no step would ever run again.
        unallocated = sum(r.extend_len for r in self.running if r.extend_len > 1) - sum(n for _, n in chunks)
        reserved = self.admission.running_need(self.running) + unallocated
        held: list[Req] = []  # requests waiting for a prefix another one is computing, in queue order
        computing = [r for r in self.running if self._computes_cacheable_prompt(r)]  # usually 0-2 requests
        while self.waiting and budget > 0 and prompt_tokens < join and len(self.running) < self.limits.max_running:
            req = self.waiting[0]
            # A request paused while the step in flight samples its next token resumes once that token is known.
            if req.pending or self.groups.must_wait(req) or self._prefix_in_flight(req, computing) \
                    or (self.lora is not None and not self.lora.can_acquire(req.lora_id)):
                held.append(self.waiting.popleft())
                continue
            n = self._admit(req, budget, reserved)
            if n == 0:
                break
            if self._computes_cacheable_prompt(req):
                computing.append(req)
            self.waiting.popleft()
            if req.cached_len > 0:
                fills.append(req)
            chunks.append((req, n))
            budget -= n
            prompt_tokens += n
            reserved += self.admission.future_need(req) + req.extend_len - n
        self.waiting.extendleft(reversed(held))
        if not decodes and not chunks and not spec:
            return None
        self.step += 1
        plan = build_plan(self.pool, self.step, decodes, decode_locs, chunks, fills, spec)
        batch_size = len(plan.shm_indices)
        self.counters["last_batch_size"] = batch_size
        self.counters["max_batch_size"] = max(self.counters["max_batch_size"], batch_size)
        record = StepRecord(plan, decodes + [row.req for row in spec] + [r for r, _ in chunks])
        self._advance(record)
        if spec:
            self._spec_step = self.step
        return record

    def may_plan_ahead(self) -> bool:
        """Whether the router may plan the next step while the last one planned runs (the overlap schedule). Not
        while a step with drafts runs (how far its requests got is known only once it is done), nor while a decoding
        request would speculate at its next step (its last token must be known to look up; planned ahead it would
        decode plainly)."""
        if self.speculation is None:
            return True
        return self._spec_step <= self.finished_step and not self.speculation.may_speculate(
            [r for r in self.running if r.extend_len <= 1])

    def _advance(self, record: StepRecord) -> None:
        """The step is planned: its rows count as computed and its samples as pending. A prompt it completes goes
        into the radix cache now (requests planned after it read those rows after it has written them)."""
        plan = record.plan
        # A speculating row computes its last token now; its draft rows count once rank 0 has accepted them.
        computed = plan.extend_lens - plan.spec_lens if plan.spec_lens.size else plan.extend_lens
        for i, req in enumerate(record.reqs):
            req.computed_len += int(computed[i])
            req.pending += int(plan.sample[i])
            if req.use_cache and not req.prompt_cached and req.computed_len >= req.prompt_len - 1:
                self._cache_prompt(req)
                self.groups.on_prompt_cached(req)

    def _decoding(self) -> list[Req]:
        """The running requests whose next step is one token."""
        return [r for r in self.running if r.extend_len == 1 and not self._ends_by_length(r)]

    def _ends_by_length(self, req: Req) -> bool:
        """The token a step in flight samples for `req` is its last by length (max_new_tokens or the slot's
        length), so rank 0 finishes it: no further step needs to decode it."""
        return bool(req.pending) and (req.num_output + req.pending >= req.max_new_tokens
                                      or req.seq_len >= self.pool.max_len)

    @staticmethod
    def _computes_cacheable_prompt(req: Req) -> bool:
        """A running request whose prompt is being computed and will go into the radix cache."""
        return req.use_cache and not req.prompt_cached and not req.prompt_logprobs

    def _prefix_in_flight(self, req: Req, computing: list[Req]) -> bool:
        """True when one of `computing` (running requests computing a prompt for the cache) shares at
        least SHARED_PREFIX_HOLD uncached tokens with `req`'s prompt. Admitted now, `req` would compute
        that prefix a second time in parallel (a burst of prompts over one long system prompt or
        document would compute it once per request of the first step); held until the prompt is
        cached (_cache_prompt, at the end of its prefill), it matches the prefix and computes only
        its own tokens."""
        if not req.use_cache or req.prompt_logprobs:
            return False
        ids = self.pool.token_ids[req.shm_index]
        for other in computing:
            if other.lora_id != req.lora_id:
                continue  # its KV is another adapter's
            n = min(req.prompt_len, other.prompt_len) - 1
            if n - other.cached_len < SHARED_PREFIX_HOLD:
                continue
            differ = np.flatnonzero(ids[:n] != self.pool.token_ids[other.shm_index, :n])
            shared = int(differ[0]) if differ.size else n
            if shared - other.cached_len >= SHARED_PREFIX_HOLD:
                return True
        return False

    def _cache_prompt(self, req: Req) -> None:
        """The request's prompt is computed: put its KV (all but the last prompt token, which is what
        a later request with the same prompt matches) into the radix cache now, while it still runs.
        Requests admitted from now on that share the prefix (a burst of chat turns or few-shot
        prompts, the n samples of a group) compute only the rest, instead of each computing the
        shared prefix because none of them had finished yet."""
        req.prompt_cached = True
        n = req.prompt_len - 1
        if req.cached_len >= n:
            return  # the whole prefix came from the cache
        ids = self.pool.token_ids[req.shm_index, :n]
        present = self.cache.insert(ids, req.kv_locs[:n], req.lora_id)
        if present > req.cached_len:
            # The tree already held [cached_len, present): our rows there duplicate it. We still
            # attend over them, so they are freed when we retire, not now.
            req.dup_locs = req.kv_locs[req.cached_len:present].copy()
        locs, node = self.cache.match_prefix(ids, req.lora_id)
        assert len(locs) == n, (len(locs), n)
        self.cache.lock(node)
        self.cache.unlock(req.prefix_node)
        req.prefix_node = node
        req.cached_len = n  # rows [0, n) are the tree's now

    def _reserve_decode_rows(self, decodes: list[Req]) -> bool:
        """Make room for one new row per decode: evict the cache, then pause the newest requests."""
        need = len(decodes)
        if self._ensure_free(need):
            return True
        while self.running and not self._ensure_free(len(self._decoding())):
            self._pause(self.running[-1])
        self.admission.on_pause()
        return False

    def _ensure_free(self, n: int) -> bool:
        short = n - self.allocator.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        return self.allocator.num_free >= n

    def _grow(self, req: Req, n: int) -> bool:
        """Allocate `n` more KV rows for `req`'s next tokens."""
        if not self._ensure_free(n):
            return False
        locs = self.allocator.alloc(n)
        assert locs is not None
        req.ensure_capacity(req.computed_len + n)
        req.kv_locs[req.computed_len: req.computed_len + n] = locs
        return True

    def _admit(self, req: Req, budget: int, reserved: int) -> int:
        """Start `req` (match its prefix, take rows for its first chunk). Returns the chunk length,
        or 0 if it must keep waiting."""
        ids = self.pool.token_ids[req.shm_index, : req.seq_len]
        prefix_locs, node = np.zeros(0, np.int32), None
        if req.use_cache:
            # Leave at least one token to compute: its logits give the next token. A first run that
            # needs prompt logprobs matches nothing (the root): the cache has no logits to give.
            fresh_scoring = req.prompt_logprobs and req.status is ReqStatus.WAITING
            prefix_locs, node = self.cache.match_prefix(ids[: 0 if fresh_scoring else req.seq_len - 1], req.lora_id)
            self.cache.lock(node)
        available = self.allocator.num_free + (self.cache.evictable_size if self.cache else 0)
        need = req.seq_len - len(prefix_locs)
        if not self.admission.can_admit(req, need, available, reserved):
            if node is not None:
                self.cache.unlock(node)
            return 0
        req.prefix_node = node
        req.cached_len = req.computed_len = len(prefix_locs)
        req.ensure_capacity(req.seq_len + 1)
        req.kv_locs[: len(prefix_locs)] = prefix_locs
        n = min(need, self.limits.chunk_size, budget)
        if not self._grow(req, n):
            if node is not None:
                self.cache.unlock(node)
            req.prefix_node, req.cached_len, req.computed_len = None, 0, 0
            return 0
        if req.status is ReqStatus.PAUSED:
            self.counters["resumes_total"] += 1
        else:
            self.counters["prompt_tokens_total"] += req.prompt_len
            self.counters["prompt_tokens_cached_total"] += req.cached_len
            self.pool.cached_len[req.shm_index] = req.cached_len
        if self.lora is not None:
            req.lora_slot = self.lora.acquire(req.lora_id)
        req.status = ReqStatus.RUNNING
        self.running.append(req)
        return n

    # ---- after the step -------------------------------------------------------------------------------
    def finish_step(self, record: StepRecord, finish: np.ndarray | None = None,
                    num_accepted: np.ndarray | None = None) -> None:
        """Rank 0 has published the step's tokens: count them, retire finished requests. `finish` [B] uint8: each
        plan row's FinishReason as rank 0 reported it (StepDone.finish); None reads it from shm, which only a
        caller that plans no step ahead may do (rank 0 may already be writing the next step's). `num_accepted` [B]
        int32 (StepDone.num_accepted): for a step with drafts, the tokens each row published beyond its first."""
        plan = record.plan
        self.finished_step = plan.step
        if finish is None:
            finish = self.pool.finish[plan.shm_indices]
        spec_lens = plan.spec_lens
        if spec_lens.size:
            assert num_accepted is not None and num_accepted.shape == spec_lens.shape, "drafts need num_accepted"
        for i, req in enumerate(record.reqs):
            if req.status is ReqStatus.DONE:
                continue  # retired while the step ran (aborted, or finished by the step before): rank 0 dropped it
            if plan.sample[i]:
                new = 1
                if spec_lens.size and spec_lens[i]:
                    new += int(num_accepted[i])
                    self.speculation.settle(req, int(spec_lens[i]), int(num_accepted[i]), self.allocator)
                req.pending -= 1
                req.num_output += new
                self.counters["generation_tokens_total"] += new
            if finish[i] != FinishReason.NONE:
                if req.status is ReqStatus.RUNNING:
                    self.running.remove(req)
                else:
                    self.waiting.remove(req)  # paused while its last token was being sampled
                self._retire(req)
        while self._unreleased and self._unreleased[0][0] <= plan.step:
            self.pool.release(Owner.ROUTER, self._unreleased.popleft()[1])
        self.admission.on_step()

    # ---- state changes ------------------------------------------------------------------------------
    def _pause(self, req: Req) -> None:
        """Release a running request's KV (into the cache, so resuming mostly re-matches) and put it
        at the head of the queue. Its stream just waits; its output is unchanged."""
        self.running.remove(req)
        self._give_back_kv(req)
        req.status = ReqStatus.PAUSED
        req.computed_len = req.cached_len = 0
        self.waiting.appendleft(req)
        self.counters["pauses_total"] += 1

    def _retire(self, req: Req) -> None:
        if req.status is ReqStatus.RUNNING:
            self._give_back_kv(req)
        req.status = ReqStatus.DONE
        self.groups.leave(req)
        del self.by_slot[req.shm_index]
        if self.step > self.finished_step:
            # A step in flight may name the slot (rank 0 writes its outputs there): the front may reuse it only
            # after that step.
            self._unreleased.append((self.step, req.shm_index))
        else:
            self.pool.release(Owner.ROUTER, req.shm_index)

    def _give_back_kv(self, req: Req) -> None:
        """Hand the request's computed KV to the prefix cache (or the allocator) and unlock its prefix."""
        if self.speculation is not None:
            self.speculation.drop_drafts(req, self.allocator)
        n = req.computed_len
        locs = req.kv_locs[:n]
        if req.use_cache and self.cache is not None:
            ids = self.pool.token_ids[req.shm_index, :n]
            present = self.cache.insert(ids, locs, req.lora_id)
            # The tree already held [0, present): our own rows in [cached_len, present) duplicate it.
            if present > req.cached_len:
                self.allocator.free(locs[req.cached_len: present].copy())
            self.cache.unlock(req.prefix_node)
        else:
            self.allocator.free(locs.copy())
        if req.dup_locs is not None:
            self.allocator.free(req.dup_locs)
            req.dup_locs = None
        req.prefix_node = None
        if self.lora is not None:
            self.lora.release(req.lora_slot)
            req.lora_slot = -1

    # ---- metrics --------------------------------------------------------------------------------------
    def publish_stats(self) -> None:
        cached = self.cache.total_size if self.cache is not None else 0
        stats = dict(self.counters, **(self.speculation.stats() if self.speculation is not None else {}),
                     kv_tokens_total=self.allocator.num_total, kv_tokens_free=self.allocator.num_free,
                     kv_tokens_cached=cached, requests_running=len(self.running),
                     requests_waiting=sum(r.status is ReqStatus.WAITING for r in self.waiting),
                     requests_paused=sum(r.status is ReqStatus.PAUSED for r in self.waiting),
                     steps_total=self.step)
        for name, value in stats.items():
            self.pool.set_stat(name, value)
