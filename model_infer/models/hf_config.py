"""Readers of the config.json keys that several families share (sizes, rope, windows, eos), used by each
family's `read_config`. Each raises ValueError naming the key it cannot serve."""
from __future__ import annotations

import math

DEFAULT_ROPE_THETA = 10000.0
ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def base_fields(arch: str, cfg: dict, default_head_dim: int | None = None) -> dict:
    """The ModelConfig fields every decoder has."""
    hidden, num_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or default_head_dim or hidden // num_heads
    return {
        "architecture": arch,
        "hidden_size": hidden,
        "intermediate_size": int(cfg["intermediate_size"]),
        "num_layers": int(cfg["num_hidden_layers"]),
        "num_heads": num_heads,
        "num_kv_heads": int(cfg.get("num_key_value_heads") or num_heads),
        "head_dim": int(head_dim),
        "vocab_size": int(cfg["vocab_size"]),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(cfg.get("max_position_embeddings", 2048)),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "eos_token_ids": as_tuple(cfg.get("eos_token_id")),
        "bos_token_id": cfg.get("bos_token_id"),
    }


def read_rope(cfg: dict, params: dict | None = None) -> dict:
    """Rope settings from either form: transformers 5's `rope_parameters` dict, or the older top-level
    `rope_theta` plus optional `rope_scaling` dict (whose type key is `type` or `rope_type`). `params`: one
    layer type's entry of a per-layer-type `rope_parameters` (Gemma 3)."""
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        params.update(cfg.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported for this architecture")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type in ("su", "yarn") and "short_factor" in params:  # Phi-3's old names for longrope
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; expected one of {ROPE_TYPES}")
    if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    theta = params.get("rope_theta", cfg.get("rope_theta", DEFAULT_ROPE_THETA))
    out = {"rope_theta": float(theta), "rope_type": rope_type}
    original = int(params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or cfg.get("max_position_embeddings", 2048))
    if rope_type in ("linear", "llama3"):
        out["rope_factor"] = float(params["factor"])
    if rope_type == "llama3":
        out["rope_low_freq_factor"] = float(params["low_freq_factor"])
        out["rope_high_freq_factor"] = float(params["high_freq_factor"])
        out["rope_original_max_position_embeddings"] = int(
            cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
            or cfg.get("max_position_embeddings", 2048))
    if rope_type == "longrope":
        # transformers' _compute_longrope_parameters: without an explicit factor, the ratio of the
        # context to the original one sets the attention factor (Phi-3 style).
        factor = params.get("factor") or int(cfg.get("max_position_embeddings", 2048)) / original
        attention = params.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        out["rope_original_max_position_embeddings"] = original
        out["rope_short_factor"] = tuple(float(x) for x in params["short_factor"])
        out["rope_long_factor"] = tuple(float(x) for x in params["long_factor"])
        out["rope_attention_factor"] = float(attention)
    return out


def layer_windows(cfg: dict, window: int | None, num_layers: int) -> tuple[int, ...]:
    """Per-layer sliding windows: `layer_types` names the windowed layers where the config has it, otherwise
    every layer is windowed (Mistral v0.1, Phi-3). () when there is no window."""
    if not window:
        return ()
    types = cfg.get("layer_types")
    if types is None:
        return (int(window),) * num_layers
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types {types!r} is not supported (sliding_attention / full_attention per layer)")
    return tuple(int(window) if t == "sliding_attention" else 0 for t in types)


def refuse_keys(cfg: dict, **unsupported: object) -> None:
    """ValueError naming the first key whose value differs from what we serve (key=served value)."""
    for key, served in unsupported.items():
        value = cfg.get(key, served)
        if value != served and not (value is None and served in (False, 0)):
            raise ValueError(f"{key}={value!r} is not supported (only {served!r})")


def as_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
