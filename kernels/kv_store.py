"""Scatter of this step's K and V into the token-level KV cache. Called by the model's attention before it attends.

kv_locs comes from the router's KV allocator: one cache row per new token."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightserve.config import KernelBackend
from lightserve.kernels.backend import runs_triton


def store_kv_ref(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, kv_locs: Tensor) -> None:
    """k_cache[kv_locs[i]] = k[i] and v_cache[kv_locs[i]] = v[i] (index_copy_ reads strided k/v directly)."""
    locs = kv_locs.long()
    k_cache.index_copy_(0, locs, k.to(k_cache.dtype))
    v_cache.index_copy_(0, locs, v.to(v_cache.dtype))


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, locs_ptr,
    k_stride_t, k_stride_h, v_stride_t, v_stride_h, kc_stride_row, kc_stride_h, vc_stride_row, vc_stride_h,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, NUM_ELEMS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    loc = tl.load(locs_ptr + token).to(tl.int64)  # int64: row * stride overflows int32 in a large cache
    offs = tl.arange(0, BLOCK)  # flattened (head, dim) of one token
    mask = offs < NUM_ELEMS
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    k = tl.load(k_ptr + token * k_stride_t + head * k_stride_h + dim, mask=mask)
    v = tl.load(v_ptr + token * v_stride_t + head * v_stride_h + dim, mask=mask)
    tl.store(k_cache_ptr + loc * kc_stride_row + head * kc_stride_h + dim, k, mask=mask)
    tl.store(v_cache_ptr + loc * vc_stride_row + head * vc_stride_h + dim, v, mask=mask)


def store_kv_triton(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, kv_locs: Tensor) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and k_cache.shape == v_cache.shape, (k.shape, v.shape, k_cache.shape, v_cache.shape)
    assert k_cache.shape[1:] == (num_kv_heads, head_dim), (k.shape, k_cache.shape)
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype, (k.dtype, k_cache.dtype)
    assert k.stride(2) == v.stride(2) == k_cache.stride(2) == v_cache.stride(2) == 1, "head dim must be contiguous"
    assert kv_locs.shape == (num_tokens,) and kv_locs.dtype in (torch.int32, torch.int64), kv_locs.dtype
    if num_tokens == 0:
        return
    num_elems = num_kv_heads * head_dim
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, kv_locs,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HEAD_DIM=head_dim, BLOCK=triton.next_power_of_2(num_elems), NUM_ELEMS=num_elems,
        num_warps=4,
    )


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, kv_locs: Tensor,
             backend: KernelBackend | None = None) -> None:
    """k, v [T, Hk, D] (may be strided views) -> k_cache/v_cache [num_kv_rows, Hk, D] at rows kv_locs [T]."""
    if runs_triton(k, backend):
        store_kv_triton(k, v, k_cache, v_cache, kv_locs)
    elif not store_kv_cpu(k, v, k_cache, v_cache, kv_locs):
        store_kv_ref(k, v, k_cache, v_cache, kv_locs)


def store_kv_cpu(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, kv_locs: Tensor, lib=None) -> bool:
    """The C row copy (kernels/cpu/elementwise.c) where k, v and both caches share one dtype the C kernels take
    and every kv_loc is a row of the cache. False when it cannot run here (then nothing was written): a dtype cast,
    other layouts, or a loc out of range, for which the reference raises. `lib`: another kernel build (tests)."""
    from lightserve.kernels.cpu import library, profiled
    from lightserve.kernels.prefill_attention import c_kv_layout

    lib = lib or library()
    if lib is None or not c_kv_layout(k_cache, v_cache) or k.dim() != 3 \
            or not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype) \
            or k.shape != v.shape or k_cache.shape != v_cache.shape or k_cache.shape[1:] != k.shape[1:] \
            or k.stride(2) != 1 or v.stride(2) != 1 or kv_locs.shape != (k.shape[0],) \
            or kv_locs.dtype not in (torch.int32, torch.int64) or not kv_locs.is_contiguous():
        return False
    head_dim = k.shape[2]
    with profiled("store_kv_cpu"):  # visible in scripts/profile_step.py
        rc = lib.store_kv(k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
                          k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), v_cache.data_ptr(),
                          v_cache.stride(0), v_cache.stride(1),
                          k_cache.shape[0], kv_locs.data_ptr(), int(kv_locs.dtype == torch.int64), k.shape[0],
                          k.shape[1], head_dim, int(k.dtype == torch.bfloat16), torch.get_num_threads())
    return rc == 0
