"""The attention kernels' tiles fit a Hopper GPU's shared memory (227 KB per block on an H100 or H200) at every
head dim and dtype served: each kernel's block choice, through the estimate prefill_attention.attention_smem_bytes
(query tile, num_stages buffers of the K and V tiles, P), with SMEM_SLACK_BYTES left for Triton's own use.
A launch past the limit fails on the GPU only ("out of resource: shared memory"), so this is checked on the host."""
import pytest
import torch
import triton

from lightserve.kernels.decode_attention import decode_blocks
from lightserve.kernels.mla_attention import mla_decode_blocks
from lightserve.kernels.prefill_attention import (
    SMEM_LIMIT_BYTES,
    SMEM_SLACK_BYTES,
    attention_smem_bytes,
    prefill_blocks,
)

HEAD_DIMS = (64, 80, 96, 128, 192, 256)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BUDGET = SMEM_LIMIT_BYTES - SMEM_SLACK_BYTES


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def test_the_estimate_counts_query_stages_of_k_and_v_and_p():
    # 64 x 64 tiles at BLOCK_D 256, 2 stages, float32: Q 64 KB + 2 x (K 64 KB + V 64 KB) + P 16 KB = 336 KB, the
    # tiles the prefill kernel took before it chose by the estimate: past the 227 KB an H100 block may use.
    assert attention_smem_bytes(64, 64, 256, 2, 4) == 4 * (64 * 256 + 2 * 64 * 512 + 64 * 64) == 336 * 1024
    assert attention_smem_bytes(64, 64, 256, 2, 4) > SMEM_LIMIT_BYTES
    assert attention_smem_bytes(16, 32, 576, 2, 2, block_dv=0) == 2 * (16 * 576 + 2 * 32 * 576 + 16 * 32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_prefill_tiles_fit(head_dim, dtype):
    elem = torch.empty(0, dtype=dtype).element_size()
    block_m, block_n, _, num_stages = prefill_blocks(head_dim, elem)
    assert block_m >= 16 and block_n >= 16  # tl.dot's smallest tile
    assert attention_smem_bytes(block_m, block_n, _block(head_dim), num_stages, elem) <= BUDGET
    if elem == 2:  # 16-bit dtypes keep the tiles they always had
        assert (block_m, block_n) == ((128 if head_dim <= 64 else 64), 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 4, 8, 16, 32, 64])
def test_decode_tiles_fit(head_dim, group, dtype):
    elem = torch.empty(0, dtype=dtype).element_size()
    block_n, num_stages = decode_blocks(head_dim, group, elem)
    assert block_n >= 16
    assert attention_smem_bytes(_block(group), block_n, _block(head_dim), num_stages, elem) <= BUDGET


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank, rope_dim", [(512, 64), (256, 64), (128, 32), (32, 16)])  # 512 / 64: DeepSeek-V3
def test_mla_decode_tiles_fit(rank, rope_dim, dtype):
    elem = torch.empty(0, dtype=dtype).element_size()
    block_n, num_stages = mla_decode_blocks(rank, rope_dim, 16, elem)
    assert block_n >= 16
    used = attention_smem_bytes(16, block_n, _block(rank) + _block(rope_dim), num_stages, elem, block_dv=0)
    assert used <= BUDGET
