"""LatentKVCache: one rank's MLA latent rows for every layer plus the req_to_token table, owned by the worker.

The MLA counterpart of KVCache (model_infer/kv_cache.py): a token's row per layer holds its kv_lora_rank
normalized latent values and its qk_rope_head_dim roped key values, one "KV head" that every query head reads,
and no separate V. Every TP rank holds all of it (the heads are split, the latents are not). `fill_req_to_token`
works on it unchanged.
"""
from __future__ import annotations

import torch


class LatentKVCache:
    """`latent_caches[layer]` is a [num_kv_rows, 1, kv_lora_rank + qk_rope_head_dim] view into one buffer;
    `req_to_token[req_row, position]` is the KV row of that token."""

    def __init__(self, num_layers: int, num_kv_rows: int, latent_dim: int, num_req_rows: int,
                 max_req_total_len: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.num_kv_rows = num_kv_rows
        self.dtype = dtype
        self.device = torch.device(device)
        # NOTE: zeros, not empty: attention may read (and mask) rows never written; NaN times a zero weight is NaN.
        self.latent = torch.zeros(num_layers, num_kv_rows, 1, latent_dim, dtype=dtype, device=device)
        self.latent_caches = list(self.latent.unbind(0))  # num_layers x [num_kv_rows, 1, latent_dim]
        self.req_to_token = torch.zeros(num_req_rows, max_req_total_len, dtype=torch.int32, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, latent_dim: int, dtype: torch.dtype) -> int:
        """Latent bytes of one token over all layers (DeepSeek-V3 in bf16: 61 x 576 x 2 = 70 KiB)."""
        return num_layers * latent_dim * torch.empty((), dtype=dtype).element_size()
