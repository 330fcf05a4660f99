"""prefill_attention: the reference against naive attention and HF's sdpa path, the Triton and C kernels against
the reference, over ragged requests with cached prefixes and GQA."""

import pytest
import torch

from lightserve.kernels.cpu import library, variant_library
from lightserve.kernels.prefill_attention import (
    prefill_attention,
    prefill_attention_cpu,
    prefill_attention_ref,
    prefill_attention_triton,
)
from tests.kernels.kernel_cases import (
    DEVICE,
    HEAD_LAYOUTS,
    KERNEL_CASES,
    TOL,
    VARIANTS,
    c_library_variants,
    make_kv_batch,
    naive_attention,
    window_softcap_meta,
)

# (prefix_len, extend_len) per request: no prefix, long prefix, a 1-token extend, lengths off the 16-token tiles.
REQS = [(0, 21), (19, 6), (5, 1), (33, 17)]


def _prefill_case(reqs, num_heads, num_kv_heads, head_dim, dtype, seed=0, head_major=False):
    batch = make_kv_batch([p + e for p, e in reqs], num_kv_heads, head_dim, dtype, seed, head_major)
    extend_lens = [e for _, e in reqs]
    q = torch.randn(sum(extend_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    starts = torch.tensor([0] + extend_lens[:-1], device=DEVICE).cumsum(0)
    meta = {
        "req_to_token": batch.req_to_token, "req_rows": batch.req_rows, "q_start_locs": starts.to(torch.int32),
        "prefix_lens": torch.tensor([p for p, _ in reqs], dtype=torch.int32, device=DEVICE),
        "extend_lens": torch.tensor(extend_lens, dtype=torch.int32, device=DEVICE),
        "max_extend_len": max(extend_lens),
        "sm_scale": head_dim ** -0.5,
    }
    return batch, q.to(DEVICE, dtype), meta


@pytest.mark.parametrize("num_heads, num_kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_naive_attention(num_heads, num_kv_heads, dtype):
    batch, q, meta = _prefill_case(REQS, num_heads, num_kv_heads, 64, dtype)
    out = prefill_attention_ref(q, batch.k_cache, batch.v_cache, **meta)
    start = 0
    for req, (prefix_len, extend_len) in enumerate(REQS):
        positions = list(range(prefix_len, prefix_len + extend_len))
        expect = naive_attention(batch, req, q[start:start + extend_len], positions, meta["sm_scale"])
        torch.testing.assert_close(out[start:start + extend_len], expect.to(dtype), **TOL[dtype])
        start += extend_len


@pytest.mark.parametrize("prefix_len", [0, 9])
def test_reference_is_hf_sdpa_bit_for_bit_in_float32(prefix_len):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class _Module:  # what sdpa_attention_forward reads from LlamaAttention
        num_key_value_groups = 3
        is_causal = True

    extend_len, total = 12, prefix_len + 12
    batch, q, meta = _prefill_case([(prefix_len, extend_len)], 6, 2, 64, torch.float32)
    locs = batch.req_to_token[batch.req_rows[0], :total].long()
    k = batch.k_cache[locs].transpose(0, 1)[None]  # [1, Hk, total, D]
    v = batch.v_cache[locs].transpose(0, 1)[None]  # [1, Hk, total, D]
    # HF passes no mask for a fresh prompt and its bool causal mask (bottom-right) with a cache.
    mask = None
    if prefix_len > 0:
        mask = torch.ones(extend_len, total, dtype=torch.bool, device=DEVICE).tril(prefix_len)[None, None]
    expect, _ = sdpa_attention_forward(_Module(), q.transpose(0, 1)[None], k, v, mask, scaling=meta["sm_scale"])
    assert torch.equal(prefill_attention_ref(q, batch.k_cache, batch.v_cache, **meta), expect[0])


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, dtype", KERNEL_CASES)
def test_prefill_triton_matches_reference(num_heads, num_kv_heads, head_dim, dtype):
    batch, q, meta = _prefill_case(REQS, num_heads, num_kv_heads, head_dim, dtype)
    out = prefill_attention_triton(q, batch.k_cache, batch.v_cache, **meta, block_m=16, block_n=16)
    torch.testing.assert_close(out, prefill_attention_ref(q, batch.k_cache, batch.v_cache, **meta), **TOL[dtype])


def test_prefill_triton_strided_q_and_default_blocks():
    batch, q, meta = _prefill_case([(0, 40), (70, 3)], 4, 2, 64, torch.float16)
    kv = torch.zeros(q.shape[0], 2 * 2 * 64, dtype=q.dtype, device=DEVICE)
    qkv = torch.cat([q.flatten(1), kv], dim=1)  # [Tq, (Hq + 2 Hk) * D], like the fused projection
    q_view = qkv[:, :4 * 64].view(q.shape)  # [Tq, Hq, D] with row stride (Hq + 2 Hk) * D
    out = prefill_attention_triton(q_view, batch.k_cache, batch.v_cache, **meta)
    torch.testing.assert_close(out, prefill_attention_ref(q, batch.k_cache, batch.v_cache, **meta),
                               **TOL[torch.float16])


def test_prefill_triton_head_dim_256_in_float32():
    # The tiles prefill_blocks picks to fit shared memory (32 x 32 here); the second request's keys span two tiles.
    batch, q, meta = _prefill_case([(0, 5), (37, 3)], 2, 1, 256, torch.float32)
    out = prefill_attention_triton(q, batch.k_cache, batch.v_cache, **meta)
    torch.testing.assert_close(out, prefill_attention_ref(q, batch.k_cache, batch.v_cache, **meta),
                               **TOL[torch.float32])


# The C kernel's cases: every query-block and key-block edge (16-token query blocks at G=3, 96-key blocks),
# a 1-token extend after a long prefix, and a prefix ending inside a key block.
C_REQS = [(0, 130), (100, 40), (64, 1), (0, 1), (5, 17), (63, 66), (95, 98)]


@pytest.mark.skipif(DEVICE.type != "cpu" or library() is None, reason="the C kernel is the CPU path")
@pytest.mark.parametrize("variant", c_library_variants())
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, dtype", [
    (9, 3, 64, torch.float32), (2, 2, 64, torch.float32), (8, 1, 128, torch.float32), (64, 1, 16, torch.float32),
    (4, 2, 80, torch.float32), (9, 3, 64, torch.bfloat16), (4, 1, 128, torch.bfloat16), (6, 2, 48, torch.bfloat16),
])
@pytest.mark.parametrize("head_major", [False, True])
def test_cpu_kernel_matches_reference(num_heads, num_kv_heads, head_dim, dtype, variant, head_major):
    """Every build this CPU runs (its wide and 16-wide tiles, plain C); bf16 q read in place and bf16 output.
    Head dims 80 and 48 end with a 16-wide tile after the 32-wide ones of AVX-512 builds. K/V token-major, and as
    views of [Hk, rows, D] storage."""
    lib = variant_library(variant)
    batch, q, meta = _prefill_case(C_REQS, num_heads, num_kv_heads, head_dim, dtype, head_major=head_major)
    # q as the model passes it: a strided view into the fused qkv projection
    qkv = torch.cat([q.flatten(1), torch.zeros(q.shape[0], 2 * num_kv_heads * head_dim, dtype=dtype)], dim=1)
    q_view = qkv[:, :num_heads * head_dim].view(q.shape)
    meta_cpu = {k: v for k, v in meta.items() if k != "max_extend_len"}
    out = prefill_attention_cpu(q_view, batch.k_cache, batch.v_cache, **meta_cpu, lib=lib)
    assert out is not None and out.dtype == dtype
    torch.testing.assert_close(out, prefill_attention_ref(q, batch.k_cache, batch.v_cache, **meta), **TOL[dtype])


@pytest.mark.skipif(DEVICE.type != "cpu" or library() is None, reason="the C kernel is the CPU path")
@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("c_tiles", [False, True])
def test_dispatch_takes_sdpa_for_fresh_bf16_prompts_on_amx_cpus(monkeypatch, amx, c_tiles):
    """On a CPU whose flags name amx_bf16 (patched here either way) and whose C kernel has no AMX tiles (patched
    either way), a bf16 step with no cached prefix runs the SDPA reference, bit for bit; a step where a request has a
    prefix, a float32 step, a C kernel on the tiles, and every step elsewhere run the C kernel, bit for bit."""
    import lightserve.kernels.cpu as cpu

    monkeypatch.setattr(cpu, "cpu_flags", lambda: "fpu avx512f avx512_bf16" + (" amx_bf16 amx_tile" if amx else ""))
    lib = library()
    monkeypatch.setattr(lib, "prefill_attention_amx", lambda dim: int(c_tiles))
    fresh = [(0, 21), (0, 6)]
    for reqs, dtype in ((fresh, torch.bfloat16), (REQS, torch.bfloat16), (fresh, torch.float32)):
        batch, q, meta = _prefill_case(reqs, 9, 3, 64, dtype, head_major=True)
        out = prefill_attention(q, batch.k_cache, batch.v_cache, **meta)
        meta_cpu = {k: v for k, v in meta.items() if k != "max_extend_len"}
        sdpa = amx and not c_tiles and dtype == torch.bfloat16 and not any(p for p, _ in reqs)
        expect = prefill_attention_ref(q, batch.k_cache, batch.v_cache, **meta) if sdpa \
            else prefill_attention_cpu(q, batch.k_cache, batch.v_cache, **meta_cpu)
        assert torch.equal(out, expect), (reqs, dtype)


@pytest.mark.skipif(DEVICE.type != "cpu" or library() is None, reason="the C kernel is the CPU path")
def test_cpu_kernel_declines_what_it_does_not_support():
    batch, q, meta = _prefill_case([(3, 5)], 4, 1, 24, torch.float32)  # head_dim 24: not a multiple of 16
    meta_cpu = {k: v for k, v in meta.items() if k != "max_extend_len"}
    assert prefill_attention_cpu(q, batch.k_cache, batch.v_cache, **meta_cpu) is None
    # and the dispatch falls back to the reference
    torch.testing.assert_close(prefill_attention(q, batch.k_cache, batch.v_cache, **meta),
                               prefill_attention_ref(q, batch.k_cache, batch.v_cache, **meta))


# Window and softcap: a fresh prompt longer than the window, a prefix longer than the window, a window that
# starts inside a cached prefix, a 1-token extend; the query blocks of 16 and 48 rows cross window edges.
W_REQS = [(0, 70), (50, 20), (3, 9), (33, 1)]


@pytest.mark.parametrize("window, softcap", VARIANTS)
def test_reference_window_and_softcap_match_naive_attention(window, softcap):
    batch, q, meta = _prefill_case(W_REQS, 4, 2, 64, torch.float32)
    meta = window_softcap_meta(meta, window, softcap)
    out = prefill_attention_ref(q, batch.k_cache, batch.v_cache, **meta)
    start = 0
    for req, (prefix_len, extend_len) in enumerate(W_REQS):
        positions = list(range(prefix_len, prefix_len + extend_len))
        expect = naive_attention(batch, req, q[start:start + extend_len], positions, meta["sm_scale"], window, softcap)
        torch.testing.assert_close(out[start:start + extend_len], expect.float(), **TOL[torch.float32])
        start += extend_len


@pytest.mark.parametrize("window, softcap", VARIANTS)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, dtype", [(4, 1, 64, torch.float32),
                                                                      (2, 2, 80, torch.float16)])
def test_prefill_triton_window_and_softcap_match_reference(window, softcap, num_heads, num_kv_heads, head_dim, dtype):
    batch, q, meta = _prefill_case(W_REQS, num_heads, num_kv_heads, head_dim, dtype)
    meta = window_softcap_meta(meta, window, softcap)
    out = prefill_attention_triton(q, batch.k_cache, batch.v_cache, **meta, block_m=32, block_n=16)
    torch.testing.assert_close(out, prefill_attention_ref(q, batch.k_cache, batch.v_cache, **meta), **TOL[dtype])


@pytest.mark.skipif(DEVICE.type != "cpu" or library() is None, reason="the C kernel is the CPU path")
@pytest.mark.parametrize("variant", c_library_variants())
@pytest.mark.parametrize("window, softcap", VARIANTS)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, dtype", [
    (9, 3, 64, torch.float32), (2, 2, 64, torch.float32), (4, 1, 128, torch.bfloat16),
])
def test_cpu_kernel_window_and_softcap_match_reference(window, softcap, num_heads, num_kv_heads, head_dim, dtype,
                                                       variant):
    lib = variant_library(variant)
    batch, q, meta = _prefill_case(C_REQS, num_heads, num_kv_heads, head_dim, dtype)
    meta = window_softcap_meta(meta, window, softcap)
    meta_cpu = {k: v for k, v in meta.items() if k != "max_extend_len"}
    out = prefill_attention_cpu(q, batch.k_cache, batch.v_cache, **meta_cpu, lib=lib)
    assert out is not None
    torch.testing.assert_close(out, prefill_attention_ref(q, batch.k_cache, batch.v_cache, **meta), **TOL[dtype])
