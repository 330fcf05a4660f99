"""ForwardBatch: one step's inputs as device tensors, built from a BatchPlan by `make_forward_batch`
(the worker's ModelRunner and the model tests' FakeWorker both call it).

The model reads everything it needs from this object; there is no module-level context.
Batch order: the `num_decode` decode requests come first (one new token each), then the
extend (prefill) requests, each with `extend_len` new tokens after `prefix_len` cached ones.

Two things keep a step free of avoidable GPU work: every device array a Triton kernel takes starts 16-byte aligned
whatever the batch shape (HostStaging pads; the extend requests' arrays are their own segments, not slices at
offset num_decode), so no step meets a kernel variant the warm-up did not compile; and the per-request metadata
is also kept on the host (`host`), so code that loops over requests in Python reads it without a device sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from lightserve.kernels.lora import LoraSegments

if TYPE_CHECKING:
    from lightserve.messages import BatchPlan
    from lightserve.model_infer.host_staging import HostStaging


@dataclass(frozen=True)
class ExtendInputs:
    """The extend requests' (num_decode .. B-1) metadata as the prefill attention kernels take it: int32 [num_extend]
    device arrays, each 16-byte aligned (a slice [num_decode:] would start wherever num_decode puts it)."""
    req_rows: torch.Tensor
    q_start_locs: torch.Tensor   # rebased to token num_decode: offsets into q[num_decode:]
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor


@dataclass(frozen=True)
class HostMetadata:
    """The step's per-request metadata on the host, int32 numpy [B] in batch order (the BatchPlan's)."""
    req_rows: np.ndarray
    prefix_lens: np.ndarray
    extend_lens: np.ndarray
    q_start_locs: np.ndarray


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor      # [T] int64, new tokens of all requests back to back
    positions: torch.Tensor      # [T] int64, position of each new token in its sequence
    kv_locs: torch.Tensor        # [T] int64, KV cache row where each new token's K/V is written
    req_rows: torch.Tensor       # [B] int32, row of each request in the req_to_token table
    prefix_lens: torch.Tensor    # [B] int32, tokens already in the KV cache before this step
    extend_lens: torch.Tensor    # [B] int32, new tokens this step (1 for decode requests)
    seq_lens: torch.Tensor       # [B] int32, prefix_lens + extend_lens
    q_start_locs: torch.Tensor   # [B] int32, offset of each request's first new token in [T]
    logits_indices: torch.Tensor  # [B] int64, index in [T] of each request's last new token
    num_decode: int              # requests [0, num_decode) are decodes (extend_len == 1)
    max_seq_len: int             # max(seq_lens)
    max_extend_len: int          # max(extend_lens) over the extend requests (0 if none)
    req_to_token: torch.Tensor   # [num_rows, max_req_total_len] int32, KV row of every token
    # Only each logits row's argmax is read (every sampled row greedy, unprocessed, reporting no logprob): the model
    # may return logits exact only near each row's maximum (kernels/argmax_head.py).
    argmax_only: bool = False
    # LoRA: the step's runs of tokens under an adapter slot (BatchPlan.lora_slots per token); None when every
    # token runs the base model. The model adds each targeted projection's delta for these tokens.
    lora: LoraSegments | None = None
    # --speculative_algorithm mtp: the model keeps every token's final-normed hidden state [T, hidden] in `hidden`
    # (the MTP layer's input at the next step, model_infer/mtp_drafter.py).
    keep_hidden: bool = False
    hidden: torch.Tensor | None = None
    # make_forward_batch fills both; a batch built elsewhere (CUDA-graph buffers, tests) leaves them None and the
    # accessors below derive them once.
    extend: ExtendInputs | None = None
    host: HostMetadata | None = None

    def extend_inputs(self) -> ExtendInputs:
        """The extend requests' metadata (ExtendInputs)."""
        if self.extend is None:  # slices: aligned only by chance, but such batches are decode-only or tests
            nd = self.num_decode
            self.extend = ExtendInputs(self.req_rows[nd:], self.q_start_locs[nd:] - nd, self.prefix_lens[nd:],
                                       self.extend_lens[nd:])
        return self.extend

    def host_metadata(self) -> HostMetadata:
        """The per-request metadata on the host (HostMetadata): no device sync for a batch make_forward_batch
        built, one read of the device arrays per batch otherwise."""
        if self.host is None:
            self.host = HostMetadata(*(t.cpu().numpy() for t in (self.req_rows, self.prefix_lens, self.extend_lens,
                                                                   self.q_start_locs)))
        return self.host

    @property
    def num_reqs(self) -> int:
        return int(self.req_rows.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def make_forward_batch(plan: BatchPlan, req_to_token: torch.Tensor, staging: HostStaging,
                       argmax_only: bool = False) -> ForwardBatch:
    """The step's device tensors. Writes `req_to_token` first: the plan's prefix rows (fill_*) and the KV row
    of every new token, which attention then reads. Logits rows: the sampling requests' last tokens ([S]; a
    speculating request's last 1 + spec_len tokens, its draft positions included), then plan.prompt_logit_idx
    ([E]). `plan.lora_slots` ([B], -1 = base; empty = none) becomes the batch's `lora` segments."""
    extend = plan.extend_lens
    num_tokens = int(plan.input_ids.shape[0])
    q_start = np.cumsum(extend, dtype=np.int32) - extend                        # [B]
    # Token t of request b sits at position prefix[b] + (t - q_start[b]).
    positions = np.repeat(plan.prefix_lens - q_start, extend) + np.arange(num_tokens, dtype=np.int32)
    rows = np.repeat(plan.shm_indices, extend)                                 # [T]
    seq_lens = plan.prefix_lens + extend                                       # [B]
    logits_idx = np.concatenate([_sample_logit_rows(plan, q_start), plan.prompt_logit_idx]).astype(np.int32)
    nd = plan.num_decode
    # LoRA segments cut on the host (runs of tokens under one slot), uploaded with the step's other arrays.
    segs = LoraSegments.from_token_slots(np.repeat(plan.lora_slots, extend)) if plan.lora_slots.size else None
    lora_arrays = [segs.host_starts, segs.host_lens, segs.host_slots] if segs is not None else []
    # Every integer array of the step in one host-to-device copy (pinned and asynchronous on CUDA), each 16-byte
    # aligned; the extend requests' arrays are copied as their own segments (ExtendInputs).
    (input_ids, positions_t, kv_locs, rows_t, req_rows, prefix_lens, extend_t, seq_lens_t, q_start_t,
     logits_idx_t, fill_rows, fill_pos, fill_locs, *rest) = staging.upload(
        [plan.input_ids, positions, plan.kv_locs, rows, plan.shm_indices, plan.prefix_lens, extend, seq_lens,
         q_start, logits_idx, plan.fill_rows, plan.fill_pos, plan.fill_locs,
         plan.shm_indices[nd:], q_start[nd:] - nd, plan.prefix_lens[nd:], extend[nd:], *lora_arrays])
    extend_inputs, lora_t = rest[:4], rest[4:]
    lora = LoraSegments(*lora_t, *lora_arrays) if segs is not None else None
    if plan.fill_rows.size:
        req_to_token[fill_rows.long(), fill_pos.long()] = fill_locs
    positions_t = positions_t.long()
    req_to_token[rows_t.long(), positions_t] = kv_locs
    return ForwardBatch(
        input_ids=input_ids.long(),
        positions=positions_t,
        kv_locs=kv_locs.long(),
        req_rows=req_rows,
        prefix_lens=prefix_lens,
        extend_lens=extend_t,
        seq_lens=seq_lens_t,
        q_start_locs=q_start_t,
        logits_indices=logits_idx_t.long(),
        num_decode=nd,
        max_seq_len=int(seq_lens.max()),
        max_extend_len=int(extend[nd:].max()) if extend.shape[0] > nd else 0,
        req_to_token=req_to_token,
        argmax_only=argmax_only,
        lora=lora,
        extend=ExtendInputs(*extend_inputs),
        host=HostMetadata(*(np.asarray(a, np.int32) for a in (plan.shm_indices, plan.prefix_lens, extend, q_start))),
    )


def _sample_logit_rows(plan: BatchPlan, q_start: np.ndarray) -> np.ndarray:
    """[S'] indices in [T] of the sampled logits rows: each sampling request's last token, or for a speculating one
    its last 1 + spec_len tokens in order (the positions after its last sampled token and after each draft)."""
    last = (q_start + plan.extend_lens - 1)[plan.sample]                         # [S]
    if not plan.spec_lens.size:
        return last
    counts = 1 + plan.spec_lens[plan.sample]                                    # [S]
    first = np.cumsum(counts) - counts                                          # [S] each block's start in [S']
    return np.repeat(last - counts + 1, counts) + np.arange(int(counts.sum())) - np.repeat(first, counts)
