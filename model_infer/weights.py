"""ModelWeights: one tensor-parallel rank's shard of a checkpoint, loaded from safetensors (or from a GGUF file
through gguf_reader.GGUFCheckpointReader, the same interface, whose quantized weights stay QuantLinear).

Called once by the worker (through the model's `load`). The generic part lives here: the reader, the shard
ranges and the weight containers. Each family module (`model_infer/models/`) names its HF tensors and says
which ranges a rank reads. Each rank reads only its slices (`safe_open(...).get_slice`), so a rank never
holds the full q/k/v or MLP matrices.

Sharding (`TPShards` computes every range):
  q/k/v, gate/up   column-parallel: rank r keeps its heads / its I/tp rows; fused into one matrix each.
  o_proj, down     row-parallel: rank r keeps the matching input columns; outputs are all-reduced.
  embed, lm_head   vocab-parallel: rank r keeps rows [r*Vp, (r+1)*Vp), Vp = ceil(V/tp), zero-padded.
KV heads: when tp <= Hk, rank r keeps kv heads [r*Hk/tp, (r+1)*Hk/tp) (needs Hk % tp == 0).
When tp > Hk, kv heads are replicated: rank r keeps the single kv head r*Hk//tp (needs tp % Hk == 0).
That head is the one its query heads [r*Hq/tp, (r+1)*Hq/tp) use: with tp = m*Hk each kv group of
g = Hq/Hk query heads is split evenly over m consecutive ranks.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from lightserve.kernels.quant_linear import QuantLinear, cat_rows, dequantize, quant_tensor

if TYPE_CHECKING:
    from lightserve.kernels.linear import PackedLinear, PrepackedLinear
    from lightserve.model_config import ModelConfig
    from lightserve.model_infer.moe_layers import MoEWeights

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPShards:
    """Index ranges owned by one rank; all in units of rows (heads are converted with head_dim)."""
    tp_rank: int
    tp_size: int
    num_heads: int        # Hq_local
    num_kv_heads: int     # Hk_local
    q_head_start: int
    kv_head_start: int
    inter_size: int       # I_local
    inter_start: int
    vocab_per_rank: int   # Vp, the padded vocab slice of every rank
    vocab_start: int

    @classmethod
    def for_rank(cls, config: ModelConfig, tp_rank: int, tp_size: int) -> TPShards:
        """Raises ValueError when tp_size does not divide the heads / intermediate size."""
        hq, hk = config.num_heads, config.num_kv_heads
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
        if hq % tp_size != 0:
            raise ValueError(f"{tp_size} ranks do not divide the model's {hq} attention heads "
                             f"(num_attention_heads; {hk} KV heads): use a divisor of {hq}")
        if config.intermediate_size % tp_size != 0:
            raise ValueError(f"tp_size {tp_size} must divide intermediate_size {config.intermediate_size}")
        if tp_size <= hk:
            if hk % tp_size != 0:
                raise ValueError(f"tp_size {tp_size} must divide num_key_value_heads {hk}")
            kv_local, kv_start = hk // tp_size, tp_rank * (hk // tp_size)
        else:
            if tp_size % hk != 0:
                raise ValueError(f"tp_size {tp_size} > num_key_value_heads {hk} must be a multiple of it")
            kv_local, kv_start = 1, tp_rank * hk // tp_size
        inter_local = config.intermediate_size // tp_size
        vocab_per_rank = -(-config.vocab_size // tp_size)
        return cls(
            tp_rank=tp_rank,
            tp_size=tp_size,
            num_heads=hq // tp_size,
            num_kv_heads=kv_local,
            q_head_start=tp_rank * (hq // tp_size),
            kv_head_start=kv_start,
            inter_size=inter_local,
            inter_start=tp_rank * inter_local,
            vocab_per_rank=vocab_per_rank,
            vocab_start=tp_rank * vocab_per_rank,
        )


@dataclass
class LayerWeights:
    # The four projections are [N, K] tensors as loaded; a model on CPU replaces them with the same
    # weights packed for its GEMM: kernels.PackedLinear in float32, kernels.PrepackedLinear in bfloat16
    # (see models/base.py). From a GGUF file a quantized projection is a QuantLinear, kept as loaded.
    # Norm weights are stored as the multiplier: Gemma's (1 + w) is added at load.
    input_norm: torch.Tensor            # [hidden], before attention
    qkv_proj: torch.Tensor | PackedLinear | PrepackedLinear  # [(Hq_local + 2*Hk_local) * D, hidden]; rows q | k | v
    qkv_bias: torch.Tensor | None       # [(Hq_local + 2*Hk_local) * D]
    q_norm: torch.Tensor | None         # [D] (Qwen3)
    k_norm: torch.Tensor | None         # [D] (Qwen3)
    o_proj: torch.Tensor | PackedLinear | PrepackedLinear    # [hidden, Hq_local * D]
    o_bias: torch.Tensor | None         # [hidden], full; added once after the all-reduce
    post_attn_norm: torch.Tensor        # [hidden], before the MLP (HF Llama's post_attention_layernorm)
    gate_up_proj: torch.Tensor | PackedLinear | PrepackedLinear | None  # [2 * I_local, hidden]; rows gate | up
    down_proj: torch.Tensor | PackedLinear | PrepackedLinear | None  # [hidden, I_local]; both None on a MoE layer
    attn_out_norm: torch.Tensor | None = None  # [hidden], on the attention output (Gemma)
    mlp_out_norm: torch.Tensor | None = None   # [hidden], on the MLP output (Gemma)
    moe: MoEWeights | None = None              # a MoE layer's router and experts (models/moe.py), instead of the MLP


@dataclass
class ModelWeights:
    shards: TPShards
    embed: torch.Tensor | QuantLinear   # [Vp, hidden] (tp == 1: [V, hidden]); padded rows are zero
    layers: list[LayerWeights]         # a family with other layers keeps its own type (models/deepseek.py)
    final_norm: torch.Tensor            # [hidden], in the activation dtype (every norm is)
    lm_head: torch.Tensor | QuantLinear  # [Vp, hidden]; the same weight as embed when tied
    # An fp8 KV cache's per-tensor (k_scale, v_scale) of every layer, where the checkpoint carries them
    # (read_kv_scales); None: 1.0.
    kv_scales: list[tuple[float, float]] | None = None


def read_kv_scales(reader: CheckpointReader, num_layers: int) -> list[tuple[float, float]] | None:
    """The per-tensor K and V scales an fp8-KV checkpoint stores per layer, under the names vLLM and LightLLM read:
    `model.layers.N.self_attn.k_scale` / `.v_scale` (compressed-tensors, ModelOpt), or one `.kv_scale` for both
    (older AutoFP8 files). None when layer 0 has neither: the cache then uses 1.0."""
    def scale(name: str) -> float:
        return float(reader[name].float().reshape(-1)[0])

    prefix = "model.layers.{}.self_attn."
    if reader.has(prefix.format(0) + "k_scale"):
        return [(scale(prefix.format(i) + "k_scale"), scale(prefix.format(i) + "v_scale")) for i in range(num_layers)]
    if reader.has(prefix.format(0) + "kv_scale"):
        return [(scale(prefix.format(i) + "kv_scale"),) * 2 for i in range(num_layers)]
    return None


def vocab_rows(reader: CheckpointReader, name: str, config: ModelConfig, sh: TPShards) -> torch.Tensor | QuantLinear:
    if sh.tp_size == 1:
        return reader.full(name)  # [V, hidden]
    end = min(sh.vocab_start + sh.vocab_per_rank, config.vocab_size)
    part = reader.rows(name, sh.vocab_start, end)  # [<=Vp, hidden]
    num_rows = part.out_features if isinstance(part, QuantLinear) else part.shape[0]
    if num_rows == sh.vocab_per_rank:
        return part
    if isinstance(part, QuantLinear):
        # All-zero bytes decode to zeros in every GGML block format (zero scales and mins).
        seg = part.segments[-1]
        zeros = seg.blocks.new_zeros(sh.vocab_per_rank - num_rows, seg.blocks.shape[1])
        return cat_rows([part, quant_tensor(seg.qtype, zeros, part.in_features)])
    padded = part.new_zeros(sh.vocab_per_rank, part.shape[1])  # [Vp, hidden]
    padded[: part.shape[0]] = part
    return padded


def cat_weights(parts: list[torch.Tensor | QuantLinear]) -> torch.Tensor | QuantLinear:
    """Row-stack the pieces of a fused projection (q | k | v, gate | up): torch.cat of tensors, quant_linear.cat_rows
    of GGML-block weights. A GGUF file mixing float and quantized pieces of one projection gets a float
    projection (the quantized pieces dequantized to the tensors' dtype)."""
    if all(isinstance(p, QuantLinear) for p in parts):
        return cat_rows(parts)
    dtype = next(p.dtype for p in parts if isinstance(p, torch.Tensor))
    return torch.cat([dequantize(p).to(dtype) if isinstance(p, QuantLinear) else p for p in parts])


def stack_weights(parts: list[torch.Tensor | QuantLinear]) -> torch.Tensor | tuple[QuantLinear, ...]:
    """One weight per expert: [E, N, K] stacked tensors, or a tuple of GGML-block weights (what
    kernels.moe.ExpertWeights holds once packed)."""
    quantized = [isinstance(p, QuantLinear) for p in parts]
    if all(quantized):
        return tuple(parts)
    if any(quantized):
        raise ValueError("the experts of one layer mix float and GGML block weights")
    return torch.stack(parts)


class CheckpointReader(Mapping[str, torch.Tensor]):
    """Reads tensors, or row/column ranges of them, from all *.safetensors files of a folder.

    `full`/`rows`/`cols` return the model dtype on the reader's device. As a Mapping (`reader[name]`) it gives a
    whole tensor as stored, on the host: for the layer loaders that take a Mapping, cut their rank's slices and
    cast themselves (mla_layer.load_mla_weights, moe_layers.load_moe_weights; a float32 router stays float32)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device | str) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
        self.dtype, self.device = dtype, device
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}  # noqa: SIM118 (not iterable)

    def has(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def __contains__(self, name: object) -> bool:  # without loading the tensor, as Mapping's default would
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def full(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor, in the model dtype or in `dtype` (for math before the cast)."""
        t = self._handle(name).get_tensor(name)
        if dtype is not None:
            return t.to(device=self.device, dtype=dtype).contiguous()
        return self._cast(t)

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        return self._cast(self._handle(name).get_slice(name)[start:end])

    def row_ranges(self, name: str, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """Rows [a, b) of each range, concatenated (the pieces of a fused projection one rank owns)."""
        return torch.cat([self.rows(name, a, b) for a, b in ranges])

    def cols(self, name: str, start: int, end: int) -> torch.Tensor:
        return self._cast(self._handle(name).get_slice(name)[:, start:end])

    def close(self) -> None:
        self._handles.clear()
        self._where.clear()

    def _handle(self, name: str):
        try:
            return self._where[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} not found in the checkpoint") from None

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype).contiguous()
