"""OutputWriter.argmax_only: the worker asks the model for argmax-only logits exactly when nothing of a step's logits
but each sampled row's argmax will be read."""
from __future__ import annotations

import dataclasses
import os
import secrets
from types import SimpleNamespace

import numpy as np
import pytest

from lightserve.messages import BatchPlan
from lightserve.model_infer.output_writer import OutputWriter
from lightserve.sampling import GrammarKind, SamplingParams
from lightserve.shm.req_pool import ReqPool

VOCAB = 500


class _NoSocket:
    def send(self, *_args, **_kw) -> None:
        pass

    def close(self, **_kw) -> None:
        pass


@pytest.fixture
def pool():
    p = ReqPool.create(f"lightserve-{os.getpid()}-{secrets.token_hex(3)}-test", num_slots=4, max_len=64)
    yield p
    p.close()
    p.segment.unlink()


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
