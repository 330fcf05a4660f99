#!/usr/bin/env python3
"""Writes the GGUF checkpoints that scripts/compare_llamacpp.sh serves, and the HF float folders of the same weights
for lightserve's full-precision side, into a cache folder (default `<cache root>/bench_gguf`, the cache root being
$LIGHTSERVE_CACHE or ~/.cache/lightserve):

    SmolLM2-135M-Instruct.Q8_0.gguf          the bundled SmolLM2-135M-Instruct Q4_1 GGUF dequantized and requantized
                                             to Q8_0 (norms stay F32), every metadata and tokenizer field kept; its
                                             float side is the bundled model's float32 conversion (model_prep)
    Llama-3.2-1B-shape-random.Q4_K_M.gguf    a Llama-3.2-1B-shaped checkpoint with random weights, Q4_K_M-style:
                                             Q4_K for most matrices, Q6_K for attn_v, ffn_down and token_embd (the
                                             output layer: the embeddings are tied), F32 norms
    Llama-3.2-1B-shape-random.Q4_K_M-hf/     those weights dequantized: config.json, model.safetensors (float32) and
                                             the bundled model's tokenizer files
    Llama-3.2-1B-shape-random.Q8_0.gguf      the same random weights as Q8_0 (norms F32)
    Llama-3.2-1B-shape-random.Q8_0-hf/       and dequantized

The Llama-3.2-1B shape: hidden 2048, 16 layers, 32 query heads, 8 KV heads, head_dim 64, intermediate 8192, tied
embeddings, rope theta 500000 (no llama3 rope scaling), rms eps 1e-5, 8,192 positions. It keeps SmolLM2-135M-
Instruct's tokenizer and vocabulary (49,152 tokens, not Llama 3's 128,256; the GGUF's tokenizer.* fields and the HF
folder's tokenizer files both come from the bundled model), so every server of a comparison tokenizes the prompts
alike: 1.07 billion parameters (Llama-3.2-1B: 1.24 billion, the difference its larger vocabulary). The weights are
normal(0, 0.02) per matrix (transformers' Llama initialization) and 1 per norm, drawn from a generator seeded per
tensor, so the Q4_K_M and Q8_0 files quantize the same weights and activations stay finite; the text it writes is
noise (it measures speed and memory, not answers).

The GGUF files come from lightserve.engine.gguf_export (llama.cpp's tensor names and q/k row order). Its K-quants are
min/max quantizers, not llama-quantize's search: the block layout (and so the speed) is llama.cpp's, the values
differ. The HF folders hold each GGUF file's weights as read back from it (gguf's own dequantizer, q/k rows put
back in HF order), so lightserve's float side serves exactly the values its GGUF side serves packed.

Files and folders already there are skipped (--force rewrites them); each is written under a temporary name and
renamed into place. Memory stays near one tensor's float32 copy (the safetensors file is streamed tensor by tensor).
All of it: 0.7 + 1.1 GB of GGUF, 2 x 4.3 GB of float32 folders, about 12 minutes on 2 busy cores.

    python scripts/make_bench_gguf.py [--out DIR] [--only smollm2-q8_0,llama1b-q4_k_m,llama1b-q8_0] [--force]
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger("make_bench_gguf")

SMOLLM2_Q8_0 = "SmolLM2-135M-Instruct.Q8_0.gguf"
LLAMA1B = "Llama-3.2-1B-shape-random"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
# Llama-3.2-1B's shape with SmolLM2-135M-Instruct's vocabulary and special tokens (bos 1, eos 2).
LLAMA1B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "vocab_size": 49152,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "initializer_range": 0.02,
    "dtype": "float32",
}
TARGETS = ("smollm2-q8_0", "llama1b-q4_k_m", "llama1b-q8_0")


def default_out_dir() -> Path:
    from lightserve import envs

    return envs.cache_root() / "bench_gguf"


# ---- types -------------------------------------------------------------------------------------------------------

def q4_k_m_rule():
    """GGUF name, shape -> type: Q6_K for attn_v, ffn_down, token_embd and output, Q4_K for the other matrices;
    gguf_export.type_rule's F32 norms and fallbacks (rows not of whole 256-blocks) apply to both."""
    from lightserve.engine.gguf_export import type_rule

    q6, q4 = type_rule("q6_k"), type_rule("q4_k")

    def rule(name: str, shape: tuple[int, ...]):
        more_bits = ".attn_v." in name or ".ffn_down." in name or name in ("token_embd.weight", "output.weight")
        return (q6 if more_bits else q4)(name, shape)

    return rule


# ---- (a) the bundled GGUF requantized ----------------------------------------------------------------------------

def requantize_gguf(src: Path, dst: Path, types: str = "q8_0") -> None:
    """Every tensor of `src` dequantized and quantized again by gguf_export.type_rule(types) (norms stay F32), with
    all of src's metadata but general.file_type (set to the new type's)."""
    import gguf

    from lightserve.engine.gguf_export import quantize, type_rule

    rule = type_rule(types)
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch, use_temp_file=True)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{types.upper()}"])
    for t in reader.tensors:
        values = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)  # [rows, cols], a copy
        qtype = rule(t.name, tuple(values.shape))
        writer.add_tensor(t.name, quantize(torch.from_numpy(values), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---- (b) the Llama-3.2-1B-shaped random checkpoint -----------------------------------------------------------------

class RandomLlama(Mapping[str, torch.Tensor]):
    """The HF state dict of a Llama config with random weights, each tensor made when read: normal(0, std) for
    matrices, ones for norms, from a generator seeded by the tensor's place, so every read gives the same values."""

    def __init__(self, config: dict, seed: int = 0, std: float = 0.02):
        h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
        hd = config.get("head_dim") or h // config["num_attention_heads"]
        q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
        self.shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
        for i in range(config["num_hidden_layers"]):
            p = f"model.layers.{i}."
            self.shapes.update({
                p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter)})
        self.shapes["model.norm.weight"] = (h,)
        if not config.get("tie_word_embeddings"):
            self.shapes["lm_head.weight"] = (v, h)
        self.seed, self.std = seed, std

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if len(shape) == 1:
            return torch.ones(shape)
        gen = torch.Generator().manual_seed(self.seed * 100_003 + list(self.shapes).index(name))
        return torch.randn(shape, generator=gen) * self.std

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def hf_name_map(config: dict, hf_names: list[str]) -> dict[str, str]:
    """GGUF tensor name -> HF name, by gguf's own name table for the llama architecture."""
    import gguf

    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    out = {}
    for name in hf_names:
        base, suffix = name.rsplit(".", 1)
        out[table.get_name(base) + "." + suffix] = name
    return out


def unpermute_qk(t: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (each head's rope halves interleaved) back to HF's: the inverse of
    convert_hf_to_gguf.py's LlamaModel.permute."""
    rows = t.shape[0]
    return t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def write_hf_folder(gguf_path: Path, config: dict, hf_names: list[str], tokenizer_dir: Path, out_dir: Path) -> None:
    """The weights of gguf_path dequantized, as an HF folder: config.json, model.safetensors (float32, streamed one
    tensor at a time) and the tokenizer files of tokenizer_dir."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    names = hf_name_map(config, hf_names)
    tensors = {t.name: t for t in reader.tensors}
    missing = sorted(set(names) - set(tensors))
    extra = sorted(set(tensors) - set(names))
    if missing or extra:
        raise ValueError(f"{gguf_path}: tensors missing {missing[:4]}, unexpected {extra[:4]}")
    order = sorted(names, key=lambda g: names[g])  # safetensors lists its tensors by name
    header: dict = {"__metadata__": {"format": "pt", "source": gguf_path.name}}
    offset = 0
    for g in order:
        shape = [int(d) for d in reversed(tensors[g].shape)]  # GGUF lists dimensions innermost first
        size = 4 * int(np.prod(shape))
        header[names[g]] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(out_dir / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for g in order:
            t = tensors[g]
            values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            if ".attn_q." in g:
                values = unpermute_qk(values, config["num_attention_heads"])
            elif ".attn_k." in g:
                values = unpermute_qk(values, config["num_key_value_heads"])
            assert list(values.shape) == header[names[g]]["shape"], (g, values.shape)
            f.write(np.ascontiguousarray(values).astype("<f4", copy=False).tobytes())
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)


# ---- writing in place ----------------------------------------------------------------------------------------------

def write_file(path: Path, make, force: bool) -> None:
    """make(tmp_path) writes the file, which is then renamed to path; skipped when path exists (unless force)."""
    if path.exists() and not force:
        logger.info("%s is there; skipped", path)
        return
    start = time.perf_counter()
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        make(tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    logger.info("wrote %s (%.0f MB, %.0f s)", path, path.stat().st_size / 1e6, time.perf_counter() - start)


def write_folder(path: Path, make, force: bool) -> None:
    """make(tmp_dir) fills a temporary sibling folder, which is then renamed to path; skipped when path exists."""
    if path.exists() and not force:
        logger.info("%s is there; skipped", path)
        return
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        make(tmp)
        tmp.chmod(0o755)
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("wrote %s/ (%.0f s)", path, time.perf_counter() - start)


def make_all(out: Path, targets: list[str], force: bool = False) -> None:
    from lightserve.engine.gguf_export import export_gguf
    from lightserve.engine.model_prep import default_gguf, ensure_default_model

    out.mkdir(parents=True, exist_ok=True)
    bundled = default_gguf()
    if "smollm2-q8_0" in targets:
        write_file(out / SMOLLM2_Q8_0, lambda tmp: requantize_gguf(bundled, tmp, "q8_0"), force)
    llama_types = {"llama1b-q4_k_m": ("Q4_K_M", q4_k_m_rule()), "llama1b-q8_0": ("Q8_0", "q8_0")}
    chosen = [t for t in targets if t in llama_types]
    if not chosen:
        return
    tokenizer_dir = ensure_default_model()
    weights = RandomLlama(LLAMA1B_CONFIG)
    for target in chosen:
        label, types = llama_types[target]
        gguf_path = out / f"{LLAMA1B}.{label}.gguf"
        write_file(gguf_path, lambda tmp, types=types, label=label: export_gguf(
            weights, LLAMA1B_CONFIG, tmp, types, tokenizer_from=bundled, name=f"{LLAMA1B}.{label}"), force)
        write_folder(out / f"{LLAMA1B}.{label}-hf", lambda tmp, g=gguf_path: write_hf_folder(
            g, LLAMA1B_CONFIG, list(weights), tokenizer_dir, tmp), force)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="the cache folder (default: <cache root>/bench_gguf)")
    ap.add_argument("--only", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)} (all)")
    ap.add_argument("--force", action="store_true", help="rewrite files and folders that are already there")
    args = ap.parse_args(argv)
    targets = [t for t in args.only.split(",") if t]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        ap.error(f"--only: unknown {unknown} (known: {', '.join(TARGETS)})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    make_all(args.out if args.out is not None else default_out_dir(), targets, args.force)


if __name__ == "__main__":
    sys.exit(main())
