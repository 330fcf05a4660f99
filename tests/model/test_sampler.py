"""Batched sampler: greedy, seeded determinism independent of batch composition, the sampled
distribution, top-k / top-p filtering, and returned logprobs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lightserve.kernels.cpu import library
from lightserve.model_infer.sampler import (
    SamplingTensors,
    _argmax_logsumexp,
    _filter_top_k_top_p,
    greedy_cpu,
    greedy_host,
    sample,
    uniform_from_seed,
)
from lightserve.sampling import PARAMS_DTYPE, SamplingParams
from tests.kernels.kernel_cases import portable_library


def _params(batch: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed0: int = 0):
    return {
        "temperature": torch.full((batch,), temperature),
        "top_p": torch.full((batch,), top_p),
        "top_k": torch.full((batch,), top_k, dtype=torch.int64),
        "seed": torch.arange(seed0, seed0 + batch, dtype=torch.int64),
        "step": torch.zeros(batch, dtype=torch.int64),
    }


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    ids, _ = sample(logits, SamplingTensors(**_params(6, temperature=0.0)))
    assert torch.equal(ids, logits.argmax(-1))
    ids, _ = sample(logits, SamplingTensors(**_params(6, temperature=0.7, top_k=1)))
    assert torch.equal(ids, logits.argmax(-1))


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1)) * 3
    ref = torch.log_softmax(logits, -1)
    for params in (_params(5, temperature=0.0), _params(5, temperature=0.5, top_p=0.8, top_k=10)):
        ids, logprobs = sample(logits, SamplingTensors(**params))
        torch.testing.assert_close(logprobs, ref.gather(1, ids[:, None]).squeeze(1))


def test_same_seed_same_tokens_whatever_the_batch():
    gen = torch.Generator().manual_seed(2)
    row = torch.randn(1, 100, generator=gen)
    others = torch.randn(7, 100, generator=gen)
    mine = {"temperature": torch.tensor([0.9]), "top_p": torch.tensor([0.95]), "top_k": torch.tensor([50]),
            "seed": torch.tensor([1234]), "step": torch.tensor([3])}
    alone, _ = sample(row, SamplingTensors(**mine))
    # The same request at index 5 of a batch whose other rows are greedy, filtered or plain.
    p = _params(8, temperature=1.0, seed0=10)
    p["temperature"][0] = 0.0
    p["top_k"][1] = 5
    p["top_p"][2] = 0.5
    logits = torch.cat([others[:5], row, others[5:]])
    for key in p:
        p[key][5] = mine[key][0]
    batched, _ = sample(logits, SamplingTensors(**p))
    assert batched[5] == alone[0]


def test_different_seeds_and_steps_give_different_draws():
    logits = torch.zeros(64, 1000)  # uniform: every draw is as random as it gets
    a, _ = sample(logits, SamplingTensors(**_params(64, seed0=0)))
    b, _ = sample(logits, SamplingTensors(**_params(64, seed0=64)))
    assert (a != b).sum() > 55
    p = _params(64, seed0=0)
    p["step"] += 1
    c, _ = sample(logits, SamplingTensors(**p))
    assert (a != c).sum() > 55
    u = uniform_from_seed(torch.arange(100000), torch.zeros(100000, dtype=torch.int64))
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.005


def test_temperature_1_draws_follow_softmax():
    num_draws, vocab = 40000, 8
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5])
    # Many requests with distinct seeds, one row each: the draws of one step over many seeds.
    ids, _ = sample(logits.expand(num_draws, vocab).contiguous(), SamplingTensors(**_params(num_draws)))
    counts = torch.bincount(ids, minlength=vocab).double()
    expected = torch.softmax(logits.double(), -1) * num_draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 30.0, (chi2, counts, expected)  # 7 degrees of freedom: p(chi2 > 30) < 1e-4

    ids, _ = sample((logits * 2).expand(num_draws, vocab).contiguous(),
                    SamplingTensors(**_params(num_draws, temperature=2.0)))
    counts = torch.bincount(ids, minlength=vocab).double()
    assert float(((counts - expected) ** 2 / expected).sum()) < 30.0


def test_top_p_and_top_k_exclude_the_tail():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    logits = probs.log().expand(4000, 5).contiguous()
    ids, _ = sample(logits, SamplingTensors(**_params(4000, top_p=0.75)))  # nucleus {0, 1}: 0.5 < 0.75 <= 0.8
    assert set(ids.tolist()) == {0, 1}
    ids, _ = sample(logits, SamplingTensors(**_params(4000, top_p=0.45)))  # token 0 alone reaches 0.45
    assert set(ids.tolist()) == {0}
    ids, _ = sample(logits, SamplingTensors(**_params(4000, top_k=3)))
    assert set(ids.tolist()) == {0, 1, 2}
    # Top-p over the renormalized top 3 (0.56, 0.33, 0.11): 0.85 drops token 2, which raw probs would keep.
    ids, _ = sample(logits, SamplingTensors(**_params(4000, top_k=3, top_p=0.85)))
    assert set(ids.tolist()) == {0, 1}
    # Shuffled vocabulary order: filtering follows probability, not position.
    perm = torch.tensor([3, 0, 4, 2, 1])
    ids, _ = sample(logits[:, perm], SamplingTensors(**_params(4000, top_p=0.75)))
    assert set(perm[ids].tolist()) == {0, 1}


def _filter_reference(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """One row, the obvious way: full sort, top-k, renormalize, top-p."""
    vals, idx = scaled.sort(descending=True)
    if 0 < top_k < len(vals):
        vals[top_k:] = float("-inf")
    probs = torch.softmax(vals.double(), -1)
    drop = (probs.cumsum(-1) - probs) >= top_p
    drop[0] = False
    vals[drop] = float("-inf")
    return torch.empty_like(scaled).scatter_(0, idx, vals)


def test_candidate_filter_equals_full_sort_on_a_large_vocabulary():
    # Peaked rows are served from the top-1024 candidates; the nearly flat ones (top_p mass beyond
    # 1024 tokens) fall back to a full sort, and the top_k=2000 row widens the candidate set.
    gen = torch.Generator().manual_seed(3)
    vocab = 5000
    scale = torch.tensor([[8.0], [8.0], [0.1], [1e-3], [8.0], [3.0]])
    scaled = torch.randn(6, vocab, generator=gen) * scale
    top_ks = torch.tensor([vocab, 50, vocab, vocab, 2000, vocab])
    top_ps = torch.tensor([0.9, 0.95, 0.9, 0.5, 0.99, 1.0])
    got = _filter_top_k_top_p(scaled.clone(), top_ks, top_ps, k_needed=2000, all_have_k=False)
    for r in range(6):
        kept = ~torch.isinf(_filter_reference(scaled[r].clone(), int(top_ks[r]), float(top_ps[r])))
        got_kept = ~torch.isinf(got[r])
        # float32 vs float64 cumsums may disagree on the one token at the nucleus boundary
        assert int((got_kept ^ kept).sum()) <= 1, r
        assert torch.equal(got[r][got_kept], scaled[r][got_kept])
    assert abs(int((~torch.isinf(got[3])).sum()) - vocab // 2) < 100  # nearly flat: about half


@pytest.mark.skipif(library() is None, reason="no C compiler: greedy sampling runs torch ops")
@pytest.mark.parametrize("portable", [False, True])
def test_fused_greedy_kernel_matches_torch(portable):
    """The C argmax + logsumexp (the all-greedy CPU path) against torch's ops, on rows with ties (in the
    first block and past it), -inf entries (banned tokens), a vocabulary off the kernel's 16 lanes and a
    batch over the threading threshold; a NaN row declines it, so sample() gives torch's answer there."""
    lib = portable_library() if portable else None
    logits = torch.randn(70, 49157, generator=torch.Generator().manual_seed(5)) * 4
    logits[3, [10, 20000]] = 50.0  # a tie: the first index wins, as in torch.argmax
    logits[4, :40000] = float("-inf")
    logits[5, [30000, 45000]] = 60.0  # a tie past the kernel's first blocks
    ids, lse = greedy_cpu(logits, lib=lib)
    assert torch.equal(ids, logits.argmax(-1)) and int(ids[3]) == 10 and int(ids[5]) == 30000
    # References in float64: torch's own float32 log_softmax is off by up to 2e-5 on these rows on some CPUs
    # (AVX2), more than the kernel is.
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits.double(), -1), rtol=1e-6, atol=1e-5)
    ids, logprobs = sample(logits, SamplingTensors(**_params(70, temperature=0.0)))
    want = torch.log_softmax(logits.double(), -1).gather(1, ids[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs.double(), want, rtol=1e-5, atol=1e-5)
    logits[4, 100] = float("nan")  # among the -inf entries before the row's first finite value
    assert greedy_cpu(logits, lib=lib) is None
    logits[4, 100] = float("-inf")
    logits[7, 5] = float("nan")
    assert greedy_cpu(logits, lib=lib) is None
    assert torch.equal(sample(logits, SamplingTensors(**_params(70, temperature=0.0)))[0], logits.argmax(-1))


@pytest.mark.skipif(library() is None, reason="no C compiler: greedy sampling runs torch ops")
@pytest.mark.parametrize("portable", [False, True])
def test_argmax_alone_where_no_logprob_is_shown(portable):
    """A batch that shows no logprob takes the kernel's argmax without the exponentials: the same ids as torch's
    argmax on ties, -inf entries and past the threading threshold, from float32 or bf16 logits; a NaN or an all -inf
    row declines it; through greedy_host (no row reporting logprobs) and sample(logprobs=False) the logprobs are
    zeros."""
    lib = portable_library() if portable else None
    logits = torch.randn(70, 49157, generator=torch.Generator().manual_seed(6)) * 4
    logits[3, [10, 20000]] = 50.0
    logits[4, :40000] = float("-inf")
    logits[5, [30000, 45000]] = 60.0
    ids, lse = _argmax_logsumexp(logits, lib, logsumexp=False)
    assert lse is None and np.array_equal(ids, logits.argmax(-1).numpy()) and ids[3] == 10 and ids[5] == 30000
    quiet = _records([SamplingParams(temperature=0.0, report_logprobs=False)] * 70)
    host_ids, host_lps = greedy_host(logits, quiet)
    assert np.array_equal(host_ids, ids) and host_lps.dtype == np.float32 and not host_lps.any()
    got_ids, got_lps = sample(logits, SamplingTensors(**_params(70, temperature=0.0)), logprobs=False)
    assert np.array_equal(got_ids.numpy(), ids) and not got_lps.any()
    for row, bad in ((7, (5, float("nan"))), (8, (slice(None), float("-inf")))):
        broken = logits.clone()
        broken[row, bad[0]] = bad[1]
        assert _argmax_logsumexp(broken, lib, logsumexp=False) is None
        assert greedy_host(broken, quiet) is None
        assert _argmax_logsumexp(broken.bfloat16(), lib, logsumexp=False) is None
    # bf16 logits (a bf16 model's argmax-only step): read as they are, the ids of their float32 copy; bf16 rounding
    # makes more ties, which go to the first index as torch's argmax does.
    half = logits.bfloat16()
    ids, _ = _argmax_logsumexp(half, lib, logsumexp=False)
    assert np.array_equal(ids, half.float().argmax(-1).numpy()) and np.array_equal(ids, half.argmax(-1).numpy())
    assert _argmax_logsumexp(half, lib) is None  # no logsumexp of bf16 logits: torch's ops take those


def _records(params: list[SamplingParams]) -> np.ndarray:
    records = np.zeros(len(params), dtype=PARAMS_DTYPE)
    for i, p in enumerate(params):
        p.to_record(records[i])
    return records


@pytest.mark.skipif(library() is None, reason="no C compiler: greedy sampling runs torch ops")
def test_greedy_host_returns_what_sample_returns_bit_for_bit():
    """The output writer's all-greedy CPU path (numpy and one C call) against sample() on the same batch: the same
    ids and the same logprob bits, with greedy asked as temperature 0 or as top_k 1, on rows with a tie and banned
    (-inf) tokens. A row that samples or a non-finite row leaves the batch to sample()."""
    logits = torch.randn(9, 49157, generator=torch.Generator().manual_seed(7)) * 4
    logits[2, [11, 30000]] = 40.0
    logits[5, :20000] = float("-inf")
    params = _records([SamplingParams(temperature=0.0)] * 6 + [SamplingParams(temperature=0.8, top_k=1)] * 3)
    ids, logprobs = greedy_host(logits, params)
    want_ids, want_logprobs = sample(logits, SamplingTensors.from_params(params, np.zeros(9, np.int64)))
    assert ids.dtype == np.int64 and logprobs.dtype == np.float32
    assert np.array_equal(ids, want_ids.numpy()) and int(ids[2]) == 11
    assert np.array_equal(logprobs.view(np.int32), want_logprobs.numpy().view(np.int32))

    one_samples = _records([SamplingParams(temperature=0.0)] * 8 + [SamplingParams(temperature=0.7)])
    assert greedy_host(logits, one_samples) is None
    logits[4, 7] = float("nan")
    assert greedy_host(logits, params) is None


def test_logits_off_the_cpu_never_ask_for_the_c_library(monkeypatch):
    """The first greedy step of a GPU worker must not build the CPU library with gcc: logits on another device
    (meta here: anything but the CPU is treated like CUDA's) are turned away before library() is called."""
    import lightserve.kernels.cpu as cpu

    def no_library():
        raise AssertionError("library() reached for logits off the CPU")
    monkeypatch.setattr(cpu, "library", no_library)
    logits = torch.empty(3, 50, device="meta")
    assert greedy_cpu(logits) is None
    ids, logprobs = sample(logits, SamplingTensors(**_params(3, temperature=0.0)))
    assert ids.device.type == "meta" and ids.shape == (3,) and logprobs.shape == (3,)
    assert greedy_host(logits, _records([SamplingParams(temperature=0.0)] * 3)) is None


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_no_logsumexp_when_no_logprob_is_read(monkeypatch, temperature):
    """logprobs=False: the same tokens, zeros for logprobs and no full-vocabulary logsumexp (the greedy torch path,
    what a GPU runs, and the sampling path); logprobs=True: log_softmax at the chosen token, as before."""
    import lightserve.model_infer.sampler as sampler

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(2)) * 3
    params = SamplingTensors(**_params(4, temperature=temperature))
    monkeypatch.setattr(sampler, "_greedy_fused", lambda _logits, _logprobs=True: None)     # as on a GPU: no C kernel
    ids, logprobs = sample(logits, params)
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, ids[:, None])[:, 0])
    logsumexp = torch.logsumexp
    calls = []
    monkeypatch.setattr(torch, "logsumexp", lambda t, dim: calls.append(tuple(t.shape)) or logsumexp(t, dim))
    quiet_ids, zeros = sample(logits, params, logprobs=False)
    assert calls == [] and torch.equal(quiet_ids, ids)
    assert zeros.dtype == torch.float32 and torch.equal(zeros, torch.zeros(4))
