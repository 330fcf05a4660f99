"""MLAAttention: DeepSeek-V3's multi-head latent attention layer (HF DeepseekV3Attention), over a latent KV pool.

Built by a model family's module per layer, with MLAConfig read from config.json and the rope table from
`build_mla_cos_sin` (one per model, shared by the layers). Called with the input-normed hidden states [T, H], the
step's ForwardBatch and the layer's latent cache ([num_kv_rows, 1, kv_lora_rank + qk_rope_head_dim], e.g.
`LatentKVCache.latent_caches[i]`). Decode steps absorb kv_b_proj into the query and output; prefill up-projects
(kernels/mla_attention.py).

HF checkpoint names under `model.layers.{i}.self_attn.` (`load_mla_weights` reads them):
  q_proj.weight [H * (Dn + Dr), hidden]                     when q_lora_rank is None, else
  q_a_proj.weight [q_lora_rank, hidden] (+ .bias with attention_bias), q_a_layernorm.weight [q_lora_rank],
  q_b_proj.weight [H * (Dn + Dr), q_lora_rank]
  kv_a_proj_with_mqa.weight [R + Dr, hidden] (+ .bias), kv_a_layernorm.weight [R]
  kv_b_proj.weight [H * (Dn + Dv), R]                        per head: Dn rows of W_UK, then Dv rows of W_UV
  o_proj.weight [hidden, H * Dv] (+ .bias)
with Dn = qk_nope_head_dim, Dr = qk_rope_head_dim, Dv = v_head_dim, R = kv_lora_rank.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from lightserve import kernels
from lightserve.config import KernelBackend
from lightserve.kernels.backend import resolve_kernel_backend
from lightserve.kernels.kv_store import KVScale
from lightserve.kernels.linear import cpu_pack_for
from lightserve.kernels.mla_attention import (
    mla_decode,
    mla_prefill_attention,
    store_latent,
)

if TYPE_CHECKING:
    from lightserve.kernels.linear import PackedLinear, PrepackedLinear
    from lightserve.model_infer.forward_batch import ForwardBatch

    LinearWeight = Tensor | PackedLinear | PrepackedLinear

SUPPORTED_ROPE_TYPES = ("default", "yarn")
_LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default (MLAConfig.from_hf)


@dataclass(frozen=True)
class MLAConfig:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float  # of q_a_layernorm and kv_a_layernorm (from_hf: 1e-6, see there)
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_interleave: bool = True  # the rope dims come in (even, odd) pairs
    attention_bias: bool = False
    rope_type: str = "default"  # or "yarn"
    rope_factor: float | None = None  # yarn: None = max_position_embeddings / original
    rope_original_max_position_embeddings: int | None = None
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    rope_attention_factor: float | None = None  # yarn: scales cos and sin; None = from factor and mscales
    rope_truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported for MLA; expected {SUPPORTED_ROPE_TYPES}")

    @classmethod
    def from_hf(cls, hf: Mapping) -> MLAConfig:
        """From a config.json dict: transformers 5's `rope_parameters` or the hub's `rope_scaling` + `rope_theta`."""
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        # NOTE: transformers' DeepseekV3Attention (and DeepSeek's own modeling code) builds q_a_layernorm and
        # kv_a_layernorm with DeepseekV3RMSNorm's default eps, 1e-6, whatever config.rms_norm_eps says (which
        # only the decoder's norms use). DeepSeek-V3's config has 1e-6 for both.
        return cls(
            hf["hidden_size"], hf["num_attention_heads"], hf.get("q_lora_rank"), hf["kv_lora_rank"],
            hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"], _LATENT_NORM_EPS,
            hf["max_position_embeddings"], rope.get("rope_theta") or hf.get("rope_theta") or 10000.0,
            hf.get("rope_interleave", True), hf.get("attention_bias", False),
            rope.get("rope_type") or rope.get("type") or "default", rope.get("factor"),
            rope.get("original_max_position_embeddings"), rope.get("beta_fast") or 32.0, rope.get("beta_slow") or 1.0,
            rope.get("mscale"), rope.get("mscale_all_dim"), rope.get("attention_factor"), rope.get("truncate", True))

    @property
    def sm_scale(self) -> float:
        """HF's yarn_apply_mscale: (Dn + Dr)^-0.5, times mscale(factor, mscale_all_dim)^2 under yarn."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if self.rope_type != "default" and self.rope_mscale_all_dim:
            mscale = _yarn_mscale(self.rope_factor, self.rope_mscale_all_dim)
            scale = scale * mscale * mscale
        return scale


@dataclass(frozen=True)
class MLAWeights:
    """One rank's weights (its H / tp heads). With rope_interleave, the rope rows of q and kv_a are stored
    de-interleaved (even dims, then odd), so the NeoX rotary kernel gives HF's interleaved rope exactly."""

    q_proj: LinearWeight | None  # [H * (Dn + Dr), hidden] (no q_lora_rank)
    q_a_proj: LinearWeight | None  # [q_lora_rank, hidden]
    q_a_bias: Tensor | None
    q_a_norm: Tensor | None  # [q_lora_rank]
    q_b_proj: LinearWeight | None  # [H * (Dn + Dr), q_lora_rank]
    kv_a_proj: LinearWeight  # [R + Dr, hidden]
    kv_a_bias: Tensor | None
    kv_a_norm: Tensor  # [R]
    kv_b_proj: LinearWeight  # [H * (Dn + Dv), R], the prefill up-projection
    w_kc: Tensor  # [H, Dn, R] W_UK, absorbed into the decode query
    w_vc: Tensor  # [H, Dv, R] W_UV, applied to the decode's latent output
    o_proj: LinearWeight  # [hidden, H * Dv]
    o_bias: Tensor | None


class MLAAttention:
    """x [T, hidden] -> [T, hidden]; writes the step's latents into the layer's cache at batch.kv_locs."""

    def __init__(self, config: MLAConfig, weights: MLAWeights, cos_sin: Tensor, tp_size: int = 1,
                 tp_group: dist.ProcessGroup | None = None, backend: KernelBackend | None = None) -> None:
        self.config = config
        self.num_heads = weights.w_kc.shape[0]  # this rank's heads
        self.cos_sin = cos_sin  # [max_pos, Dr] float32, build_mla_cos_sin
        self.sm_scale = config.sm_scale
        self.tp_size, self.tp_group = tp_size, tp_group
        self.backend = resolve_kernel_backend(backend, cos_sin.device)
        pack = cpu_pack_for(weights.kv_a_norm) if self.backend is KernelBackend.CPU else None
        if pack is not None:  # CPU: the projections run on weights packed once here (w_kc, w_vc stay for bmm)
            names = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj")
            weights = replace(weights, **{n: pack(getattr(weights, n)) for n in names
                                          if getattr(weights, n) is not None})
        self.weights = weights

    def forward(self, x: Tensor, batch: ForwardBatch, latent_cache: Tensor, latent_scale: KVScale = None) -> Tensor:
        """`latent_scale`: an 8-bit cache's scales of this layer (LatentKVCache.latent_scales)."""
        cfg, w = self.config, self.weights
        num_tokens, heads = x.shape[0], self.num_heads
        nope, rope, rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        if w.q_proj is not None:
            q = kernels.linear(x, w.q_proj)  # [T, H * (Dn + Dr)]
        else:
            q_a = kernels.linear(x, w.q_a_proj, w.q_a_bias)  # [T, q_lora_rank]
            q_a = kernels.rmsnorm(q_a, w.q_a_norm, cfg.rms_norm_eps, self.backend)
            q = kernels.linear(q_a, w.q_b_proj)  # [T, H * (Dn + Dr)]
        q = q.view(num_tokens, heads, nope + rope)
        q_nope, q_pe = q[..., :nope], q[..., nope:]  # [T, H, Dn], [T, H, Dr] views
        kv_a = kernels.linear(x, w.kv_a_proj, w.kv_a_bias)  # [T, R + Dr]
        c_kv = kernels.rmsnorm(kv_a[:, :rank], w.kv_a_norm, cfg.rms_norm_eps, self.backend)  # [T, R]
        k_pe = kv_a[:, rank:].unsqueeze(1)  # [T, 1, Dr] view
        kernels.rotary_emb(q_pe, k_pe, batch.positions, self.cos_sin, self.backend)  # in place, into q and kv_a
        store_latent(c_kv, k_pe, latent_cache, batch.kv_locs, latent_scale=latent_scale)

        nd = batch.num_decode
        parts = []  # decode outputs first, then extend outputs: the batch's token order
        if nd > 0:
            parts.append(mla_decode(
                q_nope[:nd], q_pe[:nd], latent_cache, w.w_kc, w.w_vc, batch.req_to_token, batch.req_rows[:nd],
                batch.seq_lens[:nd], batch.max_seq_len, self.sm_scale, self.backend,
                latent_scale=latent_scale))  # [num_decode, H, Dv]
        if batch.num_reqs > nd:
            # The prefill lays out its keys on the host: its metadata comes from the host copy the batch carries
            # (no device->host sync per layer).
            host = batch.host_metadata()
            parts.append(mla_prefill_attention(
                q_nope[nd:], q_pe[nd:], latent_cache, w.kv_b_proj, cfg.v_head_dim, batch.req_to_token,
                host.req_rows[nd:], host.q_start_locs[nd:] - nd, host.prefix_lens[nd:], host.extend_lens[nd:],
                self.sm_scale, self.backend, latent_scale=latent_scale))  # [T - num_decode, H, Dv]
        o = (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(num_tokens, heads * cfg.v_head_dim)
        if self.tp_size == 1:
            return kernels.linear(o, w.o_proj, w.o_bias)  # [T, hidden]
        out = kernels.linear(o, w.o_proj)  # [T, hidden], partial sum over this rank's heads
        dist.all_reduce(out, group=self.tp_group)
        if w.o_bias is not None:  # once, after the reduction
            out += w.o_bias
        return out

    __call__ = forward


def load_mla_weights(tensors: Mapping[str, Tensor], layer_prefix: str, config: MLAConfig, dtype: torch.dtype,
                     device: torch.device | str = "cpu", tp_rank: int = 0, tp_size: int = 1) -> MLAWeights:
    """Rank tp_rank's MLAWeights (heads split, the a-projections and norms replicated) from checkpoint tensors;
    `layer_prefix` e.g. "model.layers.3.". Raises ValueError when the heads do not split by tp_size."""
    cfg = config
    if cfg.num_heads % tp_size:
        raise ValueError(f"num_attention_heads {cfg.num_heads} is not a multiple of --tp {tp_size}")
    heads = cfg.num_heads // tp_size
    own = slice(tp_rank * heads, (tp_rank + 1) * heads)
    nope, rope, rank, vdim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    # HF's interleaved rope pairs dims (2i, 2i+1) and writes the rotated pair back as halves; storing the rows
    # as (evens, odds) turns it into the rotate_half rope every rotary kernel implements.
    perm = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)]) if cfg.rope_interleave \
        else torch.arange(rope)
    name = f"{layer_prefix}self_attn.{{}}".format
    def get(n):
        return tensors[name(n)].to(device, dtype)
    def opt(n):
        return get(n) if cfg.attention_bias and name(n) in tensors else None

    def q_rows(weight: Tensor) -> Tensor:  # [H * (Dn + Dr), K] -> this rank's heads, rope rows de-interleaved
        w = weight.view(cfg.num_heads, nope + rope, -1)[own]
        return torch.cat([w[:, :nope], w[:, nope:][:, perm]], dim=1).reshape(heads * (nope + rope), -1).contiguous()

    kv_a, kv_a_bias = get("kv_a_proj_with_mqa.weight"), opt("kv_a_proj_with_mqa.bias")
    kv_a = torch.cat([kv_a[:rank], kv_a[rank:][perm]]).contiguous()
    if kv_a_bias is not None:
        kv_a_bias = torch.cat([kv_a_bias[:rank], kv_a_bias[rank:][perm]])
    kv_b = get("kv_b_proj.weight").view(cfg.num_heads, nope + vdim, rank)[own]  # [H_local, Dn + Dv, R]
    o_proj = get("o_proj.weight").view(cfg.hidden_size, cfg.num_heads, vdim)[:, own]
    lora = cfg.q_lora_rank is not None
    return MLAWeights(
        q_proj=None if lora else q_rows(get("q_proj.weight")),
        q_a_proj=get("q_a_proj.weight") if lora else None,
        q_a_bias=opt("q_a_proj.bias") if lora else None,
        q_a_norm=get("q_a_layernorm.weight") if lora else None,
        q_b_proj=q_rows(get("q_b_proj.weight")) if lora else None,
        kv_a_proj=kv_a, kv_a_bias=kv_a_bias, kv_a_norm=get("kv_a_layernorm.weight"),
        kv_b_proj=kv_b.reshape(heads * (nope + vdim), rank).contiguous(),
        w_kc=kv_b[:, :nope].contiguous(), w_vc=kv_b[:, nope:].contiguous(),
        o_proj=o_proj.reshape(cfg.hidden_size, heads * vdim).contiguous(), o_bias=opt("o_proj.bias"))


def build_mla_cos_sin(config: MLAConfig, max_pos: int | None = None,
                      device: torch.device | str | None = None) -> Tensor:
    """[max_pos, Dr] float32: cos of the Dr / 2 frequencies, then their sin, both times yarn's attention factor,
    with transformers' float32 ops (its default rope for DeepSeek-V3 and `_compute_yarn_parameters`)."""
    max_pos = config.max_position_embeddings if max_pos is None else max_pos
    dim, base = config.qk_rope_head_dim, config.rope_theta
    attention_factor = 1.0
    if config.rope_type == "default":
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
    else:
        inv_freq, attention_factor = _yarn_inv_freq(config, device)
    freqs = torch.arange(max_pos, device=device).float()[:, None] * inv_freq[None, :]  # [max_pos, Dr / 2]
    return torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1).contiguous()


def _yarn_inv_freq(config: MLAConfig, device: torch.device | str | None) -> tuple[Tensor, float]:
    dim, base = config.qk_rope_head_dim, config.rope_theta
    original = config.rope_original_max_position_embeddings
    factor = config.rope_factor if config.rope_factor is not None else config.max_position_embeddings / original
    attention_factor = config.rope_attention_factor
    if attention_factor is None:
        if config.rope_mscale and config.rope_mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, config.rope_mscale)
                                     / _yarn_mscale(factor, config.rope_mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(config.rope_beta_fast), correction_dim(config.rope_beta_slow)
    if config.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation = 1 - ramp  # [Dr / 2]: 1 keeps the original frequency, 0 takes the interpolated one
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return inv_freq, attention_factor


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
