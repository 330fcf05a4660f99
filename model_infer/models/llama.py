"""The Llama family: Llama, Mistral, Qwen2 and Qwen3, one forward for all.

Variants are ModelConfig fields read here (biases, q/k norm, rope scaling, Mistral's sliding window, Qwen's
optional one), never subclasses. Also the forward of Phi-3 (models/phi3.py reads its own checkpoints).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lightserve import envs, kernels
from lightserve.config import KernelBackend
from lightserve.kernels.decoder_layers import LORA_C_DTYPES, CpuDecoderLayers, DecoderLayer, ModelShape
from lightserve.kernels.prefill_attention import sdpa_takes_fresh_prefills
from lightserve.log import get_logger
from lightserve.model_config import ModelConfig
from lightserve.model_infer.models.base import AttentionInputs, DecoderLM
from lightserve.model_infer.models.hf_config import base_fields, layer_windows, read_rope, refuse_keys
from lightserve.model_infer.weights import LayerWeights, ModelWeights, TPShards, cat_weights, vocab_rows

if TYPE_CHECKING:
    from lightserve.kernels.lora import LoraSegments
    from lightserve.model_infer.forward_batch import ForwardBatch
    from lightserve.model_infer.kv_cache import KVCache
    from lightserve.model_infer.lora import LoraWeights
    from lightserve.model_infer.weights import CheckpointReader

logger = get_logger(__name__)

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

# transformers' per-class defaults for keys a config.json may omit.
_DEFAULT_HEAD_DIM = {"Qwen3ForCausalLM": 128}


def read_config(arch: str, cfg: dict) -> ModelConfig:
    refuse_keys(cfg, hidden_act="silu", mlp_bias=False)
    fields = base_fields(arch, cfg, _DEFAULT_HEAD_DIM.get(arch))
    attention_bias = bool(cfg.get("attention_bias", False))
    window = cfg.get("sliding_window")
    if arch == "MistralForCausalLM":  # every layer is windowed (transformers ignores Mistral's layer_types)
        cfg = {k: v for k, v in cfg.items() if k != "layer_types"}
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not cfg.get("use_sliding_window", False):
            window = None
        elif window and cfg.get("layer_types") is None:  # transformers' default: layers from max_window_layers
            first = int(cfg.get("max_window_layers", 28))
            cfg = {**cfg, "layer_types": ["sliding_attention" if i >= first else "full_attention"
                                          for i in range(int(cfg["num_hidden_layers"]))]}
    return ModelConfig(
        **fields,
        **read_rope(cfg),
        # Qwen2 always has q/k/v bias and no o bias; Llama and Qwen3 put attention_bias on all four;
        # Mistral has none.
        qkv_bias=arch == "Qwen2ForCausalLM" or (arch != "MistralForCausalLM" and attention_bias),
        o_bias=arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and attention_bias,
        qk_norm=arch == "Qwen3ForCausalLM",
        layer_windows=layer_windows(cfg, window, fields["num_layers"]),
    )


def tp_shards(config: ModelConfig, tp_rank: int, tp_size: int) -> TPShards:
    """Heads and MLP rows split evenly; KV heads split or replicated (weights.TPShards)."""
    return TPShards.for_rank(config, tp_rank, tp_size)


def read_weights(reader: CheckpointReader, config: ModelConfig, sh: TPShards) -> ModelWeights:
    layers = [read_layer(reader, f"model.layers.{i}.", config, sh) for i in range(config.num_layers)]
    return read_embeddings(reader, config, sh, layers)


def read_layer(reader: CheckpointReader, p: str, config: ModelConfig, sh: TPShards, mlp: bool = True) -> LayerWeights:
    """One layer's q/k/v/o and gate/up/down slices under HF Llama's names (Gemma's are the same).
    mlp=False: the attention and norms only (a MoE layer, whose experts models/moe.py reads)."""
    q_rows, kv_rows, inter_rows = _row_ranges(config, sh)
    attn, ffn = p + "self_attn.", p + "mlp."
    qkv = cat_weights([
        reader.rows(attn + "q_proj.weight", *q_rows),
        reader.rows(attn + "k_proj.weight", *kv_rows),
        reader.rows(attn + "v_proj.weight", *kv_rows),
    ])
    qkv_bias = None
    if config.qkv_bias:
        qkv_bias = torch.cat([
            reader.rows(attn + "q_proj.bias", *q_rows),
            reader.rows(attn + "k_proj.bias", *kv_rows),
            reader.rows(attn + "v_proj.bias", *kv_rows),
        ])
    return LayerWeights(
        input_norm=reader.full(p + "input_layernorm.weight"),
        qkv_proj=qkv,
        qkv_bias=qkv_bias,
        q_norm=reader.full(attn + "q_norm.weight") if config.qk_norm else None,
        k_norm=reader.full(attn + "k_norm.weight") if config.qk_norm else None,
        o_proj=reader.cols(attn + "o_proj.weight", *q_rows),
        o_bias=reader.full(attn + "o_proj.bias") if config.o_bias else None,
        post_attn_norm=reader.full(p + "post_attention_layernorm.weight"),
        gate_up_proj=cat_weights([
            reader.rows(ffn + "gate_proj.weight", *inter_rows),
            reader.rows(ffn + "up_proj.weight", *inter_rows),
        ]) if mlp else None,
        down_proj=reader.cols(ffn + "down_proj.weight", *inter_rows) if mlp else None,
    )


def read_embeddings(reader: CheckpointReader, config: ModelConfig, sh: TPShards,
                    layers: list[LayerWeights]) -> ModelWeights:
    """The embedding, final norm and lm_head under HF's names (every family so far) around `layers`."""
    embed = vocab_rows(reader, "model.embed_tokens.weight", config, sh)
    # NOTE: a checkpoint without lm_head.weight is tied whatever its config says.
    tied = config.tie_word_embeddings or not reader.has("lm_head.weight")
    lm_head = embed if tied else vocab_rows(reader, "lm_head.weight", config, sh)
    return ModelWeights(
        shards=sh, embed=embed, layers=layers, final_norm=reader.full("model.norm.weight"), lm_head=lm_head
    )


def _row_ranges(config: ModelConfig, sh: TPShards) -> tuple[tuple[int, int], ...]:
    """This rank's rows of q, of k (and v), and of gate (and up), each within its own matrix."""
    d = config.head_dim
    return ((sh.q_head_start * d, (sh.q_head_start + sh.num_heads) * d),
            (sh.kv_head_start * d, (sh.kv_head_start + sh.num_kv_heads) * d),
            (sh.inter_start, sh.inter_start + sh.inter_size))


class LlamaForCausalLM(DecoderLM):
    """Pre-norm decoder: x + attn(norm(x)), then + mlp(norm(.)); the residual add is fused into the norm.

    On CPU, where every kernel of a layer runs in C, the layers run in one C call (kernels/decoder_layers.py):
    the same kernels as the loop below, bit for bit, without the Python between them, LoRA deltas included. With
    bf16 GEMMs on oneDNN above a few rows (an AMX CPU without the tile GEMM), that is the steps of up to PAIR_MAX_M
    tokens; the loop runs the others, and the bf16 steps whose prefills run torch's SDPA (an AMX CPU whose C
    attention has no tiles)."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, tp_rank: int = 0, tp_size: int = 1,
                 tp_group: dist.ProcessGroup | None = None, backend: KernelBackend | None = None) -> None:
        super().__init__(config, weights, tp_rank, tp_size, tp_group, backend)
        self.cpu_layers = self._build_cpu_layers()

    def _build_cpu_layers(self) -> CpuDecoderLayers | None:
        """The one-call CPU driver, or None: under the triton backend, with tensor parallelism (an all-reduce inside
        each layer), for a family whose layers differ from Llama's (its own _ffn, a non-SiLU MLP), for weights kept
        in GGML blocks under bf16 activations (the driver takes them in float32), or where
        LIGHTSERVE_PER_KERNEL_FORWARD asks for the loop."""
        cfg, w = self.config, self.weights
        if self.backend is not KernelBackend.CPU or self.tp_size > 1 or type(self)._ffn is not LlamaForCausalLM._ffn \
                or cfg.hidden_act != "silu" or envs.per_kernel_forward():
            return None
        if any(layer.gate_up_proj is None for layer in w.layers):
            return None
        layers = [DecoderLayer(layer.input_norm, layer.post_attn_norm, layer.qkv_proj, layer.qkv_bias,
                               layer.o_proj, layer.o_bias, layer.gate_up_proj, layer.down_proj, self.layer_rope[i],
                               cfg.window(i), layer.q_norm, layer.k_norm)
                  for i, layer in enumerate(w.layers)]
        shape = ModelShape(cfg.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, w.shards.inter_size,
                           cfg.rms_norm_eps, self.sm_scale, cfg.attn_softcap)
        return CpuDecoderLayers.build(layers, shape, self.dtype)

    def attach_lora(self, lora: LoraWeights) -> None:
        super().attach_lora(lora)
        if self.cpu_layers is None:
            return
        if lora.limits.dtype in LORA_C_DTYPES:  # the driver adds the deltas itself, so LoRA steps keep the one call
            self.cpu_layers.bind_lora(lora.stacks(), lora.targeted)
        else:  # float16 stacks, which lora.c does not read: every step runs kernel by kernel, LoRA by the reference
            logger.warning("--lora_dtype %s on CPU: the one-call decoder layers are off and the LoRA products run in "
                           "torch (float32 or bfloat16 run in C)", str(lora.limits.dtype).removeprefix("torch."))
            self.cpu_layers = None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        cfg, w = self.config, self.weights
        attn = AttentionInputs.from_batch(batch)
        hidden = self._embed(batch.input_ids)  # [T, hidden]
        residual = hidden  # a fresh tensor, so add_rmsnorm may update it in place
        one_call = self.cpu_layers is not None and self.cpu_layers.takes(hidden.shape[0]) \
            and not self._fresh_prefills_on_sdpa(attn, kv_cache)
        if one_call:
            hidden = self.cpu_layers.run(
                residual, kv_cache.k_caches, kv_cache.v_caches, batch.req_to_token, batch.positions, batch.kv_locs,
                batch.num_decode, attn.decode_req_rows, attn.decode_seq_lens, attn.extend_req_rows,
                attn.extend_q_start_locs, attn.extend_prefix_lens, attn.extend_lens, kv_cache.k_scales,
                kv_cache.v_scales, batch.lora)  # [T, hidden]
        for i, layer in enumerate(() if one_call else w.layers):  # the loop the C call replaces
            if i == 0:
                x = kernels.rmsnorm(hidden, layer.input_norm, cfg.rms_norm_eps, self.backend)
            else:
                x = kernels.add_rmsnorm(hidden, residual, layer.input_norm, cfg.rms_norm_eps, self.backend)
            x = self._attention(i, layer, x, batch, attn, kv_cache)
            x = kernels.add_rmsnorm(x, residual, layer.post_attn_norm, cfg.rms_norm_eps, self.backend)
            hidden = self._ffn(i, layer, x, batch.lora)  # [T, hidden]
        if batch.keep_hidden:  # every token's final-normed state, then the sampled rows of it
            batch.hidden = kernels.add_rmsnorm(hidden, residual, w.final_norm, cfg.rms_norm_eps, self.backend)
        if batch.logits_indices.shape[0] == 0:  # a step that only writes KV (a draft model's last forward)
            return hidden.new_empty(0, cfg.vocab_size, dtype=torch.float32)
        if batch.hidden is not None:
            return self._logits(batch.hidden[batch.logits_indices], batch.argmax_only)
        # Only the sampled positions need the final norm and lm_head.
        last_hidden = hidden[batch.logits_indices]  # [B, hidden]
        last_residual = residual[batch.logits_indices]  # [B, hidden]
        x = kernels.add_rmsnorm(last_hidden, last_residual, w.final_norm, cfg.rms_norm_eps, self.backend)
        return self._logits(x, batch.argmax_only)

    def _fresh_prefills_on_sdpa(self, attn: AttentionInputs, kv_cache: KVCache) -> bool:
        """Whether the step's prefills, none with a cached prefix, run torch's SDPA in the per-kernel loop
        (kernels/prefill_attention.py, sdpa_is_faster: bf16 on AMX CPUs whose C attention has no tiles), which then
        runs the step instead of the one-call driver and its slower C attention."""
        return attn.has_extend and sdpa_takes_fresh_prefills(self.dtype, kv_cache.k_caches[0].dtype, self.head_dim) \
            and not bool(attn.extend_prefix_lens.any())

    def _ffn(self, i: int, layer: LayerWeights, x: torch.Tensor, lora: LoraSegments | None = None) -> torch.Tensor:
        """Layer i's feed-forward block on the normed hidden states, all-reduced (models/moe.py: its experts);
        `lora`: the step's adapter segments."""
        return self._mlp(layer, x, i, lora)


Model = LlamaForCausalLM
