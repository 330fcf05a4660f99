"""The model registry: architectures map to their family, each family reads its own config keys, and what
no family serves (an architecture, a vision tower, a config key) is refused by name, at start."""
from __future__ import annotations

import json

import pytest

from lightserve.config import Device, DType, ServerConfig
from lightserve.engine.procs import StartError
from lightserve.kernels import cpu as kernels_cpu
from lightserve.model_infer.models import ARCHITECTURES, config_from_dict, family_of, gemma, llama, phi3
from lightserve.resolve_config import resolve_config

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 256}


def test_every_architecture_has_its_family():
    assert family_of("Qwen3ForCausalLM") is llama and family_of("Gemma3ForCausalLM") is gemma
    assert family_of("Phi3ForCausalLM") is phi3
    assert set(ARCHITECTURES) >= {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Gemma2ForCausalLM"}


@pytest.mark.parametrize("cfg, match", [
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "Gemma3ForConditionalGeneration.*not supported"),
    ({"architectures": ["Gemma3ForCausalLM"], "vision_config": {"hidden_size": 8}}, "multimodal.*vision_config"),
    ({"architectures": ["Gemma3ForCausalLM"], "text_config": {"hidden_size": 8}}, "multimodal.*text_config"),
    ({"architectures": ["Gemma2ForCausalLM"], "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"}, "hidden_act"),
    ({"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ({"architectures": ["Qwen2ForCausalLM"], "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    # DeepSeek's FP8 release (block-scaled e4m3 weights), a bit width not served, a served method outside the Llama
    # family (tests/model/test_hf_quant.py: the others)
    ({"architectures": ["DeepseekV3ForCausalLM"], "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}},
     "quant_method 'fp8' is not supported"),
    ({"architectures": ["LlamaForCausalLM"], "quantization_config": {"quant_method": "awq", "bits": 3}},
     "awq bits=3 is not supported"),
    ({"architectures": ["Gemma2ForCausalLM"], "quantization_config": {"quant_method": "gptq", "bits": 4}},
     "gptq checkpoints are served for LlamaForCausalLM"),
    ({"architectures": ["DeepseekV2ForCausalLM"]}, "'DeepseekV2ForCausalLM' is not supported"),
])
def test_unsupported_configs_are_refused_by_name(cfg, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict({**BASE, **cfg})


def test_the_launcher_refuses_an_unsupported_model_at_start(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "architectures": ["Gemma3ForConditionalGeneration"]}))
    with pytest.raises(StartError, match="Gemma3ForConditionalGeneration"):
        resolve_config(ServerConfig(model_dir=str(tmp_path), device=Device.CPU))


def test_resolved_config_carries_the_model_facts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "architectures": ["MistralForCausalLM"],
                                                      "sliding_window": 16, "eos_token_id": [2, 7]}))
    config = resolve_config(ServerConfig(model_dir=str(tmp_path), device=Device.CPU))
    assert config.model.architecture == "MistralForCausalLM" and config.vocab_size == 100
    assert config.eos_token_ids == (2, 7) and config.model_dir == str(tmp_path)
    # a window no longer caps the context: it is a real window on every layer
    assert config.max_req_total_len == 256 and config.model.layer_windows == (16,) * 4


@pytest.mark.parametrize("flags, dtype", [
    ("avx2 fma", DType.FLOAT32),                                  # AVX2 only
    ("avx2 avx512f avx512bw avx512_vnni", DType.FLOAT32),         # AVX-512 without AVX512-BF16
    ("avx2 avx512f avx512_bf16", DType.BFLOAT16),
    ("avx2 avx512f amx_bf16 amx_tile", DType.BFLOAT16),
])
def test_auto_dtype_on_cpu_is_bf16_where_the_cpu_multiplies_bf16(tmp_path, monkeypatch, flags, dtype):
    """--data_type auto reads the CPU's flag words through kernels/cpu.cpu_has_native_bf16, the rule the linears'
    choice of oneDNN follows too."""
    monkeypatch.setattr(kernels_cpu, "cpu_flags", lambda: flags)
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "architectures": ["LlamaForCausalLM"]}))
    config = resolve_config(ServerConfig(model_dir=str(tmp_path), device=Device.CPU, data_type=DType.AUTO))
    assert config.data_type is dtype


def test_window_layouts_follow_transformers_defaults():
    qwen = config_from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                             "sliding_window": 32, "max_window_layers": 2})
    assert qwen.layer_windows == (0, 0, 32, 32)  # layers from max_window_layers on
    assert config_from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32}).layer_windows == ()
    gemma2 = config_from_dict({**BASE, "architectures": ["Gemma2ForCausalLM"], "sliding_window": 8})
    assert gemma2.layer_windows == (8, 0, 8, 0)  # every second layer global
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.hidden_act) == (50.0, 30.0, "gelu_tanh")
    assert gemma2.head_dim == 256 and gemma2.sm_scale == 256 ** -0.5
    gemma3 = config_from_dict({**BASE, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 12,
                               "rope_theta": 1e6, "rope_local_base_freq": 1e4})
    assert gemma3.layer_windows == ((4096,) * 5 + (0,)) * 2  # every sixth layer global
    assert (gemma3.rope_theta, gemma3.rope_local_theta, gemma3.attn_softcap) == (1e6, 1e4, 0.0)


def test_longrope_factors_and_attention_factor_match_transformers():
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.3 * i for i in range(8)]}
    hf_cfg = transformers.Phi3Config(**{**BASE, "num_key_value_heads": 4}, original_max_position_embeddings=64,
                                     rope_parameters=dict(rope))
    _, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](hf_cfg, "cpu")
    ours = config_from_dict({**hf_cfg.to_dict(), "architectures": ["Phi3ForCausalLM"]})
    assert ours.rope_attention_factor == attention_factor > 1.0
    assert ours.rope_original_max_position_embeddings == 64
    assert ours.rope_short_factor == tuple(rope["short_factor"])
