"""decode_attention: the reference against naive attention, the flash-decoding Triton kernel against the reference,
over ragged sequence lengths, GQA and split counts that leave some splits empty."""
import pytest
import torch

from lightserve.kernels.cpu import library, tuning_flags, variant_library
from lightserve.kernels.decode_attention import (
    SPLIT_BUCKETS,
    _default_num_splits,
    decode_attention_cpu,
    decode_attention_ref,
    decode_attention_triton,
)
from tests.kernels.kernel_cases import (
    DECODE_TUNINGS,
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

SEQ_LENS = [1, 23, 70, 16]  # a single token, lengths off the 16-token tiles, one exactly on a tile


def _decode_case(seq_lens, num_heads, num_kv_heads, head_dim, dtype, seed=0, head_major=False):
    batch = make_kv_batch(seq_lens, num_kv_heads, head_dim, dtype, seed, head_major)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    meta = {
        "req_to_token": batch.req_to_token, "req_rows": batch.req_rows,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), "max_seq_len": max(seq_lens),
        "sm_scale": head_dim ** -0.5,
    }
    return batch, q.to(DEVICE, dtype), meta


@pytest.mark.parametrize("num_heads, num_kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_matches_naive_attention(num_heads, num_kv_heads, dtype):
    batch, q, meta = _decode_case(SEQ_LENS, num_heads, num_kv_heads, 64, dtype)
    out = decode_attention_ref(q, batch.k_cache, batch.v_cache, **meta)
    assert not out.isnan().any()  # padded slots point at NaN rows in the test cache: they must never leak in
    for req, seq_len in enumerate(SEQ_LENS):
        expect = naive_attention(batch, req, q[req:req + 1], [seq_len - 1], meta["sm_scale"])
        torch.testing.assert_close(out[req:req + 1], expect.to(dtype), **TOL[dtype])


def test_reference_ignores_max_seq_len_padding():
    batch, q, meta = _decode_case([5, 9], 4, 1, 64, torch.float32)
    wider = decode_attention_ref(q, batch.k_cache, batch.v_cache, **{**meta, "max_seq_len": 12})
    torch.testing.assert_close(wider, decode_attention_ref(q, batch.k_cache, batch.v_cache, **meta),
                               **TOL[torch.float32])


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, dtype", KERNEL_CASES)
@pytest.mark.parametrize("num_splits", [1, 4])  # 4 splits of a 1- or 16-token sequence: empty splits
def test_decode_triton_matches_reference(num_heads, num_kv_heads, head_dim, dtype, num_splits):
    batch, q, meta = _decode_case(SEQ_LENS, num_heads, num_kv_heads, head_dim, dtype)
    out = decode_attention_triton(q, batch.k_cache, batch.v_cache, **meta, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(out, decode_attention_ref(q, batch.k_cache, batch.v_cache, **meta), **TOL[dtype])


def test_split_counts_stay_in_the_compiled_buckets():
    # Every batch x length an eager step can meet maps to one of the 7 warmed-up split counts, and no split
    # is left without a whole tile to read.
    device = torch.device("cpu")
    seen = set()
    for num_programs in (1, 2, 3, 8, 24, 31, 64, 100, 256, 800, 2048):
        for num_tiles in (1, 2, 3, 5, 7, 16, 33, 100, 129, 2048):
            splits = _default_num_splits(device, num_programs, num_tiles)
            assert splits in SPLIT_BUCKETS and splits <= num_tiles, (num_programs, num_tiles, splits)
            seen.add(splits)
    assert seen <= set(SPLIT_BUCKETS) and len(seen) >= 3
    assert SPLIT_BUCKETS == (1, 2, 4, 8, 16, 32, 64)


def test_decode_triton_refuses_an_unwarmed_split_count():
    batch, q, meta = _decode_case([5], 4, 1, 64, torch.float32)
    with pytest.raises(AssertionError):
        decode_attention_triton(q, batch.k_cache, batch.v_cache, **meta, num_splits=3)


def test_decode_triton_strided_q_and_default_splits():
    batch, q, meta = _decode_case([40, 130], 9, 3, 64, torch.float16)
    kv = torch.zeros(2, 2 * 3 * 64, dtype=q.dtype, device=DEVICE)
    qkv = torch.cat([q.flatten(1), kv], dim=1)  # [B, (Hq + 2 Hk) * D], like the fused projection
    q_view = qkv[:, :9 * 64].view(q.shape)  # [B, Hq, D] with row stride (Hq + 2 Hk) * D
    out = decode_attention_triton(q_view, batch.k_cache, batch.v_cache, **meta)
    torch.testing.assert_close(out, decode_attention_ref(q, batch.k_cache, batch.v_cache, **meta),
                               **TOL[torch.float16])


def test_decode_triton_head_dim_256_in_float32():
    # The key tile decode_blocks picks to fit shared memory (32 here), default split counts.
    batch, q, meta = _decode_case([1, 45], 2, 1, 256, torch.float32)
    out = decode_attention_triton(q, batch.k_cache, batch.v_cache, **meta)
    torch.testing.assert_close(out, decode_attention_ref(q, batch.k_cache, batch.v_cache, **meta),
                               **TOL[torch.float32])


@pytest.mark.skipif(DEVICE.type != "cpu" or library() is None, reason="the C kernel is the CPU path")
@pytest.mark.parametrize("variant", c_library_variants())
@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (9, 3), (32, 8), (5, 1), (7, 1), (8, 1), (12, 1)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])  # 256: Gemma's
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_matches_reference(variant, num_heads, num_kv_heads, head_dim, dtype):
    """Every build this CPU runs (AVX-512 with and without AVX512-BF16, AVX2, plain C), GQA groups 1, 3, 4, 5
    and 8 (compiled in) and 12 (a run-time group); ragged lengths: 1 token, off and on the 32-token blocks, and a
    300-token request that is split into chunks and merged; rows scattered through the cache; a strided q (a view
    into the fused qkv projection). On an AVX512-BF16 CPU the native build scores bf16 with vdpbf16ps: a head at a
    time for groups of 1, head-packed (four heads to an instruction, some lanes empty for 3 and 5) for the rest."""
    lib = variant_library(variant)
    seq_lens = [1, 31, 32, 33, 300, 7]
    batch, q, meta = _decode_case(seq_lens, num_heads, num_kv_heads, head_dim, dtype)
    qkv = torch.cat([q.flatten(1), torch.zeros(len(seq_lens), 2 * num_kv_heads * head_dim, dtype=dtype)], dim=1)
    q_view = qkv[:, :num_heads * head_dim].view(q.shape)
    meta_cpu = {k: v for k, v in meta.items() if k != "max_seq_len"}
    out = decode_attention_cpu(q_view, batch.k_cache, batch.v_cache, **meta_cpu, lib=lib)
    assert out is not None and out.dtype == dtype
    torch.testing.assert_close(out, decode_attention_ref(q, batch.k_cache, batch.v_cache, **meta), **TOL[dtype])


@pytest.mark.skipif(DEVICE.type != "cpu" or library() is None, reason="the C kernel is the CPU path")
@pytest.mark.parametrize("variant", c_library_variants())
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (32, 8, 128), (8, 1, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_reads_a_head_major_cache(variant, num_heads, num_kv_heads, head_dim, dtype):
    """K/V as views of [Hk, rows, D] storage (head stride rows x D), as a CPU KVCache lays them out: every build
    finds each head's rows by the head stride, bit for bit the result over the same values token-major."""
    lib = variant_library(variant)
    seq_lens = [1, 33, 300, 64]
    batch, q, meta = _decode_case(seq_lens, num_heads, num_kv_heads, head_dim, dtype, head_major=True)
    assert batch.k_cache.stride(1) == batch.k_cache.shape[0] * head_dim
    meta_cpu = {k: v for k, v in meta.items() if k != "max_seq_len"}
    out = decode_attention_cpu(q, batch.k_cache, batch.v_cache, **meta_cpu, lib=lib)
    assert out is not None
    token_major = decode_attention_cpu(q, batch.k_cache.contiguous(), batch.v_cache.contiguous(), **meta_cpu, lib=lib)
    torch.testing.assert_close(out, token_major, atol=0, rtol=0)
    torch.testing.assert_close(out, decode_attention_ref(q, batch.k_cache, batch.v_cache, **meta), **TOL[dtype])


@pytest.mark.skipif(DEVICE.type != "cpu" or library() is None, reason="the C kernel is the CPU path")
@pytest.mark.parametrize("tuning", DECODE_TUNINGS)
@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (8, 1, 128), (32, 4, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_with_other_compile_time_choices_matches_reference(tuning, head_major, num_heads, num_kv_heads,
                                                                      head_dim, dtype):
    """The builds scripts/bench_cpu_kernels.py --define times: no software prefetch, with the distance at 0, head
    packing never and the V pass always widening (on an AVX512-BF16 CPU every group then scores a head at a time and
    adds V with FMAs); prefetcht0 at a distance off the block size (the next task's rows are then prefetched from
    mid-block), head packing from groups of 5 (groups of 8 packed, of 3 not) with each pass loading its own K, and
    the V pass as vdpbf16ps for every group, odd block lengths included; the heads one after another in one and
    block by block in the other; over a token-major and a head-major cache."""
    lib = variant_library("native", tuning)
    batch, q, meta = _decode_case([1, 31, 33, 300, 129], num_heads, num_kv_heads, head_dim, dtype,
                                  head_major=head_major)
    meta_cpu = {k: v for k, v in meta.items() if k != "max_seq_len"}
    out = decode_attention_cpu(q, batch.k_cache, batch.v_cache, **meta_cpu, lib=lib)
    assert out is not None
    torch.testing.assert_close(out, decode_attention_ref(q, batch.k_cache, batch.v_cache, **meta), **TOL[dtype])


@pytest.mark.parametrize("defines, match", [({"PF_LOCALITY": 4}, "PF_LOCALITY=4: out of range"),
                                            ({"PACK_MIN_GROUP": 2}, "PACK_MIN_GROUP=2: out of range"),
                                            ({"BLOCK": 16}, "BLOCK: not a tunable")])
def test_tuning_flags_reject_what_the_source_does_not_take(defines, match):
    with pytest.raises(ValueError, match=match):
        tuning_flags(defines)
    assert tuning_flags({"PF_LOCALITY": -1, "PF_DIST": 64}) == ("-DPF_DIST=64", "-DPF_LOCALITY=-1")


@pytest.mark.skipif(DEVICE.type != "cpu" or library() is None, reason="the C kernel is the CPU path")
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_cpu_kernel_split_merge_is_thread_count_independent(threads):
    """One long request: the kernel splits its tokens into chunks by thread count and merges them; the
    result must not depend on how many threads shared the work (beyond float rounding)."""
    batch, q, meta = _decode_case([2000], 9, 3, 64, torch.float32)
    meta_cpu = {k: v for k, v in meta.items() if k != "max_seq_len"}
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = decode_attention_cpu(q, batch.k_cache, batch.v_cache, **meta_cpu)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, decode_attention_ref(q, batch.k_cache, batch.v_cache, **meta), **TOL[torch.float32])


@pytest.mark.skipif(DEVICE.type != "cpu" or library() is None, reason="the C kernel is the CPU path")
def test_cpu_kernel_declines_what_it_does_not_support():
    batch, q, meta = _decode_case([5, 9], 4, 1, 80, torch.float32)  # head_dim 80: not compiled in
    meta_cpu = {k: v for k, v in meta.items() if k != "max_seq_len"}
    assert decode_attention_cpu(q, batch.k_cache, batch.v_cache, **meta_cpu) is None


W_SEQ_LENS = [1, 23, 70, 8, 300]  # shorter than, equal to and longer than the windows; 300: several C chunks


@pytest.mark.parametrize("window, softcap", VARIANTS)
def test_reference_window_and_softcap_match_naive_attention(window, softcap):
    batch, q, meta = _decode_case(W_SEQ_LENS, 4, 2, 64, torch.float32)
    meta = window_softcap_meta(meta, window, softcap)
    out = decode_attention_ref(q, batch.k_cache, batch.v_cache, **meta)
    for req, seq_len in enumerate(W_SEQ_LENS):
        expect = naive_attention(batch, req, q[req:req + 1], [seq_len - 1], meta["sm_scale"], window, softcap)
        torch.testing.assert_close(out[req:req + 1], expect.float(), **TOL[torch.float32])


@pytest.mark.parametrize("window, softcap", VARIANTS)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, dtype", [(4, 1, 64, torch.float32),
                                                                      (2, 2, 80, torch.float16)])
def test_decode_triton_window_and_softcap_match_reference(window, softcap, num_heads, num_kv_heads, head_dim, dtype):
    batch, q, meta = _decode_case(W_SEQ_LENS, num_heads, num_kv_heads, head_dim, dtype)
    meta = window_softcap_meta(meta, window, softcap)
    out = decode_attention_triton(q, batch.k_cache, batch.v_cache, **meta, num_splits=4, block_n=16)
    torch.testing.assert_close(out, decode_attention_ref(q, batch.k_cache, batch.v_cache, **meta), **TOL[dtype])


@pytest.mark.skipif(DEVICE.type != "cpu" or library() is None, reason="the C kernel is the CPU path")
@pytest.mark.parametrize("variant", c_library_variants())
@pytest.mark.parametrize("window, softcap", VARIANTS)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, dtype", [
    (9, 3, 64, torch.float32), (8, 1, 128, torch.bfloat16), (4, 2, 256, torch.bfloat16),  # 256: Gemma 2's
])
def test_cpu_kernel_window_and_softcap_match_reference(window, softcap, num_heads, num_kv_heads, head_dim, dtype,
                                                       variant):
    lib = variant_library(variant)
    batch, q, meta = _decode_case(W_SEQ_LENS, num_heads, num_kv_heads, head_dim, dtype)
    meta = window_softcap_meta(meta, window, softcap)
    meta_cpu = {k: v for k, v in meta.items() if k != "max_seq_len"}
    out = decode_attention_cpu(q, batch.k_cache, batch.v_cache, **meta_cpu, lib=lib)
    assert out is not None
    torch.testing.assert_close(out, decode_attention_ref(q, batch.k_cache, batch.v_cache, **meta), **TOL[dtype])
