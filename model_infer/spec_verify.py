"""Speculative decoding's verification on rank 0: how many of each request's draft tokens the target model accepts.
Called by OutputWriter (output_writer.py) on the logits of a step with BatchPlan.spec_lens.

- Greedy rows (accept_greedy): a draft is accepted while it equals the model's argmax at the position before it, so
  the published tokens are exactly those plain decoding would have produced.
- Sampling rows (accept_sampled): speculative sampling (Leviathan et al. 2023, Chen et al. 2023) with a
  deterministic proposal, q = one-hot on the draft d. At each draft position in order, d is accepted with probability
  min(1, p(d) / q(d)) = p(d); at the first rejection the token is drawn from the residual normalize(max(p - q, 0)),
  which is p without d, and the row stops; after k accepted drafts the bonus token is drawn from p after the last.
  Every published token then has exactly the distribution plain sampling gives it.

A request's random numbers come from its seed (sampler.uniform_from_seed), keyed by the output index a position
samples: the acceptance test of the draft for output index s is stream ACCEPT_STREAM at step s, and the token drawn
at a rejection or as the bonus for output index s is stream 0 at step s, the number a plain decode of s would draw.
Each output index is drawn once, so a seeded request gives the same tokens on every run with the same drafts (and
other tokens than without speculation: the acceptance tests take their own numbers).
"""
from __future__ import annotations

import numpy as np
import torch

from lightserve.model_infer.sampler import draw_tokens, uniform_from_seed

ACCEPT_STREAM = 1  # uniform_from_seed's stream for the acceptance test of a draft


def block_positions(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """counts [R]: each request's scored positions, back to back. Returns (owner [N], within [N]): each position's
    request and its offset in that request's block."""
    owner = np.repeat(np.arange(counts.size), counts)
    within = np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, within


def accept_greedy(targets: np.ndarray, drafts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """targets [N] int: the model's greedy token at every scored position, request by request, each request's block
    of counts[r] = 1 + k_r positions (after its last sampled token, then after each draft); drafts [N - R] int: the
    requests' k_r draft tokens back to back. Returns accepted [R] int32: the leading drafts that match, so that
    request r's new tokens are targets[block start : block start + accepted[r] + 1] (the accepted drafts, which equal
    the targets before them, and the model's token after the last)."""
    return _leading_run(drafts == targets[_draft_rows(counts)], counts - 1)


def accept_sampled(probs: torch.Tensor, drafts: np.ndarray, counts: np.ndarray, seeds: np.ndarray,
                   steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Speculative sampling of R requests (the module docstring's rule). probs [N, V] on any device: the processed
    distribution (sampler.sampling_probs) at every scored position, in accept_greedy's blocks of counts[r] = 1 + k_r;
    drafts [N - R] int; seeds [R] int64; steps [R] int64: the output index of each request's first position (its
    output count). Returns (accepted [R] int32, tokens [R] int64): request r's new tokens are its first accepted[r]
    drafts, then tokens[r] (the replacement of its first rejected draft, or the bonus token after its last)."""
    k = counts - 1                                                        # [R] drafts per request
    draft_owner, draft_within = block_positions(k)                        # [N - R] each draft's request, its index
    dev = probs.device
    draft_rows = torch.from_numpy(_draft_rows(counts)).to(dev)
    p_draft = probs[draft_rows, torch.from_numpy(drafts.astype(np.int64)).to(dev)].double().cpu().numpy()  # [N - R]
    u_accept = uniform_from_seed(torch.from_numpy(seeds[draft_owner].astype(np.int64)),
                                 torch.from_numpy((steps[draft_owner] + draft_within).astype(np.int64)),
                                 stream=ACCEPT_STREAM).numpy()            # [N - R]
    accepted = _leading_run(u_accept < p_draft, k)                        # [R]
    # Each request's last token is drawn at block start + accepted: from p there, less the rejected draft's mass.
    block = np.cumsum(counts) - counts
    dist = probs[torch.from_numpy(block + accepted).to(dev)]              # [R, V], a copy
    rejected = np.flatnonzero(accepted < k)
    rejected_drafts = drafts[(np.cumsum(k) - k)[rejected] + accepted[rejected]].astype(np.int64)
    if rejected.size:
        # draw_tokens scales its inverse CDF by the row's total: the residual is renormalized there.
        dist[torch.from_numpy(rejected).to(dev), torch.from_numpy(rejected_drafts).to(dev)] = 0.0
    u_draw = uniform_from_seed(torch.from_numpy(seeds.astype(np.int64)),
                               torch.from_numpy((steps + accepted).astype(np.int64)))     # [R] stream 0
    tokens = draw_tokens(dist, u_draw.to(dev)).cpu().numpy()             # [R]
    # NOTE: a rejection whose residual is all zeros can only come from rounding (p(d) a hair under the row's whole
    # mass, as float32 softmax gives when every other token underflows): d is then the only possible token.
    if rejected.size:
        empty = (dist[torch.from_numpy(rejected).to(dev)].sum(dim=-1) <= 0).cpu().numpy()
        tokens[rejected[empty]] = rejected_drafts[empty]
    return accepted, tokens


def _draft_rows(counts: np.ndarray) -> np.ndarray:
    """[N - R]: the scored position whose distribution each draft is tested against (its block start + its index)."""
    k = counts - 1
    draft_owner, draft_within = block_positions(k)
    return (np.cumsum(counts) - counts)[draft_owner] + draft_within


def _leading_run(ok: np.ndarray, k: np.ndarray) -> np.ndarray:
    """ok [sum(k)] bool, each request's k[r] drafts back to back -> [R] int32: each request's leading run of True."""
    num_reqs = k.size
    width = int(k.max()) if num_reqs else 0
    # Pad to [R, width + 1]: a column of False after every request's last draft ends its run.
    draft_owner, draft_within = block_positions(k)
    padded = np.zeros((num_reqs, width + 1), bool)
    padded[draft_owner, draft_within] = ok
    return np.argmin(padded, axis=1).astype(np.int32)                     # the first False = the run's length
