"""Speculative decoding in the router: the n-gram proposer, and the Scheduler with Speculation against a fake rank 0
that verifies drafts as OutputWriter does (a fake model whose next token depends on the last one only, so a prompt
that writes a stretch of its output out in advance gets its drafts accepted). Checked: the rows planned, the KV
accounting after every step, rejected rows freed, and the radix cache holding only rows whose KV matches its tokens.
"""
from __future__ import annotations

import numpy as np
import pytest

from lightserve.config import MAX_SPECULATIVE_TOKENS, AdmissionPolicy, ServerConfig, SpeculativeAlgorithm
from lightserve.messages import FinishReason
from lightserve.router.admission import Admission
from lightserve.router.kv_allocator import KVAllocator
from lightserve.router.ngram_proposer import NgramProposer
from lightserve.router.radix_cache import RadixCache
from lightserve.router.req import ReqStatus
from lightserve.router.scheduler import Limits, Scheduler
from lightserve.router.speculation import MAX_SPEC_BATCH, Speculation
from lightserve.sampling import SamplingParams
from lightserve.shm.req_pool import SPEC_POSITIONS, STATS_FIELDS

K = 4
KV = 2048


def test_ngram_proposer_continues_the_latest_longest_match():
    p = NgramProposer(2, 4)
    t = np.array([1, 2, 3, 4, 5, 6, 1, 2, 3], np.int32)
    assert p.propose(t, 4).tolist() == [4, 5, 6, 1]
    assert p.propose(t, 2).tolist() == [4, 5]
    # Two earlier occurrences of [1 2]: the most recent one's continuation.
    assert p.propose(np.array([5, 1, 2, 9, 8, 1, 2, 7, 7, 1, 2], np.int32), 3).tolist() == [7, 7, 1]
    # The longer match wins over a more recent shorter one: [3 1 2] occurs once, at the start.
    assert p.propose(np.array([3, 1, 2, 40, 9, 1, 2, 50, 3, 1, 2], np.int32), 2).tolist() == [40, 9]
    # Nothing recurs, or only single tokens (below prompt_lookup_min): no draft.
    assert p.propose(np.array([1, 2, 3, 4, 5, 6, 7, 9, 3], np.int32), 4).size == 0
    assert NgramProposer(1, 3).propose(np.array([1, 2, 3, 4, 5, 6, 7, 9, 3], np.int32), 4).tolist() == [4, 5, 6, 7]
    # Short inputs and a match at the very end (nothing after it yet).
    assert p.propose(np.array([1, 2], np.int32), 4).size == 0
    assert p.propose(np.array([1, 2, 1, 2], np.int32), 4).tolist() == [1, 2]


def test_stats_fields_cover_every_draft_position():
    assert SPEC_POSITIONS == MAX_SPECULATIVE_TOKENS
    assert all(f"spec_accepted_pos_{i}" in STATS_FIELDS for i in range(SPEC_POSITIONS))


def test_bad_speculative_flags_name_the_flag():
    for kw, flag in ((dict(num_speculative_tokens=0), "--num_speculative_tokens"),
                     (dict(num_speculative_tokens=MAX_SPECULATIVE_TOKENS + 1), "--num_speculative_tokens"),
                     (dict(speculative_algorithm=SpeculativeAlgorithm.DRAFT), "--speculative_draft_model_dir"),
                     (dict(speculative_draft_model_dir="/x"), "--speculative_draft_model_dir needs"),
                     (dict(speculative_config='{"method": "draft_model", "model": 3}'), "model must be a path"),
                     (dict(prompt_lookup_min=5, prompt_lookup_max=4), "--prompt_lookup_min"),
                     (dict(speculative_config='{"method": "eagle"}'), "unknown method"),
                     (dict(speculative_config='{"num_speculative_tokens": 4, "k": 1}'), "unknown key 'k'")):
        with pytest.raises(ValueError, match=flag):
            ServerConfig(**kw)
    config = ServerConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
                                             '"prompt_lookup_max": 5, "prompt_lookup_min": 1}')
    assert (config.speculative_algorithm, config.num_speculative_tokens, config.prompt_lookup_max,
            config.prompt_lookup_min) == (SpeculativeAlgorithm.NGRAM, 3, 5, 1)
    config = ServerConfig(speculative_config='{"method": "draft_model", "model": "/d", "num_speculative_tokens": 2}')
    assert (config.speculative_algorithm, config.speculative_draft_model_dir, config.num_speculative_tokens) == (
        SpeculativeAlgorithm.DRAFT, "/d", 2)


# ---- the scheduler with speculation -------------------------------------------------------------------------------
def fake_next(last: int) -> int:
    """The fake model: the next token depends on the last token only."""
    return (last * 7 + 3) % 97 + 100


def chain(start: int, n: int) -> list[int]:
    out = [start]
    for _ in range(n - 1):
        out.append(fake_next(out[-1]))
    return out


class FakeRank0:
    """Rank 0 for the scheduler: 'writes' every planned token's KV row (kv[loc] = token), then for every sampled row
    scores its inputs with fake_next, accepts the drafts that match, and publishes the burst in the pool's write order,
    cut at max_new_tokens or at a stop id. Returns (finish [B], num_accepted [B]) as StepDone carries them."""

    def __init__(self, pool, stop_id: int | None = None):
        self.pool = pool
        self.kv: dict[int, int] = {}
        self.stop_id = stop_id

    def step(self, record):
        plan, pool = record.plan, self.pool
        rows = plan.pending_inputs                   # planned ahead: the step before wrote these inputs
        assert not plan.spec_lens.any() or rows.size == 0, "drafts in a step planned ahead"
        plan.input_ids[rows] = pool.token_ids[plan.shm_indices[rows], plan.prefix_lens[rows]]
        for loc, tok in zip(plan.kv_locs.tolist(), plan.input_ids.tolist()):
            self.kv[loc] = tok
        finish = np.zeros(plan.shm_indices.size, np.uint8)
        accepted = np.zeros(plan.shm_indices.size, np.int32)
        q_start = np.cumsum(plan.extend_lens) - plan.extend_lens
        spec = plan.spec_lens if plan.spec_lens.size else np.zeros(plan.shm_indices.size, np.int32)
        for i in np.flatnonzero(plan.sample):
            slot, k = int(plan.shm_indices[i]), int(spec[i])
            if pool.finish[slot] != FinishReason.NONE:   # the step before ended it (planned ahead): dropped
                finish[i] = pool.finish[slot]
                continue
            inputs = plan.input_ids[q_start[i] + plan.extend_lens[i] - 1 - k: q_start[i] + plan.extend_lens[i]]
            n = int(pool.num_output[slot])
            burst = [fake_next(int(inputs[0]))]
            for j in range(k):
                if inputs[1 + j] != burst[-1]:
                    break
                burst.append(fake_next(int(inputs[1 + j])))
            pos = int(pool.prompt_len[slot]) + n
            for tok in burst:
                pool.token_ids[slot, pos] = tok
                pos += 1
                n += 1
                if tok == self.stop_id:
                    finish[i] = FinishReason.STOP
                elif n >= pool.params[slot]["max_new_tokens"]:
                    finish[i] = FinishReason.LENGTH
                if finish[i]:
                    break
            accepted[i] = n - int(pool.num_output[slot]) - 1
            pool.num_output[slot] = n
            pool.finish[slot] = finish[i]
        return finish, accepted


def make_scheduler(pool, kv=KV, max_batch=MAX_SPEC_BATCH) -> Scheduler:
    alloc = KVAllocator(kv, check_double_free=True)
    return Scheduler(pool, alloc, RadixCache(alloc), Admission(AdmissionPolicy.OPTIMISTIC),
                     Limits(64, 1024, 1024, 512), Speculation(NgramProposer(2, 4), K, pool, max_batch))


def add(sched, pool, slot, prompt, max_new=24, **kw):
    pool.acquire(slot, req_id=1000 + slot)
    pool.write_request(slot, prompt, SamplingParams(max_new_tokens=max_new, **kw), seed=0)
    sched.add_req(slot, 1000 + slot)


def assert_kv_accounted(sched):
    """Every KV row is free, in the radix cache, or held by exactly one running request (its computed rows, its
    draft rows, its duplicate rows), once."""
    held = []
    for req in sched.running:
        held.extend(req.kv_locs[req.cached_len: req.computed_len].tolist())
        if req.draft_locs is not None:
            held.extend(req.draft_locs.tolist())
        if req.dup_locs is not None:
            held.extend(req.dup_locs.tolist())
    assert len(held) == len(set(held))
    assert sched.allocator.num_free + sched.cache.total_size + len(held) == sched.allocator.num_total


def run(sched, pool, rank0, max_steps=200) -> list:
    records = []
    while sched.has_work() and len(records) < max_steps:
        record = sched.plan_step()
        assert record is not None
        records.append(record)
        finish, accepted = rank0.step(record)
        sched.finish_step(record, finish, accepted)
        assert_kv_accounted(sched)
    assert not sched.has_work()
    return records


def assert_cache_matches_kv(sched, pool, rank0, slot, num_tokens):
    """The tree's rows for the request's tokens hold exactly those tokens: no rejected draft's row got in."""
    ids = pool.token_ids[slot, :num_tokens]
    locs, node = sched.cache.match_prefix(ids)
    assert len(locs) > 0
    assert [rank0.kv[int(loc)] for loc in locs] == ids[: len(locs)].tolist()


def test_copying_request_speculates_and_outputs_what_plain_decoding_would(pool):
    sched = make_scheduler(pool)
    rank0 = FakeRank0(pool)
    # The prompt writes out the model's own continuation of token 5, then ends in 5: every draft is right.
    prompt = chain(5, 30) + [1, 2, 5]
    add(sched, pool, 0, prompt, max_new=20)
    records = run(sched, pool, rank0)
    out = pool.output_ids(0, 0, int(pool.num_output[0])).tolist()
    assert out == chain(fake_next(5), 20)                        # exactly the greedy output
    assert pool.finish[0] == FinishReason.LENGTH
    spec_steps = [r for r in records if r.plan.spec_lens.size and r.plan.spec_lens.any()]
    assert spec_steps and len(records) < 1 + 20 // 2             # bursts: far fewer steps than tokens
    for r in spec_steps:                                         # the row: its last token, then the drafts
        i = int(np.flatnonzero(r.plan.spec_lens)[0])
        assert r.plan.extend_lens[i] == 1 + r.plan.spec_lens[i] and r.plan.sample[i]
    c = sched.speculation.counters
    assert c["spec_accepted_tokens_total"] == c["spec_draft_tokens_total"] > 0
    assert sched.counters["generation_tokens_total"] == 20
    assert sched.allocator.num_free + sched.cache.total_size == KV
    assert_cache_matches_kv(sched, pool, rank0, 0, len(prompt) + 19)


def test_rejected_drafts_free_their_rows_and_never_reach_the_cache(pool):
    sched = make_scheduler(pool)
    rank0 = FakeRank0(pool)
    # The prompt's stretch after [5, x] goes wrong after 3 tokens: drafts are partly rejected, again and again
    # (the lookup keeps finding the same wrong continuation, then backs off).
    good = chain(5, 4)
    prompt = good + [7, 8, 9, 10, 11] + [1, 2] + [5]
    add(sched, pool, 0, prompt, max_new=24)
    records = run(sched, pool, rank0)
    assert pool.output_ids(0, 0, 24).tolist() == chain(fake_next(5), 24)
    c = sched.speculation.counters
    assert 0 < c["spec_accepted_tokens_total"] < c["spec_draft_tokens_total"]
    assert any(r.plan.spec_lens.size for r in records)
    assert sched.allocator.num_free + sched.cache.total_size == KV   # every draft row came back
    assert_cache_matches_kv(sched, pool, rank0, 0, len(prompt) + 23)


def test_stop_id_and_length_inside_a_burst(pool):
    sched = make_scheduler(pool)
    want = chain(fake_next(5), 30)
    rank0 = FakeRank0(pool, stop_id=want[9])
    add(sched, pool, 0, chain(5, 40) + [1, 2, 5], max_new=30)      # stops at its 10th token, inside a burst
    add(sched, pool, 1, chain(5, 40) + [3, 4, 5], max_new=7)       # max_new_tokens inside a burst
    run(sched, pool, rank0)
    assert pool.output_ids(0, 0, int(pool.num_output[0])).tolist() == want[:10]
    assert pool.finish[0] == FinishReason.STOP
    assert pool.output_ids(1, 0, int(pool.num_output[1])).tolist() == want[:7]
    assert pool.finish[1] == FinishReason.LENGTH
    assert sched.counters["generation_tokens_total"] == 17


@pytest.mark.parametrize("kw, admitted", [
    (dict(), True), (dict(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05, seed=3), True),
    (dict(temperature=0.8, repetition_penalty=1.1), False), (dict(presence_penalty=0.5), False),
    (dict(frequency_penalty=0.5), False), (dict(temperature=0.8, logit_bias={5: 1.0}), False),
    (dict(allowed_token_ids=[5, 6]), False), (dict(temperature=0.8, top_logprobs=2), False),
    (dict(grammar_kind=1, grammar="{}"), False),
], ids=["greedy", "sampling", "repetition", "presence", "frequency", "bias", "allowed", "top_logprobs", "grammar"])
def test_admits_greedy_and_sampling_requests_without_per_token_processing(pool, kw, admitted):
    pool.acquire(0, req_id=1)
    pool.write_request(0, [1, 2, 3], SamplingParams(max_new_tokens=8, **kw), seed=0)
    assert Speculation.admits(pool.params[0]) == admitted


def test_sampling_request_speculates(pool):
    """The fake rank 0 verifies by its own rule; what matters here is that the router plans drafts for the request."""
    sched = make_scheduler(pool)
    add(sched, pool, 0, chain(5, 30) + [1, 2, 5], temperature=0.8, top_p=0.9, seed=1)
    records = run(sched, pool, FakeRank0(pool))
    assert any(r.plan.spec_lens.any() for r in records)
    assert sched.speculation.counters["spec_accepted_tokens_total"] > 0


def test_no_speculation_for_penalized_requests_big_batches_or_nothing_to_copy(pool):
    sched = make_scheduler(pool, max_batch=2)
    rank0 = FakeRank0(pool)
    add(sched, pool, 0, chain(5, 30) + [1, 2, 5], temperature=0.8, repetition_penalty=1.2)   # never speculates
    add(sched, pool, 1, [1, 2, 3, 4, 6, 9, 11, 12, 5])                 # nothing to copy: backs off
    records = run(sched, pool, rank0)
    assert not any(r.plan.spec_lens.size for r in records)
    assert sched.speculation.counters["spec_drafts_total"] == 0
    # A third copying request would speculate, but three decoding requests are past max_batch 2.
    sched = make_scheduler(pool, max_batch=2)
    for slot in (4, 5, 6):
        add(sched, pool, slot, chain(5, 30) + [slot, 2, 5])
    assert not any(r.plan.spec_lens.size for r in run(sched, pool, rank0))


def test_back_off_lets_the_router_plan_ahead(pool):
    """A request with nothing to copy stops asking for a synchronous step: after a failed lookup it skips a number
    of steps (doubling), during which may_plan_ahead is True."""
    sched = make_scheduler(pool)
    rank0 = FakeRank0(pool)
    add(sched, pool, 0, [1, 2, 3, 4, 6, 9, 11, 12, 13], max_new=64)
    ahead = []
    while sched.has_work():
        record = sched.plan_step()
        ahead.append(sched.may_plan_ahead())
        sched.finish_step(record, *rank0.step(record))
    # Lookups that find nothing back off 1, 2, 4, ... steps: most steps may be planned ahead, few look up.
    assert sum(ahead) > len(ahead) // 2
    assert sched.speculation.counters["spec_drafts_total"] < 64 // 4


def test_abort_and_pause_with_drafts_in_flight_return_their_rows(pool):
    sched = make_scheduler(pool)
    rank0 = FakeRank0(pool)
    add(sched, pool, 0, chain(5, 30) + [1, 2, 5], max_new=20)
    while True:
        record = sched.plan_step()
        if record.plan.spec_lens.size:
            break
        sched.finish_step(record, *rank0.step(record))
    req = sched.by_slot[0]
    assert req.draft_locs is not None and req.draft_locs.size == K
    sched.abort_req(0, 1000, FinishReason.ABORT)              # while the step with its drafts runs
    assert req.status is ReqStatus.DONE and req.draft_locs is None
    sched.finish_step(record, *rank0.step(record))
    assert not sched.has_work()
    assert sched.allocator.num_free + sched.cache.total_size == KV


def test_planned_ahead_until_a_request_wants_to_speculate_again(pool):
    """The router's loop (process.py): a step is planned while the one before runs whenever may_plan_ahead says so.
    A request with nothing to copy backs off and is planned ahead; its back-off counts those steps too, so once its
    output starts repeating itself (the fake model's chain cycles after 96 tokens) the router waits for its token,
    the lookup finds the repeat, and the rest comes in bursts, still exactly the model's output."""
    sched = make_scheduler(pool)
    rank0 = FakeRank0(pool)
    add(sched, pool, 0, [13, 4], max_new=220)
    inflight, ahead = [], 0
    while sched.has_work() or inflight:
        depth = 2 if sched.may_plan_ahead() else 1
        record = sched.plan_step() if len(inflight) < depth else None
        if record is not None:
            inflight.append(record)
            ahead += len(inflight) == 2
            if len(inflight) < depth and sched.may_plan_ahead():
                continue
        oldest = inflight.pop(0)
        sched.finish_step(oldest, *rank0.step(oldest))
        assert_kv_accounted(sched)
    assert pool.output_ids(0, 0, 220).tolist() == chain(fake_next(4), 220)
    assert ahead > 40                                             # overlapped while backing off
    assert sched.speculation.counters["spec_accepted_tokens_total"] > 60   # bursts once it repeats
    assert sched.allocator.num_free + sched.cache.total_size == KV
