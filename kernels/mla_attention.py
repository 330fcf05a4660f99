"""DeepSeek multi-head latent attention (MLA) over a token-level latent KV pool. Called by model_infer/mla_layer.py.

The pool holds, per token and layer, one row of kv_lora_rank (R) normalized latent values followed by the
qk_rope_head_dim (Dr) roped key values: [num_kv_rows, 1, R + Dr], one "KV head" shared by every query head.
An 8-bit pool (kernels/kv_store.py's formats) quantizes each row as one: int8 with one scale per token over its
R + Dr values (`latent_scale` [num_kv_rows, 1] float32), fp8 with one per-tensor float; every function takes it
as `latent_scale` (None for a float pool).
Decode absorbs the up-projection (kv_b_proj = [W_UK; W_UV] per head) into the query and the output:
  q_latent = q_nope @ W_UK  [B, H, R];  score = (q_latent . c + q_pe . k_pe) * scale;  o = (p @ c) @ W_UV^T
so it reads each cached row once for all heads and never expands K/V. Prefill up-projects the request's latents
to per-head K/V and runs ordinary causal attention (fewer FLOPs per score than the absorbed form when the query
block is long).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from lightserve.config import KernelBackend
from lightserve.kernels.backend import runs_triton
from lightserve.kernels.decode_attention import (
    SPLIT_BUCKETS,
    _decode_merge_kernel,
    _default_num_splits,
    store_split,
)
from lightserve.kernels.kv_store import (
    QUANT_KV_DTYPES,
    TRITON_KV_QUANT,
    KVScale,
    dequantize_tile,
    fp8_dequant_scale,
    gather_kv,
    quantize_kv_ref,
)
from lightserve.kernels.linear import PackedLinear, PrepackedLinear, linear
from lightserve.kernels.prefill_attention import (
    dot_precision,
    fits_in_smem,
    online_softmax_start,
    online_softmax_step,
    prefill_attention,
)

if TYPE_CHECKING:
    HostInts = np.ndarray | Tensor  # [B] integers; numpy: read with no device sync

_LOG2E = 1.4426950408889634


def store_latent(c_kv: Tensor, k_pe: Tensor, latent_cache: Tensor, kv_locs: Tensor,
                 latent_scale: KVScale = None) -> None:
    """latent_cache[kv_locs[i], 0] = cat(c_kv[i], k_pe[i]); c_kv [T, R], k_pe [T, Dr] (may be strided views).
    An 8-bit pool quantizes the whole row (quantize_kv_ref with one "head" of R + Dr values); int8 writes the rows'
    scales into latent_scale [rows, 1] too."""
    rank = c_kv.shape[-1]
    locs = kv_locs.long()
    if latent_cache.dtype not in QUANT_KV_DTYPES:
        latent_cache[:, 0, :rank].index_copy_(0, locs, c_kv.to(latent_cache.dtype))
        latent_cache[:, 0, rank:].index_copy_(0, locs, k_pe.reshape(k_pe.shape[0], -1).to(latent_cache.dtype))
        return
    rows = torch.cat([c_kv, k_pe.reshape(k_pe.shape[0], -1).to(c_kv.dtype)], dim=-1)[:, None]  # [T, 1, R + Dr]
    q, row_scale = quantize_kv_ref(rows, latent_cache.dtype, latent_scale if isinstance(latent_scale, float) else 1.0)
    # As bytes: index_copy_ has no fp8 kernel on every device.
    latent_cache.view(torch.uint8).index_copy_(0, locs, q.view(torch.uint8))
    if row_scale is not None:
        latent_scale.index_copy_(0, locs, row_scale)                                  # [T, 1]


def mla_decode(
    q_nope: Tensor, q_pe: Tensor, latent_cache: Tensor, w_kc: Tensor, w_vc: Tensor, req_to_token: Tensor,
    req_rows: Tensor, seq_lens: Tensor, max_seq_len: int, sm_scale: float, backend: KernelBackend | None = None,
    latent_scale: KVScale = None,
) -> Tensor:
    """One query token per request, weights absorbed: q_nope [B, H, Dn], q_pe [B, H, Dr] (roped), w_kc [H, Dn, R]
    (W_UK), w_vc [H, Dv, R] (W_UV) -> [B, H, Dv]; request b attends to its tokens 0 .. seq_lens[b] - 1."""
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_kc).transpose(0, 1)  # [B, H, R]
    o_latent = mla_decode_attention(q_latent, q_pe, latent_cache, req_to_token, req_rows, seq_lens, max_seq_len,
                                    sm_scale, backend, latent_scale=latent_scale)  # [B, H, R]
    return torch.bmm(o_latent.transpose(0, 1), w_vc.transpose(1, 2)).transpose(0, 1)  # [B, H, Dv]


def mla_decode_attention_ref(
    q_latent: Tensor, q_pe: Tensor, latent_cache: Tensor, req_to_token: Tensor, req_rows: Tensor, seq_lens: Tensor,
    max_seq_len: int, sm_scale: float, latent_scale: KVScale = None,
) -> Tensor:
    """Latent-space attention, q_latent [B, H, R], q_pe [B, H, Dr] -> o_latent [B, H, R] in q's dtype: one SDPA
    call, the H heads as query rows of the single latent KV head (as decode_attention_ref packs a GQA group); an
    8-bit pool's rows dequantized to q's dtype, a float pool's read in the wider of its dtype and q's.

    This is also the CPU path. A C kernel (like decode_attention.c, which takes head dims 64 and 128 and groups up
    to 16) would stream each request's rows in place instead of gathering a [B, L, R + Dr] copy, and would load
    every row once for all H heads (128 for DeepSeek-V3): per layer it saves one write and one read of the gathered
    latents, which dominate decode at long contexts."""
    batch, _, rank = q_latent.shape
    locs = req_to_token.index_select(0, req_rows.long())[:, :max_seq_len].long()  # [B, L]
    valid = torch.arange(max_seq_len, device=q_latent.device)[None, :] < seq_lens[:, None]  # [B, L]
    # Slots past a request's length may point at rows never written: aim them at its first token (masked anyway).
    locs = torch.where(valid, locs, locs[:, :1]).view(-1)  # [B * L]
    # An 8-bit pool is dequantized to q's dtype; a float pool and q meet in the wider of their dtypes (a bf16 pool
    # under float32 activations is widened, as the Triton kernel and the C attention read it).
    dtype = q_latent.dtype if latent_cache.dtype in QUANT_KV_DTYPES \
        else torch.promote_types(q_latent.dtype, latent_cache.dtype)
    lat = gather_kv(latent_cache, latent_scale, locs, dtype).view(batch, 1, max_seq_len, -1)  # [B, 1, L, R + Dr]
    q = torch.cat([q_latent, q_pe], dim=-1).to(lat.dtype)[:, None]  # [B, 1, H, R + Dr]
    out = F.scaled_dot_product_attention(q, lat, lat[..., :rank], attn_mask=valid[:, None, None],
                                         scale=sm_scale)  # [B, 1, H, R]
    return out[:, 0].to(q_latent.dtype)


# q_latent is a transposed bmm output ([H, B, R] viewed as [B, H, R]): its head stride is B * R, which changes with
# the batch; specialized on (% 16), it would make a new variant for some batch sizes when R is not a multiple of 16.
@triton.jit(do_not_specialize=["ql_stride_h"])
def _mla_decode_split_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, scales_ptr, scale_stride, cache_scale, mid_o_ptr, mid_lse_ptr, req_to_token_ptr,
    req_rows_ptr, seq_lens_ptr,
    qk_scale, ql_stride_b, ql_stride_h, qp_stride_b, qp_stride_h, cache_stride_row, r2t_stride, num_heads,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_mask = heads < num_heads
    seq_len = tl.load(seq_lens_ptr + req)
    row = tl.load(req_rows_ptr + req).to(tl.int64)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N  # whole tiles: only the last is partial
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    # BLOCK_R / BLOCK_P: R and Dr rounded up to powers of two; the padding lanes load 0.
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < RANK
    offs_p = tl.arange(0, BLOCK_P)
    p_mask = offs_p < ROPE_DIM
    q_lat = tl.load(q_lat_ptr + req * ql_stride_b + heads[:, None] * ql_stride_h + offs_r[None, :],
                    mask=h_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_R]
    q_pe = tl.load(q_pe_ptr + req * qp_stride_b + heads[:, None] * qp_stride_h + offs_p[None, :],
                   mask=h_mask[:, None] & p_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_P]

    m_i, l_i, acc = online_softmax_start(BLOCK_H, BLOCK_R)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        locs = tl.load(req_to_token_ptr + row * r2t_stride + offs_n, mask=n_mask, other=0).to(tl.int64)
        # The latent tile is both the key's first R dims and the value: loaded once.
        c = tl.load(cache_ptr + locs[:, None] * cache_stride_row + offs_r[None, :],
                    mask=n_mask[:, None] & r_mask[None, :], other=0)  # [BLOCK_N, BLOCK_R]
        k_pe = tl.load(cache_ptr + locs[None, :] * cache_stride_row + RANK + offs_p[:, None],
                       mask=p_mask[:, None] & n_mask[None, :], other=0)  # [BLOCK_P, BLOCK_N]
        if KV_QUANT == 1:  # int8: one scale per row, the same for its latent and rope parts
            row_scales = tl.load(scales_ptr + locs * scale_stride, mask=n_mask, other=0.0)  # [BLOCK_N]
            c = dequantize_tile(c, row_scales[:, None], KV_QUANT).to(q_lat.dtype)
            k_pe = dequantize_tile(k_pe, row_scales[None, :], KV_QUANT).to(q_lat.dtype)
        elif KV_QUANT != 0:  # fp8: the per-tensor scale
            c = dequantize_tile(c, cache_scale, KV_QUANT).to(q_lat.dtype)
            k_pe = dequantize_tile(k_pe, cache_scale, KV_QUANT).to(q_lat.dtype)
        else:  # a float pool in its own dtype (bf16 under float32 activations); else a no-op
            c = c.to(q_lat.dtype)
            k_pe = k_pe.to(q_lat.dtype)
        qk = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
        qk = (qk + tl.dot(q_pe, k_pe, input_precision=PRECISION)) * qk_scale  # [BLOCK_H, BLOCK_N], log2 units
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        # The latent tile is the value too. Every tile in the loop has a valid key, so the running max is finite.
        m_i, l_i, acc = online_softmax_step(qk, c, m_i, l_i, acc, PRECISION, False)

    mid = (req * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_H] rows of mid_o [B, H, NUM_SPLITS, R]
    store_split(m_i, l_i, acc, mid_o_ptr, mid_lse_ptr, mid, h_mask, offs_r, r_mask, RANK)


def mla_decode_attention_triton(
    q_latent: Tensor, q_pe: Tensor, latent_cache: Tensor, req_to_token: Tensor, req_rows: Tensor, seq_lens: Tensor,
    max_seq_len: int, sm_scale: float, num_splits: int | None = None, block_n: int | None = None,
    block_h: int = 16, latent_scale: KVScale = None,
) -> Tensor:
    """Flash-decoding over the latent rows: stage 1 per (request, block of heads, split), then decode_attention's
    merge kernel with head_dim R. An 8-bit pool is dequantized tile by tile in registers."""
    batch, num_heads, rank = q_latent.shape
    rope_dim = q_pe.shape[2]
    assert q_pe.shape[:2] == (batch, num_heads), (q_latent.shape, q_pe.shape)
    assert latent_cache.dim() == 3 and latent_cache.shape[1:] == (1, rank + rope_dim), latent_cache.shape
    assert q_latent.dtype == q_pe.dtype \
        and (latent_cache.dtype.is_floating_point or latent_cache.dtype in QUANT_KV_DTYPES), \
        (q_latent.dtype, q_pe.dtype, latent_cache.dtype)
    assert q_latent.stride(2) == 1 and q_pe.stride(2) == 1 and latent_cache.stride(2) == 1, "last dims contiguous"
    assert req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1, req_to_token.dtype
    for meta in (req_rows, seq_lens):
        assert meta.shape == (batch,) and meta.dtype == torch.int32 and meta.is_contiguous(), (meta.shape, meta.dtype)
    cache, scales, scale_stride, cache_scale, kv_quant = _latent_args(latent_cache, latent_scale)
    out = torch.empty(batch, num_heads, rank, dtype=q_latent.dtype, device=q_latent.device)
    if batch == 0:
        return out
    head_blocks = triton.cdiv(num_heads, block_h)
    block_r, block_p = max(16, triton.next_power_of_2(rank)), max(16, triton.next_power_of_2(rope_dim))
    default_n, num_stages = mla_decode_blocks(rank, rope_dim, block_h, q_latent.element_size(),
                                              latent_cache.element_size())
    block_n = block_n or default_n
    if num_splits is None:
        num_splits = _default_num_splits(q_latent.device, batch * head_blocks, triton.cdiv(max_seq_len, block_n))
    assert num_splits in SPLIT_BUCKETS, num_splits
    mid_o = torch.empty(batch, num_heads, num_splits, rank, dtype=torch.float32, device=q_latent.device)
    mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q_latent.device)
    _mla_decode_split_kernel[(batch, head_blocks, num_splits)](
        q_latent, q_pe, cache, scales, scale_stride, cache_scale, mid_o, mid_lse, req_to_token, req_rows, seq_lens,
        sm_scale * _LOG2E,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), latent_cache.stride(0),
        req_to_token.stride(0), num_heads,
        RANK=rank, BLOCK_R=block_r, ROPE_DIM=rope_dim, BLOCK_P=block_p, BLOCK_H=block_h, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, PRECISION=dot_precision(q_latent.dtype), KV_QUANT=kv_quant, num_warps=4,
        num_stages=num_stages,
    )
    _decode_merge_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, out.stride(0), out.stride(1), num_heads,
        HEAD_DIM=rank, BLOCK_D=triton.next_power_of_2(rank), NUM_SPLITS=num_splits, num_warps=4,
    )
    return out


def mla_decode_blocks(rank: int, rope_dim: int, block_h: int, elem_size: int,
                      kv_elem_size: int | None = None) -> tuple[int, int]:
    """(BLOCK_N, num_stages) of the MLA split kernel: the longest latent tile (BLOCK_N rows of R + Dr, the value
    being the key's own first R columns) whose shared memory estimate fits (prefill_attention.fits_in_smem;
    kv_elem_size: the pool's, 1 for 8 bits, defaults to q's elem_size). DeepSeek-V3 (R 512, Dr 64) gets 32 in every
    dtype."""
    block_d = max(16, triton.next_power_of_2(rank)) + max(16, triton.next_power_of_2(rope_dim))
    num_stages = 2
    block_n = next((n for n in (32, 16) if fits_in_smem(block_h, n, block_d, num_stages, elem_size, block_dv=0,
                                                         kv_elem_size=kv_elem_size)), 16)
    return block_n, num_stages


def mla_decode_attention(
    q_latent: Tensor, q_pe: Tensor, latent_cache: Tensor, req_to_token: Tensor, req_rows: Tensor, seq_lens: Tensor,
    max_seq_len: int, sm_scale: float, backend: KernelBackend | None = None, latent_scale: KVScale = None,
) -> Tensor:
    """q_latent [B, H, R], q_pe [B, H, Dr], latent_cache [rows, 1, R + Dr] -> o_latent [B, H, R]."""
    if runs_triton(q_latent, backend):
        return mla_decode_attention_triton(q_latent, q_pe, latent_cache, req_to_token, req_rows, seq_lens,
                                           max_seq_len, sm_scale, latent_scale=latent_scale)
    return mla_decode_attention_ref(q_latent, q_pe, latent_cache, req_to_token, req_rows, seq_lens, max_seq_len,
                                    sm_scale, latent_scale)


def warm_up_mla_decode_attention(q_latent: Tensor, q_pe: Tensor, latent_cache: Tensor, req_to_token: Tensor,
                                 req_rows: Tensor, seq_lens: Tensor, latent_scale: KVScale = None) -> None:
    """Compile the split kernel and the merge for every split count an eager step can pick, with the model's
    shapes and dtype (arguments as mla_decode_attention's). The outputs are discarded."""
    for num_splits in SPLIT_BUCKETS:
        mla_decode_attention_triton(q_latent, q_pe, latent_cache, req_to_token, req_rows, seq_lens,
                                    int(req_to_token.shape[1]), 1.0, num_splits=num_splits, latent_scale=latent_scale)


def mla_prefill_attention(
    q_nope: Tensor, q_pe: Tensor, latent_cache: Tensor, kv_b_proj: Tensor | PackedLinear | PrepackedLinear,
    v_head_dim: int, req_to_token: Tensor, req_rows: HostInts, q_start_locs: HostInts, prefix_lens: HostInts,
    extend_lens: HostInts, sm_scale: float, backend: KernelBackend | None = None, latent_scale: KVScale = None,
) -> Tensor:
    """Causal attention of each request's new tokens over its prefix and themselves, K/V up-projected from the
    latents: q_nope [T, H, Dn], q_pe [T, H, Dr] (roped), kv_b_proj [H * (Dn + Dv), R] -> [T, H, Dv].

    HF DeepseekV3Attention's math: k = cat(k_nope, k_pe), q = cat(q_nope, q_pe). Every key row of the step's requests
    (each request's prefix and new tokens, request after request) is up-projected in one GEMM, the prefill's cost,
    and then one call of the prefill attention kernel attends over them (Triton or the CPU path by `backend`), with V
    zero-padded to K's width (the kernels take one head_dim) and cut back after. The metadata is read on the host:
    pass host arrays (numpy, as ForwardBatch.host_metadata gives them; MLAAttention does) and the call makes no
    device->host sync; device tensors work too, at the cost of one sync each. An 8-bit pool's gathered rows are
    dequantized to q's dtype (the only copy, the gather the prefill makes anyway)."""
    num_tokens, num_heads, nope_dim = q_nope.shape
    rope_dim = q_pe.shape[2]
    rank = latent_cache.shape[2] - rope_dim
    dev = q_nope.device
    rows, q_starts, prefixes, extends = (_host_ints(a) for a in (req_rows, q_start_locs, prefix_lens, extend_lens))
    totals = prefixes + extends                               # [B] keys of each request
    key_starts = np.cumsum(totals) - totals                   # [B] each request's first row among the step's keys
    num_keys = int(totals.sum())
    # Request and position of every key, request after request: one gather of their KV rows.
    key_req_rows = np.repeat(rows, totals)
    key_pos = np.arange(num_keys) - np.repeat(key_starts, totals)
    locs = req_to_token[torch.as_tensor(key_req_rows, device=dev).long(), torch.as_tensor(key_pos, device=dev).long()]
    dtype = q_nope.dtype if latent_cache.dtype in QUANT_KV_DTYPES else latent_cache.dtype
    lat = gather_kv(latent_cache, latent_scale, locs.long(), dtype)[:, 0]  # [K, R + Dr]
    kv = linear(lat[:, :rank].to(q_nope.dtype), kv_b_proj).view(num_keys, num_heads, nope_dim + v_head_dim)
    qk_dim = nope_dim + rope_dim
    k = torch.empty(num_keys, num_heads, qk_dim, dtype=q_nope.dtype, device=dev)   # [K, H, Dn + Dr]
    k[..., :nope_dim] = kv[..., :nope_dim]
    k[..., nope_dim:] = lat[:, None, rank:].to(q_nope.dtype)                        # one k_pe for every head
    v = torch.zeros(num_keys, num_heads, qk_dim, dtype=q_nope.dtype, device=dev)   # [K, H, Dn + Dr], Dv used
    v[..., :v_head_dim] = kv[..., nope_dim:]
    q = torch.cat([q_nope, q_pe], dim=-1)                                          # [T, H, Dn + Dr]
    # The keys' own table: request b's position i is key row key_starts[b] + i (positions past its total unread). Its
    # width, the kernel's row stride, is a multiple of 16 whatever the step: Triton specializes an int argument on
    # being 1 or a multiple of 16, and a width that followed the longest request would compile while serving.
    width = -(-max(int(totals.max(initial=1)), 1) // 16) * 16
    table = np.minimum(key_starts[:, None] + np.arange(width)[None, :], max(num_keys - 1, 0)).astype(np.int32)
    meta = [torch.as_tensor(a.astype(np.int32), device=dev)
            for a in (np.arange(rows.size), q_starts, prefixes, extends)]
    out = prefill_attention(q, k, v, torch.as_tensor(table, device=dev), *meta, int(extends.max(initial=0)),
                            sm_scale, backend=backend)                             # [T, H, Dn + Dr]
    return out[..., :v_head_dim]


def _latent_args(latent_cache: Tensor, latent_scale: KVScale) -> tuple[Tensor, Tensor | None, int, float, int]:
    """The split kernel's (cache, scales, scale_stride, cache_scale, KV_QUANT) for a latent pool: fp8 as a uint8
    view with its float (dequantize_tile's rebias folded in), int8 with its [rows, 1] float32 scales."""
    kv_quant = TRITON_KV_QUANT.get(latent_cache.dtype, 0)
    if kv_quant == 0:
        return latent_cache, None, 0, 1.0, 0
    if kv_quant == 1:
        assert isinstance(latent_scale, Tensor) and latent_scale.dtype == torch.float32 \
            and latent_scale.shape == latent_cache.shape[:2], "int8 latents need [rows, 1] float32 scales"
        return latent_cache, latent_scale, latent_scale.stride(0), 1.0, 1
    assert isinstance(latent_scale, float), "fp8 latents need a per-tensor float scale"
    return latent_cache.view(torch.uint8), None, 0, fp8_dequant_scale(latent_cache.dtype, latent_scale), kv_quant


def _host_ints(a: HostInts) -> np.ndarray:
    """[B] integers on the host as int64 numpy (a device tensor is read back: one sync)."""
    return np.asarray(a.cpu() if isinstance(a, Tensor) else a, dtype=np.int64)
