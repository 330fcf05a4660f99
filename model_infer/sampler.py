"""Batched token sampling (greedy, temperature, top-k, top-p, min-p) with per-request seeds. Called by the
worker (rank 0) on the logits of each step; no per-request Python loop and no torch.Generator.

Randomness: each row's uniform draw is a splitmix64 hash of (seed, step), computed with vectorized
int64 ops, so a request's tokens depend only on its own seed, step and logits, never on what else
is in the batch. The draw picks a token by inverse CDF over the filtered softmax.
NOTE: the alternative, Gumbel noise hashed per (seed, step, token index), needs ~15 int64 ops over
the whole [B, V] matrix; measured here at B=64, V=49152 it cost ~16x more than inverse CDF
(softmax + cumsum + searchsorted), so the single draw per row is used instead.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

_U64 = 1 << 64


def _signed(c: int) -> int:  # a uint64 constant as the int64 with the same bits
    return c - _U64 if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
_NUM_CANDIDATES = 1024  # tokens per row considered by top-k/top-p before falling back to a full sort


@dataclass
class SamplingTensors:
    """The sampler's per-row parameters of one batch: [B] host tensors of any numeric dtype, each
    field but `step` named as its SamplingParams / PARAMS_DTYPE field, so `from_params` builds them
    from the batch's shm records without naming any. A new sampling parameter is a field here and
    its use in `sample`."""
    temperature: torch.Tensor        # <= 0: greedy
    top_p: torch.Tensor              # 1: off
    top_k: torch.Tensor              # <= 0 or >= V: off; 1: greedy
    seed: torch.Tensor               # int64
    step: torch.Tensor               # index of the token being sampled in its request: a fresh draw per step
    min_p: torch.Tensor | None = None  # 0 / None: off

    @classmethod
    def from_params(cls, params: np.ndarray, steps: np.ndarray) -> SamplingTensors:
        """params [B]: PARAMS_DTYPE records (lightserve/sampling.py); steps [B]: each row's output count."""
        names = [f.name for f in fields(cls) if f.name != "step"]
        return cls(step=torch.from_numpy(steps.astype(np.int64)),
                   **{name: torch.from_numpy(params[name].copy()) for name in names})


def sample(logits: torch.Tensor, params: SamplingTensors, raw_logits: torch.Tensor | None = None,
           logprobs: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row.

    logits [B, V] float32; params: one row each (SamplingTensors). Every decision on the parameters
    (all greedy? which rows filter?) is made on the host and they reach logits' device by
    non-blocking copies, so on a GPU the only waits are the caller's read of the result and a top_p
    row's full-sort check. min_p drops tokens whose probability is below min_p times the top token's
    (after temperature). raw_logits [B, V]: the model's logits before any processing (penalties,
    bias), for logprobs; None means `logits`. logprobs=False: no row's logprob is read, so no full-vocabulary
    logsumexp is taken (the returned logprobs are zeros).
    Returns next_ids [B] int64 and logprobs [B] float32: log_softmax of the raw (untempered) logits
    at the chosen token. Does not modify its inputs.
    """
    dev = logits.device
    # Host copies in fixed dtypes (the parameters usually come from numpy arrays of any int/float width).
    temperatures = params.temperature.to("cpu", torch.float32)
    top_ks = params.top_k.to("cpu", torch.int64)
    greedy = greedy_rows(temperatures, top_ks)  # [B] bool, on the host
    raw = logits if raw_logits is None else raw_logits
    all_greedy = bool(greedy.all())
    # An all-greedy batch needs none of the other parameters: it returns before they are converted (each small
    # torch op costs tens of us right after a CPU forward has streamed the weights through the caches).
    if raw is logits and all_greedy:
        fused = _greedy_fused(logits, logprobs)  # argmax (and logsumexp) in one C call on CPU
        if fused is not None:
            return torch.from_numpy(fused[0]), torch.from_numpy(fused[1])
    greedy_ids = logits.argmax(dim=-1)  # [B]
    if all_greedy:
        next_ids = greedy_ids
    else:
        greedy_dev = greedy.to(dev, non_blocking=True)
        probs = _filtered_probs(logits, params, temperatures, top_ks, greedy)
        u = uniform_from_seed(params.seed.to(dev, torch.int64, non_blocking=True),  # via int64: uint64 has few ops
                              params.step.to(dev, torch.int64, non_blocking=True))
        next_ids = torch.where(greedy_dev, greedy_ids, draw_tokens(probs, u))
    if not logprobs:
        return next_ids, torch.zeros(next_ids.shape[0], dtype=torch.float32, device=dev)
    chosen = raw.gather(1, next_ids.unsqueeze(1)).squeeze(1)  # [B]
    return next_ids, chosen - torch.logsumexp(raw, dim=-1)  # [B]


def greedy_cpu(logits: torch.Tensor, lib=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """logits [B, V] float32 on CPU -> (argmax [B] int64, logsumexp [B] float32) from the C kernel
    (kernels/cpu/sampling.c), or None when it cannot run here or a row is not finite (NaN, all -inf):
    then the caller uses torch's ops, which define those cases."""
    out = _argmax_logsumexp(logits, lib)
    return None if out is None else (torch.from_numpy(out[0]), torch.from_numpy(out[1]))


def greedy_rows(temperature, top_k):
    """Which rows sample greedily: temperature <= 0 or top_k 1. [B] numpy arrays or torch tensors alike."""
    return (temperature <= 0) | (top_k == 1)


def greedy_host(logits: torch.Tensor, params: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """sample() of an all-greedy batch on CPU without a torch op: logits [B, V] float32 (the model's, not
    processed), params [B] PARAMS_DTYPE records -> (next ids [B] int64, logprobs [B] float32), what sample()
    returns there; None where sample() must run (a row that samples, logits on a GPU, no C kernel, a row that is not
    finite). The output writer calls it with the shm records: building sample()'s SamplingTensors and its greedy
    test is a dozen small torch ops, each tens of microseconds right after a CPU forward; the greedy path through
    sample() took 0.30 ms of a 15.4 ms float32 decode step at batch 1 (scripts/profile_step.py, Zen 5)."""
    if logits.device.type != "cpu" or not greedy_rows(params["temperature"], params["top_k"]).all():
        return None
    return _greedy_fused(logits, bool(params["report_logprobs"].any()))


def _greedy_fused(logits: torch.Tensor, logprobs: bool = True) -> tuple[np.ndarray, np.ndarray] | None:
    """An all-greedy batch's (next ids [B] int64, logprobs [B] float32) from the C kernel, or None (see greedy_cpu).
    logprobs=False: no row's logprob is shown, so the kernel takes the argmax alone and the logprobs are zeros (as
    sample() returns them then)."""
    out = _argmax_logsumexp(logits, logsumexp=logprobs)
    if out is None:
        return None
    ids, lse = out
    if lse is None:
        return ids, np.zeros(ids.size, np.float32)
    # The chosen logit is the row's maximum: its logprob is that minus the logsumexp, in float32.
    return ids, logits.numpy()[np.arange(ids.size), ids] - lse


def _argmax_logsumexp(logits: torch.Tensor, lib=None, logsumexp: bool = True) \
        -> tuple[np.ndarray, np.ndarray | None] | None:
    """greedy_cpu's kernel call with numpy outputs: (argmax [B] int64, logsumexp [B] float32, or None where
    `logsumexp` is off) or None (a row with NaN or no finite value, or no kernel here). logits float32, or bfloat16
    for the argmax alone (an argmax-only step's bf16 lm_head output as it is: DecoderLM._logits).
    Logits off the CPU return None before the library is asked for: library() may build it with gcc, which a GPU
    worker's first greedy step must not wait for."""
    dtypes = (torch.float32,) if logsumexp else (torch.float32, torch.bfloat16)
    if logits.device.type != "cpu" or logits.dtype not in dtypes or logits.dim() != 2 or logits.stride(1) != 1:
        return None
    from lightserve.kernels.cpu import library, profiled

    lib = lib or library()
    if lib is None:
        return None
    rows, vocab = logits.shape
    ids = np.empty(rows, dtype=np.int64)
    lse = np.empty(rows, dtype=np.float32) if logsumexp else None
    with profiled("argmax_logsumexp_cpu"):
        lib.argmax_logsumexp(logits.data_ptr(), logits.stride(0), rows, vocab, ids.ctypes.data,
                             None if lse is None else lse.ctypes.data, int(logits.dtype == torch.bfloat16),
                             torch.get_num_threads())
    if not (np.isfinite(lse).all() if logsumexp else (ids >= 0).all()):
        return None
    return ids, lse


def uniform_from_seed(seeds: torch.Tensor, steps: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """[B] float64 in (0, 1), a deterministic function of each (seed, step, stream) triple (splitmix64).
    seeds, steps: [B] int64. Stream 0 is the draw of a token (sample); another stream is a further draw at the same
    step that must be independent of it (speculative decoding's acceptance test, spec_verify.accept_sampled)."""
    z = _splitmix64(_splitmix64(seeds + _GOLDEN) + steps * _GOLDEN)
    if stream:
        z = _splitmix64(z + stream * _GOLDEN)
    return (_shift_right(z, 11).double() + 0.5) * 2.0 ** -53  # top 53 bits


def sampling_probs(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """The distribution sample() draws each row's token from: softmax(logits / temperature) after top_k, top_p and
    min_p, [B, V] on logits' device. logits [B, V] float32; every row samples (none greedy). Does not modify logits."""
    temperatures = params.temperature.to("cpu", torch.float32)
    top_ks = params.top_k.to("cpu", torch.int64)
    greedy = greedy_rows(temperatures, top_ks)
    assert not bool(greedy.any()), "sampling_probs of a greedy row"
    return _filtered_probs(logits, params, temperatures, top_ks, greedy)


def draw_tokens(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: probs [B, V] (each row's weights, any positive total), u [B] float64 in (0, 1) -> [B] int64,
    token i with probability probs[i] / probs.sum()."""
    cdf = probs.cumsum(dim=-1)  # [B, V]
    # Scale by the row total rather than trusting cumsum to end at exactly 1.
    target = u.to(cdf.dtype) * cdf[:, -1]  # [B]
    # First index whose cdf exceeds the target; a zero-probability token repeats the previous cdf
    # value and so can never be the first to exceed it.
    ids = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)  # [B]
    return ids.clamp_(max=probs.shape[1] - 1)


def _filtered_probs(logits: torch.Tensor, params: SamplingTensors, temperatures: torch.Tensor, top_ks: torch.Tensor,
                    greedy: torch.Tensor) -> torch.Tensor:
    """sample()'s distribution of every row that samples, [B, V] on logits' device (a greedy row's is its softmax
    at temperature 1, never read). temperatures [B] float32, top_ks [B] int64 and greedy [B] bool: host tensors.
    Every decision on the parameters (which rows filter?) is made on the host and they reach logits' device by
    non-blocking copies, so no nonzero() waits for a GPU."""
    dev = logits.device
    vocab = logits.shape[1]
    top_ps = params.top_p.to("cpu", torch.float32)
    top_ks = torch.where((top_ks <= 0) | (top_ks > vocab), torch.full_like(top_ks, vocab), top_ks)
    min_ps = torch.zeros_like(temperatures) if params.min_p is None else params.min_p.to("cpu", torch.float32)
    # Rows to filter, chosen on the host ([R] and [M] indices).
    filter_rows = (~greedy & ((top_ks < vocab) | (top_ps < 1.0))).nonzero().squeeze(1)
    min_p_rows = (~greedy & (min_ps > 0)).nonzero().squeeze(1)
    filter_ks = top_ks[filter_rows]                                        # [R]
    k_needed = int(torch.where(filter_ks < vocab, filter_ks, 0).max()) if filter_rows.numel() else 0
    all_have_k = bool((filter_ks < vocab).all())

    def to_dev(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return t.to(dev, dtype, non_blocking=True)

    # Greedy rows: any finite temperature.
    temps = to_dev(torch.where(greedy, torch.ones_like(temperatures), temperatures), logits.dtype)
    scaled = logits / temps.unsqueeze(1)  # [B, V], a new tensor
    rows = to_dev(filter_rows)  # [R]
    if rows.numel() > 0:
        scaled[rows] = _filter_top_k_top_p(scaled[rows], to_dev(top_ks)[rows], to_dev(top_ps, logits.dtype)[rows],
                                           k_needed, all_have_k)
    rows = to_dev(min_p_rows)  # [M]
    if rows.numel() > 0:
        # p < min_p * p_max  <=>  scaled < max(scaled) + log(min_p); the top token always survives.
        sub = scaled[rows]
        floor = sub.max(dim=-1).values + torch.log(to_dev(min_ps, logits.dtype)[rows])
        scaled[rows] = sub.masked_fill(sub < floor.unsqueeze(1), float("-inf"))
    return torch.softmax(scaled, dim=-1)  # [B, V]


def _filter_top_k_top_p(scaled: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, k_needed: int,
                        all_have_k: bool) -> torch.Tensor:
    """scaled [R, V] -> [R, V] with tokens outside each row's top-k, then outside its top-p nucleus
    (of the top-k renormalized distribution), set to -inf. The most likely token always survives.

    NOTE: sorting a 49k vocabulary costs far more than the rest of sampling, so the filter works on
    the top `_NUM_CANDIDATES` (or top-k) tokens of each row; that is exact whenever those candidates
    hold the whole top-k set or at least top_p of the mass. The rare flatter rows get a full sort
    (knowing whether a row needs it reads `covered` back: the one host wait of a top_p-only batch).
    k_needed: the largest top-k below V among the rows (0 if none); all_have_k: every row has one.
    """
    vocab = scaled.shape[1]
    if all_have_k:  # every row's candidates are its top-k set: exact, and the cheapest topk
        num_cand, full_lse = k_needed, None
    else:
        num_cand, full_lse = min(vocab, max(_NUM_CANDIDATES, k_needed)), torch.logsumexp(scaled, dim=-1)
    vals, idx = scaled.topk(num_cand, dim=-1)  # [R, K], descending
    vals, covered = _mask_sorted(vals, top_ks, top_ps, full_lse=full_lse)
    out = torch.full_like(scaled, float("-inf")).scatter_(1, idx, vals)  # [R, V]
    if not bool(covered.all()):
        rows = (~covered).nonzero().squeeze(1)  # [R']
        vals, idx = scaled[rows].sort(dim=-1, descending=True)  # [R', V]
        vals, _ = _mask_sorted(vals, top_ks[rows], top_ps[rows], full_lse=None)
        out[rows] = torch.empty_like(vals).scatter_(1, idx, vals)
    return out


def _mask_sorted(
    vals: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, full_lse: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """vals [R, K]: each row's K largest scaled logits, descending (K may be V). Returns them with the
    dropped ones at -inf, and [R] bool: whether the row's result is exact from these K alone.
    full_lse [R]: logsumexp of each whole row, for rows without top-k (None when every row has one)."""
    num_cand = vals.shape[1]
    positions = torch.arange(num_cand, device=vals.device).unsqueeze(0)  # [1, K]
    vals = vals.masked_fill(positions >= top_ks.unsqueeze(1), float("-inf"))
    in_cand_k = top_ks <= num_cand  # [R] the whole top-k set is among the candidates
    lse = torch.logsumexp(vals, dim=-1)  # [R], renormalizes over the top-k set
    if full_lse is not None:
        lse = torch.where(in_cand_k, lse, full_lse)  # no top-k: probabilities over the whole vocabulary
    probs = torch.exp(vals - lse.unsqueeze(1))  # [R, K]
    cum = probs.cumsum(dim=-1)  # [R, K]
    mass_before = cum - probs  # probability of the strictly better tokens
    drop_p = mass_before >= top_ps.unsqueeze(1)  # keeps the smallest prefix whose mass reaches top_p
    drop_p[:, 0] = False
    drop_p &= (top_ps < 1.0).unsqueeze(1)  # top_p == 1 is off, even where cumsum rounds up to 1
    covered = in_cand_k | (cum[:, -1] >= top_ps)
    return vals.masked_fill(drop_p, float("-inf")), covered


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic: it copies the sign bit)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _splitmix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's output mix; int64 multiplication wraps like uint64 in two's complement."""
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)
