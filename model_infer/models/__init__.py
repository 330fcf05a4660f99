"""The model registry: HF `architectures` names -> the family module that serves them.

A family module (one file here) owns everything model-specific:
  ARCHITECTURES                         the HF class names it serves
  read_config(arch, cfg) -> ModelConfig  its config.json keys (raises ValueError naming what it cannot serve)
  tp_shards(config, tp_rank, tp_size)   its tensor-parallel rules (raises ValueError when tp cannot split it)
  read_weights(reader, config, shards)  its HF tensor names and how a rank's slices are cut
  Model                                  its forward (a `models.base.DecoderLM`), which packs its CPU weights
Adding a family = its module + one entry in FAMILIES. The launcher reads the config once
(`read_model_config`) and checks the TP size (`check_tp`) and a GGUF file (`check_gguf`); the worker builds the
model (`load_model`). The weights are the folder's *.safetensors, or else its one .gguf file (`gguf_weights`; read
by gguf_reader.GGUFCheckpointReader, quantized tensors kept in their GGML blocks). Safetensors whose config has a
quantization_config (compressed-tensors int8 / int4, AWQ, GPTQ) are read by hf_quant_reader.HFQuantReader, their
linears kept packed as well.
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from lightserve.log import get_logger
from lightserve.model_infer.gguf_reader import GGUFCheckpointReader
from lightserve.model_infer.gguf_reader import check_gguf as check_gguf  # the launcher's look at a GGUF file
from lightserve.model_infer.hf_quant_reader import HFQuantReader, QuantScheme, quant_scheme
from lightserve.model_infer.models import deepseek, gemma, llama, moe, phi3
from lightserve.model_infer.models.deepseek import mtp_layer_index as mtp_layer_index  # the launcher's check of mtp
from lightserve.model_infer.weights import CheckpointReader, read_kv_scales

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from lightserve.config import KernelBackend
    from lightserve.model_config import ModelConfig
    from lightserve.model_infer.models.base import DecoderLM
    from lightserve.model_infer.weights import ModelWeights

logger = get_logger(__name__)

FAMILIES: tuple[ModuleType, ...] = (llama, gemma, phi3, moe, deepseek)

ARCHITECTURES: dict[str, ModuleType] = {arch: family for family in FAMILIES for arch in family.ARCHITECTURES}
# Multimodal configs keep the text model under one of these keys; their towers are not served.
_TOWER_KEYS = ("vision_config", "audio_config", "vision_tower", "mm_tokens_per_image")


def family_of(architecture: str) -> ModuleType:
    """The family module of an HF architecture name; ValueError naming it when none serves it."""
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; lightserve serves "
                         f"{', '.join(sorted(ARCHITECTURES))}") from None


def config_from_dict(cfg: dict) -> ModelConfig:
    """ModelConfig from a parsed config.json. ValueError names the unsupported architecture, tower, quantization
    or key."""
    architectures = cfg.get("architectures") or []
    arch = architectures[0] if architectures else "<none>"
    family = family_of(arch)
    towers = [key for key in _TOWER_KEYS if cfg.get(key) is not None]
    if cfg.get("text_config") is not None:  # a multimodal layout, even without its tower's config
        towers.append("text_config")
    if towers:
        raise ValueError(f"{arch}: multimodal checkpoints are not supported ({', '.join(towers)} found); "
                         "lightserve serves the text model only")
    quantization = cfg.get("quantization_config")
    if quantization is None:
        return family.read_config(arch, cfg)
    # int8 / 4-bit linears (hf_quant_reader) are read for the Llama family's layers; anything else a
    # quantization_config names (fp8, other bit widths, DeepSeek-V3's block scales) is refused here, at launch.
    scheme = quant_scheme(quantization)
    if family is not llama:
        raise ValueError(f"{arch}: {scheme.method} checkpoints are served for {', '.join(llama.ARCHITECTURES)} only")
    return replace(family.read_config(arch, cfg), quantization=scheme.to_json())


def read_model_config(model_dir: str | Path) -> ModelConfig:
    """Read `<model_dir>/config.json` once; see config_from_dict."""
    with open(Path(model_dir) / "config.json") as f:
        return config_from_dict(json.load(f))


def check_tp(config: ModelConfig, tp_size: int) -> None:
    """ValueError when the family cannot split this model over tp_size ranks (or its weights are act-order ones)."""
    family_of(config.architecture).tp_shards(config, 0, tp_size)
    if tp_size > 1 and config.quantization and QuantScheme.from_json(config.quantization).act_order:
        # Each rank's input columns of o_proj and down_proj would be scattered over the weight's sorted groups.
        raise ValueError("act-order weights (GPTQ desc_act, compressed-tensors actorder \"group\") are served on one "
                         "rank only")


def load_model(
    config: ModelConfig,
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_group: dist.ProcessGroup | None = None,
    backend: KernelBackend | None = None,
    int8_activations: bool = False,
) -> DecoderLM:
    """This rank's model: its weight shard loaded, packed for the CPU GEMMs where `backend` (--kernel_backend, None =
    by device) runs them. `int8_activations`: --quant_activations int8 (see load_weights)."""
    weights = load_weights(model_dir, config, dtype, device, tp_rank, tp_size, int8_activations)
    return family_of(config.architecture).Model(config, weights, tp_rank, tp_size, tp_group, backend)


def load_weights(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    tp_rank: int = 0,
    tp_size: int = 1,
    int8_activations: bool = False,
) -> ModelWeights:
    """Load this rank's shard of every weight, cast to `dtype`, on `device`, with the family's own HF names
    and TP rules (its `tp_shards` and `read_weights`).

    `model_dir`: a folder of *.safetensors, a folder whose weights are one .gguf file, or a .gguf file.
    Raises ValueError for a tp_size the head counts do not allow (or, from GGUF or a quantized checkpoint, for a
    tensor type not served, blocks a rank's slice would cut, or a device other than CPU), FileNotFoundError when the
    folder has no weights, KeyError naming a missing tensor. `int8_activations`: the weights a GGUF file keeps in GGML
    blocks multiply int8-quantized activations at small batches (QuantLinear.int8_dot); no effect on float weights
    or on an HF quantized checkpoint's (its own block formats have no integer path).
    """
    family = family_of(config.architecture)
    start = time.perf_counter()
    shards = family.tp_shards(config, tp_rank, tp_size)
    gguf_file = gguf_weights(model_dir)
    if gguf_file is not None:
        reader = GGUFCheckpointReader(gguf_file, config, dtype, device, int8_dot=int8_activations)
    elif config.quantization:
        reader = HFQuantReader(Path(model_dir), QuantScheme.from_json(config.quantization), dtype, device)
    else:
        reader = CheckpointReader(Path(model_dir), dtype, device)
    try:
        weights = family.read_weights(reader, config, shards)
        weights.kv_scales = read_kv_scales(reader, config.num_layers)
    finally:
        reader.close()
    logger.info("loaded weights (tp %d/%d, %s) in %.1fs", tp_rank, tp_size, dtype, time.perf_counter() - start)
    return weights


def gguf_weights(model_path: str | Path) -> Path | None:
    """The GGUF file that holds a model's weights: `model_path` itself when it is a .gguf file, else the one .gguf in
    a folder without *.safetensors; None for a safetensors folder. ValueError when a folder holds several."""
    path = Path(model_path)
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if any(path.glob("*.safetensors")):
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"{path} holds {len(files)} .gguf files ({', '.join(f.name for f in files)}): "
                         "pass the one to serve")
    return files[0] if files else None
