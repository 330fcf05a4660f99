"""store_kv: the Triton kernel and the reference against a per-token copy, from strided views of a fused qkv."""
import pytest
import torch

from lightserve.kernels.kv_store import store_kv_ref, store_kv_triton
from tests.kernels.kernel_cases import DEVICE


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
