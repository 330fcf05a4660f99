"""Phi-3 (Phi3ForCausalLM): Llama's forward on checkpoints with fused projections and longrope scaling.

Its own parts: the fused `qkv_proj` ([q | k | v] rows) and `gate_up_proj` ([gate | up] rows), of which a
rank reads its own row ranges of each piece; longrope's short and long factors and attention factor
(read by hf_config.read_rope, applied by model_infer/rope.py); a sliding window on every layer when the
config sets one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from lightserve.model_config import ModelConfig
from lightserve.model_infer.models.hf_config import base_fields, layer_windows, read_rope, refuse_keys
from lightserve.model_infer.models.llama import LlamaForCausalLM, read_embeddings
from lightserve.model_infer.weights import LayerWeights, TPShards

if TYPE_CHECKING:
    from lightserve.model_infer.weights import CheckpointReader, ModelWeights

ARCHITECTURES = ("Phi3ForCausalLM",)


def read_config(arch: str, cfg: dict) -> ModelConfig:
    refuse_keys(cfg, hidden_act="silu", attention_bias=False, mlp_bias=False)
    fields = base_fields(arch, cfg)
    return ModelConfig(
        **fields,
        **read_rope(cfg),
        # transformers' Phi-3 windows every layer when the config has one (Phi-3-mini-4k: 2047).
        layer_windows=layer_windows({k: v for k, v in cfg.items() if k != "layer_types"}, cfg.get("sliding_window"),
                                    fields["num_layers"]),
    )


def tp_shards(config: ModelConfig, tp_rank: int, tp_size: int) -> TPShards:
    """Llama's rules, cut inside the fused matrices."""
    return TPShards.for_rank(config, tp_rank, tp_size)


def read_weights(reader: CheckpointReader, config: ModelConfig, sh: TPShards) -> ModelWeights:
    d, hq, hk, inter = config.head_dim, config.num_heads, config.num_kv_heads, config.intermediate_size
    q_rows = (sh.q_head_start * d, (sh.q_head_start + sh.num_heads) * d)
    kv = (sh.kv_head_start * d, (sh.kv_head_start + sh.num_kv_heads) * d)
    k_rows = (hq * d + kv[0], hq * d + kv[1])            # k follows all q rows
    v_rows = ((hq + hk) * d + kv[0], (hq + hk) * d + kv[1])  # v follows all k rows
    gate_rows = (sh.inter_start, sh.inter_start + sh.inter_size)
    up_rows = (inter + gate_rows[0], inter + gate_rows[1])  # up follows all gate rows
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        layers.append(LayerWeights(
            input_norm=reader.full(p + "input_layernorm.weight"),
            qkv_proj=reader.row_ranges(p + "self_attn.qkv_proj.weight", [q_rows, k_rows, v_rows]),
            qkv_bias=None,
            q_norm=None,
            k_norm=None,
            o_proj=reader.cols(p + "self_attn.o_proj.weight", *q_rows),
            o_bias=None,
            post_attn_norm=reader.full(p + "post_attention_layernorm.weight"),
            gate_up_proj=reader.row_ranges(p + "mlp.gate_up_proj.weight", [gate_rows, up_rows]),
            down_proj=reader.cols(p + "mlp.down_proj.weight", *gate_rows),
        ))
    return read_embeddings(reader, config, sh, layers)


Model = LlamaForCausalLM  # Phi-3's forward is Llama's: pre-norm, SwiGLU, rope on the whole head
