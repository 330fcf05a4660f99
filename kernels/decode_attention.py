"""Attention of one new query per request over its whole cached sequence (decode step).

Called by the model's attention in a decode step. On GPU it is flash-decoding: stage 1 splits each sequence into
chunks and writes a partial softmax per chunk, stage 2 merges the chunks. On CPU a C kernel streams each
request's K/V rows in place (kernels/cpu/decode_attention.c); the torch reference, batched SDPA over a
gathered copy, is the test oracle and the fallback where no C compiler is available.
`window` and `softcap` are prefill_attention's (0 = off): a windowed request reads only its last `window` rows.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from lightserve.config import KernelBackend
from lightserve.kernels.backend import runs_triton
from lightserve.kernels.kv_store import (
    KV_KIND,
    QUANT_KV_DTYPES,
    KVScale,
    c_kv_layout,
    c_scale_args,
    c_scales_fit,
    gather_kv,
    triton_kv_args,
)
from lightserve.kernels.prefill_attention import (
    dot_precision,
    fits_in_smem,
    online_softmax_start,
    online_softmax_step,
    score_kv_tile,
    softcap_args,
    softcap_attention_ref,
)

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64
# NUM_SPLITS is a compile-time constant: each value is one Triton compile (0.5-2 s). Eager steps meet any
# batch x length, so the split count is rounded down to a power of two: 7 values, all compiled at start-up.
SPLIT_BUCKETS = tuple(1 << i for i in range(_MAX_SPLITS.bit_length()))  # (1, 2, 4, ..., 64)


def decode_attention_ref(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, req_to_token: Tensor, req_rows: Tensor, seq_lens: Tensor,
    max_seq_len: int, sm_scale: float, window: int = 0, softcap: float = 0.0, k_scale: KVScale = None,
    v_scale: KVScale = None,
) -> Tensor:
    """Gather every request's K/V padded to max_seq_len (dequantized to q's dtype from an 8-bit cache), mask the
    padding, one SDPA call for the whole batch.

    Layout choice, measured on 2 Zen 5 cores, 1 thread, bf16, Hq 9, Hk 3, D 64 (medians of 25, same run):
      B=64, L=400: SDPA with the group's query heads as query rows (HF's pack_gqa) 38 ms,
                   SDPA enable_gqa=True 89 ms, explicit [B, Hk, group, D] matmuls + softmax 95-136 ms
      B=1,  L=512: pack_gqa 0.42 ms, enable_gqa 1.18 ms, matmuls 0.62-1.0 ms
    The gather uses index_select, 4x faster than advanced indexing (4 ms vs 16 ms for B=64, L=400).
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    locs = req_to_token.index_select(0, req_rows.long())[:, :max_seq_len].long()  # [B, L]
    key_pos = torch.arange(max_seq_len, device=q.device)[None, :]  # [1, L]
    valid = key_pos < seq_lens[:, None]  # [B, L]
    # Slots past a request's length may point at rows never written (NaN from torch.empty); aim them at the
    # request's first token, always written, so masked-out scores never multiply a NaN value.
    locs = torch.where(valid, locs, locs[:, :1]).view(-1)  # [B * L]
    if window > 0:
        valid &= key_pos >= seq_lens[:, None] - window
    k = gather_kv(k_cache, k_scale, locs, q.dtype).view(batch, max_seq_len, num_kv_heads, head_dim)  # [B, L, Hk, D]
    v = gather_kv(v_cache, v_scale, locs, q.dtype).view(batch, max_seq_len, num_kv_heads, head_dim)  # [B, L, Hk, D]
    # One query token: the group's query heads act as query rows of their KV head, so no K/V repeat.
    qg = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hk, group, D]
    if softcap > 0:
        # Query rows of the group against their own KV head: a group of 1 per head in the eager formula.
        out = softcap_attention_ref(qg.reshape(batch * num_kv_heads, 1, -1, head_dim),
                                    k.transpose(1, 2).reshape(batch * num_kv_heads, 1, max_seq_len, head_dim),
                                    v.transpose(1, 2).reshape(batch * num_kv_heads, 1, max_seq_len, head_dim),
                                    valid.repeat_interleave(num_kv_heads, 0)[:, None, None], sm_scale, softcap)
        return out.reshape(batch, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=valid[:, None, None], scale=sm_scale
    )  # [B, Hk, group, D]
    return out.reshape(batch, num_heads, head_dim)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, scale_stride, k_scale, v_scale, mid_o_ptr, mid_lse_ptr,
    req_to_token_ptr, req_rows_ptr, seq_lens_ptr,
    qk_scale, window, softcap_scale, softcap_out,
    q_stride_b, q_stride_h, kc_stride_row, kc_stride_h, vc_stride_row, vc_stride_h, r2t_stride,
    num_heads,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, KV_QUANT: tl.constexpr,
):
    # int64 program ids: every offset below is computed in 64 bits.
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    row = tl.load(req_rows_ptr + req).to(tl.int64)
    first = 0
    if USE_WINDOW:  # the query sits at seq_len - 1 and sees its last `window` keys only
        first = tl.maximum(seq_len - window, 0)
    # Chunks are whole BLOCK_N tiles so only the sequence's last tile is partial.
    chunk = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    # All query heads of the GQA group in one tile, so each K/V tile is loaded once for the group.
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    # BLOCK_D is head_dim rounded up to a power of two (tl.arange needs one); the padding lanes load 0.
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_ptrs = q_ptr + req * q_stride_b + heads[:, None] * q_stride_h + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    m_i, l_i, acc = online_softmax_start(BLOCK_G, BLOCK_D)
    for start_n in range(start, end, BLOCK_N):
        _, n_mask, qk, v = score_kv_tile(  # qk [BLOCK_G, BLOCK_N]
            q, start_n, end, k_cache_ptr, v_cache_ptr, req_to_token_ptr, row, r2t_stride, kv_head, kc_stride_row,
            kc_stride_h, vc_stride_row, vc_stride_h, offs_d, d_mask, k_scales_ptr, v_scales_ptr, scale_stride, k_scale,
            v_scale, qk_scale, softcap_scale, softcap_out, BLOCK_N, KV_QUANT, PRECISION, USE_SOFTCAP)
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        # Every tile in the loop has a valid key, so the running max is finite.
        m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, PRECISION, False)

    mid = (req * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_G] row of mid_o [B, Hq, NUM_SPLITS, D]
    store_split(m_i, l_i, acc, mid_o_ptr, mid_lse_ptr, mid, g_mask, offs_d, d_mask, HEAD_DIM)


@triton.jit
def store_split(m_i, l_i, acc, mid_o_ptr, mid_lse_ptr, mid, row_mask, offs_d, d_mask, WIDTH: tl.constexpr):
    # A flash-decoding split's result, what the merge kernel reads: rows `mid` [M] of mid_o [.., WIDTH] get the output
    # and of mid_lse its lse (log2 units), from the online softmax state (m_i, l_i, acc of online_softmax_step). Shared
    # with the MLA split kernel. An empty split (a short sequence) leaves l_i = 0: it writes lse = -inf and zeros,
    # which the merge weighs 0.
    has_keys = l_i > 0
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    tl.store(mid_o_ptr + mid[:, None] * WIDTH + offs_d[None, :], out, mask=row_mask[:, None] & d_mask[None, :])
    tl.store(mid_lse_ptr + mid, lse, mask=row_mask)


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, o_stride_b, o_stride_h, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    # NUM_SPLITS is a power of two (_default_num_splits), so it is its own block size.
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    base = (req * num_heads + head) * NUM_SPLITS
    lse = tl.load(mid_lse_ptr + base + offs_s)  # [NUM_SPLITS], log2 units
    part = tl.load(mid_o_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=d_mask[None, :],
                   other=0.0)  # [NUM_SPLITS, BLOCK_D]
    weight = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty for seq_len >= 1, so the max is finite
    out = tl.sum(weight[:, None] * part, 0) / tl.sum(weight, 0)
    tl.store(out_ptr + req * o_stride_b + head * o_stride_h + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def decode_attention_triton(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, req_to_token: Tensor, req_rows: Tensor, seq_lens: Tensor,
    max_seq_len: int, sm_scale: float, window: int = 0, softcap: float = 0.0, num_splits: int | None = None,
    block_n: int | None = None, k_scale: KVScale = None, v_scale: KVScale = None,
) -> Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == head_dim, (q.shape, k_cache.shape, v_cache.shape)
    assert k_cache.dtype.is_floating_point or k_cache.dtype in QUANT_KV_DTYPES, (q.dtype, k_cache.dtype, v_cache.dtype)
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1, "head dim must be contiguous"
    assert head_dim % 8 == 0, head_dim  # 16-byte rows; any such head_dim is padded to BLOCK_D below
    assert req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1, req_to_token.dtype
    for meta in (req_rows, seq_lens):
        assert meta.shape == (batch,) and meta.dtype == torch.int32 and meta.is_contiguous(), (meta.shape, meta.dtype)
    cache_args, kv_quant = triton_kv_args(k_cache, v_cache, k_scale, v_scale)  # fp8 as uint8 views
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    block_g = max(16, triton.next_power_of_2(group))  # tl.dot needs at least 16 rows
    default_n, num_stages = decode_blocks(head_dim, group, q.element_size(), k_cache.element_size())
    block_n = block_n or default_n
    if num_splits is None:
        keys = min(max_seq_len, window) if window > 0 else max_seq_len
        num_splits = _default_num_splits(q.device, batch * num_kv_heads, triton.cdiv(keys, block_n))
    assert num_splits in SPLIT_BUCKETS, num_splits  # the values warm_up_decode_attention compiles
    block_d = max(16, triton.next_power_of_2(head_dim))
    mid_o = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, *cache_args, mid_o, mid_lse, req_to_token, req_rows, seq_lens, sm_scale * _LOG2E, window,
        *softcap_args(sm_scale, softcap), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0), num_heads,
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        PRECISION=dot_precision(q.dtype), USE_WINDOW=window > 0, USE_SOFTCAP=softcap > 0, KV_QUANT=kv_quant,
        num_warps=4, num_stages=num_stages,
    )
    _decode_merge_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, out.stride(0), out.stride(1), num_heads,
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits, num_warps=4,
    )
    return out


def decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, req_to_token: Tensor, req_rows: Tensor, seq_lens: Tensor,
    max_seq_len: int, sm_scale: float, window: int = 0, softcap: float = 0.0, backend: KernelBackend | None = None,
    k_scale: KVScale = None, v_scale: KVScale = None,
) -> Tensor:
    """q [B, Hq, D] -> [B, Hq, D]; request b attends to its tokens 0 .. seq_lens[b] - 1 (seq_lens >= 1), with a
    window only to the last `window` of them. k_scale / v_scale: an 8-bit cache's scales (kernels/kv_store.py)."""
    if runs_triton(q, backend):
        return decode_attention_triton(q, k_cache, v_cache, req_to_token, req_rows, seq_lens, max_seq_len, sm_scale,
                                       window, softcap, k_scale=k_scale, v_scale=v_scale)
    out = decode_attention_cpu(q, k_cache, v_cache, req_to_token, req_rows, seq_lens, sm_scale, window=window,
                               softcap=softcap, k_scale=k_scale, v_scale=v_scale)
    if out is None:
        out = decode_attention_ref(q, k_cache, v_cache, req_to_token, req_rows, seq_lens, max_seq_len, sm_scale,
                                   window, softcap, k_scale, v_scale)
    return out


def decode_attention_cpu(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, req_to_token: Tensor, req_rows: Tensor, seq_lens: Tensor,
    sm_scale: float, lib=None, window: int = 0, softcap: float = 0.0, k_scale: KVScale = None,
    v_scale: KVScale = None,
) -> Tensor | None:
    """The C kernel (kernels/cpu/decode_attention.c): reads each request's K/V rows in place, no gather; an 8-bit
    cache is dequantized in registers (k_scale / v_scale as kernels/kv_store.py has them).
    None when it cannot run here (no compiler, an unsupported dtype, shape or scale layout): use the reference.
    `lib`: a loaded kernel library other than the default build (tests of the portable C path)."""
    from lightserve.kernels.cpu import C_DTYPES, library, profiled

    lib = lib or library()
    if lib is None or not c_kv_layout(k_cache, v_cache) or v_cache.dtype != k_cache.dtype \
            or not c_scales_fit(k_cache, k_scale, v_scale):
        return None
    batch, num_heads, head_dim = q.shape
    # float32 and bfloat16 q are read in place (a view of qkv); the output comes back in q's dtype.
    if q.dtype not in C_DTYPES or q.stride(-1) != 1:
        q = q.to(torch.float32).contiguous()
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype)              # [B, Hq, D]
    rows = req_rows.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    with profiled("decode_attention_cpu"):  # visible in scripts/profile_step.py
        rc = lib.decode_attention(*decode_attention_c_args(q, k_cache, v_cache, req_to_token, rows, lens, sm_scale,
                                                           out, window, softcap, k_scale, v_scale))
    if rc != 0:
        return None
    return out


def decode_attention_c_args(q: Tensor, k_cache: Tensor, v_cache: Tensor, req_to_token: Tensor, req_rows: Tensor,
                            seq_lens: Tensor, sm_scale: float, out: Tensor, window: int = 0,
                            softcap: float = 0.0, k_scale: KVScale = None, v_scale: KVScale = None) -> tuple:
    """decode_attention.c's arguments, in order, for tensors already in the layouts it reads: q [B, Hq, D] float32 or
    bf16 with unit last stride, out [B, Hq, D] contiguous in q's dtype, req_rows / seq_lens [B] int32 contiguous.
    scripts/bench_cpu_kernels.py calls the kernel with them directly, as the one-call driver calls it from C."""
    assert req_to_token.dtype == torch.int32 and req_to_token.stride(-1) == 1
    batch, num_heads, head_dim = q.shape
    return (q.data_ptr(), q.stride(0), q.stride(1), int(q.dtype == torch.bfloat16), k_cache.data_ptr(),
            v_cache.data_ptr(), KV_KIND[k_cache.dtype], *c_scale_args(k_scale, v_scale), req_to_token.data_ptr(),
            req_rows.data_ptr(),
            seq_lens.data_ptr(), out.data_ptr(), batch, num_heads, k_cache.shape[1], head_dim, k_cache.stride(0),
            v_cache.stride(0), k_cache.stride(1), v_cache.stride(1), req_to_token.stride(0), sm_scale, window, softcap,
            torch.get_num_threads())


def decode_blocks(head_dim: int, group: int, elem_size: int, kv_elem_size: int | None = None) -> tuple[int, int]:
    """(BLOCK_N, num_stages) of the split kernel: the longest key tile whose shared memory estimate fits next to
    the group's query tile (prefill_attention.fits_in_smem; kv_elem_size: the cache's, 1 for 8 bits, defaults to q's
    elem_size). float32 at head_dim 256 gets 32 (64 would need about 276 KB)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_g = max(16, triton.next_power_of_2(group))
    num_stages = 2
    block_n = next((n for n in (64, 32) if fits_in_smem(block_g, n, block_d, num_stages, elem_size,
                                                         kv_elem_size=kv_elem_size)), 16)
    return block_n, num_stages


def warm_up_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, req_to_token: Tensor, req_rows: Tensor,
                             seq_lens: Tensor, variants: set[tuple[int, float]] = frozenset({(0, 0.0)}),
                             k_scale: KVScale = None, v_scale: KVScale = None) -> None:
    """Compile both kernels for every split count an eager step can pick, with the model's q/K/V shapes
    and dtype (q [B, Hq, D]; the other arguments, an 8-bit cache's scales included, as decode_attention's), once per
    (window, softcap) the model's layers use (each on/off combination is its own compile). The outputs are
    discarded."""
    for window, softcap in variants:
        for num_splits in SPLIT_BUCKETS:
            decode_attention_triton(q, k_cache, v_cache, req_to_token, req_rows, seq_lens,
                                    int(req_to_token.shape[1]), 1.0, window, softcap, num_splits=num_splits,
                                    k_scale=k_scale, v_scale=v_scale)


def _default_num_splits(device: torch.device, num_programs: int, num_tiles: int) -> int:
    # Enough programs to cover every SM about twice, but never a split without a whole tile to read;
    # rounded down to a power of two (SPLIT_BUCKETS).
    wanted = max(1, min(triton.cdiv(2 * _num_sms(device), num_programs), num_tiles, _MAX_SPLITS))
    return 1 << (wanted.bit_length() - 1)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter in tests: any small number works
    return torch.cuda.get_device_properties(device).multi_processor_count
