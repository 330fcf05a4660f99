"""Rotary position embedding (NeoX / HF `rotate_half` layout), applied in place to q and k.

Called by the model's attention after the qkv projection; q and k may be strided views of the fused output.

Ahead of an int8 KV cache (`hadamard=True`) each rotated head of q and k is then multiplied by the normalized
Walsh-Hadamard matrix H (block-diagonal in blocks of `hadamard_block(D)`; H is orthogonal and symmetric, so
(q H) . (k H) = q . k and attention's output is unchanged). Why: a few of a trained model's key channels are an order
of magnitude larger than the rest (SmolLM2's reach |20| where most stay near 1), so int8's one scale per token and
head leaves the small channels coarse; after H every channel carries a share of each, and the scale covers them
evenly. SmolLM2 by teacher forcing against transformers (docs/kv_cache.md): mean |dlogprob| 0.022 -> 0.009. It has to
follow the rotary (it does not commute with it), so it is done here, in the kernel that already holds the rows, rather
than folded into the weights. fp8 caches are left unrotated: their per-tensor scales come from checkpoints calibrated
on K as the model computes it, which a rotation would invalidate (it moves each tensor's largest value)."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightserve.config import KernelBackend
from lightserve.kernels.backend import runs_triton


def rotary_emb_ref(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, hadamard: bool = False) -> None:
    """HF apply_rotary_pos_emb, bit for bit, written into q and k; with `hadamard`, then hadamard_ref of each.

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
        if hadamard:
            x.copy_(hadamard_ref(x))


# The largest Walsh-Hadamard block (kernels/cpu/elementwise.c HADAMARD_MAX): a head wider than it is done in blocks.
# 64 channels spread a large one well enough, and keep the Triton kernel's matrices small (at most [64, 64] float32
# in its usual forms, below).
HADAMARD_MAX = 64


def hadamard_block(head_dim: int) -> int:
    """The Walsh-Hadamard block for a head of head_dim: its largest power-of-two divisor, at most HADAMARD_MAX (64 for
    SmolLM2's 64 and for 128, 32 for Phi-3's 96)."""
    return min(head_dim & -head_dim, HADAMARD_MAX)


def hadamard_ref(x: Tensor) -> Tensor:
    """x [..., D] times the block-diagonal normalized Walsh-Hadamard matrix, in x's dtype: butterflies of span 1, 2, ..,
    block / 2 in float32, then one multiply by 1 / sqrt(block) (the C kernel's operations, in its order)."""
    shape, block = x.shape, hadamard_block(x.shape[-1])
    t = x.float()
    span = 1
    while span < block:
        t = t.reshape(*shape[:-1], -1, 2, span)  # [..., D / (2 span), 2, span]: each pair of halves a butterfly's
        a, c = t[..., 0, :], t[..., 1, :]
        t = torch.stack((a + c, a - c), dim=-2)
        span *= 2
    return (t.reshape(shape) * torch.tensor(1.0 / math.sqrt(block), dtype=torch.float32)).to(x.dtype)


@triton.jit
def _hadamard_part(row0, col0, h_scale, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, HADAMARD: tl.constexpr):
    """[BLOCK_HALF, BLOCK_HALF] float32: the normalized block-diagonal Walsh-Hadamard matrix's rows row0 + i and
    columns col0 + j for i, j < HALF, zero in the padding lanes. Entry (r, c) of a block is (-1)^popcount(r & c)."""
    i = tl.arange(0, BLOCK_HALF)
    rows = row0 + i[:, None]
    cols = col0 + i[None, :]
    inside = (rows // HADAMARD == cols // HADAMARD) & (i[:, None] < HALF) & (i[None, :] < HALF)
    bits = rows & cols & (HADAMARD - 1)
    parity = bits & 1
    for b in tl.static_range(1, 6):  # HADAMARD <= 64: six bits
        parity ^= (bits >> b) & 1
    return tl.where(inside, (1.0 - 2.0 * parity.to(tl.float32)) * h_scale, 0.0)


@triton.jit
def _rotary_kernel(
    x_ptr, pos_ptr, cos_sin_ptr,
    x_stride_t, x_stride_h, cos_sin_stride,
    num_heads, max_pos, h_scale,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, HADAMARD: tl.constexpr,
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
    y1 = x1f * cos - x2f * sin  # [BLOCK_H, BLOCK_HALF]
    y2 = x2f * cos + x1f * sin
    if HADAMARD > 0 and HALF % HADAMARD == 0 and BLOCK_HALF == HALF:
        # Whole blocks in each half (head_dim 128, 256): each half's rows of blocks [BLOCK_H * HALF / HADAMARD,
        # HADAMARD] times one block of H.
        hb = _hadamard_part(0, 0, h_scale, HADAMARD, HADAMARD, HADAMARD)  # [HADAMARD, HADAMARD]
        y1 = tl.reshape(tl.dot(tl.reshape(y1, [BLOCK_H * HALF // HADAMARD, HADAMARD]), hb, input_precision="ieee"),
                        [BLOCK_H, BLOCK_HALF])
        y2 = tl.reshape(tl.dot(tl.reshape(y2, [BLOCK_H * HALF // HADAMARD, HADAMARD]), hb, input_precision="ieee"),
                        [BLOCK_H, BLOCK_HALF])
    elif HADAMARD > 0:  # blocks across the halves (or padded ones): [y1 | y2] times H as four products of halves
        h00 = _hadamard_part(0, 0, h_scale, HALF, BLOCK_HALF, HADAMARD)
        h01 = _hadamard_part(0, HALF, h_scale, HALF, BLOCK_HALF, HADAMARD)
        h10 = _hadamard_part(HALF, 0, h_scale, HALF, BLOCK_HALF, HADAMARD)
        h11 = _hadamard_part(HALF, HALF, h_scale, HALF, BLOCK_HALF, HADAMARD)
        z1 = tl.dot(y1, h00, input_precision="ieee") + tl.dot(y2, h10, input_precision="ieee")
        y2 = tl.dot(y1, h01, input_precision="ieee") + tl.dot(y2, h11, input_precision="ieee")
        y1 = z1
    tl.store(ptr1, y1.to(x1.dtype), mask=mask)
    tl.store(ptr1 + HALF, y2.to(x1.dtype), mask=mask)


def rotary_emb_triton(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, hadamard: bool = False) -> None:
    num_tokens, _, head_dim = q.shape
    assert k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim, (q.shape, k.shape)
    assert q.stride(2) == 1 and k.stride(2) == 1, "the head dim must be contiguous"
    assert head_dim % 2 == 0, head_dim
    assert positions.shape == (num_tokens,) and positions.dtype in (torch.int32, torch.int64), positions.dtype
    assert cos_sin.dim() == 2 and cos_sin.shape[1] == head_dim and cos_sin.dtype == torch.float32, cos_sin.shape
    assert cos_sin.stride(1) == 1, cos_sin.stride()
    if num_tokens == 0:
        return
    block, block_half = hadamard_block(head_dim) if hadamard else 0, triton.next_power_of_2(head_dim // 2)
    if hadamard:
        block_half = max(block_half, 16)
    for x in (q, k):
        block_h = 16 if hadamard else min(triton.next_power_of_2(x.shape[1]), 16)
        grid = (num_tokens, triton.cdiv(x.shape[1], block_h))
        _rotary_kernel[grid](
            x, positions, cos_sin, x.stride(0), x.stride(1), cos_sin.stride(0), x.shape[1], cos_sin.shape[0],
            1.0 / math.sqrt(block) if block else 1.0,
            HALF=head_dim // 2, BLOCK_HALF=block_half, BLOCK_H=block_h, HADAMARD=block,
        )


def rotary_emb(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, backend: KernelBackend | None = None,
               hadamard: bool = False) -> None:
    """q [T, Hq, D], k [T, Hk, D] rotated in place at positions [T]; cos_sin [max_pos, D] float32 (cos | sin).
    hadamard: then each head through the Walsh-Hadamard transform (ahead of an int8 KV cache; see the top)."""
    if runs_triton(q, backend):
        rotary_emb_triton(q, k, positions, cos_sin, hadamard)
    elif not rotary_emb_cpu(q, k, positions, cos_sin, hadamard=hadamard):
        rotary_emb_ref(q, k, positions, cos_sin, hadamard)


def rotary_emb_cpu(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, lib=None, hadamard: bool = False) -> bool:
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
                       cos_sin.data_ptr(), cos_sin.stride(0), hadamard_block(q.shape[2]) if hadamard else 0, bf16,
                       threads)
    return True
