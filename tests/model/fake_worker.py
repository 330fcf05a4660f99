"""A minimal stand-in for the worker process, for the model tests: owns a KVCache, hands out KV rows
in order, and turns (req_row, new token ids) lists into ForwardBatch objects."""
from __future__ import annotations

import torch

from lightserve.model_infer.forward_batch import ForwardBatch
from lightserve.model_infer.kv_cache import KVCache, fill_req_to_token
from lightserve.model_infer.llama import LlamaForCausalLM


class FakeWorker:
    def __init__(self, model: LlamaForCausalLM, num_kv_rows: int = 1024, num_req_rows: int = 8, max_len: int = 256):
        cfg = model.config
        self.model = model
        self.kv_cache = KVCache(cfg.num_layers, num_kv_rows, model.num_kv_heads, cfg.head_dim,
                                num_req_rows, max_len, model.dtype, model.device)
        self.next_kv_loc = 1  # row 0 is never used, as a worker would keep it for padding
        self.kv_locs: dict[int, list[int]] = {}  # req_row -> KV row of each cached token

    def share_prefix(self, dst_row: int, src_row: int, num_tokens: int) -> None:
        """Make request dst_row start with src_row's first num_tokens cached tokens (a prefix-cache hit)."""
        locs = self.kv_locs[src_row][:num_tokens]
        self.kv_locs[dst_row] = list(locs)
        self.kv_cache.req_to_token[dst_row, :num_tokens] = torch.tensor(locs, dtype=torch.int32)

    def step(self, items: list[tuple[int, list[int]]], num_decode: int, all_logits: bool = False) -> torch.Tensor:
        """items: (req_row, new token ids), decodes (one token each) first. Returns [B, V] logits of each
        request's last new token, or with all_logits [T, V] logits of every new token."""
        batch = self.make_batch(items, num_decode, all_logits)
        return self.model.forward(batch, self.kv_cache)

    def make_batch(self, items: list[tuple[int, list[int]]], num_decode: int, all_logits: bool = False) -> ForwardBatch:
        input_ids, positions, kv_locs, token_rows = [], [], [], []
        prefix_lens, extend_lens, q_start_locs = [], [], []
        for row, new_ids in items:
            cached = self.kv_locs.setdefault(row, [])
            new_locs = list(range(self.next_kv_loc, self.next_kv_loc + len(new_ids)))
            self.next_kv_loc += len(new_ids)
            q_start_locs.append(len(input_ids))
            prefix_lens.append(len(cached))
            extend_lens.append(len(new_ids))
            input_ids += new_ids
            positions += range(len(cached), len(cached) + len(new_ids))
            kv_locs += new_locs
            token_rows += [row] * len(new_ids)
            cached += new_locs
        assert all(n == 1 for n in extend_lens[:num_decode])
        def long(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64)

        def i32(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int32)

        fill_req_to_token(self.kv_cache, long(token_rows), long(positions), long(kv_locs))
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        if all_logits:
            logits_indices = long(list(range(len(input_ids))))
        else:
            logits_indices = long([s + e - 1 for s, e in zip(q_start_locs, extend_lens)])
        return ForwardBatch(
            input_ids=long(input_ids),
            positions=long(positions),
            kv_locs=long(kv_locs),
            req_rows=i32([row for row, _ in items]),
            prefix_lens=i32(prefix_lens),
            extend_lens=i32(extend_lens),
            seq_lens=i32(seq_lens),
            q_start_locs=i32(q_start_locs),
            logits_indices=logits_indices,
            num_decode=num_decode,
            max_seq_len=max(seq_lens),
            max_extend_len=max(extend_lens[num_decode:], default=0),
            req_to_token=self.kv_cache.req_to_token,
        )
