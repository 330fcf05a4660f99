"""The Scheduler without processes: a real request pool, a fake rank 0 that publishes tokens.

Every test checks the KV accounting invariant after each step and at the end: each KV row is free,
cached, or held by exactly one running request (assert_kv_accounted).
"""
from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from lightserve.config import AdmissionPolicy
from lightserve.messages import FinishReason
from lightserve.router.admission import Admission
from lightserve.router.kv_allocator import KVAllocator
from lightserve.router.radix_cache import RadixCache
from lightserve.router.req import ReqStatus
from lightserve.router.scheduler import Limits, Scheduler
from lightserve.sampling import SamplingParams
from lightserve.shm.req_pool import Owner
from tests.shm.helpers import is_released


def make_scheduler(pool, kv=4096, cache=True, max_running=64, batch_max=1024, chunk=None,
                   policy=AdmissionPolicy.OPTIMISTIC, join=None) -> Scheduler:
    alloc = KVAllocator(kv, check_double_free=True)
    return Scheduler(pool, alloc, RadixCache(alloc) if cache else None, Admission(policy),
                     Limits(max_running, batch_max, chunk or batch_max, 512, join))


def add(sched, pool, slot, prompt, max_new=8, **kw):
    pool.acquire(slot, req_id=1000 + slot)
    pool.write_request(slot, prompt, SamplingParams(max_new_tokens=max_new, **kw), seed=0)
    sched.add_req(slot, 1000 + slot)


def next_token(last: int, pos: int) -> int:
    """The fake model: the next token depends on the last input token and its position, so a plan
    that feeds a request a wrong, stale or other request's token changes what comes out after it."""
    return (last * 31 + pos * 7) % 4999 + 1


def expected_outputs(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq[-1], len(seq) - 1))
    return seq[len(prompt):]


def fake_rank0(pool, record, stop_after=None):
    """Publish one token per sampling request, computed from what the plan fed it (next_token of the
    request's last input token and position), in the pool's write order; finish at max_new_tokens, or with
    STOP once a slot has `stop_after[slot]` outputs (what eos or a stop id does, unknown to the router). As
    rank 0's OutputWriter does for a step planned while the one before ran: the pending decode rows take the
    token that step wrote, and a request that step finished is dropped. Returns each row's finish status,
    as StepDone carries it."""
    plan = record.plan
    rows = plan.pending_inputs
    assert (plan.input_ids[rows] == -1).all(), "a pending input the router claimed to know"
    plan.input_ids[rows] = pool.token_ids[plan.shm_indices[rows], plan.prefix_lens[rows]]
    finish = np.zeros(len(plan.shm_indices), np.uint8)
    ends = np.cumsum(plan.extend_lens)
    for i in np.flatnonzero(plan.sample):
        slot = int(plan.shm_indices[i])
        if pool.finish[slot] != FinishReason.NONE:
            finish[i] = pool.finish[slot]
            continue
        n = int(pool.num_output[slot])
        pos = int(plan.prefix_lens[i] + plan.extend_lens[i] - 1)
        assert pos == pool.prompt_len[slot] + n - 1, f"slot {slot} samples at position {pos} with {n} outputs"
        pool.token_ids[slot, pos + 1] = next_token(int(plan.input_ids[ends[i] - 1]), pos)
        pool.num_output[slot] = n + 1
        if stop_after and n + 1 == stop_after.get(slot):
            pool.finish[slot] = FinishReason.STOP
        elif n + 1 >= pool.params[slot]["max_new_tokens"]:
            pool.finish[slot] = FinishReason.LENGTH
        finish[i] = pool.finish[slot]
    return finish


def run_until_idle(sched, pool, max_steps=10_000, on_plan=None, stop_after=None):
    """Each step planned after the one before has finished (tp > 1, or --disable_overlap_schedule)."""
    plans = []
    while sched.has_work():
        record = sched.plan_step()
        assert record is not None, "work left but nothing planned: a stall"
        assert not record.plan.pending_inputs.size
        if on_plan:
            on_plan(record)
        plans.append(record.plan)
        if stop_after is None:
            fake_rank0(pool, record)
            sched.finish_step(record)  # reads the statuses from shm
        else:
            sched.finish_step(record, fake_rank0(pool, record, stop_after))
        assert_kv_accounted(sched)
        assert len(plans) < max_steps
    return plans


FREE, TREE = -1, -2  # owners of a KV row besides the running requests (named by shm_index)


def assert_kv_accounted(sched):
    """Each KV row is free, in the radix tree, or held by exactly one running request (its rows past
    cached_len, and those duplicating the tree's after a mid-run prompt insert): every row once. The
    rows a running request reads are the tree's or its own, never free nor another request's."""
    alloc = sched.allocator
    held = [(FREE, alloc._stack[: alloc.num_free]), (TREE, _tree_rows(sched.cache))]
    for req in sched.running:
        held.append((req.shm_index, req.kv_locs[req.cached_len: req.computed_len]))
        if req.dup_locs is not None:
            held.append((req.shm_index, req.dup_locs))
    count = np.bincount(np.concatenate([locs for _, locs in held]), minlength=alloc.num_total)
    assert len(count) == alloc.num_total and (count == 1).all(), (
        f"rows held twice: {np.flatnonzero(count > 1)[:8].tolist()}, "
        f"by nobody: {np.flatnonzero(count == 0)[:8].tolist()}")
    owner = np.empty(alloc.num_total, np.int64)
    for who, locs in held:
        owner[locs] = who
    assert sched.cache is None or sched.cache.total_size == int((owner == TREE).sum())
    for req in sched.running:
        locs = req.kv_locs[: req.computed_len]
        stray = locs[~np.isin(owner[locs], (TREE, req.shm_index))]
        assert stray.size == 0, f"slot {req.shm_index} reads rows it does not hold: {stray[:8].tolist()}"


def _tree_rows(cache) -> np.ndarray:
    nodes = [child for root in cache.roots for child in root.children.values()] if cache else []
    rows = [np.zeros(0, np.int32)]
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children.values())
        rows.append(node.value)
    return np.concatenate(rows)


def run_overlapped(sched, pool, stop_after=None, max_steps=10_000):
    """The router's overlap schedule (router/process.py, tp 1): each step is planned before the one before it
    has run, and finished with the statuses rank 0 reported."""
    inflight, plans = deque(), []
    while sched.has_work() or inflight:
        record = sched.plan_step() if len(inflight) < 2 else None
        if record is not None:
            inflight.append(record)
            plans.append(record.plan)
            if len(inflight) < 2:
                continue
        assert inflight, "work left but nothing planned: a stall"
        oldest = inflight.popleft()
        sched.finish_step(oldest, fake_rank0(pool, oldest, stop_after))
        assert_kv_accounted(sched)
        assert len(plans) < max_steps
    return plans


def reset_slots(pool, n):
    pool.num_output[:n] = 0
    pool.finish[:n] = 0


def test_new_requests_join_the_running_batch(pool):
    sched = make_scheduler(pool)
    reset_slots(pool, 64)
    add(sched, pool, 0, list(range(1, 11)), max_new=5)
    r1 = sched.plan_step()
    assert r1.plan.num_decode == 0 and r1.plan.extend_lens.tolist() == [10] and r1.plan.sample.tolist() == [True]
    fake_rank0(pool, r1)
    sched.finish_step(r1)
    add(sched, pool, 1, list(range(1, 6)), max_new=5)
    r2 = sched.plan_step()
    # The decode of request 0 and the prefill of request 1 share the step, decodes first.
    assert r2.plan.num_decode == 1 and r2.plan.shm_indices.tolist() == [0, 1]
    # request 0's first output token is the decode input
    assert r2.plan.input_ids[0] == expected_outputs(list(range(1, 11)), 1)[0]
    fake_rank0(pool, r2)
    sched.finish_step(r2)
    run_until_idle(sched, pool)
    assert pool.output_ids(0, 0, 5).tolist() == expected_outputs(list(range(1, 11)), 5)
    assert pool.output_ids(1, 0, 5).tolist() == expected_outputs(list(range(1, 6)), 5)
    assert is_released(pool, Owner.ROUTER, 0) and is_released(pool, Owner.ROUTER, 1)
    assert_kv_accounted(sched)


def test_limits_on_running_requests_and_tokens_per_step(pool):
    sched = make_scheduler(pool, max_running=4, batch_max=64)
    reset_slots(pool, 64)
    for slot in range(10):
        add(sched, pool, slot, list(range(1, 31)), max_new=4)
    plans = run_until_idle(sched, pool)
    assert max(len(p.shm_indices) for p in plans) <= 4
    assert max(int(p.extend_lens.sum()) for p in plans) <= 64
    assert all(pool.output_ids(s, 0, 4).tolist() == expected_outputs(list(range(1, 31)), 4) for s in range(10))
    assert_kv_accounted(sched)


def test_a_step_takes_no_further_prompt_past_the_join_limit(pool):
    """Short prompts join a step until its prompt tokens reach the join limit; one long prompt, or
    the next chunk of one, still fills the step past it; decodes do not count against the limit."""
    sched = make_scheduler(pool, batch_max=512, chunk=256, join=128)
    reset_slots(pool, 64)
    prompts = {s: list(range(100 * s + 1, 100 * s + 49)) for s in range(7)}  # 48 tokens, no shared prefix
    for slot, prompt in prompts.items():
        add(sched, pool, slot, prompt, max_new=3)
    steps = []

    def step():
        record = sched.plan_step()
        plan = record.plan
        steps.append((plan.num_decode, plan.shm_indices.tolist(), plan.extend_lens.tolist()))
        fake_rank0(pool, record)
        sched.finish_step(record)
        return steps[-1]

    assert step() == (0, [0, 1, 2], [48, 48, 48])  # 96 < 128 takes in a third prompt, 144 no fourth
    assert step() == (3, [0, 1, 2, 3, 4, 5], [1, 1, 1, 48, 48, 48])
    prompts[7] = list(range(5000, 5400))
    prompts[8] = list(range(6001, 6041))
    add(sched, pool, 7, prompts[7], max_new=2)
    add(sched, pool, 8, prompts[8], max_new=2)
    # Slot 6 has waited longest; at 48 prompt tokens the long prompt joins, with a whole 256-token chunk.
    assert step() == (6, [0, 1, 2, 3, 4, 5, 6, 7], [1] * 6 + [48, 256])
    # Its last 144 tokens run past the limit alone: slot 8 waits one more step.
    assert step() == (4, [3, 4, 5, 6, 7], [1, 1, 1, 1, 144])
    assert step()[1][-1] == 8
    run_until_idle(sched, pool)
    for slot, prompt in prompts.items():
        n = 2 if slot in (7, 8) else 3
        assert pool.output_ids(slot, 0, n).tolist() == expected_outputs(prompt, n), slot
    assert_kv_accounted(sched)


def test_without_a_join_limit_short_prompts_fill_the_budget(pool):
    sched = make_scheduler(pool, batch_max=512, chunk=512)
    reset_slots(pool, 64)
    prompts = {s: list(range(100 * s + 1, 100 * s + 49)) for s in range(12)}
    for slot, prompt in prompts.items():
        add(sched, pool, slot, prompt, max_new=2)
    record = sched.plan_step()
    assert record.plan.extend_lens.tolist() == [48] * 10 + [32]  # 512 tokens: ten prompts and a chunk
    fake_rank0(pool, record)
    sched.finish_step(record)
    run_until_idle(sched, pool)
    assert all(pool.output_ids(s, 0, 2).tolist() == expected_outputs(p, 2) for s, p in prompts.items())
    assert_kv_accounted(sched)


def test_chunked_prefill_samples_only_after_the_last_chunk(pool):
    sched = make_scheduler(pool, chunk=16)
    reset_slots(pool, 64)
    add(sched, pool, 0, list(range(1, 51)), max_new=2)
    plans = run_until_idle(sched, pool)
    chunks = [p for p in plans if p.num_decode == 0]
    assert [int(p.extend_lens[0]) for p in chunks] == [16, 16, 16, 2]
    assert [bool(p.sample[0]) for p in chunks] == [False, False, False, True]
    assert [int(p.prefix_lens[0]) for p in chunks] == [0, 16, 32, 48]
    assert_kv_accounted(sched)


def test_prefix_cache_hit_computes_only_the_rest(pool):
    sched = make_scheduler(pool)
    reset_slots(pool, 64)
    shared = list(range(1, 101))
    add(sched, pool, 0, shared + [500], max_new=3)
    run_until_idle(sched, pool)
    add(sched, pool, 1, shared + [600, 601], max_new=3)
    record = sched.plan_step()
    plan = record.plan
    assert int(plan.prefix_lens[0]) == 100 and int(plan.extend_lens[0]) == 2
    assert pool.cached_len[1] == 100
    # The worker is told to copy the 100 cached rows into request 1's token table.
    assert plan.fill_rows.tolist() == [1] * 100 and plan.fill_pos.tolist() == list(range(100))
    fake_rank0(pool, record)
    sched.finish_step(record)
    run_until_idle(sched, pool)
    assert sched.counters["prompt_tokens_cached_total"] == 100
    assert_kv_accounted(sched)


def test_pause_under_kv_pressure_then_resume_from_cache(pool):
    # 8 requests of 20 prompt + 40 output tokens need 480 rows; the cache holds 256.
    sched = make_scheduler(pool, kv=256)
    reset_slots(pool, 64)
    for slot in range(8):
        add(sched, pool, slot, [slot + 1] * 20, max_new=40)
    statuses = []
    run_until_idle(sched, pool, on_plan=lambda r: statuses.extend(q.status for q in sched.waiting))
    assert sched.counters["pauses_total"] > 0 and sched.counters["resumes_total"] > 0
    assert ReqStatus.PAUSED in statuses
    assert all(pool.num_output[s] == 40 for s in range(8))
    # Each request's tokens follow from its own prompt and outputs, pauses or not: a resume that
    # recomputed a wrong or stale token would change every token after it.
    for s in range(8):
        assert pool.output_ids(s, 0, 40).tolist() == expected_outputs([s + 1] * 20, 40), f"slot {s}"
    assert_kv_accounted(sched)


def test_conservative_admission_never_pauses(pool):
    sched = make_scheduler(pool, kv=256, policy=AdmissionPolicy.CONSERVATIVE)
    reset_slots(pool, 64)
    for slot in range(8):
        add(sched, pool, slot, [slot + 1] * 20, max_new=40)
    run_until_idle(sched, pool)
    assert sched.counters["pauses_total"] == 0
    assert all(pool.output_ids(s, 0, 40).tolist() == expected_outputs([s + 1] * 20, 40) for s in range(8))


def test_abort_frees_kv_and_releases_the_slot(pool):
    sched = make_scheduler(pool, cache=False)
    reset_slots(pool, 64)
    add(sched, pool, 0, list(range(1, 41)), max_new=100)
    add(sched, pool, 1, list(range(1, 41)), max_new=100)
    for _ in range(3):
        record = sched.plan_step()
        fake_rank0(pool, record)
        sched.finish_step(record)
    sched.abort_req(0, 1000, FinishReason.ABORT)
    sched.abort_req(1, 9999, FinishReason.ABORT)  # wrong req_id: a stale message, ignored
    assert is_released(pool, Owner.ROUTER, 0) and not is_released(pool, Owner.ROUTER, 1)
    assert sched.released == [(0, 1000, FinishReason.ABORT)]
    assert sched.allocator.num_free == sched.allocator.num_total - sched.by_slot[1].computed_len
    # A waiting request aborts too.
    add(sched, pool, 2, [1, 2, 3], max_new=4)
    sched.abort_req(2, 1002, FinishReason.ABORT)
    assert is_released(pool, Owner.ROUTER, 2) and 2 not in sched.by_slot


def test_admission_ratio_decays_and_bumps_on_pause():
    adm = Admission(AdmissionPolicy.OPTIMISTIC)
    start = adm.ratio
    for _ in range(100):
        adm.on_step()
    assert adm.ratio < start
    low = adm.ratio
    adm.on_pause()
    assert adm.ratio > low
    cons = Admission(AdmissionPolicy.CONSERVATIVE)
    cons.on_step()
    assert cons.ratio == 1.0


def test_prompt_logprobs_requests_compute_their_whole_prompt_in_chunks(pool):
    """A request asking for prompt logprobs skips the prefix cache at admission, and across its
    chunks the plan asks for the logits of every prompt position but the last (the sampling row)."""
    sched = make_scheduler(pool, chunk=16)
    prompt = list(range(1, 41))
    add(sched, pool, 0, prompt, max_new=2)
    run_until_idle(sched, pool)                              # the prompt is cached now
    add(sched, pool, 1, prompt, max_new=2, prompt_logprobs=1)
    add(sched, pool, 2, prompt, max_new=2)                   # a plain twin still matches
    positions: dict[int, list[int]] = {1: [], 2: []}

    def on_plan(record):
        plan = record.plan
        q_start = np.cumsum(plan.extend_lens) - plan.extend_lens
        for t in plan.prompt_logit_idx:
            b = int(np.searchsorted(q_start, t, side="right") - 1)
            positions[int(plan.shm_indices[b])].append(int(plan.prefix_lens[b] + t - q_start[b]))

    run_until_idle(sched, pool, on_plan=on_plan)
    assert positions[1] == list(range(len(prompt) - 1)) and positions[2] == []
    assert pool.cached_len[1] == 0 and pool.cached_len[2] == len(prompt) - 1
    assert_kv_accounted(sched)


def test_a_running_requests_prompt_is_matched_by_later_requests(pool):
    """A burst sharing a long prefix: once the first request's prompt is computed it is in the cache
    while it still decodes, so the requests admitted after it compute only their own tokens."""
    sched = make_scheduler(pool, batch_max=62, chunk=62)  # the first prompt fills the first step
    shared = list(range(1, 61))
    for slot in range(4):
        add(sched, pool, slot, shared + [100 + slot, 200 + slot], max_new=16)
    run_until_idle(sched, pool)
    # slot 0 computed the prefix; the others were admitted after its prompt step and matched it
    assert pool.cached_len[0] == 0
    assert all(pool.cached_len[s] == len(shared) for s in (1, 2, 3)), pool.cached_len[:4]
    assert sched.counters["prompt_tokens_cached_total"] == 3 * len(shared)
    assert_kv_accounted(sched)


def test_requests_wait_for_a_shared_prefix_being_computed(pool):
    """A burst over one long prefix, all fitting one step: only the first computes the prefix; the
    others wait for its prompt to reach the cache instead of computing the prefix again beside it.
    Prompts that share less than SHARED_PREFIX_HOLD tokens, or nothing, are not held."""
    from lightserve.router.scheduler import SHARED_PREFIX_HOLD

    sched = make_scheduler(pool, batch_max=1024)
    reset_slots(pool, 64)
    shared = list(range(1, 101))
    for slot in range(4):
        add(sched, pool, slot, shared + [300 + slot, 400 + slot], max_new=4)
    other = list(range(1000, 1050))
    add(sched, pool, 4, other, max_new=4)  # unrelated: runs in the first step
    short = shared[:SHARED_PREFIX_HOLD - 2] + list(range(2000, 2040))
    add(sched, pool, 5, short, max_new=4)  # shares too little to wait for
    first = sched.plan_step()
    assert first.plan.shm_indices.tolist() == [0, 4, 5]
    fake_rank0(pool, first)
    sched.finish_step(first)
    second = sched.plan_step()
    # slot 0's prompt is cached now: the held requests match all of the shared prefix (+ nothing more)
    assert second.plan.shm_indices.tolist()[3:] == [1, 2, 3]
    assert second.plan.extend_lens.tolist()[3:] == [2, 2, 2]
    fake_rank0(pool, second)
    sched.finish_step(second)
    run_until_idle(sched, pool)
    assert [int(pool.cached_len[s]) for s in range(6)] == [0, 100, 100, 100, 0, 0]
    assert all(pool.num_output[s] == 4 for s in range(6))
    assert_kv_accounted(sched)


def test_steps_planned_ahead_give_every_request_its_tokens(pool):
    """The overlap schedule over chunked prompts, a shared prefix and requests that end early (STOP, which the
    router learns only a step later): every request's tokens follow from its own prompt, exactly as when each
    step is planned after the one before, each early end costs one dropped row, and every slot and KV row comes
    back."""
    def run(overlap, base):  # base: the first slot (the pool's other owners never release them here)
        sched = make_scheduler(pool, batch_max=48, chunk=32)
        shared = list(range(1, 41))
        prompts = {base + k: shared + [100 + k] * (1 + k % 3) for k in range(6)}
        prompts.update({base + 6: list(range(500, 570)), base + 7: [7, 8, 9]})
        for slot, prompt in prompts.items():
            add(sched, pool, slot, prompt, max_new=12)
        stop_after = {base + 1: 1, base + 3: 5, base + 6: 9}
        plans = run_overlapped(sched, pool, stop_after) if overlap else run_until_idle(sched, pool,
                                                                                      stop_after=stop_after)
        outputs = {slot: pool.output_ids(slot, 0, int(pool.num_output[slot])).tolist() for slot in prompts}
        for slot, prompt in prompts.items():
            assert outputs[slot] == expected_outputs(prompt, stop_after.get(slot, 12)), f"slot {slot}"
            assert is_released(pool, Owner.ROUTER, slot)
        assert sched.counters["generation_tokens_total"] == sum(len(o) for o in outputs.values())
        assert not sched.running and not sched.waiting and not sched.by_slot
        assert_kv_accounted(sched)
        return plans

    reset_slots(pool, 64)
    ahead = run(True, 0)
    assert any(p.pending_inputs.size for p in ahead), "no step was planned ahead"
    rows = lambda plans: sum(int(p.sample.sum()) for p in plans)  # noqa: E731
    # Each request that ended by STOP while decoding had one more row planned; those ending by length had none.
    assert rows(ahead) == rows(run(False, 10)) + 3



@pytest.mark.parametrize("stop_after", [{}, {4: 32}])
def test_steps_planned_ahead_pause_and_resume_under_kv_pressure(pool, stop_after):
    """Planned ahead, a pause comes while the paused request's next token is being sampled (here slot 4, with 31
    outputs): it resumes only once that token is known, or, when that token ends it (STOP at 32), leaves the
    queue without resuming."""
    sched = make_scheduler(pool, kv=256)
    reset_slots(pool, 64)
    for slot in range(8):
        add(sched, pool, slot, [slot + 1] * 20, max_new=40)
    run_overlapped(sched, pool, stop_after=stop_after)
    assert sched.counters["pauses_total"] == 1
    assert sched.counters["resumes_total"] == (0 if stop_after else 1)
    for s in range(8):
        n = stop_after.get(s, 40)
        assert pool.output_ids(s, 0, int(pool.num_output[s])).tolist() == expected_outputs([s + 1] * 20, n), s
        assert is_released(pool, Owner.ROUTER, s)
    assert not sched.waiting and not sched.by_slot
    assert_kv_accounted(sched)


def test_a_slot_is_released_only_after_the_steps_that_name_it(pool):
    """Rank 0 writes a step's outputs into its requests' slots, so a request retired while a step that names it
    is in flight (aborted, or ended by STOP in the step before) keeps its slot until that step is done."""
    sched = make_scheduler(pool, cache=False)
    reset_slots(pool, 64)
    add(sched, pool, 0, [1, 2, 3], max_new=50)
    add(sched, pool, 1, [4, 5, 6], max_new=50)
    first, second = sched.plan_step(), sched.plan_step()  # the prompts, then their first decode planned ahead
    assert second.plan.pending_inputs.tolist() == [0, 1]
    sched.finish_step(first, fake_rank0(pool, first, stop_after={1: 1}))  # slot 1 ends with its first token
    assert 1 not in sched.by_slot and not is_released(pool, Owner.ROUTER, 1)
    sched.abort_req(0, 1000, FinishReason.ABORT)  # as the router drains its inbox, `second` in flight
    assert 0 not in sched.by_slot and not is_released(pool, Owner.ROUTER, 0)
    assert sched.plan_step() is None
    finish = fake_rank0(pool, second)
    assert pool.num_output[1] == 1 and finish[1] == FinishReason.STOP  # slot 1's row dropped, its status again
    sched.finish_step(second, finish)
    assert is_released(pool, Owner.ROUTER, 0) and is_released(pool, Owner.ROUTER, 1)
    assert sched.allocator.num_free == sched.allocator.num_total


def test_a_request_paused_while_its_token_is_sampled_resumes_after_it(pool):
    """A pause can come while the step in flight samples the paused request's next token (the KV pressure that
    causes it is found as the next step is planned). Resumed at once, its recompute would read that token's
    slot in shm before rank 0 wrote it; it waits for the step instead."""
    sched = make_scheduler(pool)
    reset_slots(pool, 64)
    prompt = list(range(1, 21))
    add(sched, pool, 0, prompt, max_new=6)
    first = sched.plan_step()                 # the prompt, sampling the first token
    req = sched.by_slot[0]
    sched._pause(req)                          # what _reserve_decode_rows does when rows run short
    pool.token_ids[0, len(prompt)] = 77777     # what that slot held before: the token is not written yet
    assert req.pending == 1 and sched.plan_step() is None
    sched.finish_step(first, fake_rank0(pool, first))
    plans = run_overlapped(sched, pool)
    assert plans[0].num_decode == 0 and plans[0].input_ids[-1] == expected_outputs(prompt, 1)[0]
    assert pool.output_ids(0, 0, 6).tolist() == expected_outputs(prompt, 6)
    assert sched.counters["resumes_total"] == 1 and is_released(pool, Owner.ROUTER, 0)
    assert_kv_accounted(sched)
