"""OutputWriter: the worker asks the model for argmax-only logits exactly when nothing of a step's logits but each
sampled row's argmax will be read; a step planned ahead of the one before gets its pending inputs, and drops a
request that step ended."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightserve.messages import BatchPlan, FinishReason, StepDone, TokensReady, decode
from lightserve.model_infer.output_writer import OutputWriter
from lightserve.sampling import GrammarKind, SamplingParams

VOCAB = 500


class _NoSocket:
    def send(self, *_args, **_kw) -> None:
        pass

    def close(self, **_kw) -> None:
        pass


class _Inbox(_NoSocket):
    def __init__(self) -> None:
        self.messages = []

    def send(self, data, **_kw) -> None:
        self.messages.append(decode(data))


@pytest.fixture
def pool(make_pool):
    return make_pool(num_slots=4, max_len=64)


def _plan(slots: list[int], sample: list[bool], prompt_logit_idx: list[int] = ()) -> BatchPlan:
    n = len(slots)
    i32 = lambda xs: np.array(xs, np.int32)  # noqa: E731
    return BatchPlan(step=1, shm_indices=i32(slots), req_ids=np.array([10 + s for s in slots], np.int64),
                     prefix_lens=i32([0] * n), extend_lens=i32([3] * n), sample=np.array(sample),
                     input_ids=i32([1] * 3 * n), kv_locs=i32(range(3 * n)), num_decode=0,
                     prompt_logit_idx=i32(prompt_logit_idx))


GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, report_logprobs=False)


@pytest.mark.parametrize("other, want", [
    (GREEDY, True),
    (dataclasses.replace(GREEDY, temperature=0.7, top_k=1), True),          # top_k 1 is greedy too
    (dataclasses.replace(GREEDY, ignore_eos=True, stop_token_ids=[3]), True),
    (dataclasses.replace(GREEDY, report_logprobs=True), False),
    (dataclasses.replace(GREEDY, temperature=0.7), False),
    (dataclasses.replace(GREEDY, top_logprobs=2), False),
    (dataclasses.replace(GREEDY, repetition_penalty=1.3), False),
    (dataclasses.replace(GREEDY, logit_bias={5: 2.0}), False),
    (dataclasses.replace(GREEDY, allowed_token_ids=[4, 5]), False),
    (dataclasses.replace(GREEDY, min_new_tokens=2), False),                   # eos banned at first
    (dataclasses.replace(GREEDY, grammar_kind=GrammarKind.JSON_OBJECT), False),
], ids=["greedy", "top_k_1", "stop_ids", "report_logprobs", "sampling", "top_logprobs", "penalty", "bias", "allowed",
        "min_tokens", "grammar"])
def test_argmax_only_when_every_sampled_row_reads_nothing_but_its_argmax(pool, other, want):
    writer = OutputWriter(pool, SimpleNamespace(eos_token_ids=(2,), vocab_size=VOCAB), "", _NoSocket(), _NoSocket())
    for slot, params in ((0, GREEDY), (1, other)):
        pool.acquire(slot, req_id=10 + slot)
        pool.write_request(slot, [1, 1, 1], params, seed=0)
    assert writer.argmax_only(_plan([0, 1], [True, True])) is want
    # A row that does not sample this step (a prompt chunk short of its end) asks nothing.
    assert writer.argmax_only(_plan([0, 1], [True, False])) is True
    # Nothing sampled, or prompt logprobs to compute: the logits as they are.
    assert writer.argmax_only(_plan([0, 1], [False, False])) is False
    assert writer.argmax_only(_plan([0], [True], prompt_logit_idx=[0, 1])) is False


def _logits(*argmaxes: int) -> torch.Tensor:
    out = torch.zeros(len(argmaxes), VOCAB)
    for row, token in enumerate(argmaxes):
        out[row, token] = 5.0
    return out


def test_a_step_planned_ahead_takes_its_inputs_and_drops_what_the_step_before_ended(pool):
    to_router, to_detok = _Inbox(), _Inbox()
    writer = OutputWriter(pool, SimpleNamespace(eos_token_ids=(2,), vocab_size=VOCAB), "", to_router, to_detok)
    for slot in (0, 1):
        pool.acquire(slot, req_id=10 + slot)
        pool.write_request(slot, [1, 1, 1], GREEDY, seed=0)
    writer.write(_plan([0, 1], [True, True]), _logits(2, 7), 0.0)   # slot 0 samples eos
    assert to_router.messages[-1].finish.tolist() == [FinishReason.STOP, FinishReason.NONE]
    # Step 2 was planned before step 1 ran: both decode, their inputs still unknown to the router.
    i32 = lambda xs: np.array(xs, np.int32)  # noqa: E731
    ahead = BatchPlan(step=2, shm_indices=i32([0, 1]), req_ids=np.array([10, 11], np.int64), prefix_lens=i32([3, 3]),
                      extend_lens=i32([1, 1]), sample=np.array([True, True]), input_ids=i32([-1, -1]),
                      kv_locs=i32([6, 7]), num_decode=2, pending_inputs=i32([0, 1]))
    writer.fill_pending_inputs(ahead)
    assert ahead.input_ids.tolist() == [2, 7]
    writer.write(ahead, _logits(9, 9), 0.0)
    done, ready = to_router.messages[-1], to_detok.messages[-1]
    assert isinstance(done, StepDone) and done.step == 2 and done.finish.tolist() == [FinishReason.STOP, 0]
    assert isinstance(ready, TokensReady) and ready.shm_indices.tolist() == [1]
    assert pool.num_output[:2].tolist() == [1, 2] and pool.output_ids(1, 0, 2).tolist() == [7, 9]
    assert pool.finish[0] == FinishReason.STOP and pool.token_ids[0, 4] == 0


def _prompt_logprob_step(pool, prompt_logprobs: int = 3) -> tuple[BatchPlan, torch.Tensor]:
    """Two prompts of 9 and 7 tokens computed in one step, both asking for prompt logprobs: the plan and its logits
    ([2 sampled + 14 prompt rows, VOCAB])."""
    params = dataclasses.replace(GREEDY, prompt_logprobs=prompt_logprobs)
    gen = torch.Generator().manual_seed(3)
    for slot, n in ((0, 9), (1, 7)):
        pool.acquire(slot, req_id=10 + slot)
        pool.write_request(slot, torch.randint(3, VOCAB, (n,), generator=gen).tolist(), params, seed=0)
    i32 = lambda xs: np.array(xs, np.int32)  # noqa: E731
    plan = BatchPlan(step=1, shm_indices=i32([0, 1]), req_ids=np.array([10, 11], np.int64), prefix_lens=i32([0, 0]),
                     extend_lens=i32([9, 7]), sample=np.array([True, True]), input_ids=i32([1] * 16),
                     kv_locs=i32(range(16)), num_decode=0, prompt_logit_idx=i32([*range(8), *range(9, 15)]))
    return plan, torch.randn(16, VOCAB, generator=gen)


def test_prompt_logprobs_in_chunks_equal_one_pass(make_pool, monkeypatch):
    from lightserve.model_infer import output_writer

    results, rows_seen = [], []
    log_softmax = torch.log_softmax

    def recording_log_softmax(t: torch.Tensor, dim: int) -> torch.Tensor:
        rows_seen.append(t.shape[0])
        return log_softmax(t, dim)

    for chunk in (None, 4):
        pool = make_pool(num_slots=4, max_len=64)
        plan, logits = _prompt_logprob_step(pool)
        writer = OutputWriter(pool, SimpleNamespace(eos_token_ids=(2,), vocab_size=VOCAB), "", _NoSocket(),
                              _NoSocket())
        rows_seen.clear()
        with monkeypatch.context() as patch:
            if chunk is not None:
                patch.setattr(output_writer, "PROMPT_LOGPROB_ROWS", chunk)
            patch.setattr(torch, "log_softmax", recording_log_softmax)
            writer.write(plan, logits, 0.0)
        assert max(rows_seen) == (14 if chunk is None else chunk)   # never more rows than a chunk at once
        results.append([pool.logprobs[:2, :10].copy(), pool.top_ids[:2, :10].copy(),
                        pool.top_logprobs[:2, :10].copy()])
        # Token p + 1 of each prompt scored by the logits after token p.
        ref = torch.log_softmax(logits[2:], dim=-1)
        targets = np.concatenate([pool.token_ids[0, 1:9], pool.token_ids[1, 1:7]])
        got = np.concatenate([pool.logprobs[0, 1:9], pool.logprobs[1, 1:7]])
        np.testing.assert_array_equal(got, ref[torch.arange(14), torch.from_numpy(targets.astype(np.int64))].numpy())
    for one_pass, chunked in zip(*results):
        np.testing.assert_array_equal(one_pass, chunked)


def test_no_logsumexp_unless_a_sampled_row_reports_its_logprob(pool, monkeypatch):
    writer = OutputWriter(pool, SimpleNamespace(eos_token_ids=(2,), vocab_size=VOCAB), "", _NoSocket(), _NoSocket())
    sampled = dataclasses.replace(GREEDY, temperature=0.8)   # through sample(), not the greedy C kernel
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    for slot in (0, 1):
        pool.acquire(slot, req_id=10 + slot)
        pool.write_request(slot, [1, 1, 1], sampled, seed=slot)
    logsumexp = torch.logsumexp
    calls = []
    monkeypatch.setattr(torch, "logsumexp", lambda t, dim: calls.append(tuple(t.shape)) or logsumexp(t, dim))
    writer.write(_plan([0, 1], [True, True]), logits, 0.0)
    assert calls == []
    quiet_ids = pool.token_ids[:2, 3].copy()
    # The same step with slot 1 reporting its logprob: the ids do not change, and the logprobs are the batch's
    # chosen logit minus its logsumexp, as before.
    for slot, report in ((2, False), (3, True)):                       # the same seeds in slots 2 and 3
        pool.acquire(slot, req_id=10 + slot)
        pool.write_request(slot, [1, 1, 1], dataclasses.replace(sampled, report_logprobs=report), seed=slot - 2)
    writer.write(_plan([2, 3], [True, True]), logits, 0.0)
    assert calls == [(2, VOCAB)]
    ids = pool.token_ids[2:4, 3]
    np.testing.assert_array_equal(ids, quiet_ids)
    want = logits.gather(1, torch.from_numpy(ids.astype(np.int64))[:, None])[:, 0] - logsumexp(logits, -1)
    np.testing.assert_array_equal(pool.logprobs[2:4, 3], want.numpy())
