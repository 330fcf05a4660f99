"""ModelConfig: the architecture facts of one checkpoint, as every process needs them.

Read once by the launcher (`lightserve.model_infer.models.read_model_config`, where each model family reads
its own config.json keys) and carried inside the resolved ServerConfig to every process: the front takes
the vocab size and eos ids from it, the workers build their model from it. Plain data, no torch: the router
and the detokenizer unpickle it too.
"""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    architecture: str                # HF `architectures[0]`; the registry maps it to a family module
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float
    rope_type: str = "default"       # "default", "linear", "llama3" or "longrope" (DeepSeek-V3: "yarn", below)
    rope_factor: float = 1.0         # linear and llama3
    rope_low_freq_factor: float = 1.0   # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max_position_embeddings: int = 0  # llama3 and longrope
    rope_short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors below the original length
    rope_long_factor: tuple[float, ...] = ()   # longrope: the same from the original length on
    rope_attention_factor: float = 1.0  # longrope: cos and sin are multiplied by it
    rope_local_theta: float | None = None  # Gemma 3: the rope base of the sliding-window layers
    qkv_bias: bool = False           # Qwen2, or Llama/Qwen3 with attention_bias
    o_bias: bool = False             # Llama/Qwen3 with attention_bias
    qk_norm: bool = False            # Qwen3, Gemma 3: RMSNorm over head_dim on q and k before rope
    hidden_act: str = "silu"         # the gated MLP's activation: "silu" or "gelu_tanh"
    # Per layer: the sliding window (a token sees itself and the window - 1 before it), 0 for a global layer.
    # The KV cache keeps every token of every layer either way; only attention masks (docs/architecture.md).
    layer_windows: tuple[int, ...] = ()
    attn_scale: float = 0.0          # scores = q.k * attn_scale; 0 means head_dim ** -0.5
    attn_softcap: float = 0.0        # Gemma 2: scores -> softcap * tanh(scores / softcap); 0 = off
    final_softcap: float = 0.0       # Gemma 2: the same on the logits
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE); num_experts == 0 for a dense model.
    num_experts: int = 0             # routed experts of each MoE layer
    num_experts_per_tok: int = 0     # top-k
    moe_intermediate_size: int = 0   # of one expert (intermediate_size stays the dense MLP's)
    norm_topk_prob: bool = False     # renormalize the top-k routing weights to sum to 1
    moe_layers: tuple[int, ...] = ()  # indices of the MoE layers; the others run the dense MLP
    # The config.json keys that only one family's layers read back at load, as JSON text (plain, hashable data).
    # DeepSeek-V3 keeps its latent-attention, rope and routing keys here for MLAConfig.from_hf and
    # MoEConfig.from_hf, which stay the one parser of each, instead of a copy of their fields in this class.
    family_keys: str = ""
    # A checkpoint whose linear weights are int8 / 4-bit (compressed-tensors, AWQ, GPTQ): its validated
    # quantization_config as model_infer/hf_quant_reader.QuantScheme JSON text; "" for float weights (and GGUF).
    quantization: str = ""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")

    @property
    def max_context_len(self) -> int:
        """Longest sequence served exactly. Sliding-window layers mask, so they cap nothing."""
        return self.max_position_embeddings

    @property
    def sm_scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5

    def family_dict(self) -> dict:
        """family_keys as the config.json dict they came from ({} for families that keep none)."""
        return json.loads(self.family_keys) if self.family_keys else {}

    def window(self, layer: int) -> int:
        """The sliding window of a layer; 0 for a global one."""
        return self.layer_windows[layer] if self.layer_windows else 0
