"""DecoderLM: the pieces every decoder family's forward is made of (vocab-parallel embedding, attention over
the KV cache, gated MLP, lm_head with its all-gather), the one-time packing of CPU weights, and the KV cache the
model reads (the worker asks the model for it: `kv_bytes_per_token`, `make_kv_cache`, `warm_up_attention`).

Each family's `Model` subclasses it and writes `forward` (models/llama.py, models/gemma.py). All math goes
through `lightserve.kernels`; tp_size == 1 makes no torch.distributed call.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightserve import kernels
from lightserve.config import KernelBackend
from lightserve.kernels.argmax_head import argmax_logits, make_argmax_head
from lightserve.kernels.backend import resolve_kernel_backend
from lightserve.kernels.decode_attention import warm_up_decode_attention
from lightserve.kernels.linear import cpu_pack_for
from lightserve.kernels.quant_linear import QuantLinear, quant_embedding
from lightserve.model_infer.kv_cache import KVCache
from lightserve.model_infer.lora import LoraGroup
from lightserve.model_infer.rope import build_cos_sin_cache

if TYPE_CHECKING:
    from lightserve.kernels.linear import PackedLinear, PrepackedLinear
    from lightserve.kernels.lora import LoraSegments
    from lightserve.model_config import ModelConfig
    from lightserve.model_infer.forward_batch import ForwardBatch
    from lightserve.model_infer.lora import LoraWeights
    from lightserve.model_infer.weights import LayerWeights, ModelWeights

_ACTIVATIONS = {"silu": kernels.silu_and_mul, "gelu_tanh": kernels.gelu_tanh_and_mul}


class DecoderLM:
    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: dist.ProcessGroup | None = None,
        backend: KernelBackend | None = None,
    ) -> None:
        """`backend`: --kernel_backend (None = by the weights' device): CPU packs the weights for the C kernels and
        may run whole layers in C; TRITON keeps the GPU layout, also on CPU (under Triton's interpreter)."""
        assert weights.shards.tp_rank == tp_rank and weights.shards.tp_size == tp_size, "weights of another rank"
        self.config = config
        self.weights = weights
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        # The activation dtype and device are the norms' (the embedding may be kept in GGML blocks).
        self.dtype = weights.final_norm.dtype
        self.device = weights.final_norm.device
        self.backend = resolve_kernel_backend(backend, self.device)
        self.act_and_mul = _ACTIVATIONS[config.hidden_act]
        self.lm_head = weights.lm_head  # [Vp, hidden]
        # On CPU every float linear runs on weights packed once at load (the C kernel's panels in float32, oneDNN's
        # blocked layout in bfloat16: kernels/linear.py); the packed copies replace the row-major projections.
        # The lm_head gets its own copy: the embedding lookup needs the row-major table. Weights kept in GGML
        # blocks (QuantLinear, from a GGUF file) stay as they are: their kernel reads the blocks.
        pack = None
        if self.backend is KernelBackend.CPU and (float_pack := cpu_pack_for(weights.final_norm)) is not None:
            def pack(w: torch.Tensor | QuantLinear) -> PackedLinear | PrepackedLinear | QuantLinear:
                return w if isinstance(w, QuantLinear) else float_pack(w)

            self.lm_head = pack(weights.lm_head)
        # A float32 model's greedy steps that report no logprob screen the vocabulary with a bf16 GEMM (of any batch
        # where the CPU multiplies bf16 natively, of up to PAIR_MAX_M rows elsewhere), and compute in float32 only the
        # entries that can be a row's maximum. Not over a packed lm_head, whose own kernel reads fewer bytes.
        self.argmax_head = None
        if pack is not None and self.dtype == torch.float32 and tp_size == 1 and config.final_softcap <= 0 \
                and not isinstance(weights.lm_head, QuantLinear):
            self.argmax_head = make_argmax_head(weights.lm_head, self.lm_head)
        self._init_layers(pack)
        # The resident LoRA adapters (attach_lora); None serves the base model only.
        self.lora: LoraWeights | None = None

    def attach_lora(self, lora: LoraWeights) -> None:
        """Serve the adapters of `lora` (ModelRunner builds it with --enable_lora): a step whose batch has LoRA
        segments adds their deltas after q/k/v, o, gate/up and down. The store's slots are filled later, in place."""
        self.lora = lora

    def _init_layers(self, pack: Callable[[torch.Tensor], PackedLinear | PrepackedLinear] | None) -> None:
        """The layers' attention state (heads, rope tables) and, with `pack`, their projections packed.
        A family whose layers are not multi-head attention over K/V (models/deepseek.py) builds its own."""
        config, weights = self.config, self.weights
        self.num_heads = weights.shards.num_heads        # Hq_local
        self.num_kv_heads = weights.shards.num_kv_heads  # Hk_local
        self.head_dim = config.head_dim
        self.sm_scale = config.sm_scale
        self.cos_sin = build_cos_sin_cache(config, device=self.device)  # [max_pos, D] float32
        # Per layer: its rope table (Gemma 3's windowed layers have their own base) and its window.
        local = self.cos_sin
        if config.rope_local_theta is not None:
            local = build_cos_sin_cache(config, device=self.device, theta=config.rope_local_theta)
        self.layer_rope = [local if config.window(i) else self.cos_sin for i in range(config.num_layers)]
        if pack is not None:
            self.weights = dataclasses.replace(weights, layers=[_pack_layer(layer, pack) for layer in weights.layers])

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Run one step; returns [B, vocab] float32 logits of the tokens at `batch.logits_indices`.

        Writes this step's K/V into kv_cache at `batch.kv_locs`. Attention reads
        `batch.req_to_token` (the worker passes kv_cache.req_to_token, already filled for this step).
        """
        raise NotImplementedError

    def __call__(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        return self.forward(batch, kv_cache)

    def kv_bytes_per_token(self, kv_dtype: torch.dtype | None = None) -> int:
        """Bytes of KV cache one token takes on this rank, over all layers (the worker sizes its cache by it), in a
        cache of `kv_dtype` (--kv_cache_dtype; None = the activation dtype)."""
        return KVCache.bytes_per_token(self.config, self.num_kv_heads, kv_dtype or self.dtype)

    def make_kv_cache(self, num_kv_rows: int, num_req_rows: int, max_req_total_len: int,
                      kv_dtype: torch.dtype | None = None) -> KVCache:
        """The KV cache this model's forward reads and writes: K and V of this rank's KV heads, every layer, stored
        as `kv_dtype` (None = the activation dtype; fp8 with the checkpoint's k_scale / v_scale where it has them)."""
        return KVCache(self.config.num_layers, num_kv_rows, self.num_kv_heads, self.head_dim, num_req_rows,
                       max_req_total_len, kv_dtype or self.dtype, self.device,
                       head_major=self.backend is KernelBackend.CPU, fp8_scales=self.weights.kv_scales)

    def warm_up_attention(self, kv_cache: KVCache, req_rows: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Compile decode attention at every split count and for every (window, softcap) of the layers, with
        the model's shapes, reading request rows `req_rows` of lengths `seq_lens` ([1] int32 each)."""
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        # q as _attention passes it: a [1, Hq, D] view of the fused qkv output (its row stride matters to
        # Triton's specialization).
        qkv = torch.zeros(1, (hq + 2 * hk) * d, dtype=self.dtype, device=self.device)
        q = qkv[:, :hq * d].view(1, hq, d)
        warm_up_decode_attention(q, kv_cache.k_caches[0], kv_cache.v_caches[0], kv_cache.req_to_token, req_rows,
                                 seq_lens, self.attention_variants(), kv_cache.k_scales[0], kv_cache.v_scales[0])

    def warm_up_kernels(self, kv_cache: KVCache, req_rows: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Compile the Triton kernel variants a warm-up step does not reach at every shape (ModelRunner.warm_up
        calls it after its steps): decode attention at every split count (`warm_up_attention`, arguments as there).
        Families extend it with their own (the MoE blocks' grouped GEMMs)."""
        self.warm_up_attention(kv_cache, req_rows, seq_lens)

    def attention_variants(self) -> set[tuple[int, float]]:
        """The (window, softcap) pairs the layers pass to the attention kernels (for warm-up compiles)."""
        return {(self.config.window(i), self.config.attn_softcap) for i in range(self.config.num_layers)}

    def _attention(
        self,
        i: int,
        layer: LayerWeights,
        x: torch.Tensor,
        batch: ForwardBatch,
        attn: AttentionInputs,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """Layer i's attention block, from the normed input to the o_proj output (all-reduced)."""
        num_tokens = x.shape[0]
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        k_cache, v_cache = kv_cache.k_caches[i], kv_cache.v_caches[i]
        scales = {"k_scale": kv_cache.k_scales[i], "v_scale": kv_cache.v_scales[i]}  # an 8-bit cache's
        qkv = kernels.linear(x, layer.qkv_proj, layer.qkv_bias)  # [T, (Hq + 2Hk) * D]
        self._add_lora(i, LoraGroup.QKV_PROJ, x, qkv, batch.lora)  # before the split, q/k norm and rope
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q = q.view(num_tokens, hq, d)  # [T, Hq, D], strided view into qkv
        k = k.view(num_tokens, hk, d)  # [T, Hk, D]
        v = v.view(num_tokens, hk, d)  # [T, Hk, D]
        if layer.q_norm is not None:  # Qwen3, Gemma 3: RMSNorm over head_dim of every head, before rope
            eps, be = self.config.rms_norm_eps, self.backend
            q = kernels.rmsnorm(q.reshape(-1, d), layer.q_norm, eps, be).view(num_tokens, hq, d)
            k = kernels.rmsnorm(k.reshape(-1, d), layer.k_norm, eps, be).view(num_tokens, hk, d)
        # An int8 cache: q and k also through the Walsh-Hadamard transform, which spreads K's few large channels
        # over the head before its one scale per token and head is taken (kernels/rotary.py)
        kernels.rotary_emb(q, k, batch.positions, self.layer_rope[i], self.backend,
                           hadamard=k_cache.dtype == torch.int8)
        kernels.store_kv(k, v, k_cache, v_cache, batch.kv_locs, self.backend, **scales)

        window, softcap = self.config.window(i), self.config.attn_softcap
        nd = batch.num_decode
        parts = []  # decode outputs first, then extend outputs: the batch's token order
        if nd > 0:
            parts.append(kernels.decode_attention(
                q[:nd], k_cache, v_cache, batch.req_to_token, attn.decode_req_rows, attn.decode_seq_lens,
                batch.max_seq_len, self.sm_scale, window, softcap, self.backend, **scales,
            ))  # [num_decode, Hq, D]
        if attn.has_extend:
            parts.append(kernels.prefill_attention(
                q[nd:], k_cache, v_cache, batch.req_to_token, attn.extend_req_rows, attn.extend_q_start_locs,
                attn.extend_prefix_lens, attn.extend_lens, batch.max_extend_len, self.sm_scale, window, softcap,
                self.backend, **scales,
            ))  # [T - num_decode, Hq, D]
        o = parts[0] if len(parts) == 1 else torch.cat(parts)  # [T, Hq, D]
        o = o.reshape(num_tokens, hq * d)  # [T, Hq * D]
        if self.tp_size == 1:
            out = kernels.linear(o, layer.o_proj, layer.o_bias)  # [T, hidden]
            self._add_lora(i, LoraGroup.O_PROJ, o, out, batch.lora)
            return out
        out = kernels.linear(o, layer.o_proj)  # [T, hidden], partial sum of this rank's heads
        self._add_lora(i, LoraGroup.O_PROJ, o, out, batch.lora)  # this rank's columns' share, summed by the all-reduce
        dist.all_reduce(out, group=self.tp_group)
        if layer.o_bias is not None:  # once, after the reduction, not once per rank
            out += layer.o_bias
        return out

    def _mlp(self, layer: LayerWeights, x: torch.Tensor, i: int = 0, lora: LoraSegments | None = None) -> torch.Tensor:
        """Layer i's gated MLP on the normed x [T, hidden], all-reduced; `lora`: the step's segments (batch.lora)."""
        gate_up = kernels.linear(x, layer.gate_up_proj)  # [T, 2 * I_local]
        self._add_lora(i, LoraGroup.GATE_UP_PROJ, x, gate_up, lora)
        act = self.act_and_mul(gate_up, self.backend)  # [T, I_local]
        out = kernels.linear(act, layer.down_proj)  # [T, hidden]
        self._add_lora(i, LoraGroup.DOWN_PROJ, act, out, lora)  # before the all-reduce, as o's
        if self.tp_size > 1:
            dist.all_reduce(out, group=self.tp_group)
        return out

    def _add_lora(self, i: int, group: LoraGroup, x: torch.Tensor, y: torch.Tensor,
                  lora: LoraSegments | None) -> None:
        """y [T, N] += the LoRA delta of layer i's `group` for its input x [T, K], in place, where the step has
        adapter segments."""
        if lora is not None:
            assert self.lora is not None, "a step with LoRA segments on a model without adapters"
            self.lora.apply(i, group, x, y, lora, self.backend)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)  # [T, hidden]
        # Vocab-parallel: each rank looks up the ids it owns, zeros elsewhere, then all ranks sum.
        sh = self.weights.shards
        local = input_ids - sh.vocab_start  # [T]
        owned = (local >= 0) & (local < sh.vocab_per_rank)  # [T] bool
        out = self._lookup(local * owned)  # [T, hidden]
        out *= owned.unsqueeze(1).to(out.dtype)
        dist.all_reduce(out, group=self.tp_group)
        return out

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, hidden] rows of the embedding table (dequantized in the activation dtype when packed)."""
        table = self.weights.embed
        if isinstance(table, QuantLinear):
            return quant_embedding(ids, table, self.dtype)
        return F.embedding(ids, table)

    def _logits(self, x: torch.Tensor, argmax_only: bool = False, chunk_rows: int = 1024) -> torch.Tensor:
        """x [B, hidden] after the final norm -> [B, V] float32 logits; with argmax_only, exact only near each row's
        maximum where the model has an argmax head, and on CPU a bf16 head's output as it is (the sampler's C argmax
        reads bf16: a float32 copy of a batch-64 step's [64, 49152] logits cost 0.9 ms of ~52). A float32 model's
        logits are the lm_head's output itself (the softcap applied in place). Where B passes chunk_rows (prompt
        logprobs: up to a whole step's tokens) and the head's output is not already the float32 logits (bfloat16, or
        tp > 1 with its all-gather buffers), the head runs chunk_rows rows at a time into one float32 output, so no
        [B, V] model-dtype or gathered copy is held beside it."""
        if argmax_only and self.argmax_head is not None:
            return argmax_logits(x, self.argmax_head)  # [B, V]

        def head(rows: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, V], model dtype, a fresh tensor
            logits = kernels.linear(rows, self.lm_head)  # [n, V] (tp > 1: [n, Vp])
            if self.tp_size > 1:
                parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
                dist.all_gather(parts, logits, group=self.tp_group)
                logits = torch.cat(parts, dim=-1)[:, : self.config.vocab_size]  # [n, V], padding dropped
            cap = self.config.final_softcap
            if cap > 0:  # Gemma 2, in the model dtype as HF computes it (/ cap, tanh, * cap), in place
                logits.div_(cap).tanh_().mul_(cap)
            return logits

        num_rows = x.shape[0]
        if num_rows <= chunk_rows or (self.dtype == torch.float32 and self.tp_size == 1):
            logits = head(x)
            keep = logits.dtype == torch.float32 or (argmax_only and logits.device.type == "cpu"
                                                     and logits.dtype == torch.bfloat16)
            return logits if keep else logits.float()
        first = head(x[:chunk_rows])
        out = torch.empty(num_rows, first.shape[1], dtype=torch.float32, device=x.device)  # [B, V]
        out[:chunk_rows] = first
        del first
        for start in range(chunk_rows, num_rows, chunk_rows):
            out[start:start + chunk_rows] = head(x[start:start + chunk_rows])
        return out


def _pack_layer(layer: LayerWeights, pack) -> LayerWeights:
    """The layer with its projections packed; a MoE layer has no dense MLP (its MoEBlock packs the experts)."""
    layer = dataclasses.replace(layer, qkv_proj=pack(layer.qkv_proj), o_proj=pack(layer.o_proj))
    if layer.gate_up_proj is None:
        return layer
    return dataclasses.replace(layer, gate_up_proj=pack(layer.gate_up_proj), down_proj=pack(layer.down_proj))


class AttentionInputs:
    """Per-step slices of the batch metadata, cut once per forward instead of once per layer."""

    __slots__ = (
        "decode_req_rows",
        "decode_seq_lens",
        "extend_lens",
        "extend_prefix_lens",
        "extend_q_start_locs",
        "extend_req_rows",
        "has_extend",
    )

    @classmethod
    def from_batch(cls, batch: ForwardBatch) -> AttentionInputs:
        nd = batch.num_decode
        self = cls()
        self.decode_req_rows = batch.req_rows[:nd]  # [num_decode]
        self.decode_seq_lens = batch.seq_lens[:nd]  # [num_decode]
        self.has_extend = batch.num_reqs > nd
        # The extend requests' own 16-byte aligned arrays, not slices at offset num_decode: Triton compiles the
        # prefill kernel once per pointer alignment, and a slice's would change with num_decode.
        ext = batch.extend_inputs()
        self.extend_req_rows = ext.req_rows  # [num_extend]
        # q[num_decode:] starts at token num_decode, so extend offsets are rebased to it.
        self.extend_q_start_locs = ext.q_start_locs  # [num_extend]
        self.extend_prefix_lens = ext.prefix_lens  # [num_extend]
        self.extend_lens = ext.extend_lens  # [num_extend]
        return self
