"""build_plan: the BatchPlan of one step, from the requests the Scheduler chose and the KV rows it
allocated. It reads the prompt/output ids from shm (a decode whose input is the token a step in flight samples
gets -1 there, and rank 0 fills it in: BatchPlan.pending_inputs) and records each decode's new row in its Req
(and a speculating request's draft rows, Req.draft_locs); it decides nothing.
"""
from __future__ import annotations

import numpy as np

from lightserve.messages import BatchPlan
from lightserve.router.req import Req
from lightserve.router.speculation import SpecRow
from lightserve.shm.req_pool import ReqPool


def build_plan(pool: ReqPool, step: int, decodes: list[Req], decode_locs: np.ndarray,
               chunks: list[tuple[Req, int]], fills: list[Req], spec: list[SpecRow] = ()) -> BatchPlan:
    """decodes: one token each, at `decode_locs`; chunks: (request, tokens to compute) whose rows are
    already in req.kv_locs; fills: admitted requests whose cached prefix rows the workers copy into
    their req_to_token rows; spec: speculating decodes, planned between the decodes and the chunks as extends of
    their last token and their drafts (every one of them sampled: BatchPlan.spec_lens)."""
    reqs = decodes + [row.req for row in spec] + [r for r, _ in chunks]
    shm = np.fromiter((r.shm_index for r in reqs), np.int32, len(reqs))
    prefix = np.fromiter((r.computed_len for r in reqs), np.int32, len(reqs))
    extend = np.fromiter((1 for _ in decodes), np.int32, len(decodes))
    spec_extend = np.fromiter((1 + row.drafts.size for row in spec), np.int32, len(spec))
    extend = np.concatenate([extend, spec_extend, np.fromiter((n for _, n in chunks), np.int32, len(chunks))])
    seq = np.fromiter((r.seq_len for r in reqs), np.int32, len(reqs))
    sample = prefix + extend == seq
    num_plain = len(decodes)
    sample[num_plain: num_plain + len(spec)] = True
    # Decode input ids in one gather; prefill chunks as slices of the prompt (+ outputs on resume).
    pending = np.flatnonzero(np.fromiter((r.pending > 0 for r in decodes), bool, len(decodes))).astype(np.int32)
    decode_ids = pool.token_ids[shm[: len(decodes)], prefix[: len(decodes)]]
    decode_ids[pending] = -1
    ids = [decode_ids]
    locs = [decode_locs]
    for row in spec:
        req = row.req
        # The last sampled token (published: a speculating request is never planned while its token is pending),
        # then the drafts, which rank 0 reads back from input_ids to verify them.
        ids.append(np.concatenate([pool.token_ids[req.shm_index, req.computed_len: req.computed_len + 1], row.drafts]))
        locs.append(row.locs)
        req.ensure_capacity(req.computed_len + 1)
        req.kv_locs[req.computed_len] = row.locs[0]
        req.draft_locs = row.locs[1:]
    for i, (req, n) in enumerate(chunks, start=len(decodes) + len(spec)):
        ids.append(pool.token_ids[req.shm_index, prefix[i]: prefix[i] + n])
        locs.append(req.kv_locs[prefix[i]: prefix[i] + n])
    for i, req in enumerate(decodes):
        req.ensure_capacity(req.computed_len + 1)
        req.kv_locs[req.computed_len] = decode_locs[i]
    prompt_logit_idx = _prompt_logit_indices(chunks, len(decodes) + int(spec_extend.sum()))
    fill_rows = np.concatenate([np.full(r.cached_len, r.shm_index, np.int32) for r in fills]) if fills else None
    fill_pos = np.concatenate([np.arange(r.cached_len, dtype=np.int32) for r in fills]) if fills else None
    fill_locs = np.concatenate([r.kv_locs[: r.cached_len] for r in fills]) if fills else None
    return BatchPlan(
        step=step, shm_indices=shm, req_ids=np.fromiter((r.req_id for r in reqs), np.int64, len(reqs)),
        prefix_lens=prefix, extend_lens=extend, sample=sample,
        input_ids=np.concatenate(ids).astype(np.int32, copy=False),
        kv_locs=np.concatenate(locs).astype(np.int32, copy=False), num_decode=len(decodes),
        **({} if not fills else dict(fill_rows=fill_rows, fill_pos=fill_pos, fill_locs=fill_locs)),
        **({} if prompt_logit_idx is None else dict(prompt_logit_idx=prompt_logit_idx)),
        **({} if not pending.size else dict(pending_inputs=pending)),
        **({} if not any(r.lora_slot >= 0 for r in reqs) else
           dict(lora_slots=np.fromiter((r.lora_slot for r in reqs), np.int32, len(reqs)))),
        **({} if not spec else dict(spec_lens=np.concatenate([np.zeros(len(decodes), np.int32), spec_extend - 1,
                                                              np.zeros(len(chunks), np.int32)]))))


def _prompt_logit_indices(chunks: list[tuple[Req, int]], chunks_start: int) -> np.ndarray | None:
    """Indices in the step's token array [T] of the tokens at prompt positions p < prompt_len - 1
    of requests that asked for prompt logprobs: their logits give the logprob of prompt token p + 1.
    (The last prompt token's logits are the sampling row, already computed.)"""
    if not any(req.prompt_logprobs for req, _ in chunks):
        return None
    out, start = [], chunks_start  # the chunks' first token in [T]
    for req, n in chunks:
        if req.prompt_logprobs:
            end = min(req.computed_len + n, req.prompt_len - 1)  # exclusive, in sequence positions
            if end > req.computed_len:
                out.append(np.arange(start, start + end - req.computed_len, dtype=np.int32))
        start += n
    return np.concatenate(out) if out else None
