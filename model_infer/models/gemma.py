"""The Gemma family: Gemma 2 and Gemma 3 (text), following transformers' modeling_gemma2/gemma3.

What differs from Llama: RMSNorm multiplies by (1 + w) (added to the weights once, here, at load); a norm
before and after both attention and the MLP; the embedding scaled by sqrt(hidden) in the model dtype;
a GeGLU MLP (gelu_pytorch_tanh); scores scaled by query_pre_attn_scalar ** -0.5; sliding-window layers
interleaved with global ones (`layer_types`); Gemma 2's attention and final logit soft-capping; Gemma 3's
q/k norm and its own rope base for the windowed layers (`rope_local_base_freq`).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from lightserve import kernels
from lightserve.config import KernelBackend
from lightserve.model_config import ModelConfig
from lightserve.model_infer.models import llama
from lightserve.model_infer.models.base import AttentionInputs, DecoderLM
from lightserve.model_infer.models.hf_config import base_fields, layer_windows, read_rope, refuse_keys
from lightserve.model_infer.weights import TPShards

if TYPE_CHECKING:
    from lightserve.model_infer.forward_batch import ForwardBatch
    from lightserve.model_infer.kv_cache import KVCache
    from lightserve.model_infer.weights import CheckpointReader, ModelWeights

ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")

# transformers' class defaults, for keys a config.json may omit.
_DEFAULTS = {
    "Gemma2ForCausalLM": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "pattern": 2,
                          "max_position_embeddings": 8192},
    "Gemma3ForCausalLM": {"attn_logit_softcapping": None, "final_logit_softcapping": None, "pattern": 6,
                          "max_position_embeddings": 131072},
}
_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0  # Gemma 3's defaults


def read_config(arch: str, cfg: dict) -> ModelConfig:
    defaults = _DEFAULTS[arch]
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
    refuse_keys(cfg, use_bidirectional_attention=False, attention_bias=False)
    cfg = {"max_position_embeddings": defaults["max_position_embeddings"], "tie_word_embeddings": True, **cfg}
    fields = base_fields(arch, cfg, default_head_dim=256)
    num_layers = fields["num_layers"]
    if cfg.get("layer_types") is None:  # transformers' default interleaving: every pattern-th layer is global
        pattern = int(cfg.get("sliding_window_pattern") or defaults["pattern"])
        cfg = {**cfg, "layer_types": ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                      for i in range(num_layers)]}
    rope, local_theta = _read_gemma_rope(arch, cfg)
    attn_cap = cfg.get("attn_logit_softcapping", defaults["attn_logit_softcapping"])
    final_cap = cfg.get("final_logit_softcapping", defaults["final_logit_softcapping"])
    return ModelConfig(
        **fields,
        **rope,
        rope_local_theta=local_theta,
        qk_norm=arch == "Gemma3ForCausalLM",
        hidden_act="gelu_tanh",
        layer_windows=layer_windows(cfg, cfg.get("sliding_window", 4096), num_layers),
        attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_softcap=float(attn_cap or 0.0),
        final_softcap=float(final_cap or 0.0),
    )


def tp_shards(config: ModelConfig, tp_rank: int, tp_size: int) -> TPShards:
    """Llama's rules: heads and MLP rows split evenly, KV heads split or replicated."""
    return TPShards.for_rank(config, tp_rank, tp_size)


def read_weights(reader: CheckpointReader, config: ModelConfig, sh: TPShards) -> ModelWeights:
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        layer = llama.read_layer(reader, p, config, sh)  # the same projection names as Llama
        # HF Gemma's post_attention_layernorm acts on the attention output; the pre-MLP norm is
        # pre_feedforward_layernorm.
        layers.append(dataclasses.replace(
            layer,
            input_norm=_norm(reader, p + "input_layernorm.weight"),
            attn_out_norm=_norm(reader, p + "post_attention_layernorm.weight"),
            post_attn_norm=_norm(reader, p + "pre_feedforward_layernorm.weight"),
            mlp_out_norm=_norm(reader, p + "post_feedforward_layernorm.weight"),
            q_norm=_norm(reader, p + "self_attn.q_norm.weight") if config.qk_norm else None,
            k_norm=_norm(reader, p + "self_attn.k_norm.weight") if config.qk_norm else None,
        ))
    weights = llama.read_embeddings(reader, config, sh, layers)
    return dataclasses.replace(weights, final_norm=_norm(reader, "model.norm.weight"))


class GemmaForCausalLM(DecoderLM):
    """Sandwich norms: x + post_norm(attn(norm(x))), then + post_norm(mlp(norm(.)))."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, tp_rank: int = 0, tp_size: int = 1,
                 tp_group=None, backend: KernelBackend | None = None) -> None:
        super().__init__(config, weights, tp_rank, tp_size, tp_group, backend)
        # HF keeps sqrt(hidden) as a float32 buffer and casts it to the weights' dtype before the multiply.
        scale = torch.tensor(config.hidden_size ** 0.5, dtype=torch.float32, device=self.device)
        self.embed_scale = scale.to(self.dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        cfg, w = self.config, self.weights
        eps, be = cfg.rms_norm_eps, self.backend
        attn = AttentionInputs.from_batch(batch)
        hidden = self._embed(batch.input_ids) * self.embed_scale  # [T, hidden], a fresh tensor
        residual = hidden
        for i, layer in enumerate(w.layers):
            if i == 0:
                x = kernels.rmsnorm(hidden, layer.input_norm, eps, be)
            else:
                x = kernels.add_rmsnorm(hidden, residual, layer.input_norm, eps, be)  # residual += mlp output
            a = self._attention(i, layer, x, batch, attn, kv_cache)  # [T, hidden]
            a = kernels.rmsnorm(a, layer.attn_out_norm, eps, be)
            x = kernels.add_rmsnorm(a, residual, layer.post_attn_norm, eps, be)  # residual += attention output
            hidden = kernels.rmsnorm(self._mlp(layer, x, i, batch.lora), layer.mlp_out_norm, eps, be)  # [T, hidden]
        if batch.logits_indices.shape[0] == 0:  # a step that only writes KV (a draft model's last forward)
            return hidden.new_empty(0, cfg.vocab_size, dtype=torch.float32)
        # Only the sampled positions need the final norm and lm_head.
        last_hidden = hidden[batch.logits_indices]  # [B, hidden]
        last_residual = residual[batch.logits_indices]  # [B, hidden]
        x = kernels.add_rmsnorm(last_hidden, last_residual, w.final_norm, eps, be)
        return self._logits(x, batch.argmax_only)


Model = GemmaForCausalLM


def _norm(reader: CheckpointReader, name: str) -> torch.Tensor:
    # HF's Gemma RMSNorm: normed * (1 + w), computed in float32. (1 + w) is formed in float32 here; a
    # bfloat16 model then rounds it once, where HF rounds only the product.
    raw = reader.full(name, dtype=torch.float32)
    return (1.0 + raw).to(reader.dtype)


def _read_gemma_rope(arch: str, cfg: dict) -> tuple[dict, float | None]:
    """(the global layers' rope fields, the windowed layers' rope base or None)."""
    if arch == "Gemma2ForCausalLM":
        return read_rope(cfg), None
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5: per layer type
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:  # older: rope_theta, rope_local_base_freq and an optional rope_scaling for the global layers
        full = {**(cfg.get("rope_scaling") or {}), **params}
        local = {}
        if "rope_local_base_freq" in cfg:
            local["rope_theta"] = cfg["rope_local_base_freq"]
    full.setdefault("rope_theta", cfg.get("rope_theta", _GLOBAL_THETA))
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", _LOCAL_THETA))
    if (local.get("rope_type") or local.get("type") or "default") != "default":
        raise ValueError("rope scaling on Gemma 3's sliding-window layers is not supported")
    return read_rope(cfg, full), float(local["rope_theta"])
