"""A minimal stand-in for the worker process, for the model tests: owns the model's KV cache, hands out KV rows
in order, and turns (req_row, new token ids) lists into BatchPlans, which the worker's own
`make_forward_batch` turns into ForwardBatch objects."""
from __future__ import annotations

import numpy as np
import torch

from lightserve.messages import BatchPlan
from lightserve.model_infer.forward_batch import ForwardBatch, make_forward_batch
from lightserve.model_infer.host_staging import HostStaging
from lightserve.model_infer.models.base import DecoderLM


class FakeWorker:
    def __init__(self, model: DecoderLM, num_kv_rows: int = 1024, num_req_rows: int = 8, max_len: int = 256,
                 kv_dtype: torch.dtype | None = None):
        """kv_dtype: the cache's storage (--kv_cache_dtype; None = the model's dtype)."""
        self.model = model
        self.kv_cache = model.make_kv_cache(num_kv_rows, num_req_rows, max_len, kv_dtype)  # as the worker's ModelRunner
        self.staging = HostStaging(model.device)
        self.next_kv_loc = 1  # row 0 is never used, as a worker would keep it for padding
        self.kv_locs: dict[int, list[int]] = {}  # req_row -> KV row of each cached token
        self.step_id = 0

    def share_prefix(self, dst_row: int, src_row: int, num_tokens: int) -> None:
        """Make request dst_row start with src_row's first num_tokens cached tokens (a prefix-cache hit)."""
        locs = self.kv_locs[src_row][:num_tokens]
        self.kv_locs[dst_row] = list(locs)
        self.kv_cache.req_to_token[dst_row, :num_tokens] = torch.tensor(locs, dtype=torch.int32)

    def step(self, items: list[tuple[int, list[int]]], num_decode: int, all_logits: bool = False,
             argmax_only: bool = False, lora_slots: list[int] | None = None) -> torch.Tensor:
        """items: (req_row, new token ids), decodes (one token each) first. Returns [B, V] logits of each
        request's last new token, or with all_logits [T, V] logits of every new token; argmax_only as the worker
        asks when only their argmax is read (ForwardBatch.argmax_only); lora_slots: each item's LoRA slot (-1: the
        base model), as BatchPlan.lora_slots."""
        batch = self.make_batch(items, num_decode, all_logits, lora_slots)
        batch.argmax_only = argmax_only
        return self.model.forward(batch, self.kv_cache)

    def make_plan(self, items: list[tuple[int, list[int]]], num_decode: int, all_logits: bool = False,
                  lora_slots: list[int] | None = None) -> BatchPlan:
        input_ids, kv_locs, prefix_lens, extend_lens = [], [], [], []
        for row, new_ids in items:
            cached = self.kv_locs.setdefault(row, [])
            new_locs = list(range(self.next_kv_loc, self.next_kv_loc + len(new_ids)))
            self.next_kv_loc += len(new_ids)
            prefix_lens.append(len(cached))
            extend_lens.append(len(new_ids))
            input_ids += new_ids
            kv_locs += new_locs
            cached += new_locs
        assert all(n == 1 for n in extend_lens[:num_decode])
        def i32(xs):
            return np.array(xs, dtype=np.int32)
        num_reqs, num_tokens = len(items), len(input_ids)
        self.step_id += 1
        return BatchPlan(
            step=self.step_id, shm_indices=i32([row for row, _ in items]), req_ids=np.arange(num_reqs, dtype=np.int64),
            prefix_lens=i32(prefix_lens), extend_lens=i32(extend_lens),
            # all_logits: no sampling rows, every token as a prompt-logprob row
            sample=np.full(num_reqs, not all_logits), input_ids=i32(input_ids), kv_locs=i32(kv_locs),
            num_decode=num_decode, prompt_logit_idx=np.arange(num_tokens, dtype=np.int32) if all_logits else i32([]),
            lora_slots=i32(lora_slots or []),
        )

    def make_batch(self, items: list[tuple[int, list[int]]], num_decode: int, all_logits: bool = False,
                   lora_slots: list[int] | None = None) -> ForwardBatch:
        plan = self.make_plan(items, num_decode, all_logits, lora_slots)
        return make_forward_batch(plan, self.kv_cache.req_to_token, self.staging)
