"""Scatter of this step's K and V into the token-level KV cache. Called by the model's attention before it attends.

kv_locs comes from the router's KV allocator: one cache row per new token.

The cache holds the activation dtype, or 8 bits an element (`--kv_cache_dtype`), quantized here as the rows are
written and dequantized in registers by the attention kernels that read them:
  int8      symmetric, one float32 scale per token and KV head, scale = amax / 127 over the head's D values,
            q = round_half_even(x * (127 / amax)); a row of zeros has scale 0. The scales live beside the cache,
            [rows, Hk] float32 contiguous, and need no calibration.
  fp8       float8_e4m3fn or float8_e5m2, one scale per tensor (the checkpoint's k_scale / v_scale, else 1.0):
            q = fp8(clamp(x / scale, -max, max)), rounded to nearest even; saturates instead of overflowing.
Every kernel that reads or writes the cache takes `k_scale` / `v_scale` (KVScale): the [rows, Hk] scale tensors for
int8, the per-tensor floats for fp8, None for a float cache. kernels/cpu/kernels.h numbers the formats (KV_KIND).
"""
from __future__ import annotations

from typing import Union

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightserve.config import KernelBackend
from lightserve.kernels.backend import runs_triton

KVScale = Union[Tensor, float, None]
QUANT_KV_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# kernels/cpu/kernels.h's KV_F32 .. KV_FP8_E5M2: the C kernels' kv_kind argument.
KV_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}


def quantize_kv_ref(x: Tensor, dtype: torch.dtype, scale: float = 1.0) -> tuple[Tensor, Tensor | None]:
    """x [T, Hk, D] -> (the cache's rows [T, Hk, D] in `dtype`, the int8 scales [T, Hk] float32 or None).
    `scale`: fp8's per-tensor scale. A float dtype is a plain cast."""
    if dtype == torch.int8:
        xf = x.float()
        amax = xf.abs().amax(-1)                                           # [T, Hk]
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))  # float32, as the kernels compute it
        q = torch.round(xf * inv[..., None]).clamp_(-127, 127).to(torch.int8)
        return q, amax / 127.0
    if dtype in FP8_MAX:
        bound = FP8_MAX[dtype]
        return (x.float() / scale).clamp_(-bound, bound).to(dtype), None
    return x.to(dtype), None


def dequantize_kv(rows: Tensor, scale: KVScale, dtype: torch.dtype = torch.float32) -> Tensor:
    """Cache rows [..., Hk, D] (any gathered subset) -> values in `dtype`. `scale`: for int8 the same rows' scales
    [..., Hk]; for fp8 the tensor's float; for a float cache None (a cast)."""
    if rows.dtype == torch.int8:
        return (rows.float() * scale[..., None]).to(dtype)
    if rows.dtype in FP8_MAX:
        return (rows.float() * float(scale)).to(dtype)
    return rows.to(dtype)


def gather_kv(cache: Tensor, scale: KVScale, locs: Tensor, dtype: torch.dtype) -> Tensor:
    """cache[locs] in `dtype`, dequantized: the references' gather of a request's rows. locs [N] int64 -> [N, Hk, D]."""
    rows = cache.index_select(0, locs)
    if cache.dtype not in QUANT_KV_DTYPES:
        return rows if rows.dtype == dtype else rows.to(dtype)
    return dequantize_kv(rows, scale.index_select(0, locs) if isinstance(scale, Tensor) else scale, dtype)


def c_scale_args(k_scale: KVScale, v_scale: KVScale) -> tuple:
    """The C kernels' (k_scales, v_scales, k_scale, v_scale) arguments (kernels/cpu/kernels.h): the int8 scale
    tensors' pointers (float32 [rows, Hk] contiguous) or NULL, the fp8 per-tensor floats or 1.0."""
    for s in (k_scale, v_scale):
        assert not isinstance(s, Tensor) or (s.dtype == torch.float32 and s.is_contiguous()), "int8 scales layout"
    return (k_scale.data_ptr() if isinstance(k_scale, Tensor) else None,
            v_scale.data_ptr() if isinstance(v_scale, Tensor) else None,
            float(k_scale) if isinstance(k_scale, float) else 1.0,
            float(v_scale) if isinstance(v_scale, float) else 1.0)


def store_kv_ref(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, kv_locs: Tensor,
                 k_scale: KVScale = None, v_scale: KVScale = None) -> None:
    """k_cache[kv_locs[i]] = k[i] and v_cache[kv_locs[i]] = v[i], quantized to the cache's format (index_copy_ reads
    strided k/v directly). int8 writes the rows' scales into k_scale / v_scale [rows, Hk] too."""
    locs = kv_locs.long()
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        q, row_scale = quantize_kv_ref(x, cache.dtype, scale if isinstance(scale, float) else 1.0)
        cache.index_copy_(0, locs, q)
        if row_scale is not None:
            scale.index_copy_(0, locs, row_scale)


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


def store_kv_triton(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, kv_locs: Tensor,
                    k_scale: KVScale = None, v_scale: KVScale = None) -> None:
    assert k_cache.dtype not in QUANT_KV_DTYPES, "8-bit KV in Triton: not built yet"
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
             backend: KernelBackend | None = None, k_scale: KVScale = None, v_scale: KVScale = None) -> None:
    """k, v [T, Hk, D] (may be strided views) -> k_cache/v_cache [num_kv_rows, Hk, D] at rows kv_locs [T], in the
    cache's format (the module's docstring; k_scale / v_scale as there)."""
    if runs_triton(k, backend):
        store_kv_triton(k, v, k_cache, v_cache, kv_locs, k_scale, v_scale)
    elif not store_kv_cpu(k, v, k_cache, v_cache, kv_locs, k_scale=k_scale, v_scale=v_scale):
        store_kv_ref(k, v, k_cache, v_cache, kv_locs, k_scale, v_scale)


def store_kv_cpu(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, kv_locs: Tensor, lib=None,
                 k_scale: KVScale = None, v_scale: KVScale = None) -> bool:
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
                          k.shape[1], head_dim, int(k.dtype == torch.bfloat16), KV_KIND[k_cache.dtype],
                          *c_scale_args(k_scale, v_scale), torch.get_num_threads())
    return rc == 0
