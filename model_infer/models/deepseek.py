"""The DeepSeek-V3 family (DeepseekV3ForCausalLM): multi-head latent attention over a latent KV cache, a dense MLP
on the first `first_k_dense_replace` layers and a mixture of experts on the others (HF's DeepseekV3Model).

Each layer's attention is an `mla_layer.MLAAttention` over `LatentKVCache.latent_caches[i]` (the model makes that
cache for the worker: one row of kv_lora_rank + qk_rope_head_dim values per token and layer); each MoE layer's
feed-forward is a `moe_layers.MoEBlock` (grouped sigmoid top-k with the correction bias, routed_scaling_factor,
norm_topk_prob, plus the shared experts). Their configs are parsed by MLAConfig.from_hf and MoEConfig.from_hf from
the config.json keys that read_config keeps in ModelConfig.family_keys. The forward is Llama's: pre-norm, the
residual add fused into the norms.

Refused at start: another router (`topk_method`, `scoring_func`), `moe_layer_freq` != 1, a rope type other than
default or yarn, and (by the registry) a quantized checkpoint such as DeepSeek's FP8 release. DeepSeek-V2
(DeepseekV2ForCausalLM: softmax routing, other group rules) is not listed, so the registry refuses it by name.
Multi-token-prediction layers (`num_nextn_predict_layers`, stored after the main layers as
model.layers.{num_hidden_layers}.*) only serve speculative decoding: the main model does not load them;
--speculative_algorithm mtp loads the first as a model of its own (model_infer/mtp_drafter.py).

Tensor parallelism: the heads split (q/q_b, kv_b and o_proj rows of MLAAttention), the latent projections and the
latent cache are replicated; every expert's, the shared experts' and the dense MLP's intermediate dims split. Each
block then ends in one all-reduce, as for Llama.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lightserve.kernels.mla_attention import warm_up_mla_decode_attention
from lightserve.kernels.moe import intermediate_shard
from lightserve.log import get_logger
from lightserve.model_config import ModelConfig
from lightserve.model_infer.latent_kv_cache import LatentKVCache
from lightserve.model_infer.mla_layer import MLAAttention, MLAConfig, build_mla_cos_sin, load_mla_weights
from lightserve.model_infer.models import llama
from lightserve.model_infer.models.hf_config import base_fields, refuse_keys
from lightserve.model_infer.models.moe import warm_up_moe_blocks
from lightserve.model_infer.moe_layers import MoEBlock, MoEConfig, load_moe_weights
from lightserve.model_infer.weights import TPShards

if TYPE_CHECKING:
    from collections.abc import Callable

    from lightserve.kernels.linear import PackedLinear, PrepackedLinear
    from lightserve.model_infer.forward_batch import ForwardBatch
    from lightserve.model_infer.mla_layer import MLAWeights
    from lightserve.model_infer.models.base import AttentionInputs
    from lightserve.model_infer.moe_layers import MoEWeights
    from lightserve.model_infer.weights import CheckpointReader, ModelWeights

    LinearWeight = torch.Tensor | PackedLinear | PrepackedLinear

logger = get_logger(__name__)

ARCHITECTURES = ("DeepseekV3ForCausalLM",)
# The config.json keys MLAConfig.from_hf and MoEConfig.from_hf read, kept in ModelConfig.family_keys.
_LAYER_KEYS = (
    "hidden_size", "hidden_act", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "rope_scaling",
    "rope_theta", "rope_interleave", "attention_bias", "n_routed_experts", "num_experts_per_tok",
    "moe_intermediate_size", "norm_topk_prob", "n_group", "topk_group", "routed_scaling_factor", "n_shared_experts",
    "num_nextn_predict_layers",  # not a layer key: whether the checkpoint has an MTP layer (model_infer/mtp_drafter.py)
)
_DEFAULT_FIRST_DENSE = 3  # transformers' DeepseekV3Config.first_k_dense_replace


def read_config(arch: str, cfg: dict) -> ModelConfig:
    # "noaux_tc" (sigmoid scores, a bias that steers the choice but not the weights) is the router MoEBlock runs.
    refuse_keys(cfg, topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1)
    cfg = {**cfg, "architectures": [arch]}
    mla, moe = MLAConfig.from_hf(cfg), MoEConfig.from_hf(cfg)  # ValueError for a rope type / activation not run
    if moe.num_experts % moe.n_group:
        raise ValueError(f"n_routed_experts {moe.num_experts} is not a multiple of n_group {moe.n_group}")
    fields = base_fields(arch, cfg)
    num_layers = fields["num_layers"]
    first_dense = cfg.get("first_k_dense_replace")
    first_dense = _DEFAULT_FIRST_DENSE if first_dense is None else int(first_dense)
    return ModelConfig(
        # As transformers' config: head_dim is the rotary dim (qk_rope_head_dim), and every head has its own K and
        # V once the latents are up-projected, so there are as many KV heads as heads.
        **{**fields, "head_dim": mla.qk_rope_head_dim, "num_kv_heads": mla.num_heads},
        rope_theta=float(mla.rope_theta),
        rope_type=mla.rope_type,
        attn_scale=mla.sm_scale,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        moe_intermediate_size=moe.intermediate_size,
        norm_topk_prob=moe.norm_topk_prob,
        moe_layers=tuple(range(first_dense, num_layers)),
        family_keys=json.dumps({k: cfg[k] for k in _LAYER_KEYS if k in cfg}, sort_keys=True),
    )


def mtp_layer_index(config: ModelConfig) -> int:
    """N, the MTP layer's index in checkpoint names (model.layers.N.*). ValueError naming --speculative_algorithm for
    a model without one: another family, or a DeepSeek-V3 config with num_nextn_predict_layers 0."""
    if config.architecture != "DeepseekV3ForCausalLM":
        raise ValueError(f"--speculative_algorithm mtp: {config.architecture} has no multi-token-prediction layer "
                         "(DeepSeek-V3's is served)")
    if int(config.family_dict().get("num_nextn_predict_layers") or 0) < 1:
        raise ValueError("--speculative_algorithm mtp: the model's config.json sets no num_nextn_predict_layers")
    return config.num_layers


def mla_config(config: ModelConfig) -> MLAConfig:
    """Every layer's MLAConfig, from the config.json keys read_config kept."""
    return MLAConfig.from_hf(config.family_dict())


def moe_config(config: ModelConfig) -> MoEConfig:
    """Every MoE layer's MoEConfig, from the config.json keys read_config kept."""
    return MoEConfig.from_hf({**config.family_dict(), "architectures": [config.architecture]})


def tp_shards(config: ModelConfig, tp_rank: int, tp_size: int) -> TPShards:
    """The heads and the dense MLP split as Llama's (TPShards.for_rank); ValueError naming num_attention_heads,
    intermediate_size or moe_intermediate_size (and so the shared experts' n_shared_experts multiple of it) when
    tp_size does not divide it."""
    intermediate_shard(config.moe_intermediate_size, tp_rank, tp_size)
    if len(config.moe_layers) == config.num_layers:  # no dense MLP whose size must split
        config = dataclasses.replace(config, intermediate_size=config.moe_intermediate_size)
    return TPShards.for_rank(config, tp_rank, tp_size)


@dataclass
class DeepseekLayerWeights:
    """One layer of this rank. The model's MLAAttention and MoEBlock take `attn` and `moe` over (and pack them on
    CPU); the layer then keeps the norms and a dense layer's MLP."""
    input_norm: torch.Tensor                 # [hidden], before attention
    post_attn_norm: torch.Tensor             # [hidden], before the MLP / experts
    attn: MLAWeights | None                  # this rank's heads; None once the model's MLAAttention holds them
    gate_up_proj: LinearWeight | None = None  # dense layers: [2 * I_local, hidden], rows gate | up
    down_proj: LinearWeight | None = None     # dense layers: [hidden, I_local]
    moe: MoEWeights | None = None             # MoE layers, until the model's MoEBlock holds them


def read_weights(reader: CheckpointReader, config: ModelConfig, sh: TPShards) -> ModelWeights:
    mla, moe = mla_config(config), moe_config(config)
    dtype, device = reader.dtype, reader.device
    inter = (sh.inter_start, sh.inter_start + sh.inter_size)
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        layer = DeepseekLayerWeights(
            input_norm=reader.full(p + "input_layernorm.weight"),
            post_attn_norm=reader.full(p + "post_attention_layernorm.weight"),
            attn=load_mla_weights(reader, p, mla, dtype, device, sh.tp_rank, sh.tp_size),
        )
        if i in config.moe_layers:
            layer.moe = load_moe_weights(reader, p, moe, dtype, device, sh.tp_rank, sh.tp_size)
        else:
            layer.gate_up_proj = torch.cat([reader.rows(p + "mlp.gate_proj.weight", *inter),
                                            reader.rows(p + "mlp.up_proj.weight", *inter)])
            layer.down_proj = reader.cols(p + "mlp.down_proj.weight", *inter)
        layers.append(layer)
    mtp = f"model.layers.{config.num_layers}."
    if any(name.startswith(mtp) for name in reader):
        logger.info("the multi-token-prediction layer %s* is not part of the model (--speculative_algorithm mtp "
                    "loads it as the drafter)", mtp)
    return llama.read_embeddings(reader, config, sh, layers)


class DeepseekV3ForCausalLM(llama.LlamaForCausalLM):
    """Llama's forward, whose attention is MLA over the latent cache and whose MoE layers run their MoEBlock."""

    def _init_layers(self, pack: Callable[[torch.Tensor], PackedLinear | PrepackedLinear] | None) -> None:
        mla = mla_config(self.config)
        self.mla = mla
        self.num_heads = self.weights.shards.num_heads  # this rank's
        self.latent_dim = mla.kv_lora_rank + mla.qk_rope_head_dim  # one cache row per token and layer
        self.cos_sin = build_mla_cos_sin(mla, device=self.device)  # [max_pos, Dr] float32, shared by the layers
        moe = moe_config(self.config)
        layers = self.weights.layers
        # Each MLAAttention and MoEBlock packs its own weights on CPU.
        self.mla_layers = [MLAAttention(mla, layer.attn, self.cos_sin, self.tp_size, self.tp_group, self.backend)
                           for layer in layers]
        self.moe_blocks = {i: MoEBlock(moe, layer.moe, self.tp_size, self.tp_group, self.backend)
                           for i, layer in enumerate(layers) if layer.moe is not None}
        # The layers drop what the blocks hold (so the unpacked copies are freed) and pack the dense MLPs.
        slim = []
        for layer in layers:
            layer = dataclasses.replace(layer, attn=None, moe=None)
            if pack is not None and layer.gate_up_proj is not None:
                layer = dataclasses.replace(layer, gate_up_proj=pack(layer.gate_up_proj),
                                            down_proj=pack(layer.down_proj))
            slim.append(layer)
        self.weights = dataclasses.replace(self.weights, layers=slim)

    def _attention(self, i: int, layer: DeepseekLayerWeights, x: torch.Tensor, batch: ForwardBatch,
                   attn: AttentionInputs, kv_cache: LatentKVCache) -> torch.Tensor:
        return self.mla_layers[i](x, batch, kv_cache.latent_caches[i], kv_cache.latent_scales[i])  # [T, hidden]

    def _ffn(self, i: int, layer: DeepseekLayerWeights, x: torch.Tensor, lora: None = None) -> torch.Tensor:
        # No LoRA here: lora_adapter.lora_target_modules refuses --enable_lora on DeepSeek.
        block = self.moe_blocks.get(i)
        return self._mlp(layer, x) if block is None else block(x)

    def kv_bytes_per_token(self, kv_dtype: torch.dtype | None = None) -> int:
        return LatentKVCache.bytes_per_token(self.config.num_layers, self.latent_dim, kv_dtype or self.dtype)

    def make_kv_cache(self, num_kv_rows: int, num_req_rows: int, max_req_total_len: int,
                      kv_dtype: torch.dtype | None = None) -> LatentKVCache:
        """The latent rows MLAAttention reads and writes, every rank all of them (the heads split, the latents
        do not), stored as `kv_dtype` (None = the activation dtype)."""
        return LatentKVCache(self.config.num_layers, num_kv_rows, self.latent_dim, num_req_rows, max_req_total_len,
                             kv_dtype or self.dtype, self.device)

    def warm_up_attention(self, kv_cache: LatentKVCache, req_rows: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Compile the MLA decode kernel at every split count, with the shapes and strides mla_decode passes."""
        heads, mla = self.num_heads, self.mla
        nope, rope = mla.qk_nope_head_dim, mla.qk_rope_head_dim
        # q_latent comes out of a bmm over the heads: a [1, H, R] transposed view of [H, 1, R].
        q_latent = torch.zeros(heads, 1, mla.kv_lora_rank, dtype=self.dtype, device=self.device).transpose(0, 1)
        # q_pe is the rope part of the [1, H, Dn + Dr] query projection.
        q_pe = torch.zeros(1, heads, nope + rope, dtype=self.dtype, device=self.device)[..., nope:]
        warm_up_mla_decode_attention(q_latent, q_pe, kv_cache.latent_caches[0], kv_cache.req_to_token, req_rows,
                                     seq_lens, kv_cache.latent_scales[0])

    def warm_up_kernels(self, kv_cache: LatentKVCache, req_rows: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """MLA decode at every split count (warm_up_attention), plus the MoE blocks' grouped GEMMs at both block
        sizes."""
        super().warm_up_kernels(kv_cache, req_rows, seq_lens)
        warm_up_moe_blocks(self.moe_blocks.values(), self.dtype, self.device)


Model = DeepseekV3ForCausalLM
