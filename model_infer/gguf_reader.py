"""GGUFCheckpointReader: the tensors of one GGUF file (llama.cpp's layout) under their HF names, for the family
loaders (the interface of weights.CheckpointReader). Called through `models.load_weights` when the model folder's
weights are a .gguf file; `check_gguf` is the launcher's look at the file before any worker starts.

Quantized tensors (the types of kernels/quant_linear.BLOCK_SHAPES) come back as QuantLinear over the file's
memory-mapped GGML blocks; F32/F16/BF16 ones as torch tensors of the activation dtype. llama.cpp's converter
(convert_hf_to_gguf.py) changes three things, undone here exactly as transformers' GGUF loader undoes them:
  - the llama architecture (Llama, Mistral, Mixtral) permutes the rows of q and k (weights and biases) so rope
    pairs neighbours; the inverse is a row permutation, so it applies to packed rows as well;
  - Gemma's norms are stored as 1 + w (the family adds 1 again at load, so they come back as stored - 1);
  - a tied lm_head has no output.weight (has("lm_head.weight") is False, the family ties it).
MoE experts are 3-D tensors (blk.N.ffn_{gate,up,down}_exps): the per-expert HF name of expert e is its slice.
"""
from __future__ import annotations

import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from lightserve.kernels.quant_linear import (
    BLOCK_SHAPES,
    FLOAT_TYPES,
    OWN_TYPES,
    GGMLType,
    QuantLinear,
    dequantize,
    quant_tensor,
    slice_cols,
    slice_rows,
)

if TYPE_CHECKING:
    from lightserve.model_config import ModelConfig

# HF architecture -> llama.cpp's GGUF architecture (general.architecture).
GGUF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
# llama.cpp's LlamaModel permutes q/k rows; Gemma's converters store every *norm.weight as 1 + w.
PERMUTED_QK_ARCHS = frozenset({"llama"})
NORM_PLUS_ONE_ARCHS = frozenset({"gemma2", "gemma3"})
# Tensors split by input columns over tensor-parallel ranks: each rank's slice must be whole blocks.
ROW_PARALLEL = ("attn_output.weight", "ffn_down.weight", "ffn_down_exps.weight")

_EXPERT = re.compile(r"(?P<base>.*\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)$")
_GGUF_MAGIC = b"GGUF"
# Bytes of each scalar GGUF metadata value type (gguf.GGUFValueType); 8 is a string, 9 an array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: `data` is the file's bytes of it, memory-mapped, as [..., rows, row bytes] uint8
    for a block type (BF16 too), float16 / float32 values [..., rows, cols] for F16 / F32; `shape` is GGUF's ne
    (input features first)."""

    name: str
    raw_type: int
    shape: tuple[int, ...]
    data: np.ndarray


# The header's readers take the mapped file as an argument: nested in read_gguf, the recursive `_skip` would be a
# closure holding itself, a reference cycle that kept the whole file mapped (and its pages resident, after the
# weights were copied out of them) until the cyclic GC next ran.
def _string(buf: np.ndarray, at: int) -> tuple[str, int]:
    """The GGUF string at byte `at` and the offset past it."""
    (n,) = struct.unpack_from("<Q", buf, at)
    return bytes(buf[at + 8:at + 8 + n]).decode("utf-8"), at + 8 + n


def _skip(buf: np.ndarray, vtype: int, at: int) -> int:
    """The offset past the metadata value of type `vtype` at byte `at`."""
    if vtype == _STRING:
        return at + 8 + struct.unpack_from("<Q", buf, at)[0]
    if vtype == _ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, at)
        at += 12
        if item_type in _SCALAR_BYTES:
            return at + count * _SCALAR_BYTES[item_type]
        for _ in range(count):
            at = _skip(buf, item_type, at)
        return at
    return at + _SCALAR_BYTES[vtype]


def read_gguf(path: str | Path, mode: str = "r") -> tuple[str, list[GGUFTensor]]:
    """(general.architecture, the tensors) of a GGUF file, reading only the header: the metadata values are skipped,
    not parsed (gguf.GGUFReader parses every one, seconds for a tokenizer's 100k strings). `mode`: np.memmap's ("c"
    maps the pages copy-on-write, so torch may wrap them; they are never written). ValueError for a file that is not
    GGUF v2/v3."""
    import gguf

    buf = np.memmap(path, dtype=np.uint8, mode=mode)
    if bytes(buf[:4]) != _GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not read here (2 and 3 are)")
    offset, arch, alignment = 24, "", 32

    for _ in range(num_kv):
        key, offset = _string(buf, offset)
        (vtype,) = struct.unpack_from("<I", buf, offset)
        offset += 4
        if key == "general.architecture":
            arch, offset = _string(buf, offset)
        elif key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", buf, offset)
            offset += 4
        else:
            offset = _skip(buf, vtype, offset)
    infos = []
    for _ in range(num_tensors):
        name, offset = _string(buf, offset)
        (n_dims,) = struct.unpack_from("<I", buf, offset)
        shape = struct.unpack_from(f"<{n_dims}Q", buf, offset + 4)
        raw_type, data_offset = struct.unpack_from("<IQ", buf, offset + 4 + 8 * n_dims)
        offset += 4 + 8 * n_dims + 12
        infos.append((name, raw_type, tuple(int(d) for d in shape), data_offset))
    start = -(-offset // alignment) * alignment
    tensors = []
    for name, raw_type, shape, data_offset in infos:
        rows = tuple(reversed(shape[1:]))
        if raw_type in (GGMLType.F32, GGMLType.F16):
            dtype = np.float32 if raw_type == GGMLType.F32 else np.float16
            count = int(np.prod(shape))
            data = buf[start + data_offset:start + data_offset + count * np.dtype(dtype).itemsize].view(dtype)
            data = data.reshape(*rows, shape[0])
        else:
            try:
                block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw_type)]
            except (ValueError, KeyError):
                block, block_bytes = 1, 0  # an unknown type: refused by name when used (_served_type)
            row_bytes = shape[0] // block * block_bytes
            nbytes = row_bytes * int(np.prod(rows, dtype=np.int64))
            data = buf[start + data_offset:start + data_offset + nbytes].reshape(*rows, row_bytes)
        tensors.append(GGUFTensor(name, raw_type, shape, data))
    return arch, tensors


def gguf_architecture(hf_architecture: str) -> str:
    """llama.cpp's architecture name of an HF one; ValueError naming it when GGUF weights of it are not served."""
    try:
        return GGUF_ARCHITECTURES[hf_architecture]
    except KeyError:
        raise ValueError(f"GGUF weights of {hf_architecture} are not served (GGUF is served for "
                         f"{', '.join(sorted(GGUF_ARCHITECTURES))})") from None


def qk_permutation(num_rows: int, num_heads: int) -> torch.Tensor:
    """[num_rows] int64: HF row r of q (or k) is GGUF row perm[r] (llama.cpp's `permute` keeps each head's rows
    and interleaves its two rope halves: HF (head, half, j) is stored at (head, j, half))."""
    half = num_rows // num_heads // 2
    return torch.arange(num_rows).view(num_heads, half, 2).transpose(1, 2).reshape(-1)


def check_gguf(path: str | Path, config: ModelConfig, tp_size: int) -> bool:
    """What would stop a worker from loading this GGUF, found before any starts: ValueError naming a tensor of a type
    not served packed (IQ*, Q2_K, Q3_K, ...) or a row-parallel tensor whose columns tp_size cannot cut at whole
    blocks, or an architecture not served from GGUF. Returns whether any tensor is kept in blocks (not all float)."""
    gguf_architecture(config.architecture)
    packed = False
    for t in read_gguf(path)[1]:
        qtype = _served_type(t)
        packed = packed or qtype in BLOCK_SHAPES
        if tp_size > 1 and qtype in BLOCK_SHAPES and t.name.endswith(ROW_PARALLEL):
            qk = BLOCK_SHAPES[qtype][0]
            cols = int(t.shape[0])  # ne0: the input features
            if cols % tp_size or (cols // tp_size) % qk:
                raise ValueError(f"--tp {tp_size} would cut {t.name}'s {cols} input features into slices of "
                                 f"{cols / tp_size:g}, not whole {qtype.name} blocks of {qk}")
    return packed


@dataclass(frozen=True)
class _Entry:
    tensor: GGUFTensor
    qtype: GGMLType
    expert: int | None  # a per-expert HF name: its slice of the 3-D tensor
    perm_heads: int | None  # q/k of the llama architecture: the heads to unpermute over
    minus_one: bool  # a Gemma norm stored as 1 + w


class GGUFCheckpointReader(Mapping[str, torch.Tensor]):
    """Reads tensors, or row/column ranges of them, of one GGUF file, by HF name.

    `full`/`rows`/`cols` return QuantLinear for a quantized tensor (full(name, dtype) dequantizes it instead, for a
    router or other small tensor the family computes with) and a tensor of the model dtype for a float one. As a
    Mapping (`reader[name]`) it gives a whole tensor dequantized to float32 on the host. Raises ValueError for a
    tensor type not served packed, KeyError naming a missing tensor. `int8_dot`: every QuantLinear it returns is
    multiplied with int8 activations (--quant_activations int8; kernels/quant_linear.py)."""

    def __init__(self, path: str | Path, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str = "cpu", int8_dot: bool = False) -> None:
        import gguf

        if torch.device(device).type != "cpu":
            raise ValueError(f"GGUF weights are served on CPU only (quantized linears run in C), not on {device}")
        self.dtype, self.device, self.int8_dot = dtype, device, int8_dot
        self.arch = gguf_architecture(config.architecture)
        self._num_heads, self._num_kv_heads = config.num_heads, config.num_kv_heads
        # mode "c": copy-on-write pages, so torch may wrap them (it warns on read-only arrays); never written.
        self._tensors = {t.name: t for t in read_gguf(path, "c")[1]}
        arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == self.arch)
        self._names = gguf.get_tensor_name_map(arch_enum, config.num_layers)

    def has(self, name: str) -> bool:
        return self._entry(name, missing_ok=True) is not None

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._float(self._entry(name), torch.float32, None)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.has(name)

    def __iter__(self) -> Iterator[str]:  # GGUF names: an HF name is known only when asked for
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def full(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor | QuantLinear:
        """The whole tensor: QuantLinear when quantized and no dtype is asked, else a tensor of `dtype` (default the
        model dtype)."""
        entry = self._entry(name)
        if entry.qtype in BLOCK_SHAPES and dtype is None:
            return self._quant(entry, None)
        return self._float(entry, dtype or self.dtype, None)

    def rows(self, name: str, start: int, end: int) -> torch.Tensor | QuantLinear:
        entry = self._entry(name)
        if entry.qtype in BLOCK_SHAPES:
            return self._quant(entry, (start, end))
        return self._float(entry, self.dtype, (start, end))

    def row_ranges(self, name: str, ranges: list[tuple[int, int]]) -> torch.Tensor | QuantLinear:
        from lightserve.model_infer.weights import cat_weights

        return cat_weights([self.rows(name, a, b) for a, b in ranges])

    def cols(self, name: str, start: int, end: int) -> torch.Tensor | QuantLinear:
        entry = self._entry(name)
        if entry.qtype in BLOCK_SHAPES:
            try:
                return slice_cols(self._quant(entry, None), start, end)
            except ValueError as exc:
                raise ValueError(f"{entry.tensor.name}: {exc}") from None
        return self._float(entry, self.dtype, None)[:, start:end].contiguous()

    def close(self) -> None:
        self._tensors.clear()

    # ---- private ----

    def _entry(self, name: str, missing_ok: bool = False) -> _Entry | None:
        base, suffix = name, ""
        if name.endswith((".weight", ".bias")):
            base, suffix = name.rsplit(".", 1)
            suffix = "." + suffix
        expert = None
        if m := _EXPERT.fullmatch(base):
            base, expert = f"{m['base']}.{m['proj']}", int(m["e"])
        gguf_name = self._names.get_name(base)
        tensor = self._tensors.get(gguf_name + suffix) if gguf_name is not None else None
        if tensor is None:
            if missing_ok:
                return None
            raise KeyError(f"tensor {name!r} not found in the GGUF file (as {gguf_name}{suffix})")
        perm_heads = None
        if self.arch in PERMUTED_QK_ARCHS and gguf_name.endswith((".attn_q", ".attn_k")):
            perm_heads = self._num_heads if gguf_name.endswith(".attn_q") else self._num_kv_heads
        minus_one = self.arch in NORM_PLUS_ONE_ARCHS and (gguf_name + suffix).endswith("norm.weight")
        return _Entry(tensor, _served_type(tensor), expert, perm_heads, minus_one)

    def _data(self, entry: _Entry) -> np.ndarray:
        data = entry.tensor.data  # [rows, bytes] uint8 (quantized) or [rows, cols] (float); experts: [E, ...]
        return data[entry.expert] if entry.expert is not None else data

    def _row_index(self, entry: _Entry, num_rows: int, span: tuple[int, int] | None) -> torch.Tensor | None:
        """The GGUF rows of HF rows span (all when None), or None when they are a plain range."""
        if entry.perm_heads is None:
            return None
        perm = qk_permutation(num_rows, entry.perm_heads)
        return perm if span is None else perm[span[0]:span[1]]

    def _quant(self, entry: _Entry, span: tuple[int, int] | None) -> QuantLinear:
        """The rows of `span` (all when None) in memory of their own: a view of the file's pages would keep them
        mapped and resident beside the fused copies made of them (q | k | v, gate | up), so the weights' resident
        size would pass the file's; with copies, close() unmaps the file and the weights take its size."""
        blocks = torch.from_numpy(self._data(entry))  # [N, K / QK * block_bytes] uint8, the file's pages
        in_features = int(entry.tensor.shape[0])
        index = self._row_index(entry, blocks.shape[0], span)
        if index is not None:
            return replace(quant_tensor(entry.qtype, blocks.index_select(0, index), in_features),
                           int8_dot=self.int8_dot)
        w = quant_tensor(entry.qtype, blocks, in_features)
        w = w if span is None else slice_rows(w, *span)
        return replace(w, segments=tuple(replace(s, blocks=s.blocks.clone()) for s in w.segments),
                       int8_dot=self.int8_dot)

    def _float(self, entry: _Entry, dtype: torch.dtype, span: tuple[int, int] | None) -> torch.Tensor:
        if entry.qtype in BLOCK_SHAPES:
            t = dequantize(self._quant(entry, span))
        else:
            import gguf

            # a copy: an F32 tensor's dequantize is a view, which would keep the whole file mapped (see _quant)
            t = torch.from_numpy(np.array(gguf.quants.dequantize(self._data(entry), entry.qtype.value), copy=True))
            index = self._row_index(entry, t.shape[0], span)
            if index is not None:
                t = t.index_select(0, index)
            elif span is not None:
                t = t[span[0]:span[1]]
            t = t.float()
        if entry.minus_one:
            t = t - 1.0  # float32, as transformers' GGUF loader
        return t.to(device=self.device, dtype=dtype).contiguous()


def _served_type(tensor: GGUFTensor) -> GGMLType:
    """The tensor's GGMLType; ValueError naming it and its type when it is neither float nor served packed."""
    import gguf

    try:
        qtype = GGMLType(tensor.raw_type)
    except ValueError:
        qtype = None
    if qtype is None or qtype in OWN_TYPES or (qtype not in BLOCK_SHAPES and qtype not in FLOAT_TYPES):
        try:
            type_name = gguf.GGMLQuantizationType(tensor.raw_type).name
        except ValueError:
            type_name = f"#{tensor.raw_type}"
        served = ", ".join(t.name for t in (*FLOAT_TYPES, *BLOCK_SHAPES) if t not in OWN_TYPES)
        raise ValueError(f"tensor {tensor.name} has GGML type {type_name}, which lightserve does not serve "
                         f"(served: {served})")
    return qtype
