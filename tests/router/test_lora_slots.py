"""LoRA adapters in the router: LoraSlots' residency and loads, the scheduler running requests of more adapters
than slots (each plan names only resident adapters, loads precede the plans that use them), and the radix cache
keeping each adapter's KV apart."""
from __future__ import annotations

import numpy as np

from lightserve.messages import LoadLora, PrefetchLora
from lightserve.router.lora_slots import LoraSlots
from tests.router.test_scheduler import (
    add,
    assert_kv_accounted,
    expected_outputs,
    fake_rank0,
    make_scheduler,
    reset_slots,
)

PATHS = {1: "/a", 2: "/b", 3: "/c"}


def test_slots_load_reuse_and_evict_the_least_recently_used_idle_one():
    slots = LoraSlots(2, PATHS)
    assert slots.acquire(0) == -1 and slots.take_loads() == []  # the base model needs no slot
    s1 = slots.acquire(1)
    assert slots.take_loads() == [LoadLora(1, "/a", s1)]
    assert slots.acquire(1) == s1 and slots.take_loads() == []  # resident: shared, no load
    s2 = slots.acquire(2)
    assert s2 != s1 and slots.take_loads() == [LoadLora(2, "/b", s2)]
    assert not slots.can_acquire(3)  # both slots have running requests
    slots.release(s2)
    assert slots.can_acquire(3) and slots.acquire(3) == s2  # the idle slot is reloaded
    assert slots.take_loads() == [LoadLora(3, "/c", s2)]
    slots.release(s1)
    slots.release(s1)
    slots.release(s2)
    slots.acquire(3)  # slot s2 used last: a new adapter takes s1, the least recently used idle slot
    slots.release(s2)
    slots.register(4, "/d")
    assert slots.acquire(4) == s1 and slots.take_loads() == [LoadLora(4, "/d", s1)]
    assert slots.num_loads == 4


def test_unregister_frees_an_idle_slot_and_a_busy_one_when_its_last_user_leaves():
    slots = LoraSlots(1, PATHS)
    s = slots.acquire(1)
    slots.unregister(1)
    assert not slots.known(1) and slots.holder[s] == 1  # still running
    slots.release(s)
    assert slots.holder[s] is None


def test_scheduler_runs_more_adapters_than_slots(pool):
    """Requests of 3 adapters and the base through 2 slots: every plan's rows run on the slot their adapter was
    loaded into by the loads sent before it, at most 2 adapters run in any step, and every request finishes with
    its tokens."""
    reset_slots(pool, 64)
    sched = make_scheduler(pool, max_running=8)
    sched.lora = LoraSlots(2, PATHS)
    lora_of, prompts, lengths = {}, {}, {}
    for slot in range(12):
        lora_of[slot], prompts[slot], lengths[slot] = slot % 4, list(range(1 + slot, 9 + slot)), 4 + slot % 3
        add(sched, pool, slot, prompts[slot], max_new=lengths[slot], lora_id=lora_of[slot])
    prefetched = _run_checked(sched, pool, lora_of, num_slots=2)
    for slot in range(12):
        assert pool.output_ids(slot, 0, lengths[slot]).tolist() == expected_outputs(prompts[slot], lengths[slot])
    assert sched.lora.num_loads >= 3
    # Every adapter was asked to be read ahead once, on its first request's arrival (none was resident then).
    assert sorted(prefetched) == [1, 2, 3]


def test_paused_requests_give_their_slot_back_and_resume_on_a_resident_one(pool):
    """A KV pool too small for every request: requests of 3 adapters are paused and resumed (their slot released
    at the pause and taken again at the resume, maybe another one) and still finish with their tokens."""
    reset_slots(pool, 64)
    sched = make_scheduler(pool, kv=160, max_running=8)
    sched.lora = LoraSlots(2, PATHS)
    lora_of, prompts = {}, {}
    for slot in range(6):
        lora_of[slot], prompts[slot] = 1 + slot % 3, list(range(10 + slot, 30 + slot))
        add(sched, pool, slot, prompts[slot], max_new=24, lora_id=lora_of[slot])
    _run_checked(sched, pool, lora_of, num_slots=2)
    assert sched.counters["pauses_total"] > 0
    for slot in range(6):
        assert pool.output_ids(slot, 0, 24).tolist() == expected_outputs(prompts[slot], 24)


def _run_checked(sched, pool, lora_of: dict[int, int], num_slots: int) -> list[int]:
    """Run the scheduler to the end with a fake rank 0, checking each plan: every row of an adapter on a slot that
    the loads sent so far filled with that adapter, base rows on none, at most num_slots adapters a step. Returns
    the adapter ids of the prefetches sent."""
    resident: dict[int, int] = {}  # what the workers' slots hold, as the loads sent so far made them
    prefetched: list[int] = []
    for _ in range(2000):
        if not sched.has_work():
            break
        record = sched.plan_step()
        assert record is not None, "a stall"
        for msg in sched.lora.take_loads():
            if isinstance(msg, PrefetchLora):
                prefetched.append(msg.lora_id)
            else:
                resident[msg.slot] = msg.lora_id
        plan = record.plan
        want = np.array([lora_of[int(s)] for s in plan.shm_indices])
        if (want == 0).all():
            assert plan.lora_slots.size == 0
        else:
            assert plan.lora_slots.shape == plan.shm_indices.shape
            for i, lora_id in enumerate(want.tolist()):
                slot = int(plan.lora_slots[i])
                assert (slot == -1) if lora_id == 0 else resident[slot] == lora_id, (plan.step, i, slot, lora_id)
            assert len({int(x) for x in want if x}) <= num_slots
        sched.finish_step(record, fake_rank0(pool, record))
        assert_kv_accounted(sched)
    assert not sched.has_work()
    assert sched.lora.users == [0] * num_slots
    return prefetched


def test_prefetch_once_per_adapter_not_resident():
    slots = LoraSlots(1, PATHS)
    slots.on_arrival(0)
    slots.on_arrival(1)
    slots.on_arrival(1)  # already asked for
    assert slots.take_loads() == [PrefetchLora(1, "/a")]
    s = slots.acquire(1)
    assert slots.take_loads() == [LoadLora(1, "/a", s)]
    slots.on_arrival(1)  # resident: nothing to read
    slots.on_arrival(2)
    assert slots.take_loads() == [PrefetchLora(2, "/b")]
    slots.release(s)
    slots.acquire(2)
    slots.take_loads()
    slots.on_arrival(1)  # evicted since: read ahead again
    assert slots.take_loads() == [PrefetchLora(1, "/a")]


def test_prefix_cache_never_matches_across_adapters(pool):
    """The same prompt under adapter 1, then under the base and adapter 2 (no hit), then under adapter 1 again
    (a hit)."""
    reset_slots(pool, 64)
    sched = make_scheduler(pool)
    sched.lora = LoraSlots(2, PATHS)
    prompt = list(range(100, 140))

    def run_one(slot, lora_id):
        add(sched, pool, slot, prompt, max_new=2, lora_id=lora_id)
        while sched.has_work():
            record = sched.plan_step()
            sched.lora.take_loads()
            sched.finish_step(record, fake_rank0(pool, record))
        assert_kv_accounted(sched)
        return int(pool.cached_len[slot])

    assert run_one(0, 1) == 0
    assert run_one(1, 0) == 0
    assert run_one(2, 2) == 0
    assert run_one(3, 1) == len(prompt) - 1
    assert run_one(4, 0) == len(prompt) - 1
