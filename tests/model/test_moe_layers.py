"""MoEBlock against transformers' own MoE modules (Mixtral, Qwen3-MoE, DeepSeek-V3) on random weights, loaded
from transformers 5's fused names and from the per-expert checkpoint names, whole and as TP shards."""
import pytest
import torch

from lightserve.model_infer.moe_layers import MoEBlock, MoEConfig, load_moe_weights

PREFIX = "model.layers.0."


def _hf_block(arch, norm_topk_prob=True):
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    if arch == "MixtralForCausalLM":
        cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=48, num_local_experts=8,
                                         num_experts_per_tok=2)
        block = MixtralSparseMoeBlock(cfg)
    elif arch == "Qwen3MoeForCausalLM":
        cfg = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=6,
                                          num_experts_per_tok=2, norm_topk_prob=norm_topk_prob)
        block = Qwen3MoeSparseMoeBlock(cfg)
    else:
        cfg = transformers.DeepseekV3Config(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8,
                                            num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                            norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5)
        block = DeepseekV3MoE(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.normal_(0, 0.5 if "gate.weight" in name else p.shape[-1] ** -0.5)
        for name, b in block.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.1)  # moves choices, and must not touch the weights
    hf_dict = {**cfg.to_dict(), "architectures": [arch]}
    return block.eval(), hf_dict


def _tensors(block, per_expert, config: MoEConfig):
    """The block's weights under a layer's checkpoint names: transformers 5's fused ones, or one per expert."""
    state = block.state_dict()
    if not per_expert:
        return {f"{PREFIX}mlp.{k}": v for k, v in state.items()}
    gate_name, up_name, down_name = config.expert_names
    out = {f"{PREFIX}{config.module_name}.{k}": v for k, v in state.items() if not k.startswith("experts.")}
    inter = config.intermediate_size
    for e in range(config.num_experts):
        base = f"{PREFIX}{config.module_name}.experts.{e}."
        out[f"{base}{gate_name}.weight"] = state["experts.gate_up_proj"][e, :inter]
        out[f"{base}{up_name}.weight"] = state["experts.gate_up_proj"][e, inter:]
        out[f"{base}{down_name}.weight"] = state["experts.down_proj"][e]
    return out


CASES = [("MixtralForCausalLM", True), ("Qwen3MoeForCausalLM", False), ("Qwen3MoeForCausalLM", True),
         ("DeepseekV3ForCausalLM", True), ("DeepseekV3ForCausalLM", False)]


@pytest.mark.parametrize("arch, norm", CASES)
@pytest.mark.parametrize("per_expert", [False, True])
def test_moe_block_matches_transformers(arch, norm, per_expert):
    block, hf = _hf_block(arch, norm)
    config = MoEConfig.from_hf(hf)
    x = torch.randn(2, 11, 64)
    with torch.no_grad():
        expect = block(x).view(-1, 64)
    ours = MoEBlock(config, load_moe_weights(_tensors(block, per_expert, config), PREFIX, config, torch.float32))
    out = ours(x.view(-1, 64))
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"])
def test_moe_block_bfloat16_is_close_to_transformers(arch):
    block, hf = _hf_block(arch)
    config = MoEConfig.from_hf(hf)
    x = torch.randn(13, 64)
    block.to(torch.bfloat16)
    if arch == "DeepseekV3ForCausalLM":  # HF keeps the router in float32 (_keep_in_fp32_modules_strict)
        block.gate.float()
    with torch.no_grad():
        expect = block(x.to(torch.bfloat16)[None])[0]
    ours = MoEBlock(config, load_moe_weights(_tensors(block, False, config), PREFIX, config, torch.bfloat16))
    out = ours(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expect.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "DeepseekV3ForCausalLM"])
def test_tp_shards_sum_to_the_whole_block(arch):
    """Each rank's block gives a partial sum (routed and shared experts alike); the all-reduce adds them."""
    block, hf = _hf_block(arch)
    config = MoEConfig.from_hf(hf)
    tensors = _tensors(block, True, config)
    x = torch.randn(7, 64)
    with torch.no_grad():
        expect = block(x[None])[0]
    parts = [MoEBlock(config, load_moe_weights(tensors, PREFIX, config, torch.float32, tp_rank=r, tp_size=2))(x)
             for r in range(2)]
    torch.testing.assert_close(parts[0] + parts[1], expect, atol=1e-5, rtol=1e-4)


def test_config_refuses_what_the_block_does_not_implement():
    with pytest.raises(ValueError, match="hidden_act"):
        MoEConfig.from_hf({"architectures": ["MixtralForCausalLM"], "hidden_act": "gelu", "hidden_size": 8,
                           "intermediate_size": 8})
    with pytest.raises(ValueError, match="no MoE block"):
        MoEConfig.from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 8})
