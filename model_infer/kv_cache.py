"""KVCache: one rank's K/V tensors for every layer plus the req_to_token table, owned by the worker.

The router decides which KV rows (`kv_locs`) each token uses; the worker writes them into
`req_to_token` (`fill_req_to_token`) before each forward, and the model's `store_kv` fills the rows.
The cache holds the activation dtype or one of kernels/kv_store.py's 8-bit formats (--kv_cache_dtype).
"""
from __future__ import annotations

import math
import mmap
from typing import TYPE_CHECKING

import torch

from lightserve.kernels.kv_store import FP8_MAX, KVScale

if TYPE_CHECKING:
    from lightserve.model_config import ModelConfig
    from lightserve.model_infer.latent_kv_cache import LatentKVCache


class KVCache:
    """K/V storage: `k_caches[layer]`, `v_caches[layer]` are [num_kv_rows, num_kv_heads, head_dim]
    views into one buffer each; `req_to_token[req_row, position]` is the KV row of that token.
    `k_scales[layer]`, `v_scales[layer]`: what the kernels take as k_scale / v_scale (kernels/kv_store.KVScale):
    int8 [num_kv_rows, num_kv_heads] float32 views, fp8 the layer's per-tensor floats, None for a float cache."""

    def __init__(
        self,
        num_layers: int,
        num_kv_rows: int,
        num_kv_heads: int,
        head_dim: int,
        num_req_rows: int,
        max_req_total_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        head_major: bool | None = None,
        fp8_scales: list[tuple[float, float]] | None = None,
    ) -> None:
        """`dtype`: how K and V are stored (a float dtype, int8, float8_e4m3fn or float8_e5m2). `head_major`: the CPU C
        kernels' layout below (default: on CPU); False gives the token-major layout the Triton kernels are tuned
        for, on any device. `fp8_scales`: an fp8 cache's (k_scale, v_scale) per layer (default 1.0)."""
        self.num_kv_rows = num_kv_rows
        self.dtype = dtype
        self.device = torch.device(device)
        # NOTE: zeros, not empty: attention kernels may read (and mask) rows never written, and NaN
        # garbage times a zero weight is still NaN. On CPU the zeros are the OS's (lazy_zeros), so the pool's
        # memory becomes resident as rows are written, not at start-up.
        if self.device.type == "cpu" if head_major is None else head_major:
            # Head-major storage [L, Hk, rows, D] behind the same [L, rows, Hk, D] view: each head's rows of a
            # request lie back to back, so where decode attention walks a task's tokens one head after another
            # (kernels/cpu/decode_attention.c, HEAD_OUTER) it reads two contiguous streams; docs/benchmarks.md has
            # what each layout measured.
            self.k = lazy_zeros((num_layers, num_kv_heads, num_kv_rows, head_dim), dtype, device).transpose(1, 2)
            self.v = lazy_zeros((num_layers, num_kv_heads, num_kv_rows, head_dim), dtype, device).transpose(1, 2)
        else:
            self.k = lazy_zeros((num_layers, num_kv_rows, num_kv_heads, head_dim), dtype, device)
            self.v = lazy_zeros((num_layers, num_kv_rows, num_kv_heads, head_dim), dtype, device)
        self.k_caches = list(self.k.unbind(0))  # num_layers x [num_kv_rows, Hk_local, D]
        self.v_caches = list(self.v.unbind(0))
        self.k_scales: list[KVScale] = [None] * num_layers
        self.v_scales: list[KVScale] = [None] * num_layers
        if dtype == torch.int8:  # token-major whatever the layout: a row's scales are one small read
            scales = lazy_zeros((2, num_layers, num_kv_rows, num_kv_heads), torch.float32, device)
            self.k_scales, self.v_scales = list(scales[0].unbind(0)), list(scales[1].unbind(0))
        elif dtype in FP8_MAX:
            pairs = fp8_scales or [(1.0, 1.0)] * num_layers
            self.k_scales, self.v_scales = [float(k) for k, _ in pairs], [float(v) for _, v in pairs]
        self.req_to_token = torch.zeros(num_req_rows, max_req_total_len, dtype=torch.int32, device=device)

    @staticmethod
    def bytes_per_token(config: ModelConfig, num_kv_heads_local: int, dtype: torch.dtype) -> int:
        """K plus V bytes of one token over all layers on one rank (for sizing num_kv_rows), int8's scales
        included: SmolLM2 (30 layers, 3 KV heads x 64) 23,040 in bf16, 12,240 in int8, 11,520 in fp8."""
        return 2 * config.num_layers * num_kv_heads_local * kv_row_bytes(config.head_dim, dtype)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype, device=device), except that on CPU the memory is a private anonymous
    mapping: the OS hands out zero pages as they are first touched, so a KV pool of 65,536 float32 tokens (2.8 GiB
    for SmolLM2) costs no start-up time and adds to the process's RSS only as its rows are written. The tensor
    holds the mapping (unmapped with its last view)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


def kv_row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one KV head of one token takes in a cache of `dtype` (an int8 row carries its float32 scale)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return head_dim * elem + (4 if dtype == torch.int8 else 0)


def fill_req_to_token(
    kv_cache: KVCache | LatentKVCache, req_rows_per_token: torch.Tensor, positions: torch.Tensor, kv_locs: torch.Tensor
) -> None:
    """req_to_token[req_rows_per_token[i], positions[i]] = kv_locs[i] for every new token i.
    All three are [T] integer tensors on the cache's device."""
    kv_cache.req_to_token[req_rows_per_token.long(), positions.long()] = kv_locs.to(torch.int32)
