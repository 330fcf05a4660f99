"""ForwardBatch: one step's inputs as device tensors, built by the worker from a BatchPlan.

The model reads everything it needs from this object; there is no module-level context.
Batch order: the `num_decode` decode requests come first (one new token each), then the
extend (prefill) requests, each with `extend_len` new tokens after `prefix_len` cached ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @property
    def num_reqs(self) -> int:
        return int(self.req_rows.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
