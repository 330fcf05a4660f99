"""gguf_export: writes an HF checkpoint (a state dict and its config.json) as a GGUF file laid out as llama.cpp's
convert_hf_to_gguf.py lays it out: its tensor names (gguf's TensorNameMap), the q/k row permutation of the llama
architecture, Gemma's norms stored as 1 + w, tied embeddings without output.weight, MoE experts stacked into 3-D
ffn_{gate,up,down}_exps, a GGML type per tensor chosen by a rule, and the architecture's metadata keys (optionally
the tokenizer.* fields copied from another GGUF). For the tests' tiny checkpoints and the benchmark scripts:
`python -m lightserve.engine.gguf_export --help`.

The legacy block types are quantized by `gguf.quants.quantize`; the K-quants (which that package only
dequantizes) by the simple min/max quantizers below: valid blocks of the GGML layout, not llama.cpp's
error-minimizing search, so a file's values differ from llama-quantize's for the same weights.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    import gguf

logger = logging.getLogger(__name__)

# HF model_type -> llama.cpp's architecture (Mistral and Mixtral are llama there).
GGUF_ARCH_OF_MODEL_TYPE = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2",
                           "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "gemma2": "gemma2", "gemma3_text": "gemma3",
                           "gemma3": "gemma3"}
PRESETS = {
    # llama.cpp's Q4_K_M in short: Q4_K, with Q6_K for the value and down projections and the output layer.
    "q4_k_m": "attn_v=Q6_K,ffn_down=Q6_K,output.=Q6_K,*=Q4_K",
}
# K-quants need rows of whole 256-blocks; llama.cpp falls back to these where a row is not.
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q8_K": "Q8_0"}
_EXPERT = re.compile(r"(?P<base>.*\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
_FUSED_EXPERTS = re.compile(r"(?P<base>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_ROWS_PER_CHUNK = 4096  # rows quantized at a time (bounds the float32 temporaries of a large matrix)

TypeRule = Callable[[str, tuple[int, ...]], "gguf.GGMLQuantizationType"]


def type_rule(spec: str) -> TypeRule:
    """A rule from a preset name (q4_k_m), one type for every matrix (q8_0), or `PATTERN=TYPE,...,*=TYPE`: the first
    pattern that starts the GGUF tensor name or one of its dot-separated parts wins (`output.` is the output layer,
    not `blk.N.attn_output`). 1-D tensors, norms and MoE routers are F32 whatever the rule;
    a K-quant on rows that are not whole 256-blocks falls back as llama.cpp's does (Q4_K -> Q5_0, Q6_K -> Q8_0)."""
    import gguf

    spec = PRESETS.get(spec.lower(), spec)
    pairs = [item.split("=", 1) if "=" in item else ("*", item) for item in spec.split(",") if item.strip()]
    try:
        table = [(pattern.strip(), gguf.GGMLQuantizationType[name.strip().upper()]) for pattern, name in pairs]
    except KeyError as exc:
        raise ValueError(f"unknown GGML type {exc} in {spec!r}") from None

    def rule(name: str, shape: tuple[int, ...]) -> gguf.GGMLQuantizationType:
        if len(shape) == 1 or name.endswith("norm.weight") or "ffn_gate_inp" in name:
            return gguf.GGMLQuantizationType.F32
        qtype = next((t for pattern, t in table if pattern == "*" or name.startswith(pattern) or f".{pattern}" in name),
                     gguf.GGMLQuantizationType.F32)
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if shape[-1] % block:
            fallback = _FALLBACK.get(qtype.name)
            qtype = gguf.GGMLQuantizationType[fallback] if fallback else gguf.GGMLQuantizationType.F16
            if shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
                qtype = gguf.GGMLQuantizationType.F16
        return qtype

    return rule


def export_gguf(state_dict: Mapping[str, torch.Tensor], config: dict, out_path: str | Path,
                types: str | TypeRule = "q8_0", tokenizer_from: str | Path | None = None,
                name: str | None = None) -> Path:
    """Write `state_dict` (HF names; a lazy Mapping is read one tensor at a time) with its HF `config` as a GGUF
    file at out_path. `types`: a type_rule spec or rule. `tokenizer_from`: a GGUF whose tokenizer.* fields are
    copied. ValueError for an architecture or tensor llama.cpp's layout has no name for."""
    import gguf

    model_type = config.get("model_type", "")
    arch = GGUF_ARCH_OF_MODEL_TYPE.get(model_type)
    if arch is None:
        raise ValueError(f"model_type {model_type!r} has no GGUF export here "
                         f"(known: {', '.join(sorted(GGUF_ARCH_OF_MODEL_TYPE))})")
    rule = type_rule(types) if isinstance(types, str) else types
    out_path = Path(out_path)
    writer = gguf.GGUFWriter(out_path, arch, use_temp_file=True)
    writer.add_name(name or out_path.stem)
    _add_metadata(writer, arch, config)
    if tokenizer_from is not None:
        _copy_tokenizer_fields(writer, Path(tokenizer_from))
    counts: dict[str, int] = {}
    for gguf_name, tensor in _gguf_tensors(state_dict, config, arch):
        qtype = rule(gguf_name, tuple(tensor.shape))
        writer.add_tensor(gguf_name, quantize(tensor, qtype), raw_dtype=qtype)
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    logger.info("wrote %s (%s)", out_path, ", ".join(f"{n} {t}" for t, n in sorted(counts.items())))
    return out_path


# ---- quantizers --------------------------------------------------------------------------------------------------

def quantize(x: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """x [..., K] float -> GGML bytes [..., K / QK * block_bytes] uint8 (F32/F16: the values themselves)."""
    import gguf

    x = x.detach().float().contiguous()
    if qtype == gguf.GGMLQuantizationType.F32:
        return x.numpy()
    if qtype == gguf.GGMLQuantizationType.F16:
        return x.half().numpy()
    k_quant = _K_QUANTIZERS.get(qtype.name)
    rows = x.reshape(-1, x.shape[-1])
    parts = []
    for start in range(0, rows.shape[0], _ROWS_PER_CHUNK):
        chunk = rows[start:start + _ROWS_PER_CHUNK]
        if k_quant is not None:
            parts.append(k_quant(chunk.reshape(-1, 256)).reshape(chunk.shape[0], -1).numpy())
        else:
            parts.append(gguf.quants.quantize(chunk.numpy(), qtype))
    return np.concatenate(parts).reshape(*x.shape[:-1], -1)


def _k_scales(sub: torch.Tensor, levels: int) -> tuple[torch.Tensor, ...]:
    """Q4_K/Q5_K's affine sub-blocks: sub [nb, 8, 32] -> (d, dmin [nb] fp16; sc, m [nb, 8] in 0..63; q [nb, 8, 32]
    in 0..levels), value = d * sc * q - dmin * m."""
    lo = sub.amin(-1).clamp(max=0.0)  # [nb, 8], a min above 0 is stored as 0 (llama.cpp does the same)
    scale = (sub.amax(-1) - lo) / levels  # [nb, 8]
    d, dmin = (scale.amax(-1) / 63).half(), (-lo).amax(-1).div(63).half()  # [nb]
    sc = _ratio(scale, d.float()[:, None]).round().clamp(0, 63)
    m = _ratio(-lo, dmin.float()[:, None]).round().clamp(0, 63)
    eff_scale, eff_min = d.float()[:, None] * sc, dmin.float()[:, None] * m  # [nb, 8]
    q = _ratio(sub + eff_min[..., None], eff_scale[..., None]).round().clamp(0, levels)
    return d, dmin, sc.to(torch.uint8), m.to(torch.uint8), q.to(torch.uint8)


def _pack_k_scales(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """8 six-bit scales and mins -> ggml's 12 bytes (get_scale_min_k4's inverse). [nb, 8] x 2 -> [nb, 12]."""
    return torch.cat([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                      (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)], dim=1)


def _quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    """x [nb, 256] -> [nb, 144]: d, dmin (fp16), scales[12], qs[128] (sub-blocks 2g / 2g+1 in the low / high
    nibbles of bytes 32g..32g+31)."""
    d, dmin, sc, m, q = _k_scales(x.view(-1, 8, 32), 15)
    qs = q[:, 0::2] | (q[:, 1::2] << 4)  # [nb, 4, 32]
    return torch.cat([_half_bytes(d), _half_bytes(dmin), _pack_k_scales(sc, m), qs.flatten(1)], dim=1)


def _quantize_q5_k(x: torch.Tensor) -> torch.Tensor:
    """x [nb, 256] -> [nb, 176]: d, dmin, scales[12], qh[32] (bit j of byte l: sub-block j's fifth bit), qs[128]."""
    d, dmin, sc, m, q = _k_scales(x.view(-1, 8, 32), 31)
    low = q & 0xF
    qs = low[:, 0::2] | (low[:, 1::2] << 4)  # [nb, 4, 32]
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    qh = (((q >> 4) & 1) << shifts).sum(1, dtype=torch.int32).to(torch.uint8)  # [nb, 32]
    return torch.cat([_half_bytes(d), _half_bytes(dmin), _pack_k_scales(sc, m), qh, qs.flatten(1)], dim=1)


def _quantize_q6_k(x: torch.Tensor) -> torch.Tensor:
    """x [nb, 256] -> [nb, 210]: ql[128], qh[64], scales[16] (int8), d (fp16); value = d * scale * (q - 32)."""
    sub = x.view(-1, 16, 16)
    scale = sub.abs().amax(-1) / 31  # [nb, 16]
    d = (scale.amax(-1) / 127).half()  # [nb]
    sc = _ratio(scale, d.float()[:, None]).round().clamp(-128, 127)
    q = _ratio(sub, (d.float()[:, None] * sc)[..., None]).round().clamp(-32, 31)
    q = (q + 32).to(torch.uint8).view(-1, 2, 4, 32)  # [nb, half, quarter, l]: element 128 half + 32 quarter + l
    ql = (q[:, :, 0:2] & 0xF) | ((q[:, :, 2:4] & 0xF) << 4)  # [nb, 2, 2, 32]: byte 64 half + l of 0..63
    shifts = (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 4, 1)
    qh = (((q >> 4) & 3) << shifts).sum(2, dtype=torch.int32).to(torch.uint8)  # [nb, 2, 32]
    return torch.cat([ql.flatten(1), qh.flatten(1), sc.to(torch.int8).view(torch.uint8), _half_bytes(d)], dim=1)


_K_QUANTIZERS = {"Q4_K": _quantize_q4_k, "Q5_K": _quantize_q5_k, "Q6_K": _quantize_q6_k}


def _ratio(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a / b, 0 where b is 0 (an all-zero sub-block)."""
    return torch.where(b > 0, a / torch.where(b > 0, b, 1.0), 0.0)


def _half_bytes(v: torch.Tensor) -> torch.Tensor:
    return v.contiguous().view(torch.uint8).view(-1, 2)


# ---- names, transforms, metadata ---------------------------------------------------------------------------------

def _gguf_tensors(state_dict: Mapping[str, torch.Tensor], config: dict, arch: str
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, float tensor as llama.cpp stores it) of every weight: experts stacked per layer and projection."""
    import gguf

    num_layers = int(config["num_hidden_layers"])
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_enum, num_layers)
    tied = config.get("tie_word_embeddings", _ties_by_default(config)) or "lm_head.weight" not in state_dict
    experts: dict[str, dict[int, str]] = {}  # HF base name of a projection -> expert -> HF tensor name

    def gguf_name(hf_base: str, suffix: str) -> str:
        mapped = names.get_name(hf_base)
        if mapped is None:
            raise ValueError(f"{hf_base}{suffix}: llama.cpp's {arch} layout has no tensor of that name")
        return mapped + suffix

    for hf_name in state_dict:
        if hf_name == "lm_head.weight" and tied:
            continue
        if m := _EXPERT.fullmatch(hf_name):
            experts.setdefault(f"{m['base']}.{m['proj']}", {})[int(m["e"])] = hf_name
            continue
        if m := _FUSED_EXPERTS.fullmatch(hf_name):  # transformers 5: gate_up [E, 2I, H], down [E, H, I]
            t = state_dict[hf_name]
            if m["proj"] == "down_proj":
                yield gguf_name(f"{m['base']}.down_proj", ".weight"), t
            else:
                gate, up = t.chunk(2, dim=1)
                yield gguf_name(f"{m['base']}.gate_proj", ".weight"), gate
                yield gguf_name(f"{m['base']}.up_proj", ".weight"), up
            continue
        base, suffix = hf_name.rsplit(".", 1) if hf_name.endswith((".weight", ".bias")) else (hf_name, "")
        name = gguf_name(base, "." + suffix if suffix else "")
        yield name, _to_llama_cpp(name, state_dict[hf_name], config, arch)
    for base, by_expert in experts.items():
        stacked = torch.stack([state_dict[by_expert[e]] for e in range(len(by_expert))])  # [E, rows, cols]
        yield gguf_name(base, ".weight"), stacked


def _ties_by_default(config: dict) -> bool:
    """transformers' default tie_word_embeddings of the config's class where config.json omits it."""
    return config.get("model_type", "").startswith("gemma")


def _to_llama_cpp(name: str, t: torch.Tensor, config: dict, arch: str) -> torch.Tensor:
    """llama.cpp's converter transforms: llama's q/k permutation (rope pairs made adjacent) and Gemma's 1 + w."""
    t = t.detach().float()
    if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
        heads = int(config["num_attention_heads"])
        if ".attn_k." in name:
            heads = int(config.get("num_key_value_heads") or heads)
        t = t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
    if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
        t = t + 1.0
    return t


def _add_metadata(writer: gguf.GGUFWriter, arch: str, config: dict) -> None:
    """The architecture keys llama.cpp (and transformers' GGUF config reader) read."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    if "full_attention" in rope:  # Gemma 3 under transformers 5: per layer type
        rope = rope["full_attention"]
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(hidden)
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config.get("intermediate_size") or 0))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or heads))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(int(config["vocab_size"]))
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type in ("linear", "yarn"):
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_type))
        writer.add_rope_scaling_factor(float(rope["factor"]))
        if "original_max_position_embeddings" in rope:
            writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    if num_experts:
        writer.add_expert_count(int(num_experts))
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
        if config.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
    if config.get("sliding_window"):
        writer.add_sliding_window(int(config["sliding_window"]))
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(float(config.get("attn_logit_softcapping") or 0.0))
        writer.add_final_logit_softcapping(float(config.get("final_logit_softcapping") or 0.0))


def _copy_tokenizer_fields(writer: gguf.GGUFWriter, source: Path) -> None:
    import gguf

    for key, field in gguf.GGUFReader(source).fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)


# ---- command line ------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightserve.engine.gguf_export",
        description="Write an HF checkpoint (or random weights for a config.json) as a GGUF file in llama.cpp's "
                    "layout, quantized per tensor.")
    parser.add_argument("model", help="an HF model folder (config.json + *.safetensors), or with --random a "
                                      "config.json (or a folder holding one)")
    parser.add_argument("out", help="the .gguf file to write")
    parser.add_argument("--types", default="q8_0",
                        help="q4_k_m, one GGML type for every matrix (q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k, "
                             "f16, f32), or PATTERN=TYPE,...,*=TYPE on the GGUF names (e.g. attn_v=q6_k,*=q4_k); "
                             "norms and 1-D tensors stay F32 (default: q8_0)")
    parser.add_argument("--random", action="store_true",
                        help="random weights for the config (transformers' initialization, seed 0) instead of a "
                             "checkpoint")
    parser.add_argument("--tokenizer_from", default=None,
                        help="copy the tokenizer.* metadata of this GGUF file ('default': the bundled "
                             "SmolLM2-135M-Instruct's)")
    parser.add_argument("--name", default=None, help="general.name (default: the output file's stem)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    source = Path(args.model)
    config_path = source / "config.json" if source.is_dir() else source
    config = json.loads(config_path.read_text())
    tokenizer_from = args.tokenizer_from
    if tokenizer_from == "default":
        from lightserve.engine.model_prep import default_gguf

        tokenizer_from = default_gguf()
    if args.random:
        state_dict = _random_state_dict(config_path)
    else:
        from safetensors.torch import load_file

        state_dict = {}
        for f in sorted(source.glob("*.safetensors")):
            state_dict.update(load_file(f))
        if not state_dict:
            sys.exit(f"{source}: no *.safetensors files (use --random for random weights)")
    export_gguf(state_dict, config, args.out, args.types, tokenizer_from, args.name)


def _random_state_dict(config_path: Path) -> dict[str, torch.Tensor]:
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(config_path.parent if config_path.name == "config.json"
                                                     else config_path)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.state_dict()


if __name__ == "__main__":
    main()
