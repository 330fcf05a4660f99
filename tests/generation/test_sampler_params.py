"""Logit processing and the sampler's new parameters, without a server (model_infer/logits_process.py,
model_infer/sampler.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lightserve.model_infer.logits_process import process_logits
from lightserve.model_infer.sampler import SamplingTensors, sample
from lightserve.model_infer.token_history import TokenHistory
from lightserve.sampling import PARAMS_DTYPE, ParamError, SamplingParams

VOCAB = 50
EOS = np.array([2], np.int32)


def _batch(params: list[SamplingParams], histories: list[list[int]], prompt_lens: list[int]):
    """params records, num_out, prompt_lens and a token_ids table for a batch of rows 0..S-1."""
    records = np.zeros(len(params), PARAMS_DTYPE)
    for i, p in enumerate(params):
        p.validate(VOCAB).to_record(records[i:i + 1].reshape(()))
    table = np.zeros((len(params), 64), np.int32)
    for i, h in enumerate(histories):
        table[i, : len(h)] = h
    lens = np.array([len(h) for h in histories], np.int64)
    prompt = np.array(prompt_lens, np.int64)
    return records, lens - prompt, prompt, table


def _run(params, histories, prompt_lens, logits):
    records, num_out, prompt, table = _batch(params, histories, prompt_lens)
    history = TokenHistory(table, torch.device("cpu"))
    return process_logits(logits.clone(), np.arange(len(params)), records, num_out, prompt, history, EOS)


def test_untouched_rows_stay_bit_identical():
    logits = torch.randn(3, VOCAB)
    out = _run([SamplingParams()] * 3, [[1, 3, 4]] * 3, [2] * 3, logits)
    assert torch.equal(out, logits)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6], logits[0, 7] = 2.0, -2.0, 3.0
    out = _run([SamplingParams(repetition_penalty=2.0)], [[5, 9, 6]], [2], logits)  # 5, 9 prompt; 6 output
    assert out[0, 5] == 1.0 and out[0, 6] == -4.0 and out[0, 7] == 3.0   # 7 never seen: unchanged


def test_presence_and_frequency_count_output_tokens_only():
    logits = torch.zeros(1, VOCAB)
    out = _run([SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)], [[8, 8, 9, 9, 9, 8]], [2], logits)
    # outputs: 9 x3, 8 x1 (the two prompt 8s do not count)
    assert out[0, 9].item() == pytest.approx(-(0.5 + 0.75))
    assert out[0, 8].item() == pytest.approx(-(0.5 + 0.25))
    assert out[0, 1] == 0


def test_logit_bias_and_allowed_ids():
    logits = torch.randn(2, VOCAB)
    out = _run([SamplingParams(logit_bias={4: 100.0, 7: -3.0}), SamplingParams(allowed_token_ids=[11, 13])],
               [[1], [1]], [1, 1], logits)
    assert out[0, 4] == pytest.approx(logits[0, 4] + 100) and out[0, 7] == pytest.approx(logits[0, 7] - 3)
    assert out[0].argmax() == 4
    finite = torch.isfinite(out[1]).nonzero().squeeze(1).tolist()
    assert finite == [11, 13]


def test_min_new_tokens_bans_eos_and_stop_ids_only_below_the_minimum():
    logits = torch.zeros(2, VOCAB)
    p = SamplingParams(max_new_tokens=8, min_new_tokens=2, stop_token_ids=[17])
    out = _run([p, p], [[1, 5], [1, 5, 6, 7]], [1, 1], logits)  # row 0: 1 output; row 1: 3 outputs
    assert out[0, 2] == float("-inf") and out[0, 17] == float("-inf") and out[0, 5] == 0
    assert torch.isfinite(out[1]).all()


def test_min_p_one_is_greedy_and_min_p_keeps_the_top_token():
    logits = torch.randn(32, VOCAB)
    n = logits.shape[0]
    args = (torch.full((n,), 1.5), torch.ones(n), torch.full((n,), -1), torch.arange(n), torch.zeros(n))
    ids, _ = sample(logits, SamplingTensors(*args, min_p=torch.ones(n)))
    assert torch.equal(ids, logits.argmax(-1))
    # min_p=0.5: every sample's probability is at least half the top token's
    ids, _ = sample(logits, SamplingTensors(*args, min_p=torch.full((n,), 0.5)))
    probs = torch.softmax(logits / 1.5, -1)
    assert (probs.gather(1, ids[:, None]).squeeze(1) >= 0.5 * probs.max(-1).values - 1e-6).all()


def test_logprobs_come_from_raw_logits_when_given():
    raw = torch.randn(2, VOCAB)
    processed = raw.clone()
    processed[:, 3] += 100
    n = 2
    greedy = SamplingTensors(torch.zeros(n), torch.ones(n), torch.full((n,), -1), torch.zeros(n), torch.zeros(n))
    ids, lps = sample(processed, greedy, raw_logits=raw)
    assert ids.tolist() == [3, 3]
    torch.testing.assert_close(lps, torch.log_softmax(raw, -1)[:, 3])


def test_validation_names_the_field():
    with pytest.raises(ParamError) as e:
        SamplingParams(logit_bias={VOCAB: 1.0}).validate(VOCAB)
    assert e.value.param == "logit_bias"
    with pytest.raises(ParamError) as e:
        SamplingParams(allowed_token_ids=list(range(65))).validate(VOCAB)
    assert e.value.param == "allowed_token_ids"
    with pytest.raises(ParamError) as e:
        SamplingParams(grammar_kind=2, grammar='{"type": "nonsense"}').validate(VOCAB)
    assert e.value.param == "grammar"

