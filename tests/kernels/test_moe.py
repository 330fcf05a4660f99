"""MoE: routing against transformers' routers, the CPU grouped path and the Triton grouped GEMM against the
per-expert reference, the block layout the Triton path uses, and TP shards summing to the whole."""
import pytest
import torch

from lightserve.kernels.cpu import library
from lightserve.kernels.launch_keys import record_launches
from lightserve.kernels.linear import (
    onednn_available,
    pack_linear_weight,
    prepack_weight,
)
from lightserve.kernels.moe import (
    ExpertWeights,
    fused_experts_cpu,
    fused_experts_ref,
    fused_experts_triton,
    grouped_topk_sigmoid,
    moe_align_block_size,
    pack_expert_weights,
    shard_expert_weights,
    topk_softmax,
    warm_up_fused_experts,
)
from tests.kernels.kernel_cases import DEVICE, TOL


def _experts(num_experts, hidden, inter, dtype, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    down = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    return ExpertWeights(gate_up.to(device, dtype), down.to(device, dtype))


def _routing(num_tokens, num_experts, top_k, seed=1, device=DEVICE, skip_expert=None):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if skip_expert is not None:
        logits[:, skip_expert] = -1e9  # an expert no token picks
    weights, ids = topk_softmax(logits, top_k, renormalize=True)
    return weights.to(device), ids.to(device)


def test_topk_softmax_matches_mixtral_and_qwen3_routers():
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    x = torch.randn(9, 32)
    mixtral = MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2))
    torch.nn.init.normal_(mixtral.weight)
    _, hf_w, hf_ids = mixtral(x)
    w, ids = topk_softmax(x @ mixtral.weight.T, 2, renormalize=True)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w, rtol=0, atol=0)
    for norm in (True, False):
        qwen = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3,
                                                 norm_topk_prob=norm))
        torch.nn.init.normal_(qwen.weight)
        _, hf_w, hf_ids = qwen(x)
        w, ids = topk_softmax(x @ qwen.weight.T, 3, renormalize=norm)
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(w, hf_w, rtol=0, atol=0)


@pytest.mark.parametrize("norm, groups, topk_groups", [(True, 2, 1), (False, 4, 2), (True, 1, 1)])
def test_grouped_topk_sigmoid_matches_deepseek_v3_router(norm, groups, topk_groups):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3TopkRouter,
    )

    cfg = DeepseekV3Config(hidden_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=groups,
                           topk_group=topk_groups, norm_topk_prob=norm, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    torch.nn.init.normal_(router.weight)
    router.e_score_correction_bias.normal_()  # large enough to change choices: the weights must ignore it
    x = torch.randn(17, 32)
    logits, hf_w, hf_ids = router(x)
    w, ids = grouped_topk_sigmoid(logits, router.e_score_correction_bias, 2, groups, topk_groups, norm, 2.5)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w, rtol=0, atol=0)
    group_of = ids // (8 // groups)  # chosen experts lie in at most topk_groups groups per token
    assert all(len(set(row)) <= topk_groups for row in group_of.tolist())


def test_moe_align_block_size_lays_out_each_expert_in_whole_blocks():
    topk_ids = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3], [3, 2]], device=DEVICE)  # expert 4, 6, 7 unused
    pairs, block_experts, num_padded = moe_align_block_size(topk_ids, 4, 8)
    pairs, block_experts = pairs.cpu(), block_experts.cpu()
    counts = {0: 2, 1: 1, 2: 1, 3: 5, 5: 1}  # expert 3 needs two blocks
    assert int(num_padded) == 4 * sum(-(-n // 4) for n in counts.values())
    flat = topk_ids.reshape(-1).cpu()
    used = pairs[: int(num_padded)]
    real = used[used < 10]
    assert sorted(real.tolist()) == list(range(10))  # every pair exactly once
    for b in range(int(num_padded) // 4):
        block = used[4 * b: 4 * b + 4]
        block = block[block < 10]
        assert len(block) and (flat[block.long()] == block_experts[b]).all()


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_cpu_matches_reference(num_tokens, dtype):
    weights = _experts(8, 64, 48, dtype, device="cpu")
    topk_w, topk_ids = _routing(num_tokens, 8, 2, device="cpu", skip_expert=5)
    x = torch.randn(num_tokens, 64).to(dtype)
    expect = fused_experts_ref(x, weights, topk_w, topk_ids)
    tol = TOL[dtype] if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(fused_experts_cpu(x, weights, topk_w, topk_ids), expect, **tol)
    pack = pack_linear_weight if dtype == torch.float32 and library() is not None else \
        prepack_weight if dtype == torch.bfloat16 and onednn_available() else None
    if pack is not None:  # the serving layout: one packed weight per expert, the C / oneDNN GEMMs
        packed = pack_expert_weights(weights, pack)
        torch.testing.assert_close(fused_experts_cpu(x, packed, topk_w, topk_ids), expect, **tol)


@pytest.mark.parametrize("num_tokens, hidden, inter", [(1, 64, 48), (5, 64, 32), (33, 40, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else []))
def test_fused_experts_triton_matches_reference(num_tokens, hidden, inter, dtype):
    """Hidden 40 and intermediate 48: masked K and N tails; 33 tokens x 2: an expert spanning several blocks."""
    weights = _experts(8, hidden, inter, dtype)
    topk_w, topk_ids = _routing(num_tokens, 8, 2, skip_expert=5)
    x = torch.randn(num_tokens, hidden).to(DEVICE, dtype)
    out = fused_experts_triton(x, weights, topk_w, topk_ids, block_m=16)
    torch.testing.assert_close(out, fused_experts_ref(x, weights, topk_w, topk_ids), **TOL[dtype])


def test_fused_experts_triton_takes_model_dtype_weights_and_no_tokens():
    weights = _experts(4, 32, 32, torch.float16)
    topk_w, topk_ids = _routing(6, 4, 3)
    x = torch.randn(6, 32).to(DEVICE, torch.float16)
    w16 = topk_w.to(torch.float16)  # Qwen3-MoE rounds the routing weights to the model dtype
    torch.testing.assert_close(fused_experts_triton(x, weights, w16, topk_ids),
                               fused_experts_ref(x, weights, w16, topk_ids), **TOL[torch.float16])
    assert fused_experts_triton(x[:0], weights, w16[:0], topk_ids[:0]).shape == (0, 32)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_shards_sum_to_the_full_experts(tp_size):
    full = _experts(4, 32, 48, torch.float32, device="cpu")
    topk_w, topk_ids = _routing(5, 4, 2, device="cpu")
    x = torch.randn(5, 32)
    parts = [fused_experts_cpu(x, shard_expert_weights(full.gate_up, full.down, r, tp_size), topk_w, topk_ids)
             for r in range(tp_size)]
    torch.testing.assert_close(sum(parts), fused_experts_ref(x, full, topk_w, topk_ids), **TOL[torch.float32])
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        shard_expert_weights(full.gate_up, full.down, 0, 5)


def _gemm_keys(log) -> set:
    return {spec for name, spec in log.keys if name == "_grouped_gemm_kernel"}


def _entry(spec, name):
    return next(entry[1:] for entry in spec if entry[0] == name)


def test_warm_up_launches_every_key_of_serving():
    # top_k 3 with T = 1 .. 16 tokens: T*k takes every residue mod 16, and both block sizes (16 up to 4 * E pairs).
    num_experts, top_k = 4, 3
    weights = _experts(num_experts, 32, 16, torch.float32)
    with record_launches() as warm:
        warm_up_fused_experts(torch.randn(3, 32, device=DEVICE), weights, top_k)
    # Both block sizes for both GEMMs (gate_up: TOP_K k, unweighted; down: TOP_K 1, weighted).
    assert {(_entry(s, "BLOCK_M"), _entry(s, "TOP_K"), _entry(s, "MUL_WEIGHT")) for s in _gemm_keys(warm)} == {
        (("constexpr", m), ("constexpr", k), ("constexpr", k == 1)) for m in (16, 64) for k in (top_k, 1)}
    assert len(_gemm_keys(warm)) == 4
    with record_launches() as served:
        for num_tokens in range(1, 17):
            topk_w, topk_ids = _routing(num_tokens, num_experts, top_k, seed=num_tokens)
            x = torch.randn(num_tokens, 32, device=DEVICE)
            out = fused_experts_triton(x, weights, topk_w, topk_ids)
            if num_tokens in (1, 16):  # both block sizes compute the right thing
                torch.testing.assert_close(out, fused_experts_ref(x, weights, topk_w, topk_ids), **TOL[torch.float32])
    assert {_entry(s, "BLOCK_M") for s in _gemm_keys(served)} == {("constexpr", 16), ("constexpr", 64)}
    assert served.keys <= warm.keys, sorted(served.keys - warm.keys, key=str)
