"""MoEBlock: the mixture-of-experts MLP of Mixtral, Qwen3-MoE and DeepSeek-V3 (HF's MixtralSparseMoeBlock,
Qwen3MoeSparseMoeBlock and DeepseekV3MoE), one class whose variants are MoEConfig fields.

Built by a model family's module per MoE layer and called with the post-attention normed hidden states [T, H].
Which layers are MoE is the caller's business (DeepSeek-V3: layers >= first_k_dense_replace; Qwen3-MoE: not in
mlp_only_layers and (i + 1) % decoder_sparse_step == 0). All math goes through lightserve.kernels.

HF checkpoint names under `model.layers.{i}.` (`load_moe_weights` reads them):
  Mixtral      block_sparse_moe.gate.weight [E, H]; block_sparse_moe.experts.{e}.w1.weight (gate) [I, H],
               .w3.weight (up) [I, H], .w2.weight (down) [H, I]
  Qwen3-MoE    mlp.gate.weight [E, H]; mlp.experts.{e}.gate_proj.weight [I, H], .up_proj.weight [I, H],
               .down_proj.weight [H, I]
  DeepSeek-V3  as Qwen3-MoE, plus mlp.gate.e_score_correction_bias [E] and mlp.shared_experts.gate_proj.weight,
               .up_proj.weight [n_shared_experts * I, H], .down_proj.weight [H, n_shared_experts * I]
transformers 5 fuses the experts when it loads (its state_dict): mlp.experts.gate_up_proj [E, 2I, H] and
mlp.experts.down_proj [E, H, I], Mixtral's block_sparse_moe renamed mlp; `load_moe_weights` reads those too.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightserve import kernels
from lightserve.config import KernelBackend
from lightserve.kernels.backend import resolve_kernel_backend
from lightserve.kernels.linear import cpu_pack_for
from lightserve.kernels.moe import (
    ExpertLinear,
    ExpertWeights,
    fused_experts,
    grouped_topk_sigmoid,
    intermediate_shard,
    pack_expert_weights,
    shard_expert_weights,
    topk_softmax,
)


class Routing(Enum):
    SOFTMAX = "softmax"  # Mixtral, Qwen3-MoE
    GROUPED_SIGMOID = "grouped_sigmoid"  # DeepSeek-V3 (topk_method "noaux_tc")


@dataclass(frozen=True)
class MoEConfig:
    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    routing: Routing
    norm_topk_prob: bool
    weights_in_model_dtype: bool = False  # Qwen3-MoE rounds the routing weights to the model dtype
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0  # DeepSeek-V3: one MLP of num_shared_experts * intermediate_size, every token
    module_name: str = "mlp"  # Mixtral's checkpoints: "block_sparse_moe"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # Mixtral: w1, w3, w2

    @classmethod
    def from_hf(cls, hf: Mapping) -> MoEConfig:
        """From a config.json dict; defaults are transformers' for keys it may omit. Raises ValueError for an
        architecture or activation this block does not implement."""
        arch = hf["architectures"][0]
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported by MoEBlock (silu only)")
        if arch == "MixtralForCausalLM":
            return cls(hf["hidden_size"], _num_experts(hf, 8), hf.get("num_experts_per_tok", 2),
                       hf["intermediate_size"], Routing.SOFTMAX, norm_topk_prob=True,
                       module_name="block_sparse_moe", expert_names=("w1", "w3", "w2"))
        if arch == "Qwen3MoeForCausalLM":
            return cls(hf["hidden_size"], _num_experts(hf, 128), hf.get("num_experts_per_tok", 8),
                       hf["moe_intermediate_size"], Routing.SOFTMAX, hf.get("norm_topk_prob", False),
                       weights_in_model_dtype=True)
        if arch == "DeepseekV3ForCausalLM":
            return cls(hf["hidden_size"], hf.get("n_routed_experts", 256), hf.get("num_experts_per_tok", 8),
                       hf["moe_intermediate_size"], Routing.GROUPED_SIGMOID, hf.get("norm_topk_prob", True),
                       n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
                       routed_scaling_factor=hf.get("routed_scaling_factor", 2.5),
                       num_shared_experts=hf.get("n_shared_experts") or 0)
        raise ValueError(f"architecture {arch!r} has no MoE block here")


@dataclass(frozen=True)
class MoEWeights:
    gate: Tensor  # [E, H] router, replicated on every rank; float32 for grouped-sigmoid routing (HF keeps it so)
    experts: ExpertWeights  # this rank's intermediate slice of every expert
    correction_bias: Tensor | None = None  # [E] float32, DeepSeek-V3
    shared_gate_up: ExpertLinear | None = None  # [2 * Is / tp, H], gate rows then up rows
    shared_down: ExpertLinear | None = None  # [H, Is / tp]


class MoEBlock:
    """x [T, H] -> [T, H]: routed experts (+ shared experts), all-reduced over the TP group like a dense MLP."""

    def __init__(self, config: MoEConfig, weights: MoEWeights, tp_size: int = 1,
                 tp_group: dist.ProcessGroup | None = None, backend: KernelBackend | None = None) -> None:
        self.config = config
        self.tp_size, self.tp_group = tp_size, tp_group
        self.backend = resolve_kernel_backend(backend, weights.experts.down.device)
        pack = cpu_pack_for(weights.experts.down) if self.backend is KernelBackend.CPU else None
        if pack is not None:  # CPU: the experts and shared MLP run on weights packed once here
            weights = replace(weights, experts=pack_expert_weights(weights.experts, pack))
            if weights.shared_gate_up is not None:
                weights = replace(weights, shared_gate_up=pack(weights.shared_gate_up),
                                  shared_down=pack(weights.shared_down))
        self.weights = weights

    def forward(self, x: Tensor) -> Tensor:
        cfg, w = self.config, self.weights
        if cfg.routing is Routing.SOFTMAX:
            logits = F.linear(x, w.gate)  # [T, E] in the model dtype, as HF
            topk_weights, topk_ids = topk_softmax(logits, cfg.top_k, cfg.norm_topk_prob)
            if cfg.weights_in_model_dtype:
                topk_weights = topk_weights.to(x.dtype)
        else:
            logits = F.linear(x.float(), w.gate)  # [T, E] float32
            topk_weights, topk_ids = grouped_topk_sigmoid(logits, w.correction_bias, cfg.top_k, cfg.n_group,
                                                          cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
        out = fused_experts(x, w.experts, topk_weights, topk_ids, self.backend)  # [T, H]
        if w.shared_gate_up is not None:
            # Both parts are partial sums over this rank's intermediate slices: one all-reduce covers them.
            act = kernels.silu_and_mul(kernels.linear(x, w.shared_gate_up), self.backend)  # [T, Is / tp]
            out += kernels.linear(act, w.shared_down)
        if self.tp_size > 1:
            dist.all_reduce(out, group=self.tp_group)
        return out

    __call__ = forward


def load_moe_weights(tensors: Mapping[str, Tensor], layer_prefix: str, config: MoEConfig, dtype: torch.dtype,
                     device: torch.device | str = "cpu", tp_rank: int = 0, tp_size: int = 1) -> MoEWeights:
    """Rank tp_rank's MoEWeights of one layer from checkpoint tensors (`layer_prefix` e.g. "model.layers.3."),
    per-expert or transformers-5 fused names. Raises ValueError when the intermediate sizes do not split by tp_size."""
    cfg = config
    rows = intermediate_shard(cfg.intermediate_size, tp_rank, tp_size)
    fused = f"{layer_prefix}mlp.experts.gate_up_proj"
    if fused in tensors:
        experts = shard_expert_weights(tensors[fused], tensors[f"{layer_prefix}mlp.experts.down_proj"], tp_rank,
                                       tp_size)
        module = "mlp"
    else:
        module = cfg.module_name
        gate_name, up_name, down_name = cfg.expert_names
        expert = f"{layer_prefix}{module}.experts.{{}}.{{}}.weight".format
        gate_up = torch.stack([torch.cat([tensors[expert(e, gate_name)][rows], tensors[expert(e, up_name)][rows]])
                               for e in range(cfg.num_experts)])  # [E, 2I/tp, H]
        down = torch.stack([tensors[expert(e, down_name)][:, rows] for e in range(cfg.num_experts)])  # [E, H, I/tp]
        experts = ExpertWeights(gate_up, down)
    def to(t):
        return t.to(device, dtype).contiguous()
    grouped = cfg.routing is Routing.GROUPED_SIGMOID
    gate = tensors[f"{layer_prefix}{module}.gate.weight"].to(device, torch.float32 if grouped else dtype)
    weights = MoEWeights(gate, ExpertWeights(to(experts.gate_up), to(experts.down)))
    if grouped:
        weights = replace(weights, correction_bias=tensors[f"{layer_prefix}mlp.gate.e_score_correction_bias"].to(
            device, torch.float32))
    if cfg.num_shared_experts:
        shared = f"{layer_prefix}mlp.shared_experts."
        srows = intermediate_shard(cfg.num_shared_experts * cfg.intermediate_size, tp_rank, tp_size)
        weights = replace(weights, shared_gate_up=to(torch.cat([tensors[f"{shared}gate_proj.weight"][srows],
                                                                tensors[f"{shared}up_proj.weight"][srows]])),
                          shared_down=to(tensors[f"{shared}down_proj.weight"][:, srows]))
    return weights


def _num_experts(hf: Mapping, default: int) -> int:
    # Hub configs spell it num_experts (Qwen3-MoE) or num_local_experts (Mixtral); transformers 5 saves both
    # families as num_local_experts.
    return hf.get("num_experts") or hf.get("num_local_experts") or default
