"""Tiny random-weight checkpoints of each supported architecture, saved by transformers in float32,
for comparing our forward against transformers' own."""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

ARCHS = ("llama3", "qwen2", "qwen3", "mistral", "llama_bias", "mistral_window", "gemma2", "gemma3", "phi3", "mixtral",
         "qwen3_moe", "deepseek_v3", "deepseek_v3_yarn")
MOE = {"num_experts_per_tok": 2}  # 4 experts (below), top-2
WINDOW = 8  # the sliding window of the windowed tiny models: prompts of the tests run past it
# Gemma's head_dim is its own (64: the C decode kernel's size); layers alternate windowed and global.
GEMMA = {"head_dim": 64, "num_hidden_layers": 4, "sliding_window": WINDOW, "query_pre_attn_scalar": 48,
         "layer_types": ["sliding_attention", "full_attention"] * 2}
# Phi-3's longrope: short factors below 128 positions, long ones from there (tests stay below it).
# DeepSeek-V3: layer 0 dense, layers 1-2 MoE (8 experts in 2 groups, top-2 from the best group, one shared expert),
# latent attention with distinct nope / rope / v head dims.
DEEPSEEK = {"num_hidden_layers": 3, "num_key_value_heads": 4, "first_k_dense_replace": 1, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1, "moe_intermediate_size": 32,
            "q_lora_rank": 48, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 24, "v_head_dim": 20}
# Its yarn variant (no q_lora_rank): mscale != mscale_all_dim, so both the cos/sin factor and the softmax scale move.
DEEPSEEK_YARN = {"q_lora_rank": None, "rope_parameters": {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
    "mscale": 1.0, "mscale_all_dim": 0.7, "beta_fast": 32.0, "beta_slow": 1.0}}
MTP_NUM_LAYERS = 3  # make_mtp_checkpoint's served layers; its MTP layer is model.layers.3
PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 128,
             "short_factor": [1.0 + 0.05 * i for i in range(32)], "long_factor": [1.0 + 0.4 * i for i in range(32)]}


def load_model_dir(model_dir: str | Path, dtype: torch.dtype, device: torch.device | str = "cpu", tp_rank: int = 0,
                   tp_size: int = 1, tp_group=None):
    """A model folder's model in one call: read_model_config + load_model (the worker gets its ModelConfig from the
    launcher)."""
    from lightserve.model_infer.models import load_model, read_model_config

    return load_model(read_model_config(model_dir), model_dir, dtype, device, tp_rank, tp_size, tp_group)


def make_tiny_model(kind: str, out_dir: Path, **overrides) -> Path:
    """Save a 2-layer model (hidden 64, 4 heads, 2 kv heads unless overridden) to out_dir; return it.
    All weights, including norms and biases, are random so every term of the forward matters."""
    import transformers

    common = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "vocab_size": 160, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
                  "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if kind == "llama3":
        cfg = transformers.LlamaConfig(**{**common, **overrides}, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**{**common, **overrides}, rope_parameters={"rope_type": "default",
                                                                                   "rope_theta": 1e6})
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**{**common, "head_dim": 24, **overrides}, tie_word_embeddings=True)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**{**common, **overrides}, sliding_window=None)
    elif kind == "llama_bias":
        cfg = transformers.LlamaConfig(**{**common, **overrides}, attention_bias=True)
    elif kind == "mistral_window":  # Mistral v0.1: every layer windowed
        cfg = transformers.MistralConfig(**{**common, "sliding_window": WINDOW, **overrides})
    elif kind == "gemma2":  # soft-capping small enough to bend the scores and logits of a tiny model
        cfg = transformers.Gemma2Config(**{**common, **GEMMA, "attn_logit_softcapping": 3.0,
                                           "final_logit_softcapping": 8.0, **overrides})
    elif kind == "gemma3":
        cfg = transformers.Gemma3TextConfig(**{**common, **GEMMA, "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, **overrides})
        cfg.architectures = ["Gemma3ForCausalLM"]
    elif kind == "phi3":  # head_dim 64 (hidden 128, 2 heads); a window on every layer
        cfg = transformers.Phi3Config(**{**common, "hidden_size": 128, "num_attention_heads": 2,
                                         "num_key_value_heads": 1, "max_position_embeddings": 512,
                                         "original_max_position_embeddings": 128, "sliding_window": WINDOW * 2,
                                         "rope_parameters": PHI3_ROPE, **overrides})
    elif kind == "mixtral":  # every layer MoE; intermediate_size is each expert's
        cfg = transformers.MixtralConfig(**{**common, **MOE, "num_local_experts": 4, **overrides})
    elif kind == "qwen3_moe":  # layer 1 dense (mlp_only_layers), q/k norm, routing weights not renormalized
        cfg = transformers.Qwen3MoeConfig(**{**common, **MOE, "num_experts": 4, "moe_intermediate_size": 32,
                                             "mlp_only_layers": [1], "norm_topk_prob": False, **overrides})
    elif kind == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(**{**common, **DEEPSEEK, **overrides})
    elif kind == "deepseek_v3_yarn":
        cfg = transformers.DeepseekV3Config(**{**common, **DEEPSEEK, **DEEPSEEK_YARN, **overrides})
    else:
        raise ValueError(kind)
    torch.manual_seed(zlib.crc32(kind.encode()))  # str hash() is salted per process
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                # Gemma's norms multiply by (1 + w): the same range of multipliers
                p.uniform_(-0.5, 0.5) if kind.startswith("gemma") else p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3: steers the expert choice, not the weights
                b.normal_(0.0, 0.1)
    model.save_pretrained(out_dir)
    return out_dir


def make_mtp_checkpoint(out_dir: Path, num_layers: int = MTP_NUM_LAYERS, **overrides) -> Path:
    """A tiny DeepSeek-V3 of `num_layers` layers whose checkpoint also holds an MTP layer: one more decoder layer
    saved by transformers (MoE, as the layers before it) becomes model.layers.{num_layers}, with random fusion
    weights and shared head beside it. `overrides`: make_tiny_model's."""
    from safetensors.torch import load_file, save_file

    make_tiny_model("deepseek_v3", out_dir, **{**overrides, "num_hidden_layers": num_layers + 1})
    config = json.loads((out_dir / "config.json").read_text())
    config.update(num_hidden_layers=num_layers, num_nextn_predict_layers=1)
    (out_dir / "config.json").write_text(json.dumps(config))
    weights = load_file(out_dir / "model.safetensors")
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    gen = torch.Generator().manual_seed(3)
    mtp = f"model.layers.{num_layers}."
    weights[mtp + "enorm.weight"] = 0.5 + torch.rand(hidden, generator=gen)
    weights[mtp + "hnorm.weight"] = 0.5 + torch.rand(hidden, generator=gen)
    weights[mtp + "eh_proj.weight"] = 0.15 * torch.randn(hidden, 2 * hidden, generator=gen)
    weights[mtp + "shared_head.norm.weight"] = 0.5 + torch.rand(hidden, generator=gen)
    weights[mtp + "shared_head.head.weight"] = 0.15 * torch.randn(vocab, hidden, generator=gen)
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir
