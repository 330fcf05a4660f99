"""LoraAdapter: a PEFT LoRA adapter folder checked against the base model, and its tensors read as float32.

The HTTP front calls `read_lora_adapter` to validate an adapter before accepting it (config and the safetensors
header only, no weights read); the workers call it again when they load one, then `load_lora_tensors`
(model_infer/lora.py shards, scales and stacks them). Light on purpose: json, safetensors and torch only.
"""
from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lightserve.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES = ATTENTION_MODULES + MLP_MODULES

# The architectures whose layers take LoRA deltas (model_infer/models/ serves them; names kept here because the
# shared words do not import process folders). The MoE families have no dense MLP per expert to adapt.
_ALL_MODULES_ARCHS = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                "Gemma2ForCausalLM", "Gemma3ForCausalLM"})
_ATTENTION_ONLY_ARCHS = frozenset({"MixtralForCausalLM", "Qwen3MoeForCausalLM"})

# adapter_config.json keys that change the adapter's math beyond W + scaling * B @ A; a true (non-empty) value is
# refused. Keys about initialisation or training only (init_lora_weights, loftq_config, lora_dropout, ...) are
# ignored, and so are layers_to_transform / exclude_modules: which layers hold tensors is read from the file.
_REFUSED_KEYS = ("use_dora", "lora_bias", "modules_to_save", "fan_in_fan_out", "rank_pattern", "alpha_pattern",
                 "layer_replication", "target_parameters", "trainable_token_indices", "alora_invocation_tokens",
                 "use_qalora", "use_bdlora", "megatron_config")
_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
_NAME = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


class LoraAdapterError(ValueError):
    """An adapter that cannot be served; the message names the file, tensor or key at fault."""


@dataclass(frozen=True)
class LoraAdapter:
    path: str                          # the adapter folder
    rank: int                          # r
    alpha: float                       # lora_alpha
    use_rslora: bool
    scaling: float                     # alpha / r, or alpha / sqrt(r) with rsLoRA: delta = scaling * B @ A
    target_modules: tuple[str, ...]    # the projections with tensors in the file, in LORA_MODULES order


def lora_target_modules(model: ModelConfig) -> tuple[str, ...]:
    """The projections an adapter may target on this base model. ValueError naming --enable_lora for a family
    whose layers cannot take LoRA deltas (DeepSeek's latent attention, Phi-3's fused checkpoint projections)."""
    if model.architecture in _ALL_MODULES_ARCHS:
        return LORA_MODULES
    if model.architecture in _ATTENTION_ONLY_ARCHS:
        return ATTENTION_MODULES
    raise ValueError(f"--enable_lora: LoRA adapters are not served on {model.architecture} (served on "
                     f"{', '.join(sorted(_ALL_MODULES_ARCHS | _ATTENTION_ONLY_ARCHS))}; MoE models: attention "
                     "projections only)")


def read_lora_adapter(path: str | Path, model: ModelConfig, max_rank: int) -> LoraAdapter:
    """Check the PEFT adapter folder `path` against the base `model` without reading its weights: the config
    (LoRA, rank <= max_rank, targets this base has, no feature beyond plain LoRA) and every tensor's name, shape and
    dtype in the safetensors header. Raises LoraAdapterError naming the file, key or tensor at fault (ValueError
    from lora_target_modules where the base family takes no adapters)."""
    folder = Path(path)
    allowed = lora_target_modules(model)
    cfg = _read_config(folder / CONFIG_FILE)
    config_file = folder / CONFIG_FILE
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraAdapterError(f"{config_file}: \"r\" must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraAdapterError(f"{config_file}: rank r={rank} is above --max_lora_rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoraAdapterError(f"{config_file}: \"lora_alpha\" must be a number, got {alpha!r}")
    if cfg.get("bias", "none") != "none":
        raise LoraAdapterError(f"{config_file}: \"bias\": {cfg['bias']!r} is not supported (only \"none\")")
    for key in _REFUSED_KEYS:
        if cfg.get(key):
            raise LoraAdapterError(f"{config_file}: \"{key}\": {cfg[key]!r} is not supported (plain LoRA only)")
    _check_config_targets(config_file, cfg.get("target_modules"), allowed, model)

    weights_file = folder / WEIGHTS_FILE
    header = _read_header(weights_file)
    found: dict[tuple[int, str], dict[str, list[int]]] = {}   # (layer, module) -> {"A": shape, "B": shape}
    for name, info in header.items():
        m = _NAME.fullmatch(name)
        if m is None:
            raise LoraAdapterError(f"{weights_file}: tensor {name!r} is not a LoRA A/B weight of a decoder layer's "
                                   f"projection ({', '.join(LORA_MODULES)})")
        layer, block, module, ab = int(m[1]), m[2], m[3], m[4]
        if module not in LORA_MODULES or block != ("self_attn" if module in ATTENTION_MODULES else "mlp"):
            raise LoraAdapterError(f"{weights_file}: tensor {name!r}: module {module!r} is not one of "
                                   f"{', '.join(LORA_MODULES)}")
        if module not in allowed:
            raise LoraAdapterError(f"{weights_file}: tensor {name!r}: {model.architecture} takes LoRA on "
                                   f"{', '.join(allowed)} only")
        if layer >= model.num_layers:
            raise LoraAdapterError(f"{weights_file}: tensor {name!r}: layer {layer} is past the base model's "
                                   f"{model.num_layers} layers")
        if info["dtype"] not in _DTYPES:
            raise LoraAdapterError(f"{weights_file}: tensor {name!r} is {info['dtype']} (F32, F16 or BF16 only)")
        in_dim, out_dim = _module_dims(model, module)
        want = [rank, in_dim] if ab == "A" else [out_dim, rank]
        if list(info["shape"]) != want:
            raise LoraAdapterError(f"{weights_file}: tensor {name!r} has shape {list(info['shape'])}, the base model "
                                   f"and r={rank} need {want}")
        found.setdefault((layer, module), {})[ab] = want
    if not found:
        raise LoraAdapterError(f"{weights_file}: no LoRA tensors")
    for (layer, module), pair in found.items():
        if len(pair) != 2:
            missing = "B" if "A" in pair else "A"
            raise LoraAdapterError(f"{weights_file}: layer {layer} {module} has no lora_{missing} tensor")
    targets = {module for _, module in found}
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return LoraAdapter(path=str(folder), rank=rank, alpha=float(alpha), use_rslora=bool(cfg.get("use_rslora")),
                       scaling=float(scaling), target_modules=tuple(m for m in LORA_MODULES if m in targets))


def load_lora_tensors(adapter: LoraAdapter) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Every targeted (layer, module)'s (A [r, in], B [out, r]) as float32 CPU tensors, unscaled. The adapter must
    come from read_lora_adapter (names and shapes checked); LoraAdapterError for a file unreadable past its header."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights_file = Path(adapter.path) / WEIGHTS_FILE
    try:
        tensors = load_file(str(weights_file))
    except (OSError, SafetensorError) as e:
        raise LoraAdapterError(f"{weights_file}: cannot be read: {e}") from e
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _NAME.fullmatch(name)
        assert m is not None, f"{name} passed read_lora_adapter's check"
        pairs.setdefault((int(m[1]), m[3]), {})[m[4]] = t.float()
    return {key: (pair["A"], pair["B"]) for key, pair in sorted(pairs.items())}


def _module_dims(model: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a projection of the base model, unsharded."""
    q, kv, hidden, inter = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim, \
        model.hidden_size, model.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}[module]


def _read_config(config_file: Path) -> dict:
    try:
        with open(config_file) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LoraAdapterError(f"{config_file}: not found (a PEFT adapter folder holds {CONFIG_FILE} and "
                               f"{WEIGHTS_FILE})") from None
    except (OSError, ValueError) as e:
        raise LoraAdapterError(f"{config_file}: cannot be read as JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise LoraAdapterError(f"{config_file}: not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"{config_file}: \"peft_type\": {cfg['peft_type']!r} is not a LoRA adapter")
    return cfg


def _check_config_targets(config_file: Path, targets: object, allowed: tuple[str, ...], model: ModelConfig) -> None:
    """The listed target_modules must be projections this base takes LoRA on. A regex string (or "all-linear")
    is left to the tensors in the file, which read_lora_adapter checks one by one."""
    if targets is None or isinstance(targets, str):
        return
    if not isinstance(targets, list):
        raise LoraAdapterError(f"{config_file}: \"target_modules\" must be a list or a string, got {targets!r}")
    for name in targets:
        short = str(name).rsplit(".", 1)[-1]
        if short not in LORA_MODULES:
            raise LoraAdapterError(f"{config_file}: target module {name!r} is not supported "
                                   f"(supported: {', '.join(LORA_MODULES)})")
        if short not in allowed:
            raise LoraAdapterError(f"{config_file}: target module {name!r}: {model.architecture} takes LoRA on "
                                   f"{', '.join(allowed)} only")


def _read_header(weights_file: Path) -> dict[str, dict]:
    """The safetensors header's tensor entries (name -> {"dtype", "shape", "data_offsets"}), checked to lie inside
    the file, without reading the data."""
    try:
        with open(weights_file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise LoraAdapterError(f"{weights_file}: corrupt safetensors file (shorter than its 8-byte header "
                                       "length)")
            (n,) = struct.unpack("<Q", head)
            size = weights_file.stat().st_size
            if n > min(_MAX_HEADER, size - 8):
                raise LoraAdapterError(f"{weights_file}: corrupt safetensors file (header of {n} bytes in a file "
                                       f"of {size})")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise LoraAdapterError(f"{weights_file}: not found (only safetensors adapters are served)") from None
    except (OSError, ValueError) as e:
        raise LoraAdapterError(f"{weights_file}: corrupt safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise LoraAdapterError(f"{weights_file}: corrupt safetensors header (not a JSON object)")
    data_len = size - 8 - n
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise LoraAdapterError(f"{weights_file}: corrupt safetensors header entry for tensor {name!r}") from None
        nbytes = math.prod(shape) * _DTYPES.get(dtype, 0)
        if not 0 <= begin <= end <= data_len or (nbytes and end - begin != nbytes):
            raise LoraAdapterError(f"{weights_file}: corrupt safetensors file: tensor {name!r} lies outside the "
                                   "file's data or has the wrong byte count")
        tensors[name] = {"dtype": dtype, "shape": shape, "data_offsets": (begin, end)}
    return tensors
