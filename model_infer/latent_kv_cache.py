"""LatentKVCache: one rank's MLA latent rows for every layer plus the req_to_token table, owned by the worker.

The MLA counterpart of KVCache (model_infer/kv_cache.py): a token's row per layer holds its kv_lora_rank
normalized latent values and its qk_rope_head_dim roped key values, one "KV head" that every query head reads,
and no separate V. Every TP rank holds all of it (the heads are split, the latents are not). `fill_req_to_token`
works on it unchanged. In an 8-bit cache (--kv_cache_dtype) a row is quantized as one unit: int8 with one float32
scale per row (`latent_scales[layer]` [num_kv_rows, 1]), fp8 with one per-tensor scale (1.0).
"""
from __future__ import annotations

import torch

from lightserve.kernels.kv_store import FP8_MAX, KVScale
from lightserve.model_infer.kv_cache import lazy_zeros


class LatentKVCache:
    """`latent_caches[layer]` is a [num_kv_rows, 1, kv_lora_rank + qk_rope_head_dim] view into one buffer;
    `req_to_token[req_row, position]` is the KV row of that token; `latent_scales[layer]` what the MLA kernels take
    as latent_scale (kernels/kv_store.KVScale: int8 [num_kv_rows, 1] float32 views, fp8 1.0, else None)."""

    def __init__(self, num_layers: int, num_kv_rows: int, latent_dim: int, num_req_rows: int,
                 max_req_total_len: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.num_kv_rows = num_kv_rows
        self.dtype = dtype
        self.device = torch.device(device)
        # NOTE: zeros, not empty: attention may read (and mask) rows never written; NaN times a zero weight is NaN.
        # On CPU lazily resident zero pages, as KVCache's.
        self.latent = lazy_zeros((num_layers, num_kv_rows, 1, latent_dim), dtype, device)
        self.latent_caches = list(self.latent.unbind(0))  # num_layers x [num_kv_rows, 1, latent_dim]
        self.latent_scales: list[KVScale] = [None] * num_layers
        if dtype == torch.int8:
            self.latent_scales = list(lazy_zeros((num_layers, num_kv_rows, 1), torch.float32, device).unbind(0))
        elif dtype in FP8_MAX:
            self.latent_scales = [1.0] * num_layers
        self.req_to_token = torch.zeros(num_req_rows, max_req_total_len, dtype=torch.int32, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, latent_dim: int, dtype: torch.dtype) -> int:
        """Latent bytes of one token over all layers, an int8 row's scale included (DeepSeek-V3 in bf16:
        61 x 576 x 2 = 70 KiB; in int8 61 x 580)."""
        return num_layers * (latent_dim * torch.empty((), dtype=dtype).element_size() + 4 * (dtype == torch.int8))
