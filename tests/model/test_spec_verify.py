"""Speculative decoding on rank 0: accept_greedy, and OutputWriter's verify-and-publish on synthetic logits (the
burst in shm, cut by eos, a stop id or the length; StepDone.num_accepted; TokensReady for every row with tokens).
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightserve.messages import BatchPlan, FinishReason, decode
from lightserve.model_infer.output_writer import OutputWriter
from lightserve.model_infer.sampler import uniform_from_seed
from lightserve.model_infer.spec_verify import accept_greedy
from lightserve.sampling import SamplingParams

VOCAB = 500
EOS = 2
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)
i32 = lambda xs: np.array(xs, np.int32)  # noqa: E731


class _Inbox:
    def __init__(self) -> None:
        self.messages = []

    def send(self, data, **_kw) -> None:
        self.messages.append(decode(data))

    def close(self, **_kw) -> None:
        pass


@pytest.fixture
def pool(make_pool):
    return make_pool(num_slots=4, max_len=64)


def test_accept_greedy_takes_the_leading_drafts_that_match():
    # Row 0: drafts 5 6 7 against targets 5 6 9 (then 4): 2 accepted. Row 1: no drafts. Row 2: both match.
    # Row 3: the first draft is wrong.
    targets = np.array([5, 6, 9, 4, 8, 1, 2, 3, 11, 12])
    drafts = np.array([5, 6, 7, 1, 2, 10])
    assert accept_greedy(targets, drafts, np.array([4, 1, 3, 2])).tolist() == [2, 0, 2, 0]


def _logits(*argmaxes: int, peak: float = 5.0) -> torch.Tensor:
    out = torch.zeros(len(argmaxes), VOCAB)
    for row, token in enumerate(argmaxes):
        out[row, token] = peak
    return out


def _writer(pool) -> tuple[OutputWriter, _Inbox, _Inbox]:
    to_router, to_detok = _Inbox(), _Inbox()
    return OutputWriter(pool, SimpleNamespace(eos_token_ids=(EOS,), vocab_size=VOCAB), "", to_router, to_detok), \
        to_router, to_detok


def _start(writer, pool, slots_params: dict[int, SamplingParams], seed: int = 0) -> None:
    """Each slot's 3-token prompt is computed and its first output, 7, published (a prefill step; a sampling row
    draws 7 too, every other token's probability underflowing)."""
    for slot, params in slots_params.items():
        pool.acquire(slot, req_id=10 + slot)
        pool.write_request(slot, [1, 1, 1], params, seed=seed)
    slots = list(slots_params)
    n = len(slots)
    writer.write(BatchPlan(step=1, shm_indices=i32(slots), req_ids=np.array([10 + s for s in slots], np.int64),
                           prefix_lens=i32([0] * n), extend_lens=i32([3] * n), sample=np.ones(n, bool),
                           input_ids=i32([1] * 3 * n), kv_locs=i32(range(3 * n)), num_decode=0),
                 _logits(*[7] * n, peak=200.0), 0.0)


def _spec_plan(rows: list[tuple[int, list[int]]], num_decode: int = 0) -> BatchPlan:
    """Each (slot, drafts): its last token 7 at position 3, then the drafts; the first num_decode rows decode
    plainly."""
    ids = [tok for _, drafts in rows for tok in [7, *drafts]]
    slots = [s for s, _ in rows]
    return BatchPlan(step=2, shm_indices=i32(slots), req_ids=np.array([10 + s for s in slots], np.int64),
                     prefix_lens=i32([3] * len(rows)), extend_lens=i32([1 + len(d) for _, d in rows]),
                     sample=np.ones(len(rows), bool), input_ids=i32(ids), kv_locs=i32(range(100, 100 + len(ids))),
                     num_decode=num_decode, spec_lens=i32([len(d) for _, d in rows]))


@pytest.mark.parametrize("params, drafts, argmaxes, want_tokens, want_finish", [
    (GREEDY, [8, 9, 10], [8, 9, 10, 11], [8, 9, 10, 11], FinishReason.NONE),           # all accepted + bonus
    (GREEDY, [8, 9, 10], [8, 4, 10, 11], [8, 4], FinishReason.NONE),                   # the second rejected
    (GREEDY, [8, 9, 10], [5, 9, 10, 11], [5], FinishReason.NONE),                      # none accepted
    (GREEDY, [8, EOS, 10], [8, EOS, 10, 11], [8, EOS], FinishReason.STOP),              # eos inside the burst
    (dataclasses.replace(GREEDY, stop_token_ids=[9]), [8, 9, 10], [8, 9, 10, 11], [8, 9], FinishReason.STOP),
    (dataclasses.replace(GREEDY, max_new_tokens=3), [8, 9, 10], [8, 9, 10, 11], [8, 9], FinishReason.LENGTH),
    (dataclasses.replace(GREEDY, ignore_eos=True), [EOS, 9], [EOS, 9, 11], [EOS, 9, 11], FinishReason.NONE),
], ids=["all", "partial", "none", "eos", "stop_id", "length", "ignore_eos"])
def test_verify_publishes_the_accepted_burst(pool, params, drafts, argmaxes, want_tokens, want_finish):
    writer, to_router, to_detok = _writer(pool)
    _start(writer, pool, {0: params})
    writer.write(_spec_plan([(0, drafts)]), _logits(*argmaxes), 0.0)
    done, ready = to_router.messages[-1], to_detok.messages[-1]
    assert done.finish.tolist() == [want_finish]
    assert done.num_accepted.tolist() == [len(want_tokens) - 1]
    assert ready.shm_indices.tolist() == [0]
    assert pool.num_output[0] == 1 + len(want_tokens) and pool.finish[0] == want_finish
    assert pool.output_ids(0, 0, 1 + len(want_tokens)).tolist() == [7, *want_tokens]
    assert pool.token_ids[0, 4 + len(want_tokens)] == 0     # nothing past the burst
    # Each published token's logprob is its position's (all logits rows alike: logprob of the max).
    lp = torch.log_softmax(_logits(8), -1)[0, 8].item()
    np.testing.assert_allclose(pool.output_logprobs(0, 1, 1 + len(want_tokens)), lp, rtol=1e-6)


def test_speculating_and_plain_rows_in_one_step(pool):
    """A plain decode (slot 1), a speculating row (slot 0) and a speculating row none of whose drafts match
    (slot 2), in plan order, and a prompt-logprob-free tail: each gets its tokens from its own logits rows."""
    writer, to_router, to_detok = _writer(pool)
    _start(writer, pool, {0: GREEDY, 1: GREEDY, 2: GREEDY})
    plan = _spec_plan([(1, []), (0, [8, 9]), (2, [30])], num_decode=1)
    #                          slot 1 | slot 0: after 7, 8, 9 | slot 2: after 7, 30
    writer.write(plan, _logits(40, 8, 9, 12, 31, 33), 0.0)
    done, ready = to_router.messages[-1], to_detok.messages[-1]
    assert done.num_accepted.tolist() == [0, 2, 0] and done.finish.tolist() == [0, 0, 0]
    assert sorted(ready.shm_indices.tolist()) == [0, 1, 2]
    assert pool.output_ids(1, 0, 2).tolist() == [7, 40]
    assert pool.output_ids(0, 0, 4).tolist() == [7, 8, 9, 12]
    assert pool.output_ids(2, 0, 2).tolist() == [7, 31]
    assert pool.num_output[:3].tolist() == [4, 2, 2]


SAMPLING = SamplingParams(max_new_tokens=16, temperature=0.8, top_k=2)


def _sampling_step(make_pool, seed: int) -> tuple[OutputWriter, _Inbox, torch.Tensor]:
    """A sampling row (slot 0) with drafts 8, 9, 10 beside a greedy one (slot 1) with drafts 8, 9, and a plain
    decode (slot 2), all of slots 0 and 2 seeded with `seed`. Slot 0's logits make 8 certain after 7 (every other
    token's probability underflows at temperature 0.8) and 9 impossible after 8 (outside its top_k 2, tokens 20 and
    21): its burst is 8, then 20 or 21 from the residual."""
    pool = make_pool(num_slots=4, max_len=64)
    writer, to_router, _ = _writer(pool)
    _start(writer, pool, {0: SAMPLING, 1: GREEDY, 2: SAMPLING}, seed=seed)
    plan = _spec_plan([(2, []), (0, [8, 9, 10]), (1, [8, 9])], num_decode=1)
    logits = _logits(40, 8, 0, 0, 0, 8, 9, 12, peak=200.0)         # slot 2 | slot 0: after 7, 8, 9, 10 | slot 1
    logits[2, [0, 20, 21]] = torch.tensor([0.0, 3.0, 2.5])            # slot 0 after 8: 9 (logit 0) is cut by top_k
    writer.write(plan, logits, 0.0)
    return writer, to_router, logits


def test_verify_samples_a_sampling_row(make_pool):
    writer, to_router, logits = _sampling_step(make_pool, seed=5)
    pool = writer.pool
    done = to_router.messages[-1]
    assert done.num_accepted.tolist() == [0, 1, 2] and done.finish.tolist() == [0, 0, 0]
    assert pool.output_ids(1, 0, 4).tolist() == [7, 8, 9, 12]           # greedy: as accept_greedy decides
    assert pool.output_ids(2, 0, 2).tolist() == [7, 40]
    assert pool.num_output[0] == 3
    # The replacement of the rejected 9 (output index 2): the residual over 20 and 21 (9 has no mass to remove),
    # drawn with the number a plain decode of index 2 draws (stream 0 of seed 5 at step 2).
    u = uniform_from_seed(torch.tensor([5]), torch.tensor([2])).item()
    p20 = 1 / (1 + np.exp((2.5 - 3.0) / 0.8))
    assert pool.output_ids(0, 0, 3).tolist() == [7, 8, 20 if u < p20 else 21]
    # Chosen-token logprobs as a plain decode reports them: log_softmax of the model's (untempered) logits.
    want = [torch.log_softmax(logits[r], -1)[t].item() for r, t in ((1, 8), (2, int(pool.token_ids[0, 5])))]
    np.testing.assert_allclose(pool.output_logprobs(0, 1, 3), want, rtol=1e-6)


def test_verify_sampling_is_seeded(make_pool):
    """A seed gives the same burst on every run; different seeds give both replacements."""
    bursts = {}
    for seed in range(8):
        runs = [_sampling_step(make_pool, seed)[0].pool.output_ids(0, 0, 3).tolist() for _ in range(2)]
        assert runs[0] == runs[1]
        bursts[seed] = runs[0][2]
    assert set(bursts.values()) == {20, 21}
