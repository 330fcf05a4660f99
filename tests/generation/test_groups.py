"""n samples of one prompt (router/groups.py): the leader prefills the prompt alone, the
siblings wait, then match its KV in the radix cache and compute one token each; no KV row leaks.
Pure logic: the Scheduler on a local pool with rank 0 simulated."""
from __future__ import annotations

import numpy as np
import pytest

from lightserve.config import AdmissionPolicy
from lightserve.messages import FinishReason
from lightserve.router.admission import Admission
from lightserve.router.kv_allocator import KVAllocator
from lightserve.router.radix_cache import RadixCache
from lightserve.router.scheduler import Limits, Scheduler
from lightserve.sampling import SamplingParams
from lightserve.shm.req_pool import Owner, ReqPool

PROMPT = list(range(100, 140))  # 40 tokens


@pytest.fixture
def pool(make_pool):
    return make_pool(num_slots=8, max_len=256, max_top_logprobs=0)


def _scheduler(pool: ReqPool, chunk: int) -> Scheduler:
    allocator = KVAllocator(1024)
    limits = Limits(max_running=8, batch_max_tokens=256, chunk_size=chunk, max_req_total_len=256)
    return Scheduler(pool, allocator, RadixCache(allocator), Admission(AdmissionPolicy.OPTIMISTIC), limits)


def _add(sched: Scheduler, pool: ReqPool, shm_index: int, req_id: int, params: SamplingParams) -> None:
    pool.acquire(shm_index, req_id)
    pool.write_request(shm_index, PROMPT, params, seed=1)
    pool.num_output[shm_index] = 0
    pool.finish[shm_index] = FinishReason.NONE
    pool.release(Owner.FRONT, shm_index)
    pool.release(Owner.DETOK, shm_index)
    sched.add_req(shm_index, req_id)


def _step(sched: Scheduler, pool: ReqPool):
    record = sched.plan_step()
    assert record is not None
    for i in np.flatnonzero(record.plan.sample):
        s = int(record.plan.shm_indices[i])
        n = int(pool.num_output[s])
        pool.token_ids[s, pool.prompt_len[s] + n] = 1000 + s  # the samples diverge
        pool.num_output[s] = n + 1
        if n + 1 >= pool.params[s]["max_new_tokens"]:
            pool.finish[s] = FinishReason.LENGTH
    sched.finish_step(record)
    return record.plan


@pytest.mark.parametrize("chunk", [256, 16])  # whole prompt in one step, or a chunked prefill
def test_group_prefills_the_prompt_once(pool, chunk):
    sched = _scheduler(pool, chunk)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True, group_id=77)
    for i in range(4):
        _add(sched, pool, i, i + 1, params)
    computed = 0
    plans = []
    while sched.has_work():
        plan = _step(sched, pool)
        plans.append(plan)
        computed += int(plan.extend_lens.sum())
        assert len(plans) < 100
    # The leader's prompt (40) and 4 tokens; each sibling 1 prompt token + 4; nothing computed twice.
    assert computed == 40 + 4 + 3 * (1 + 4)
    assert sched.counters["prompt_tokens_cached_total"] == 3 * 39
    first = plans[0]
    assert first.shm_indices.tolist() == [0]  # the siblings waited for the leader
    assert not sched.groups
    # Every KV row is either free or held by the (unlocked) cache: no leak, no double free.
    assert sched.allocator.num_free + sched.cache.total_size == sched.allocator.num_total
    assert sched.cache.evictable_size == sched.cache.total_size


def test_aborted_leader_lets_siblings_run(pool):
    """The leader is aborted after its first prompt chunk: each sibling still computes the whole prompt
    (matching what the leader left in the cache) and its own 3 tokens, fed its own samples."""
    sched = _scheduler(pool, 16)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True, group_id=5)
    for i in range(3):
        _add(sched, pool, i, i + 1, params)
    assert _step(sched, pool).shm_indices.tolist() == [0]  # leader's first chunk, the siblings wait
    sched.abort_req(0, 1, FinishReason.ABORT)
    assert sched.released == [(0, 1, FinishReason.ABORT)]
    fed: dict[int, list[int]] = {1: [], 2: []}  # per sibling: its cached prefix, then every token it was fed
    while sched.has_work():
        plan = _step(sched, pool)
        assert 0 not in plan.shm_indices.tolist()
        ends = np.cumsum(plan.extend_lens)
        for i, s in enumerate(plan.shm_indices.tolist()):
            if not fed[s]:
                fed[s] += PROMPT[: int(plan.prefix_lens[i])]
            assert len(fed[s]) == plan.prefix_lens[i], (s, len(fed[s]), plan.prefix_lens[i])
            fed[s] += plan.input_ids[ends[i] - plan.extend_lens[i]: ends[i]].tolist()
    assert not sched.groups and not sched.by_slot
    assert sched.allocator.num_free + sched.cache.total_size == sched.allocator.num_total
    for s in (1, 2):
        assert (int(pool.num_output[s]), pool.finish[s]) == (3, FinishReason.LENGTH), s
        assert pool.token_ids[s, len(PROMPT): len(PROMPT) + 3].tolist() == [1000 + s] * 3
        assert fed[s] == PROMPT + [1000 + s] * 2, (s, fed[s])  # the last sample is never fed
    assert pool.num_output[0] == 0
