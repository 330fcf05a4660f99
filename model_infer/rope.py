"""Rotary embedding tables: the [max_pos, head_dim] float32 cos/sin cache read by `kernels.rotary_emb`.

Built once per worker by the model. Computed with the same float32 ops, in the same order, as
transformers' rope init functions, so greedy outputs match transformers token for token.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightserve.model_config import ModelConfig


def compute_inv_freq(config: ModelConfig, device: torch.device | str | None = None, theta: float | None = None,
                     long: bool = False) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, with the config's rope scaling applied. `theta`: another
    base, unscaled (Gemma 3's windowed layers); `long`: longrope's long factors instead of its short ones."""
    dim = config.head_dim
    # NOTE: int64 arange then float, then a python-float base ** float32 tensor: exactly HF's op sequence.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim  # [D/2]
    if theta is not None:
        return 1.0 / (theta ** exponents)
    if config.rope_type == "longrope":  # transformers' _compute_longrope_parameters
        factors = config.rope_long_factor if long else config.rope_short_factor
        ext = torch.tensor(factors, dtype=torch.float32, device=device)  # [D/2]
        return 1.0 / (ext * config.rope_theta ** exponents)
    inv_freq = 1.0 / (config.rope_theta ** exponents)  # [D/2] float32
    if config.rope_type == "linear":
        inv_freq = inv_freq / config.rope_factor
    elif config.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, config)
    return inv_freq


def build_cos_sin_cache(
    config: ModelConfig, max_pos: int | None = None, device: torch.device | str | None = None,
    theta: float | None = None,
) -> torch.Tensor:
    """[max_pos, head_dim] float32: cos of the D/2 frequencies, then their sin. `theta`: another rope base
    (Gemma 3's windowed layers).

    Build it on the serving device: cos/sin differ in the last bit between CPU and CUDA, and
    transformers computes them on the model's device.

    Longrope: positions below original_max_position_embeddings use the short factors, the others the long
    ones, and cos/sin are multiplied by the attention factor. transformers instead picks one set for a whole
    forward by its longest position, so a sequence that grows past the original length gets its earlier
    tokens' rotation changed; per position, a token's K never changes once cached, which is what the prefix
    cache and chunked prefill need. Both agree row for row (each half matches transformers' own table).
    """
    max_pos = config.max_position_embeddings if max_pos is None else max_pos
    positions = torch.arange(max_pos, dtype=torch.int64, device=device).float()  # [max_pos]
    inv_freq = compute_inv_freq(config, device, theta)  # [D/2]
    freqs = positions[:, None] * inv_freq[None, :]  # [max_pos, D/2]
    if theta is None and config.rope_type == "longrope":
        split = min(config.rope_original_max_position_embeddings, max_pos)
        long_freqs = positions[split:, None] * compute_inv_freq(config, device, long=True)[None, :]
        freqs = torch.cat((freqs[:split], long_freqs))
        scale = config.rope_attention_factor
        return torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1).contiguous()  # [max_pos, D]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()  # [max_pos, D]


def _llama3_scale(inv_freq: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """transformers' `_compute_llama3_parameters`: long wavelengths divided by `factor`, short ones
    kept, the band between smoothly interpolated."""
    factor = config.rope_factor
    low_freq_factor = config.rope_low_freq_factor
    high_freq_factor = config.rope_high_freq_factor
    old_context_len = config.rope_original_max_position_embeddings
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq  # [D/2]
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
