"""Speculative sampling (spec_verify.accept_sampled) leaves the output distribution unchanged: on a small Markov model
whose next-token distribution is the sampler's own processed one (temperature, top_k, top_p, min_p), 20,000 seeded
requests decoded speculatively with fixed drafts (likely, unlikely, impossible) give the joint distribution of their
first two tokens that plain sampling gives, by a chi-square test at significance 0.001. Broken rules (every draft
accepted, the residual not renormalized, the rejected draft's mass kept) fail it.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightserve.model_infer.sampler import SamplingTensors, sampling_probs
from lightserve.model_infer.spec_verify import accept_sampled

VOCAB = 8
TRIALS = 20_000
START = 0                 # every request's last sampled token
Z_999 = 3.0902            # the standard normal's 0.999 quantile


def _model() -> np.ndarray:
    """P [V, V] float64: P[a] is the distribution of the token after a, as sample() draws it."""
    logits = torch.from_numpy(np.random.default_rng(2).normal(0.0, 1.0, (VOCAB, VOCAB)).astype(np.float32))
    ones = torch.ones(VOCAB)
    params = SamplingTensors(temperature=ones * 0.8, top_p=ones * 0.97, top_k=torch.full((VOCAB,), 6),
                             seed=torch.zeros(VOCAB, dtype=torch.int64), step=torch.zeros(VOCAB, dtype=torch.int64),
                             min_p=ones * 0.02)
    return sampling_probs(logits, params).double().numpy()


P = _model()


def _speculate(last: np.ndarray, drafts: list[int], seeds: np.ndarray, steps: np.ndarray) -> list[np.ndarray]:
    """One verify step of len(last) requests, each after its token `last` with the same drafts: returns its new
    tokens, [R] arrays per output, -1 where a request has fewer."""
    k = len(drafts)
    rows = len(last)
    probs = np.empty((rows, 1 + k, VOCAB), np.float32)
    probs[:, 0] = P[last]
    probs[:, 1:] = P[drafts]
    accepted, tokens = accept_sampled(torch.from_numpy(probs.reshape(-1, VOCAB)), np.tile(drafts, rows),
                                      np.full(rows, 1 + k), seeds, steps)
    out = []
    for i in range(k + 1):
        out.append(np.where(accepted > i, drafts[i] if i < k else -1, np.where(accepted == i, tokens, -1)))
    return out


def _first_two(drafts: list[int], next_drafts: list[int]) -> np.ndarray:
    """[TRIALS, 2]: each seeded request's first two tokens, decoded speculatively; a request that gets one token
    from its first step takes its second from a step with `next_drafts`."""
    seeds = np.arange(TRIALS, dtype=np.int64) * 7919 + 11
    new = _speculate(np.full(TRIALS, START), drafts, seeds, np.zeros(TRIALS, np.int64))
    first, second = new[0], new[1]
    short = np.flatnonzero(second < 0)
    second[short] = _speculate(first[short], next_drafts, seeds[short], np.ones(short.size, np.int64))[0]
    return np.stack([first, second], axis=1)


def _chi_square(pairs: np.ndarray) -> tuple[float, float, float]:
    """(statistic, its 0.999 quantile, total variation) of the pairs against plain sampling's joint
    P[START, a] * P[a, b]."""
    want = P[START][:, None] * P                                                        # [V, V]
    got = np.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB).reshape(VOCAB, VOCAB)
    assert not got[want == 0].any(), "a pair plain sampling never gives"
    cells = want > 0
    expected = want[cells] * TRIALS
    stat = float(((got[cells] - expected) ** 2 / expected).sum())
    df = int(cells.sum()) - 1
    # Wilson-Hilferty: the chi-square quantile to within a fraction of a percent at these df.
    q = df * (1 - 2 / (9 * df) + Z_999 * math.sqrt(2 / (9 * df))) ** 3
    return stat, q, 0.5 * float(np.abs(got / TRIALS - want).sum())


LIKELY = [int(np.argmax(P[START]))]
for _ in range(2):
    LIKELY.append(int(np.argmax(P[LIKELY[-1]])))


def _unlikely(after: int) -> int:
    """The least likely token after `after` that plain sampling can still give."""
    p = np.where(P[after] > 0, P[after], np.inf)
    return int(np.argmin(p))


SCENARIOS = {
    "likely": (LIKELY, [LIKELY[1], LIKELY[2]]),
    "unlikely": ([_unlikely(START), 3, 5], [_unlikely(LIKELY[0])]),
    "impossible_first": ([int(np.argmin(P[START])), 1], [2, 4]),   # P[START] of it is 0: always rejected
    "mixed": ([LIKELY[0], _unlikely(LIKELY[0]), 6], [_unlikely(LIKELY[0]), 1]),
}


def test_model_has_likely_unlikely_and_impossible_tokens():
    """top_k 6 leaves 6 of the 8 tokens, top_p and min_p fewer in some rows; one start token above 0.3, one under
    0.05."""
    assert (P == 0).any(axis=1).all() and (P > 0).sum() < 6 * VOCAB
    assert P[START, LIKELY[0]] > 0.3 and 0 < P[START, _unlikely(START)] < 0.05


@pytest.mark.parametrize("name", SCENARIOS)
def test_speculative_sampling_gives_plain_sampling_distribution(name):
    drafts, next_drafts = SCENARIOS[name]
    stat, threshold, tv = _chi_square(_first_two(drafts, next_drafts))
    assert stat < threshold, (name, stat, threshold, tv)


def test_first_token_distribution_and_acceptance_rate():
    """The first token alone (total variation under 0.02), and a likely first draft accepted at its probability."""
    pairs = _first_two(*SCENARIOS["likely"])
    first = np.bincount(pairs[:, 0], minlength=VOCAB) / TRIALS
    assert 0.5 * np.abs(first - P[START]).sum() < 0.02
    assert abs(first[LIKELY[0]] - P[START, LIKELY[0]]) < 0.02


def test_same_seed_same_tokens_and_every_draw_its_own():
    """Seeded draws are a function of (seed, output index): the same tokens on every run, and requests that differ
    only in seed differ."""
    seeds = np.arange(64, dtype=np.int64)
    runs = [_speculate(np.full(64, START), LIKELY, seeds, np.zeros(64, np.int64)) for _ in range(2)]
    assert all((a == b).all() for a, b in zip(*runs))
    assert len(set(runs[0][0].tolist())) > 1
