"""Scatter of this step's K and V into the token-level KV cache. Called by the model's attention before it attends.

kv_locs comes from the router's KV allocator: one cache row per new token.

The cache holds the activation dtype, or 8 bits an element (`--kv_cache_dtype`), quantized here as the rows are
written and dequantized in registers by the attention kernels that read them:
  int8      symmetric, one float32 scale per token and KV head, scale = amax / 127 over the head's D values,
            q = round_half_even(x * ((1 / amax) * 127)), float32 with each operation rounded (two roundings in
            the factor: every kernel computes it so); a row of zeros has scale 0. The scales live beside the cache,
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
# The Triton kernels' KV_QUANT constexpr (triton_kv_args); 0 is a float cache, whose compiled code is unchanged.
TRITON_KV_QUANT = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}


def quantize_kv_ref(x: Tensor, dtype: torch.dtype, scale: float = 1.0) -> tuple[Tensor, Tensor | None]:
    """x [T, Hk, D] -> (the cache's rows [T, Hk, D] in `dtype`, the int8 scales [T, Hk] float32 or None).
    `scale`: fp8's per-tensor scale. A float dtype is a plain cast."""
    if dtype == torch.int8:
        xf = x.float()
        amax = xf.abs().amax(-1)                                           # [T, Hk]
        inv = torch.where(amax > 0, amax.reciprocal() * 127.0, torch.zeros_like(amax))  # two roundings, as the kernels
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


def c_kv_layout(k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether the CPU C attention kernels (decode and prefill) take this KV cache: float32, bfloat16 or an 8-bit
    format (kernels/kv_store.py) [rows, Hk, D] with contiguous head rows (any row and head strides: token-major, or
    the head-major view a CPU KVCache makes) and the same strides for K and V. Shared with decode_attention,
    prefill_attention and the decoder-layer driver."""
    return k_cache.dim() == 3 and k_cache.dtype in (torch.float32, torch.bfloat16, *QUANT_KV_DTYPES) \
        and k_cache.stride(-1) == 1 \
        and v_cache.stride() == k_cache.stride()


def c_scale_args(k_scale: KVScale, v_scale: KVScale) -> tuple:
    """The C kernels' (k_scales, v_scales, k_scale, v_scale) arguments (kernels/cpu/kernels.h): the int8 scale
    tensors' pointers (float32 [rows, Hk] contiguous) or NULL, the fp8 per-tensor floats or 1.0."""
    for s in (k_scale, v_scale):
        assert not isinstance(s, Tensor) or (s.dtype == torch.float32 and s.is_contiguous()), "int8 scales layout"
    return (k_scale.data_ptr() if isinstance(k_scale, Tensor) else None,
            v_scale.data_ptr() if isinstance(v_scale, Tensor) else None,
            float(k_scale) if isinstance(k_scale, float) else 1.0,
            float(v_scale) if isinstance(v_scale, float) else 1.0)


def c_scales_fit(k_cache: Tensor, k_scale: KVScale, v_scale: KVScale) -> bool:
    """Whether the scales are what the C kernels read for k_cache's format (c_scale_args passes them): int8's
    [rows, Hk] float32 contiguous tensors, fp8's Python floats; anything for a float cache, which ignores them.
    The C wrappers decline other scales (the reference then takes them, or raises)."""
    if k_cache.dtype == torch.int8:
        return all(isinstance(s, Tensor) and s.dtype == torch.float32 and s.is_contiguous()
                   and s.shape == k_cache.shape[:2] for s in (k_scale, v_scale))
    if k_cache.dtype in FP8_MAX:
        return isinstance(k_scale, float) and isinstance(v_scale, float)
    return True


def store_kv_ref(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, kv_locs: Tensor,
                 k_scale: KVScale = None, v_scale: KVScale = None) -> None:
    """k_cache[kv_locs[i]] = k[i] and v_cache[kv_locs[i]] = v[i], quantized to the cache's format (index_copy_ reads
    strided k/v directly). int8 writes the rows' scales into k_scale / v_scale [rows, Hk] too."""
    locs = kv_locs.long()
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        q, row_scale = quantize_kv_ref(x, cache.dtype, scale if isinstance(scale, float) else 1.0)
        if cache.dtype in FP8_MAX:  # torch's CPU index_copy_ takes no fp8: copy the bytes
            cache, q = cache.view(torch.uint8), q.view(torch.uint8)
        cache.index_copy_(0, locs, q)
        if row_scale is not None:
            scale.index_copy_(0, locs, row_scale)


@triton.jit
def _bf16_bits(x):
    # float32 -> the bits of the nearest bf16 (ties to even; a NaN stays a quiet NaN) as int16: kernels/cpu/fastmath.h's
    # f32_to_bf16. Written out because Triton's interpreter truncates a cast to bf16 where a GPU rounds.
    b = x.to(tl.uint32, bitcast=True)
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, (b >> 16) | 0x40, rounded).to(tl.int16)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, locs_ptr, k_scales_ptr, v_scales_ptr,
    k_stride_t, k_stride_h, v_stride_t, v_stride_h, kc_stride_row, kc_stride_h, vc_stride_row, vc_stride_h,
    scale_stride, k_scale, v_scale,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, NUM_ELEMS: tl.constexpr, KV_QUANT: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    # A float cache: one program per token over its flattened (head, dim). An 8-bit cache: one per (token, head),
    # NUM_ELEMS = HEAD_DIM, since int8's scale is per head (program_id(1) is 0 in the float grid).
    token = tl.program_id(0).to(tl.int64)
    loc = tl.load(locs_ptr + token).to(tl.int64)  # int64: row * stride overflows int32 in a large cache
    offs = tl.arange(0, BLOCK)  # flattened (head, dim) of one token
    mask = offs < NUM_ELEMS
    head = tl.program_id(1) + offs // HEAD_DIM
    dim = offs % HEAD_DIM
    k = tl.load(k_ptr + token * k_stride_t + head * k_stride_h + dim, mask=mask)
    v = tl.load(v_ptr + token * v_stride_t + head * v_stride_h + dim, mask=mask)
    k_dst = k_cache_ptr + loc * kc_stride_row + head * kc_stride_h + dim
    v_dst = v_cache_ptr + loc * vc_stride_row + head * vc_stride_h + dim
    if BF16_BITS:  # float32 rows into a bf16 cache, viewed as int16
        tl.store(k_dst, _bf16_bits(k), mask=mask)
        tl.store(v_dst, _bf16_bits(v), mask=mask)
    elif KV_QUANT == 0:  # cast to the cache's float dtype where it is another
        tl.store(k_dst, k.to(k_dst.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_dst.dtype.element_ty), mask=mask)
    else:
        scale_row = loc * scale_stride + tl.program_id(1)  # int8's [rows, Hk] scales; unused by fp8
        quantize_store(k, k_dst, mask, k_scales_ptr, scale_row, k_scale, KV_QUANT)
        quantize_store(v, v_dst, mask, v_scales_ptr, scale_row, v_scale, KV_QUANT)


@triton.jit
def quantize_store(x, dst, mask, scales_ptr, scale_row, scale, KV_QUANT: tl.constexpr):
    # One KV head's row x [BLOCK] (masked lanes unused) -> the cache bytes at dst, bit for bit quantize_kv_ref's.
    # int8 (KV_QUANT 1) also writes the row's scale amax / 127 to scales_ptr[scale_row]; fp8 e4m3 / e5m2 (2 / 3;
    # scales_ptr None) divide by the per-tensor `scale` and write the byte's bits to a uint8 view. Divisions are
    # div_rn: a plain `/` is not correctly rounded on NVIDIA GPUs, and one ulp moves a value across a rounding tie.
    x = x.to(tl.float32)
    if KV_QUANT == 1:
        amax = tl.max(tl.where(mask, tl.abs(x), 0.0), 0)
        # 127 * (1 / amax) in two roundings, as the reference computes it (torch's 127.0 / t is t.reciprocal() * 127).
        nonzero = amax > 0
        inv = tl.where(nonzero, tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.where(nonzero, amax, 1.0)) * 127.0, 0.0)
        y = tl.minimum(tl.maximum(x * inv, -127.0), 127.0)  # the rounding of x * inv may pass 127 by an ulp
        code, negative = _round_to_grid(y, 23, 0)
        tl.store(dst, tl.where(negative, -code, code).to(tl.int8), mask=mask)
        tl.store(scales_ptr + scale_row, tl.math.div_rn(amax, tl.full([], 127.0, tl.float32)))
    else:
        if KV_QUANT == 2:  # e4m3fn: 3 mantissa bits, subnormal step 2^-9, max 448
            y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
            code, negative = _round_to_grid(y, 3, -9)
        else:  # e5m2: 2 mantissa bits, subnormal step 2^-16, max 57344
            y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -57344.0), 57344.0)
            code, negative = _round_to_grid(y, 2, -16)
        tl.store(dst, (tl.where(negative, 0x80, 0) | code).to(tl.uint8), mask=mask)


@triton.jit
def _round_to_grid(y, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    # |y| (float32) rounded to nearest, ties to even, on the grid of a float format with MANT_BITS mantissa bits whose
    # smallest step is 2^MIN_EXP, returned as that format's magnitude code (int32) and y's sign bit. For fp8 the code is
    # the byte's low 7 bits (exponent and mantissa); for int8 (MANT_BITS 23, MIN_EXP 0: step 1 below 2^23) it is
    # round_half_even(|y|). Integer arithmetic on y's bits: the interpreter's .to(tl.float8*) does not round to
    # nearest and libdevice's rint does not run there; this runs the same on a GPU. |y| must be below the format's
    # overflow (callers clamp).
    bits = y.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    biased = tl.maximum(mag >> 23, 1)  # float32 subnormals share exponent 1 with no implicit bit
    mant = (mag & 0x7FFFFF) | tl.where((mag >> 23) > 0, 0x800000, 0)  # |y| = mant * 2^(biased - 150)
    step = tl.maximum(biased - 127 - MANT_BITS, MIN_EXP)  # the grid's step 2^step at |y|
    shift = tl.minimum(step + 150 - biased, 25)  # >= 1; from 25 on, mant < half: every such |y| rounds to 0
    q = mant >> shift
    rem = mant - (q << shift)
    half = 1 << (shift - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    # A mantissa that rounds up to 2^(MANT_BITS + 1) carries into the exponent field, which is the next binade's code.
    return ((step - MIN_EXP) << MANT_BITS) + q, bits < 0


@triton.jit
def dequantize_tile(raw, scale, KV_QUANT: tl.constexpr):
    # Cache values as loaded (int8 for KV_QUANT 1; fp8 e4m3 / e5m2 bytes through a uint8 view for 2 / 3) -> float32
    # values times `scale`: for int8 the rows' scales broadcast to raw's shape, for fp8 the per-tensor float with the
    # exponent rebias folded in (fp8_dequant_scale). An fp8 byte's sign, exponent and mantissa moved into float32's
    # fields read as its value times 2^-120 (e4m3) or 2^-112 (e5m2), subnormals included: no table, no fp8 support
    # in the hardware needed.
    if KV_QUANT == 1:
        values = raw.to(tl.float32)
    else:
        b = raw.to(tl.uint32)
        if KV_QUANT == 2:
            bits = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
        else:
            bits = ((b & 0x80) << 24) | ((b & 0x7F) << 21)
        values = bits.to(tl.float32, bitcast=True)
    return values * scale


def triton_kv_args(k_cache: Tensor, v_cache: Tensor, k_scale: KVScale, v_scale: KVScale,
                   for_store: bool = False) -> tuple[tuple, int]:
    """The Triton kernels' view of a KV cache pair and its scales: ((k_cache, v_cache, k_scales, v_scales,
    scale_stride, k_scale, v_scale), KV_QUANT). KV_QUANT: 0 a float cache, 1 int8, 2 fp8 e4m3, 3 fp8 e5m2.
    fp8 caches go as uint8 views; int8 scales as the [rows, Hk] tensors (head stride 1) with their row stride;
    fp8's per-tensor floats as given for a store, else with the rebias of dequantize_tile folded in."""
    kv_quant = TRITON_KV_QUANT.get(k_cache.dtype, 0)
    assert v_cache.dtype == k_cache.dtype, (k_cache.dtype, v_cache.dtype)
    if kv_quant == 0:
        return (k_cache, v_cache, None, None, 0, 1.0, 1.0), 0
    if kv_quant == 1:
        for s in (k_scale, v_scale):
            assert isinstance(s, Tensor) and s.dtype == torch.float32 and s.shape == k_cache.shape[:2] \
                and s.stride(1) == 1 and s.device == k_cache.device, "int8 KV needs [rows, Hk] float32 scales"
        assert k_scale.stride(0) == v_scale.stride(0), (k_scale.stride(), v_scale.stride())
        return (k_cache, v_cache, k_scale, v_scale, k_scale.stride(0), 1.0, 1.0), 1
    assert isinstance(k_scale, float) and isinstance(v_scale, float), "fp8 KV needs per-tensor float scales"
    if not for_store:
        k_scale, v_scale = fp8_dequant_scale(k_cache.dtype, k_scale), fp8_dequant_scale(k_cache.dtype, v_scale)
    return (k_cache.view(torch.uint8), v_cache.view(torch.uint8), None, None, 0, k_scale, v_scale), kv_quant


def fp8_dequant_scale(dtype: torch.dtype, scale: float) -> float:
    """fp8's per-tensor scale times the power of two dequantize_tile's bit move leaves out (2^120 e4m3, 2^112 e5m2):
    one multiply per value. Exact in float32 for any scale below 2^8 (e4m3) or 2^16 (e5m2)."""
    folded = scale * 2.0 ** (120 if dtype == torch.float8_e4m3fn else 112)
    assert 0 < folded < 2.0 ** 127, f"fp8 KV scale {scale} out of range"
    return folded


def store_kv_triton(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, kv_locs: Tensor,
                    k_scale: KVScale = None, v_scale: KVScale = None) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and k_cache.shape == v_cache.shape, (k.shape, v.shape, k_cache.shape, v_cache.shape)
    assert k_cache.shape[1:] == (num_kv_heads, head_dim), (k.shape, k_cache.shape)
    quantized = k_cache.dtype in QUANT_KV_DTYPES
    # A float cache in another float dtype than k and v (--kv_cache_dtype bfloat16 under float32 activations): the
    # kernel's store rounds each value to the cache's dtype.
    assert k.dtype == v.dtype and v_cache.dtype == k_cache.dtype, (k.dtype, v.dtype, k_cache.dtype, v_cache.dtype)
    assert k.stride(2) == v.stride(2) == k_cache.stride(2) == v_cache.stride(2) == 1, "head dim must be contiguous"
    assert kv_locs.shape == (num_tokens,) and kv_locs.dtype in (torch.int32, torch.int64), kv_locs.dtype
    if num_tokens == 0:
        return
    cache_args, kv_quant = triton_kv_args(k_cache, v_cache, k_scale, v_scale, for_store=True)
    k_cache, v_cache, k_scales, v_scales, scale_stride, k_scale, v_scale = cache_args
    bf16_bits = k.dtype == torch.float32 and k_cache.dtype == torch.bfloat16
    if bf16_bits:
        k_cache, v_cache = k_cache.view(torch.int16), v_cache.view(torch.int16)
    # An 8-bit cache: one program per (token, head), each reducing its own row for int8's amax.
    num_elems = head_dim if quantized else num_kv_heads * head_dim
    grid = (num_tokens, num_kv_heads) if quantized else (num_tokens,)
    _store_kv_kernel[grid](
        k, v, k_cache, v_cache, kv_locs, k_scales, v_scales,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), scale_stride, k_scale, v_scale,
        HEAD_DIM=head_dim, BLOCK=triton.next_power_of_2(num_elems), NUM_ELEMS=num_elems, KV_QUANT=kv_quant,
        BF16_BITS=bf16_bits, num_warps=4,
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
    """The C row copy or quantizing write (kernels/cpu/elementwise.c) where k and v share a dtype the C kernels take,
    both caches hold it (or bf16, rounding float32 rows) or share an 8-bit format, and every kv_loc is a row of the
    cache. False when it cannot run here (then nothing was written): another cast between float dtypes, other
    layouts or scales (c_scales_fit), or a loc out of range, for which the reference raises. `lib`: another kernel
    build (tests)."""
    from lightserve.kernels.cpu import C_DTYPES, library, profiled

    lib = lib or library()
    if lib is None or not c_kv_layout(k_cache, v_cache) or k.dim() != 3 \
            or not (k.dtype == v.dtype and k.dtype in C_DTYPES and k_cache.dtype == v_cache.dtype) \
            or not (k_cache.dtype == k.dtype or k_cache.dtype in QUANT_KV_DTYPES
                    or (k.dtype == torch.float32 and k_cache.dtype == torch.bfloat16)) \
            or k.shape != v.shape or k_cache.shape != v_cache.shape or k_cache.shape[1:] != k.shape[1:] \
            or k.stride(2) != 1 or v.stride(2) != 1 or kv_locs.shape != (k.shape[0],) \
            or kv_locs.dtype not in (torch.int32, torch.int64) or not kv_locs.is_contiguous() \
            or not c_scales_fit(k_cache, k_scale, v_scale):
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
