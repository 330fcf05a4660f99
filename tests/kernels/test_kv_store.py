"""store_kv: the Triton kernel, the C kernel and the reference against a per-token copy, from strided views of a
fused qkv."""
import pytest
import torch

from lightserve.kernels.cpu import variant_library
from lightserve.kernels.kv_store import store_kv, store_kv_cpu, store_kv_ref, store_kv_triton
from tests.kernels.kernel_cases import DEVICE, c_library_variants


def _case(dtype, num_tokens=5, num_q_heads=4, num_kv_heads=2, head_dim=64, num_rows=20):
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=DEVICE)
    kv_start = num_q_heads * head_dim
    kv_width = num_kv_heads * head_dim
    k = qkv[:, kv_start:kv_start + kv_width].view(num_tokens, num_kv_heads, head_dim)  # strided view
    v = qkv[:, kv_start + kv_width:].view(num_tokens, num_kv_heads, head_dim)  # strided view
    k_cache = torch.zeros(num_rows, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros(num_rows, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    kv_locs = torch.randperm(num_rows, device=DEVICE)[:num_tokens]
    return k, v, k_cache, v_cache, kv_locs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("impl", [store_kv_ref, store_kv_triton])
def test_store_kv_writes_each_token_at_its_loc(dtype, impl):
    k, v, k_cache, v_cache, kv_locs = _case(dtype)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for i, loc in enumerate(kv_locs.tolist()):
        expect_k[loc] = k[i]
        expect_v[loc] = v[i]
    impl(k, v, k_cache, v_cache, kv_locs)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


def test_store_kv_triton_odd_head_count_and_int32_locs():
    k, v, k_cache, v_cache, kv_locs = _case(torch.float16, num_tokens=3, num_kv_heads=3, head_dim=64)
    store_kv_triton(k, v, k_cache, v_cache, kv_locs.to(torch.int32))  # 3 * 64 elements: masked block of 256
    assert torch.equal(k_cache[kv_locs], k) and torch.equal(v_cache[kv_locs], v)


def test_store_kv_triton_no_tokens_is_a_no_op():
    k, v, k_cache, v_cache, kv_locs = _case(torch.float16)
    store_kv_triton(k[:0], v[:0], k_cache, v_cache, kv_locs[:0])
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the C kernel is the CPU path")
@pytest.mark.parametrize("variant", c_library_variants())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("locs_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_tokens", [5, 600])  # 600 x 2 heads x 64: both threads
def test_store_kv_c_kernel_is_the_reference(num_tokens, locs_dtype, dtype, variant):
    k, v, k_cache, v_cache, kv_locs = _case(dtype, num_tokens=num_tokens, num_rows=1000)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, want_k, want_v, kv_locs)
    assert store_kv_cpu(k, v, k_cache, v_cache, kv_locs.to(locs_dtype), lib=variant_library(variant))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the C kernel is the CPU path")
def test_store_kv_c_kernel_strided_heads_and_what_it_declines():
    k, v, k_cache, v_cache, kv_locs = _case(torch.bfloat16, num_tokens=4, num_kv_heads=3, num_rows=10)
    k_t = k.transpose(0, 1).contiguous().transpose(0, 1)  # head stride T * D, not D: one copy per head
    assert store_kv_cpu(k_t, v, k_cache, v_cache, kv_locs)
    assert torch.equal(k_cache[kv_locs], k) and torch.equal(v_cache[kv_locs], v)
    # a head-major cache (views of [H, rows, D]): each head's row lands rows x D apart
    k_h, v_h = (c.transpose(0, 1).contiguous().transpose(0, 1).zero_() for c in (k_cache, v_cache))
    assert store_kv_cpu(k, v, k_h, v_h, kv_locs)
    assert torch.equal(k_h[kv_locs], k) and torch.equal(v_h[kv_locs], v)
    k_h[kv_locs], v_h[kv_locs] = 0, 0
    assert not k_h.any() and not v_h.any()  # and nothing else
    bad = kv_locs.clone()
    bad[-1] = 10  # past the last row: nothing is written, and the dispatch's reference raises
    before = k_cache.clone()
    assert not store_kv_cpu(k + 1, v, k_cache, v_cache, bad)
    assert torch.equal(k_cache, before)
    with pytest.raises((IndexError, RuntimeError)):
        store_kv(k, v, k_cache, v_cache, bad)
    assert not store_kv_cpu(k, v, k_cache.float(), v_cache.float(), kv_locs)  # a widening: the reference's job
    assert not store_kv_cpu(k.half(), v.half(), k_cache.half(), v_cache.half(), kv_locs)  # no C float16


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the C kernel is the CPU path")
@pytest.mark.parametrize("variant", c_library_variants())
def test_store_kv_c_kernel_rounds_float32_rows_into_a_bf16_cache(variant):
    """Float32 activations over a bf16 cache: each value rounded to nearest even, as the reference's
    .to(torch.bfloat16), ties and NaN included; 600 tokens x 2 heads x 64: both threads."""
    k, v, _, _, kv_locs = _case(torch.float32, num_tokens=600, num_rows=1000)
    k[0, 0, :4] = torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, float("nan"), -0.0])  # ties to even; NaN
    k_cache, v_cache = (torch.zeros(1000, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, want_k, want_v, kv_locs)
    assert store_kv_cpu(k, v, k_cache, v_cache, kv_locs, lib=variant_library(variant))
    assert torch.equal(k_cache.nan_to_num(), want_k.nan_to_num()) and torch.equal(v_cache, want_v)
    assert k_cache[kv_locs[0], 0, 2].isnan()
    assert k_cache[kv_locs[0], 0, 0] == 1.0 and k_cache[kv_locs[0], 0, 1] == 1.0 + 2.0 ** -6


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_store_kv_triton_rounds_float32_rows_into_a_16bit_cache(cache_dtype):
    """Float32 activations over a bf16 or fp16 cache (--kv_cache_dtype under --data_type float32) through the Triton
    store: each value rounded to nearest even as the reference's .to(dtype), ties and NaN included (bf16 by integer
    rounding in the kernel, since the interpreter's cast truncates where a GPU rounds)."""
    k, v, _, _, kv_locs = _case(torch.float32, num_tokens=37, num_rows=64)
    k[0, 0, :4] = torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, float("nan"), -0.0])  # bf16 ties; NaN
    k[0, 1, :2] = torch.tensor([1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11])  # fp16 ties
    k_cache, v_cache = (torch.zeros(64, 2, 64, dtype=cache_dtype, device=DEVICE) for _ in range(2))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, want_k, want_v, kv_locs)
    store_kv_triton(k, v, k_cache, v_cache, kv_locs)
    assert torch.equal(k_cache.nan_to_num(), want_k.nan_to_num()) and torch.equal(v_cache, want_v)
    assert k_cache[kv_locs[0], 0, 2].isnan()
