"""The scheduler always makes progress: with requests in flight, plan_step never returns None and
every request finishes, however tight the KV cache. Pure logic: the router's Scheduler on a local
request pool, with rank 0 simulated (one token per sampled request, LENGTH at max_new_tokens)."""
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

MAX_STEPS = 5000


@pytest.fixture
def pool(make_pool):
    return make_pool(num_slots=8, max_len=256)


def _add(sched: Scheduler, pool: ReqPool, shm_index: int, req_id: int, prompt: list[int], max_new: int) -> None:
    pool.acquire(shm_index, req_id)
    pool.write_request(shm_index, prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True), seed=1)
    pool.num_output[shm_index] = 0  # what rank 0 does when it first sees a new occupant
    pool.finish[shm_index] = FinishReason.NONE
    pool.release(Owner.FRONT, shm_index)
    pool.release(Owner.DETOK, shm_index)
    sched.add_req(shm_index, req_id)


def _run_rank0(pool: ReqPool, plan) -> None:
    """What rank 0 publishes after a step: one token per sampling request, LENGTH at the limit."""
    for i in np.flatnonzero(plan.sample):
        s = int(plan.shm_indices[i])
        n = int(pool.num_output[s])
        pool.token_ids[s, pool.prompt_len[s] + n] = 7
        pool.num_output[s] = n + 1
        if n + 1 >= pool.params[s]["max_new_tokens"]:
            pool.finish[s] = FinishReason.LENGTH


def _step(sched: Scheduler, pool: ReqPool, steps: int) -> None:
    record = sched.plan_step()
    assert record is not None, (f"stuck at step {steps}: running "
                                f"{[(r.shm_index, r.computed_len) for r in sched.running]}, "
                                f"waiting {len(sched.waiting)}, KV free {sched.allocator.num_free}")
    _run_rank0(pool, record.plan)
    sched.finish_step(record)


def _scheduler(pool: ReqPool, kv: int, chunk: int, use_cache: bool) -> Scheduler:
    allocator = KVAllocator(kv)
    cache = RadixCache(allocator) if use_cache else None
    return Scheduler(pool, allocator, cache, Admission(AdmissionPolicy.OPTIMISTIC),
                     Limits(max_running=8, batch_max_tokens=64, chunk_size=chunk, max_req_total_len=kv))


def _kv_balanced(sched: Scheduler) -> bool:
    cached = sched.cache.total_size if sched.cache is not None else 0
    return sched.allocator.num_free + cached == sched.allocator.num_total


def _drive(sched: Scheduler, pool: ReqPool) -> int:
    steps = 0
    while sched.has_work():
        record = sched.plan_step()
        assert record is not None, (f"stuck at step {steps}: running "
                                f"{[(r.shm_index, r.computed_len) for r in sched.running]}, "
                                    f"waiting {len(sched.waiting)}, KV free {sched.allocator.num_free}")
        _run_rank0(pool, record.plan)
        sched.finish_step(record)
        steps += 1
        assert steps < MAX_STEPS
    return steps


@pytest.mark.parametrize("use_cache", [True, False])
def test_two_long_prompts_in_chunked_prefill_do_not_deadlock(pool, use_cache):
    """Two 100-token prompts, 128 KV rows, 2-token chunks: admitted together, their prefills would
    meet with neither able to grow (and the router would spin forever)."""
    sched = _scheduler(pool, 128, 2, use_cache)
    _add(sched, pool, 0, 1, list(range(1000, 1100)), 4)
    record = sched.plan_step()  # A starts its prefill alone
    _run_rank0(pool, record.plan)
    sched.finish_step(record)
    _add(sched, pool, 1, 2, list(range(2000, 2100)), 4)
    _drive(sched, pool)
    assert _kv_balanced(sched)


@pytest.mark.parametrize("seed", range(6))
def test_random_arrivals_on_tight_kv_all_finish(pool, seed):
    """Requests of random prompt and output lengths (sharing random prefixes) arrive while others
    run, on a KV cache barely larger than one request: all 60 finish by length with every token they
    asked for (none dropped or cut short to make room), KV balances at the end."""
    rng = np.random.default_rng(seed)
    kv = 96
    sched = _scheduler(pool, kv, int(rng.integers(1, 9)), use_cache=bool(seed % 2))
    prefixes = [rng.integers(100, 5000, 40).tolist() for _ in range(3)]
    free_slots = list(range(pool.num_slots))
    req_ids = iter(range(1, 10**6))
    owner: dict[int, tuple[int, int]] = {}  # slot -> (req_id, max_new_tokens)
    finished: dict[int, int] = {}  # req_id -> tokens it got
    added, steps = 0, 0
    while added < 60 or sched.has_work():
        if added < 60 and free_slots and rng.random() < 0.5:
            slot = free_slots.pop()
            prompt_len = int(rng.integers(1, kv - 16))
            prompt = (prefixes[int(rng.integers(0, 3))] + rng.integers(100, 5000, kv).tolist())[:prompt_len]
            rid, max_new = next(req_ids), int(rng.integers(1, kv - prompt_len))
            owner[slot] = rid, max_new
            _add(sched, pool, slot, rid, prompt, max_new)
            added += 1
        if sched.has_work():
            _step(sched, pool, steps)
        steps += 1
        assert steps < MAX_STEPS
        for slot in list(owner):
            if slot not in sched.by_slot:  # the router retired it: rank 0 ended it by length, all tokens out
                rid, max_new = owner.pop(slot)
                assert (int(pool.num_output[slot]), pool.finish[slot]) == (max_new, FinishReason.LENGTH), rid
                finished[rid] = max_new
                free_slots.append(slot)
    assert sorted(finished) == list(range(1, 61)) and not sched.released
    assert sched.counters["generation_tokens_total"] == sum(finished.values())
    assert _kv_balanced(sched)
