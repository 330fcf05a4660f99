"""ModelConfig: the architecture facts of one Llama-family checkpoint, read from its HF config.json.

Built once by the worker (`ModelConfig.from_dir`) and passed to the weight loader, the rope cache
and the model. Variants (Qwen2 biases, Qwen3 q/k norm, Llama-3 rope scaling) are fields here.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# transformers' per-class defaults for keys a config.json may omit.
_DEFAULT_HEAD_DIM = {"Qwen3ForCausalLM": 128}
_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float
    rope_type: str                   # "default", "linear" or "llama3"
    rope_factor: float = 1.0         # linear and llama3
    rope_low_freq_factor: float = 1.0   # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max_position_embeddings: int = 0  # llama3 only
    qkv_bias: bool = False           # Qwen2, or Llama/Qwen3 with attention_bias
    o_bias: bool = False             # Llama/Qwen3 with attention_bias
    qk_norm: bool = False            # Qwen3: RMSNorm over head_dim on q and k before rope
    sliding_window: int | None = None  # Mistral v0.1; we cap the context at it instead of windowing
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: torch.dtype = torch.float32  # the checkpoint's dtype; the worker may serve in another

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; "
                f"lightserve serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported; expected one of {SUPPORTED_ROPE_TYPES}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def max_context_len(self) -> int:
        """Longest sequence served exactly: full attention is only equal to sliding-window attention
        up to the window, so a windowed model is capped there."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read `<model_dir>/config.json`; raises ValueError for an unsupported architecture."""
        path = Path(model_dir) / "config.json"
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        architectures = cfg.get("architectures") or []
        arch = architectures[0] if architectures else "<none>"
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {arch!r} is not supported; lightserve serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        if cfg.get("mlp_bias", False):
            raise ValueError("mlp_bias=true is not supported")
        hidden, num_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or _DEFAULT_HEAD_DIM.get(arch) or hidden // num_heads
        attention_bias = bool(cfg.get("attention_bias", False))
        rope = _read_rope(cfg)
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and no o bias; Llama and Qwen3 put attention_bias on all four;
            # Mistral has none.
            qkv_bias=arch == "Qwen2ForCausalLM" or (arch != "MistralForCausalLM" and attention_bias),
            o_bias=arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and attention_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=_read_sliding_window(arch, cfg),
            eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=_read_dtype(cfg),
            **rope,
        )


def _read_rope(cfg: dict) -> dict:
    """Rope settings from either form: transformers 5's `rope_parameters` dict, or the older
    top-level `rope_theta` plus optional `rope_scaling` dict (whose type key is `type` or `rope_type`)."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    theta = params.get("rope_theta", cfg.get("rope_theta", _DEFAULT_ROPE_THETA))
    out = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type in ("linear", "llama3"):
        out["rope_factor"] = float(params["factor"])
    if rope_type == "llama3":
        out["rope_low_freq_factor"] = float(params["low_freq_factor"])
        out["rope_high_freq_factor"] = float(params["high_freq_factor"])
        out["rope_original_max_position_embeddings"] = int(
            cfg.get("original_max_position_embeddings")
            or params.get("original_max_position_embeddings")
            or cfg.get("max_position_embeddings", 2048)
        )
    return out


def _read_sliding_window(arch: str, cfg: dict) -> int | None:
    window = cfg.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not cfg.get("use_sliding_window", False):
        return None
    return int(window) if window else None


def _read_dtype(cfg: dict) -> torch.dtype:
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        logger.warning("unknown checkpoint dtype %r; assuming float32", name)
        return torch.float32
    return dtype


def _as_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
