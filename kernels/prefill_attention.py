"""Causal attention for a ragged batch of new tokens over the token-level KV cache (prefill and extend).

Called by the model's attention in a prefill step, after store_kv has written the new tokens' K/V. Each request
b has prefix_lens[b] cached tokens and extend_lens[b] new ones; its KV rows are req_to_token[req_rows[b], :].
Two variants are arguments of every version: `window` > 0 (sliding-window layers: the token at position p sees
keys p - window + 1 .. p, as HF's `sliding_window_overlay`) and `softcap` > 0 (Gemma 2: scores become
softcap * tanh(scores / softcap) before the mask). 0 turns either off, and the fast paths then run unchanged.
"""
from __future__ import annotations

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
    dequantize_tile,
    gather_kv,
    triton_kv_args,
)

_LOG2E = 1.4426950408889634


def prefill_attention_ref(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, req_to_token: Tensor, req_rows: Tensor, q_start_locs: Tensor,
    prefix_lens: Tensor, extend_lens: Tensor, max_extend_len: int, sm_scale: float, window: int = 0,
    softcap: float = 0.0, k_scale: KVScale = None, v_scale: KVScale = None,
) -> Tensor:
    """One SDPA call per request, the same call HF's sdpa attention makes (bit-identical in float32 on CPU; K/V
    dequantized to q's dtype from an 8-bit cache);
    with a softcap, HF's eager attention (SDPA has no softcap).

    A per-request loop is fine here: prefill is compute-bound, so the Python overhead per request is small.
    """
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    metadata = zip(req_rows.tolist(), q_start_locs.tolist(), prefix_lens.tolist(), extend_lens.tolist())
    for row, start, prefix_len, extend_len in metadata:
        if extend_len == 0:
            continue
        total = prefix_len + extend_len
        locs = req_to_token[row, :total].long()
        k = gather_kv(k_cache, k_scale, locs, q.dtype).transpose(0, 1)[None]  # [1, Hk, total, D]
        v = gather_kv(v_cache, v_scale, locs, q.dtype).transpose(0, 1)[None]  # [1, Hk, total, D]
        qb = q[start:start + extend_len].transpose(0, 1)[None]  # [1, Hq, extend, D]
        if prefix_len == 0 and window == 0 and softcap == 0:
            o = F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=sm_scale, enable_gqa=True)
        else:
            # SDPA's is_causal aligns top-left; with a cached prefix, new token i sees keys 0 .. prefix_len + i.
            query_pos = torch.arange(prefix_len, total, device=q.device)[:, None]  # [extend, 1]
            key_pos = torch.arange(total, device=q.device)[None, :]  # [1, total]
            mask = key_pos <= query_pos  # [extend, total]
            if window > 0:
                mask &= key_pos > query_pos - window
            if softcap > 0:
                o = softcap_attention_ref(qb, k, v, mask, sm_scale, softcap)
            else:
                o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=sm_scale, enable_gqa=True)
        out[start:start + extend_len] = o[0].transpose(0, 1)  # [extend, Hq, D]
    return out


def softcap_attention_ref(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, sm_scale: float, softcap: float) -> Tensor:
    """q [N, Hq, M, D], k/v [N, Hk, L, D], mask [.., M, L] bool (True = visible) -> [N, Hq, M, D]: HF's
    eager_attention_forward with a softcap, op for op. Shared with decode_attention_ref."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [N, Hq, L, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * sm_scale  # [N, Hq, M, L]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


@triton.jit
def _softcap_log2(qk, softcap_scale, softcap_out):
    # softcap * tanh(s * sm_scale / softcap), in log2 units; tanh from exp (no libdevice in the interpreter),
    # 1 - 2 / (e^2x + 1), with 2x clamped at 60 (tanh(30) is 1 in float32) so that exp stays finite.
    x = qk * softcap_scale
    return (1.0 - 2.0 / (tl.exp(tl.minimum(2.0 * x, 60.0)) + 1.0)) * softcap_out


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, req_to_token_ptr, row, r2t_stride, offs_n, n_mask, kv_head, kc_stride_row,
                 kc_stride_h, vc_stride_row, vc_stride_h, offs_d, d_mask, k_scales_ptr, v_scales_ptr, scale_stride,
                 k_scale, v_scale, KV_QUANT: tl.constexpr, DTYPE: tl.constexpr):
    # One KV head's K (transposed, [BLOCK_D, BLOCK_N]) and V ([BLOCK_N, BLOCK_D]) at a request's positions offs_n, read
    # through its req_to_token row; masked positions and padding lanes load 0. Called by score_kv_tile.
    # An 8-bit cache (KV_QUANT, kernels/kv_store.py's triton_kv_args) is dequantized here, in registers, to DTYPE (q's):
    # int8 with the [BLOCK_N] scales of the tile's rows for this head, fp8 with the per-tensor k_scale / v_scale; a
    # float cache is converted to DTYPE.
    locs = tl.load(req_to_token_ptr + row * r2t_stride + offs_n, mask=n_mask, other=0).to(tl.int64)
    k_ptrs = k_cache_ptr + locs[None, :] * kc_stride_row + kv_head * kc_stride_h + offs_d[:, None]
    v_ptrs = v_cache_ptr + locs[:, None] * vc_stride_row + kv_head * vc_stride_h + offs_d[None, :]
    k = tl.load(k_ptrs, mask=d_mask[:, None] & n_mask[None, :], other=0)
    v = tl.load(v_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0)
    if KV_QUANT == 1:
        scale_offs = locs * scale_stride + kv_head  # [BLOCK_N] rows of the [rows, Hk] scales
        k_row_scales = tl.load(k_scales_ptr + scale_offs, mask=n_mask, other=0.0)
        v_row_scales = tl.load(v_scales_ptr + scale_offs, mask=n_mask, other=0.0)
        k = dequantize_tile(k, k_row_scales[None, :], KV_QUANT).to(DTYPE)
        v = dequantize_tile(v, v_row_scales[:, None], KV_QUANT).to(DTYPE)
    elif KV_QUANT != 0:
        k = dequantize_tile(k, k_scale, KV_QUANT).to(DTYPE)
        v = dequantize_tile(v, v_scale, KV_QUANT).to(DTYPE)
    else:  # a float cache in its own dtype (--kv_cache_dtype bfloat16 under float32 activations); else a no-op
        k = k.to(DTYPE)
        v = v.to(DTYPE)
    return k, v


@triton.jit
def attention_scores(q, k, qk_scale, softcap_scale, softcap_out, PRECISION: tl.constexpr, USE_SOFTCAP: tl.constexpr):
    # q [M, D] . k [D, N] in log2 units (qk_scale is sm_scale * log2(e)), softcapped where USE_SOFTCAP (_softcap_log2).
    qk = tl.dot(q, k, input_precision=PRECISION)
    if USE_SOFTCAP:
        qk = _softcap_log2(qk, softcap_scale, softcap_out)
    else:
        qk = qk * qk_scale
    return qk


@triton.jit
def score_kv_tile(q, start_n, end, k_cache_ptr, v_cache_ptr, req_to_token_ptr, row, r2t_stride, kv_head, kc_stride_row,
                  kc_stride_h, vc_stride_row, vc_stride_h, offs_d, d_mask, k_scales_ptr, v_scales_ptr, scale_stride,
                  k_scale, v_scale, qk_scale, softcap_scale, softcap_out, BLOCK_N: tl.constexpr,
                  KV_QUANT: tl.constexpr, PRECISION: tl.constexpr, USE_SOFTCAP: tl.constexpr):
    # One step of the prefill and decode kernels' key loop: the key tile [start_n, start_n + BLOCK_N) of a request's
    # KV head, cut at `end`, loaded (load_kv_tile, an 8-bit cache dequantized to q's dtype) and scored against
    # q [M, BLOCK_D] (attention_scores). Returns offs_n, n_mask [BLOCK_N], qk [M, BLOCK_N] (masked keys not yet
    # -inf: each kernel has its own visibility rule) and v [BLOCK_N, BLOCK_D].
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_mask = offs_n < end
    k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, req_to_token_ptr, row, r2t_stride, offs_n, n_mask, kv_head,
                        kc_stride_row, kc_stride_h, vc_stride_row, vc_stride_h, offs_d, d_mask, k_scales_ptr,
                        v_scales_ptr, scale_stride, k_scale, v_scale, KV_QUANT, q.dtype)
    qk = attention_scores(q, k, qk_scale, softcap_scale, softcap_out, PRECISION, USE_SOFTCAP)
    return offs_n, n_mask, qk, v


@triton.jit
def online_softmax_start(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    # The online softmax's state before the first key tile (online_softmax_step): max, sum, accumulator.
    return (tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32),
            tl.zeros([BLOCK_M, BLOCK_D], tl.float32))


@triton.jit
def online_softmax_step(qk, v, m_i, l_i, acc, PRECISION: tl.constexpr, EMPTY_ROWS: tl.constexpr):
    # One key tile of flash attention's online softmax, the one copy the prefill, decode and MLA decode kernels call
    # (Triton inlines it). qk [M, N]: the tile's scores in log2 units, -inf where a key is not visible; v [N, D]:
    # its values; m_i, l_i [M]: the running max and sum of exp2; acc [M, D]: the running weighted sum of values.
    # Returns (m_i, l_i, acc) after the tile. EMPTY_ROWS: a row may have seen no visible key yet (a sliding window
    # that starts in a later tile); its max is kept finite so that alpha and p are exp2(-inf) = 0, not NaN.
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if EMPTY_ROWS:
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, scale_stride, k_scale, v_scale, out_ptr,
    req_to_token_ptr, req_rows_ptr, q_start_ptr, prefix_lens_ptr, extend_lens_ptr,
    qk_scale, window, softcap_scale, softcap_out,
    q_stride_t, q_stride_h, kc_stride_row, kc_stride_h, vc_stride_row, vc_stride_h, o_stride_t, o_stride_h,
    r2t_stride,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    start_m = tl.program_id(2) * BLOCK_M
    extend_len = tl.load(extend_lens_ptr + req)
    if start_m >= extend_len:
        return
    prefix_len = tl.load(prefix_lens_ptr + req)
    q_start = tl.load(q_start_ptr + req).to(tl.int64)  # int64: token * q_stride_t may pass 2**31
    row = tl.load(req_rows_ptr + req).to(tl.int64)
    kv_head = head // GROUP

    offs_m = start_m + tl.arange(0, BLOCK_M)
    # BLOCK_D is head_dim rounded up to a power of two (tl.arange needs one); the padding lanes load 0.
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_mask = offs_m < extend_len
    q_ptrs = q_ptr + (q_start + offs_m)[:, None] * q_stride_t + head * q_stride_h + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    m_i, l_i, acc = online_softmax_start(BLOCK_M, BLOCK_D)
    # The last query row of this block sees keys up to prefix_len + its index; nothing past that is loaded.
    kv_end = prefix_len + tl.minimum(extend_len, start_m + BLOCK_M)
    kv_start = 0
    if USE_WINDOW:  # the block's first row sees nothing before prefix_len + start_m - window + 1
        kv_start = tl.maximum(prefix_len + start_m - window + 1, 0)
    for start_n in range(kv_start, kv_end, BLOCK_N):
        offs_n, n_mask, qk, v = score_kv_tile(  # qk [BLOCK_M, BLOCK_N]
            q, start_n, kv_end, k_cache_ptr, v_cache_ptr, req_to_token_ptr, row, r2t_stride, kv_head, kc_stride_row,
            kc_stride_h, vc_stride_row, vc_stride_h, offs_d, d_mask, k_scales_ptr, v_scales_ptr, scale_stride, k_scale,
            v_scale, qk_scale, softcap_scale, softcap_out, BLOCK_N, KV_QUANT, PRECISION, USE_SOFTCAP)
        visible = (offs_n[None, :] <= prefix_len + offs_m[:, None]) & n_mask[None, :]
        if USE_WINDOW:
            visible = visible & (offs_n[None, :] > prefix_len + offs_m[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
        # A windowed row may see no key of this tile yet (its window starts in a later one). Without a window
        # key 0 is visible to every row, so its max is finite from the first tile on.
        m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, PRECISION, USE_WINDOW)

    if USE_WINDOW:  # rows past extend_len may have seen no key at all; they are never stored
        l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + (q_start + offs_m)[:, None] * o_stride_t + head * o_stride_h + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill_attention_triton(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, req_to_token: Tensor, req_rows: Tensor, q_start_locs: Tensor,
    prefix_lens: Tensor, extend_lens: Tensor, max_extend_len: int, sm_scale: float, window: int = 0,
    softcap: float = 0.0, block_m: int | None = None, block_n: int | None = None, k_scale: KVScale = None,
    v_scale: KVScale = None,
) -> Tensor:
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == head_dim, (q.shape, k_cache.shape, v_cache.shape)
    assert q.dtype in _DTYPES and (k_cache.dtype.is_floating_point or k_cache.dtype in QUANT_KV_DTYPES), \
        (q.dtype, k_cache.dtype)
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1, "head dim must be contiguous"
    assert head_dim % 8 == 0, head_dim  # 16-byte rows; any such head_dim is padded to BLOCK_D below
    assert req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1, req_to_token.dtype
    cache_args, kv_quant = triton_kv_args(k_cache, v_cache, k_scale, v_scale)  # fp8 as uint8 views
    batch = req_rows.shape[0]
    for meta in (req_rows, q_start_locs, prefix_lens, extend_lens):
        assert meta.shape == (batch,) and meta.dtype == torch.int32 and meta.is_contiguous(), (meta.shape, meta.dtype)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0 or max_extend_len == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    default_m, default_n, num_warps, num_stages = prefill_blocks(head_dim, q.element_size(), k_cache.element_size())
    block_m, block_n = block_m or default_m, block_n or default_n
    grid = (batch, num_heads, triton.cdiv(max_extend_len, block_m))
    _prefill_attention_kernel[grid](
        q, *cache_args, out, req_to_token, req_rows, q_start_locs, prefix_lens, extend_lens,
        sm_scale * _LOG2E, window, *softcap_args(sm_scale, softcap),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION=dot_precision(q.dtype), USE_WINDOW=window > 0, USE_SOFTCAP=softcap > 0, KV_QUANT=kv_quant,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def prefill_blocks(head_dim: int, elem_size: int, kv_elem_size: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefill kernel for a head_dim and element size (q's; the
    cache's kv_elem_size, 1 for an 8-bit cache, defaults to it): the largest tiles whose shared memory estimate fits
    (fits_in_smem). float32 at head_dim 192 or 256 (BLOCK_D 256) gets 32 x 32 tiles; 64 x 64 would need about
    336 KB."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    num_warps, num_stages = (4 if block_d <= 64 else 8), 2
    tiles = ((128 if block_d <= 64 else 64, 64), (64, 32), (32, 32), (16, 16))
    block_m, block_n = next((t for t in tiles if fits_in_smem(*t, block_d, num_stages, elem_size,
                                                              kv_elem_size=kv_elem_size)), tiles[-1])
    return block_m, block_n, num_warps, num_stages


def attention_smem_bytes(block_m: int, block_n: int, block_d: int, num_stages: int, elem_size: int,
                         block_dv: int | None = None, kv_elem_size: int | None = None) -> int:
    """Estimated shared memory of one program of a flash-attention kernel (prefill, decode, MLA decode): the query
    tile (block_m x block_d, loaded once), num_stages buffers of the key and value tiles the software pipeline keeps
    in flight (block_n x (block_d + block_dv); block_dv defaults to block_d, 0 where V is the key's own tile, as in
    MLA) and P (block_m x block_n) staged for the second dot, all of elem_size bytes. An 8-bit cache
    (kv_elem_size 1; it defaults to elem_size) keeps its in-flight tiles at that size, plus one copy of the
    dequantized tiles in elem_size, the dots' operands."""
    block_dv = block_d if block_dv is None else block_dv
    kv_elem_size = elem_size if kv_elem_size is None else kv_elem_size
    kv_tiles = block_n * (block_d + block_dv)
    used = elem_size * (block_m * block_d + block_m * block_n) + num_stages * kv_tiles * kv_elem_size
    return used + (kv_tiles * elem_size if kv_elem_size != elem_size else 0)


def fits_in_smem(block_m: int, block_n: int, block_d: int, num_stages: int, elem_size: int,
                 block_dv: int | None = None, kv_elem_size: int | None = None) -> bool:
    """Whether attention_smem_bytes leaves SMEM_SLACK_BYTES of SMEM_LIMIT_BYTES free (Triton's own scratch: layout
    conversions, reductions). A kernel past the limit fails to launch ("out of resource: shared memory")."""
    used = attention_smem_bytes(block_m, block_n, block_d, num_stages, elem_size, block_dv, kv_elem_size)
    return used + SMEM_SLACK_BYTES <= SMEM_LIMIT_BYTES


def prefill_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, req_to_token: Tensor, req_rows: Tensor, q_start_locs: Tensor,
    prefix_lens: Tensor, extend_lens: Tensor, max_extend_len: int, sm_scale: float, window: int = 0,
    softcap: float = 0.0, backend: KernelBackend | None = None, k_scale: KVScale = None, v_scale: KVScale = None,
) -> Tensor:
    """q [Tq, Hq, D] -> out [Tq, Hq, D]: new token i of request b attends to its tokens 0 .. prefix_lens[b] + i
    (with a window, only the last `window` of them). k_scale / v_scale: an 8-bit cache's scales
    (kernels/kv_store.py)."""
    if runs_triton(q, backend):
        return prefill_attention_triton(q, k_cache, v_cache, req_to_token, req_rows, q_start_locs, prefix_lens,
                                        extend_lens, max_extend_len, sm_scale, window, softcap, k_scale=k_scale,
                                        v_scale=v_scale)
    if sdpa_is_faster(q, k_cache, prefix_lens, window, softcap):
        return prefill_attention_ref(q, k_cache, v_cache, req_to_token, req_rows, q_start_locs, prefix_lens,
                                     extend_lens, max_extend_len, sm_scale)
    out = prefill_attention_cpu(q, k_cache, v_cache, req_to_token, req_rows, q_start_locs, prefix_lens, extend_lens,
                                sm_scale, window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale)
    if out is None:
        out = prefill_attention_ref(q, k_cache, v_cache, req_to_token, req_rows, q_start_locs, prefix_lens,
                                    extend_lens, max_extend_len, sm_scale, window, softcap, k_scale, v_scale)
    return out


def sdpa_takes_fresh_prefills(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a CPU step's prefills with nothing cached before their new tokens run torch's SDPA (sdpa_is_faster)
    in the layers without a window or softcap: on CPUs with AMX-BF16, for bf16 queries over a bf16 cache, where
    the C kernel does not run them on AMX tiles itself (a build or process without the tiles, a head_dim off their
    32-wide step). Such steps run the per-kernel loop (models/llama.py), whose attention is then the faster one, not
    the one-call driver."""
    from lightserve.kernels.cpu import cpu_flags, library

    lib = library()
    return q_dtype == kv_dtype == torch.bfloat16 and "amx_bf16" in cpu_flags().split() \
        and not (lib is not None and lib.prefill_attention_amx(head_dim))


def sdpa_is_faster(q: Tensor, k_cache: Tensor, prefix_lens: Tensor, window: int, softcap: float) -> bool:
    """Whether torch's SDPA (prefill_attention_ref, a call per request) beats the C kernel on this step: on CPUs with
    AMX-BF16 whose C kernel multiplies with vdpbf16ps (sdpa_takes_fresh_prefills), for bf16 queries over a bf16
    cache with nothing cached before the new tokens, no window and no softcap, where torch's flash kernel multiplies
    on AMX tiles. Measured on an AMX Xeon (docs/benchmarks.md, "An AMX Xeon"; SmolLM2's heads, per layer): 0.40-0.66x
    the vdpbf16ps kernel's time for fresh prompts of 256 to 1,024 tokens; 16 prompts of 48 tokens over a cached
    1,024-token prefix (a masked call) took 1.05x, so extends stay in C. The C kernel on AMX tiles takes 0.79-0.98x
    SDPA's time on the fresh prompts. The C decoder-layer driver leaves the steps SDPA takes to the per-kernel loop,
    which it otherwise matches bit for bit."""
    return q.device.type == "cpu" and window == 0 and softcap == 0 \
        and sdpa_takes_fresh_prefills(q.dtype, k_cache.dtype, q.shape[-1]) and not bool(prefix_lens.any())


def prefill_attention_cpu(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, req_to_token: Tensor, req_rows: Tensor, q_start_locs: Tensor,
    prefix_lens: Tensor, extend_lens: Tensor, sm_scale: float, lib=None, window: int = 0, softcap: float = 0.0,
    k_scale: KVScale = None, v_scale: KVScale = None,
) -> Tensor | None:
    """The C kernel (kernels/cpu/prefill_attention.c): every request of the step in one parallel loop,
    K/V read in place (an 8-bit cache dequantized a block of rows at a time). None when it cannot run here (no
    compiler, an unsupported dtype or shape): use the reference. `lib`: a loaded kernel library other than the
    default build (tests of the portable path)."""
    from lightserve.kernels.cpu import C_DTYPES, library, profiled

    lib = lib or library()
    if lib is None or not c_kv_layout(k_cache, v_cache) or v_cache.dtype != k_cache.dtype \
            or not c_scales_fit(k_cache, k_scale, v_scale):
        return None
    num_tokens, num_heads, head_dim = q.shape
    # float32 and bfloat16 q are read in place (a view of qkv); the output comes back in q's dtype.
    qf = q if q.dtype in C_DTYPES and q.stride(-1) == 1 else q.to(torch.float32).contiguous()
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=qf.dtype)  # [Tq, Hq, D]
    meta = [t.to(torch.int32).contiguous() for t in (req_rows, q_start_locs, prefix_lens, extend_lens)]
    assert req_to_token.dtype == torch.int32 and req_to_token.stride(-1) == 1
    with profiled("prefill_attention_cpu"):  # visible in scripts/profile_step.py
        rc = lib.prefill_attention(
            qf.data_ptr(), qf.stride(0), qf.stride(1), int(qf.dtype == torch.bfloat16), k_cache.data_ptr(),
            v_cache.data_ptr(), KV_KIND[k_cache.dtype], *c_scale_args(k_scale, v_scale), req_to_token.data_ptr(),
            req_to_token.stride(0),
            *(t.data_ptr() for t in meta), out.data_ptr(), meta[0].shape[0], num_heads, k_cache.shape[1], head_dim,
            k_cache.stride(0), v_cache.stride(0), k_cache.stride(1), v_cache.stride(1), sm_scale, window, softcap,
            torch.get_num_threads())
    if rc != 0:
        return None
    return out.to(q.dtype)


def softcap_args(sm_scale: float, softcap: float) -> tuple[float, float]:
    """(softcap_scale, softcap_out) for _softcap_log2: the kernels' scores are raw q.k dots. Shared with
    decode_attention."""
    if softcap <= 0:
        return 1.0, 1.0
    return sm_scale / softcap, softcap * _LOG2E


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input_precision for an attention dtype; shared with decode_attention."""
    # fp32 must stay exact (it is the accuracy reference); tf32 would round the operands to 10 mantissa bits.
    return "ieee" if dtype == torch.float32 else "tf32"


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# H100 and H200: 228 KB of shared memory per SM, of which one block may use 227 KB.
SMEM_LIMIT_BYTES = 227 * 1024
SMEM_SLACK_BYTES = 32 * 1024  # kept free of the tiles (fits_in_smem)
