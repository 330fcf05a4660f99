"""The mixture-of-experts decoders: Mixtral and Qwen3-MoE, Llama's forward with the MLP of the MoE layers
replaced by a `moe_layers.MoEBlock`.

Attention is read and run as Llama's: Mixtral's as Mistral's (no biases, a window on every layer when the config
sets one), Qwen3-MoE's as Qwen3's (q/k norm, attention_bias on all four projections). The MoE fields of
ModelConfig (num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob, moe_layers) say which
layers are MoE: every Mixtral layer; Qwen3-MoE's layers not in `mlp_only_layers` whose (i + 1) is a multiple of
`decoder_sparse_step` (the others run a dense MLP of intermediate_size). Tensor parallelism: heads as Llama's,
each expert's intermediate dim split over the ranks (the block all-reduces like a dense MLP); the router is
replicated. From a GGUF file each expert is its slice of the layer's 3-D ffn_*_exps tensor, kept in GGML blocks
(QuantLinear, one per expert, run by kernels.linear in the CPU grouped loop).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from lightserve.config import KernelBackend
from lightserve.kernels.moe import ExpertWeights, intermediate_shard, shard_expert_weights, warm_up_fused_experts
from lightserve.kernels.quant_linear import QuantLinear
from lightserve.model_config import ModelConfig
from lightserve.model_infer.models import llama
from lightserve.model_infer.moe_layers import MoEBlock, MoEConfig, MoEWeights
from lightserve.model_infer.weights import TPShards, cat_weights, stack_weights

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch.distributed as dist

    from lightserve.kernels.lora import LoraSegments
    from lightserve.model_infer.kv_cache import KVCache
    from lightserve.model_infer.weights import CheckpointReader, LayerWeights, ModelWeights

ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
# The dense architecture whose attention (and config keys) each one shares.
_DENSE = {"MixtralForCausalLM": "MistralForCausalLM", "Qwen3MoeForCausalLM": "Qwen3ForCausalLM"}


def read_config(arch: str, cfg: dict) -> ModelConfig:
    moe = MoEConfig.from_hf({**cfg, "architectures": [arch]})  # ValueError for an activation it does not run
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    num_layers = int(cfg["num_hidden_layers"])
    # transformers' MoE classes default head_dim to hidden / heads (not Qwen3's 128).
    dense = {**cfg, "head_dim": cfg.get("head_dim") or hidden // heads}
    window = None
    if arch == "Qwen3MoeForCausalLM":
        # Qwen3-MoE windows every layer when use_sliding_window is set (no max_window_layers, unlike Qwen3).
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        dense["use_sliding_window"] = False
        dense_only = set(cfg.get("mlp_only_layers") or ())
        step = int(cfg.get("decoder_sparse_step", 1))
        moe_layers = tuple(i for i in range(num_layers)
                           if i not in dense_only and moe.num_experts > 0 and (i + 1) % step == 0)
    else:
        moe_layers = tuple(range(num_layers))
    config = llama.read_config(_DENSE[arch], dense)
    return dataclasses.replace(
        config,
        architecture=arch,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        moe_intermediate_size=moe.intermediate_size,
        norm_topk_prob=moe.norm_topk_prob,
        moe_layers=moe_layers,
        layer_windows=(int(window),) * num_layers if window else config.layer_windows,
    )


def moe_config(config: ModelConfig) -> MoEConfig:
    """The MoEBlock's config from the ModelConfig's MoE fields."""
    return MoEConfig.from_hf({
        "architectures": [config.architecture], "hidden_size": config.hidden_size, "hidden_act": config.hidden_act,
        "num_experts": config.num_experts, "num_experts_per_tok": config.num_experts_per_tok,
        "intermediate_size": config.moe_intermediate_size, "moe_intermediate_size": config.moe_intermediate_size,
        "norm_topk_prob": config.norm_topk_prob,
    })


def tp_shards(config: ModelConfig, tp_rank: int, tp_size: int) -> TPShards:
    """Llama's rules for the heads and the dense MLP (when some layer has one); ValueError unless tp_size also
    divides moe_intermediate_size."""
    intermediate_shard(config.moe_intermediate_size, tp_rank, tp_size)
    if len(config.moe_layers) == config.num_layers:  # no dense MLP whose size must split
        config = dataclasses.replace(config, intermediate_size=config.moe_intermediate_size)
    return TPShards.for_rank(config, tp_rank, tp_size)


def read_weights(reader: CheckpointReader, config: ModelConfig, sh: TPShards) -> ModelWeights:
    moe = moe_config(config)
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        if i in config.moe_layers:
            layer = llama.read_layer(reader, p, config, sh, mlp=False)
            layers.append(dataclasses.replace(layer, moe=read_experts(reader, p, moe, sh)))
        else:
            layers.append(llama.read_layer(reader, p, config, sh))
    return llama.read_embeddings(reader, config, sh, layers)


def read_experts(reader: CheckpointReader, p: str, cfg: MoEConfig, sh: TPShards) -> MoEWeights:
    """One MoE layer's router and this rank's slice of every expert, from the per-expert checkpoint names or
    transformers 5's fused ones (see moe_layers)."""
    if reader.has(p + "mlp.experts.gate_up_proj"):
        experts = shard_expert_weights(reader.full(p + "mlp.experts.gate_up_proj"),
                                       reader.full(p + "mlp.experts.down_proj"), sh.tp_rank, sh.tp_size)
        module = "mlp"
    else:
        module = cfg.module_name
        rows = intermediate_shard(cfg.intermediate_size, sh.tp_rank, sh.tp_size)
        gate, up, down = cfg.expert_names
        name = f"{p}{module}.experts.{{}}.{{}}.weight".format
        experts = ExpertWeights(
            stack_weights([cat_weights([reader.rows(name(e, gate), rows.start, rows.stop),
                                        reader.rows(name(e, up), rows.start, rows.stop)])
                           for e in range(cfg.num_experts)]),  # [E, 2I/tp, H]
            stack_weights([reader.cols(name(e, down), rows.start, rows.stop)
                           for e in range(cfg.num_experts)]),  # [E, H, I/tp]
        )
    # The router [E, H] as a tensor in the model dtype (dequantized where a GGUF file stores it in blocks).
    return MoEWeights(reader.full(f"{p}{module}.gate.weight", reader.dtype), experts)


class MoEForCausalLM(llama.LlamaForCausalLM):
    """Llama's forward; the MoE layers' feed-forward is their MoEBlock (which packs its experts on CPU)."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, tp_rank: int = 0, tp_size: int = 1,
                 tp_group: dist.ProcessGroup | None = None, backend: KernelBackend | None = None) -> None:
        super().__init__(config, weights, tp_rank, tp_size, tp_group, backend)
        moe = moe_config(config)
        self.moe_blocks = {i: _make_block(moe, layer.moe, tp_size, tp_group, self.backend)
                           for i, layer in enumerate(self.weights.layers) if layer.moe is not None}
        # The blocks hold the (packed) experts; the layers drop the loaded copies.
        self.weights = dataclasses.replace(
            self.weights, layers=[dataclasses.replace(layer, moe=None) for layer in self.weights.layers])

    def _ffn(self, i: int, layer: LayerWeights, x: torch.Tensor, lora: LoraSegments | None = None) -> torch.Tensor:
        """A MoE layer's block, a dense layer's MLP. Adapters target attention only here (lora_adapter refuses
        MLP targets on MoE models), so the dense MLP's LoRA groups are always skipped."""
        block = self.moe_blocks.get(i)
        return self._mlp(layer, x, i, lora) if block is None else block(x)

    def warm_up_kernels(self, kv_cache: KVCache, req_rows: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Decode attention as every family, plus the MoE blocks' grouped GEMMs at both block sizes."""
        super().warm_up_kernels(kv_cache, req_rows, seq_lens)
        warm_up_moe_blocks(self.moe_blocks.values(), self.dtype, self.device)


class _QuantMoEBlock(MoEBlock):
    """A MoEBlock whose experts are kept in GGML blocks (one QuantLinear each): nothing to pack, and the CPU path
    runs them (quantized weights are served on CPU only)."""

    def __init__(self, config: MoEConfig, weights: MoEWeights, tp_size: int = 1,
                 tp_group: dist.ProcessGroup | None = None) -> None:
        self.config, self.weights = config, weights
        self.tp_size, self.tp_group = tp_size, tp_group
        self.backend = KernelBackend.CPU


def _make_block(config: MoEConfig, weights: MoEWeights, tp_size: int, tp_group: dist.ProcessGroup | None,
                backend: KernelBackend) -> MoEBlock:
    if isinstance(weights.experts.down, tuple) and isinstance(weights.experts.down[0], QuantLinear):
        if backend is not KernelBackend.CPU:
            raise ValueError("experts kept in GGML blocks run on the CPU backend only")
        return _QuantMoEBlock(config, weights, tp_size, tp_group)
    return MoEBlock(config, weights, tp_size, tp_group, backend)


def warm_up_moe_blocks(blocks: Iterable[MoEBlock], dtype: torch.dtype, device: torch.device) -> None:
    """Compile the fused-MoE grouped GEMM at both block sizes fused_experts picks (by the step's pair count), with
    the blocks' expert shapes and routing-weight dtype; once per distinct block shape (a model's MoE blocks usually
    share one). Nothing to compile under the CPU backend. Shared with models/deepseek.py."""
    warmed = set()
    for block in blocks:
        cfg, experts = block.config, block.weights.experts
        if block.backend is not KernelBackend.TRITON:
            return
        route_dtype = dtype if cfg.weights_in_model_dtype else torch.float32  # as MoEBlock.forward routes
        shape = (tuple(experts.gate_up.shape), tuple(experts.down.shape), cfg.top_k, route_dtype)
        if shape in warmed:
            continue
        warmed.add(shape)
        x = torch.zeros(1, cfg.hidden_size, dtype=dtype, device=device)  # [T, H], as the post-attention norm makes it
        warm_up_fused_experts(x, experts, cfg.top_k, route_dtype)


Model = MoEForCausalLM
