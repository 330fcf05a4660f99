"""Rotary position embedding (NeoX / HF `rotate_half` layout), applied in place to q and k.

Called by the model's attention after the qkv projection; q and k may be strided views of the fused output."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightserve.config import KernelBackend
from lightserve.kernels.backend import runs_triton


def rotary_emb_ref(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor) -> None:
    """HF apply_rotary_pos_emb, bit for bit, written into q and k.

    HF computes x*cos + rotate_half(x)*sin in x.dtype with cos = cat(c, c), sin = cat(s, s). Per half that is
    x1*c - x2*s and x2*c + x1*s with the same roundings (negation is exact), so no rotated copy is built, and
    the in-place -= / += keep temporaries few (large temporaries cost page faults on CPU).
    """
    half = q.shape[-1] // 2
    cs = cos_sin.index_select(0, positions.long())  # [T, D]
    cos = cs[:, None, :half].to(q.dtype)  # [T, 1, D/2]
    sin = cs[:, None, half:].to(q.dtype)  # [T, 1, D/2]
    for x in (q, k):
        x1, x2 = x[..., :half], x[..., half:]  # [T, H, D/2] views
        first = x1 * cos
        first -= x2 * sin
        second = x2 * cos
        second += x1 * sin
        x1.copy_(first)
        x2.copy_(second)


@triton.jit
def _rotary_kernel(
    x_ptr, pos_ptr, cos_sin_ptr,
    x_stride_t, x_stride_h, cos_sin_stride,
    num_heads, max_pos,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)  # int64: token * x_stride_t may pass 2**31 in a large step
    head_block = tl.program_id(1)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    # The table has max_pos rows and nothing else bounds pos here (ModelRunner caps a request's length). Compiled
    # out unless Triton runs with debug on (TRITON_DEBUG=1), so it costs nothing when serving.
    tl.device_assert((pos >= 0) & (pos < max_pos), "rotary: position outside the cos/sin table")
    # BLOCK_HALF is head_dim / 2 rounded up to a power of two (head_dim 80, 96); padding lanes are masked.
    dims = tl.arange(0, BLOCK_HALF)
    d_mask = dims < HALF
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + dims, mask=d_mask, other=0.0)[None, :]  # [1, BLOCK_HALF]
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HALF + dims, mask=d_mask, other=0.0)[None, :]
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (heads < num_heads)[:, None] & d_mask[None, :]
    ptr1 = x_ptr + token * x_stride_t + heads[:, None] * x_stride_h + dims[None, :]  # [BLOCK_H, BLOCK_HALF]
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    # fp32 math, one rounding: slightly more accurate than HF's per-op rounding in bf16 (tests allow for it).
    tl.store(ptr1, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(ptr1 + HALF, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


def rotary_emb_triton(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor) -> None:
    num_tokens, _, head_dim = q.shape
    assert k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim, (q.shape, k.shape)
    assert q.stride(2) == 1 and k.stride(2) == 1, "the head dim must be contiguous"
    assert head_dim % 2 == 0, head_dim
    assert positions.shape == (num_tokens,) and positions.dtype in (torch.int32, torch.int64), positions.dtype
    assert cos_sin.dim() == 2 and cos_sin.shape[1] == head_dim and cos_sin.dtype == torch.float32, cos_sin.shape
    assert cos_sin.stride(1) == 1, cos_sin.stride()
    if num_tokens == 0:
        return
    for x in (q, k):
        block_h = min(triton.next_power_of_2(x.shape[1]), 16)
        grid = (num_tokens, triton.cdiv(x.shape[1], block_h))
        _rotary_kernel[grid](
            x, positions, cos_sin, x.stride(0), x.stride(1), cos_sin.stride(0), x.shape[1], cos_sin.shape[0],
            HALF=head_dim // 2, BLOCK_HALF=triton.next_power_of_2(head_dim // 2), BLOCK_H=block_h,
        )


def rotary_emb(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, backend: KernelBackend | None = None) -> None:
    """q [T, Hq, D], k [T, Hk, D] rotated in place at positions [T]; cos_sin [max_pos, D] float32 (cos | sin)."""
    if runs_triton(q, backend):
        rotary_emb_triton(q, k, positions, cos_sin)
    elif not rotary_emb_cpu(q, k, positions, cos_sin):
        rotary_emb_ref(q, k, positions, cos_sin)


def rotary_emb_cpu(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, lib=None) -> bool:
    """The C kernel (kernels/cpu/elementwise.c), float32 or bfloat16 q and k: the reference's exact roundings,
    with no temporaries (the torch ops made eight [T, H, D/2] ones per call). False when it cannot run here
    (then nothing was modified). `lib`: a kernel library other than the default build (tests)."""
    from lightserve.kernels.cpu import C_DTYPES, library, profiled

    lib = lib or library()
    if lib is None or q.dtype not in C_DTYPES or k.dtype != q.dtype or cos_sin.dtype != torch.float32 \
            or q.stride(2) != 1 or k.stride(2) != 1 or cos_sin.stride(1) != 1 or q.shape[2] % 2:
        return False
    pos = positions if positions.dtype == torch.int64 and positions.is_contiguous() \
        else positions.to(torch.int64).contiguous()
    threads, bf16 = torch.get_num_threads(), int(q.dtype == torch.bfloat16)
    with profiled("rotary_cpu"):  # visible in scripts/profile_step.py
        for x in (q, k):
            lib.rotary(x.data_ptr(), x.stride(0), x.stride(1), x.shape[0], x.shape[1], x.shape[2], pos.data_ptr(),
                       cos_sin.data_ptr(), cos_sin.stride(0), bf16, threads)
    return True
