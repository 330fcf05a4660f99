"""Linear layers over weights kept packed in GGML's block formats (GGUF files): y = x . w^T (+ b) where w stays in its
quantized blocks in memory and the kernel dequantizes in registers (kernels/cpu/quant_linear.c), never a full
dequantized copy. Also the embedding lookup over the same packed rows (a tied lm_head and the embedding share them).

Layout: a [N, K] weight is N rows of K / QK blocks each, exactly as a GGUF file stores it (ne0 = K runs fastest), so
a tensor is taken from the file's mapping unchanged and its resident size is the file's. A fused projection (q | k |
v, gate | up) is a list of row segments, each of one block type, because a Q4_K_M file mixes types within a layer
(attn_v in Q6_K beside attn_q in Q4_K).

The reference (`dequantize_ref`, `quant_linear_ref`) is the spec: each block format decoded in torch from the
GGML definitions (ggml-quants.c's dequantize_row_*), checked block by block against the `gguf` package's own
dequantizer in tests/kernels/test_quant_linear.py. The C kernels take float32 activations (weight-only
quantization: the result is the float32 product with the dequantized weight, up to summation order).
There is no Triton version: quantized weights are served on CPU (the launcher refuses them elsewhere).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor


class GGMLType(IntEnum):
    """GGML tensor types (ggml.h's enum ggml_type numbers, as GGUF files store them)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    BF16 = 30


# (elements per block, bytes per block) of each block format served packed.
BLOCK_SHAPES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
    GGMLType.Q8_K: (256, 292),
}
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)  # tensors read as plain torch tensors


@dataclass(frozen=True)
class QuantSegment:
    """Rows of one block type: `blocks` [rows, K / QK * block_bytes] uint8, each row its K / QK blocks in order."""

    qtype: GGMLType
    blocks: Tensor

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]


@dataclass(frozen=True)
class QuantLinear:
    """A [N, K] weight kept in GGML blocks: row segments stacked in order (N = the sum of their rows)."""

    segments: tuple[QuantSegment, ...]
    in_features: int  # K, a multiple of every segment's block size

    @property
    def out_features(self) -> int:
        return sum(s.rows for s in self.segments)

    @property
    def nbytes(self) -> int:
        return sum(s.blocks.numel() for s in self.segments)


def quant_tensor(qtype: GGMLType, blocks: Tensor, in_features: int) -> QuantLinear:
    """One segment's QuantLinear; ValueError when the byte width does not match in_features' blocks."""
    qk, nb = BLOCK_SHAPES[qtype]
    if in_features % qk or blocks.dim() != 2 or blocks.shape[1] != in_features // qk * nb or blocks.dtype != torch.uint8:
        raise ValueError(f"{qtype.name} rows of {in_features} elements take {in_features // qk * nb} bytes; "
                         f"got {tuple(blocks.shape)} {blocks.dtype}")
    return QuantLinear((QuantSegment(qtype, blocks),), in_features)


def cat_rows(parts: list[QuantLinear]) -> QuantLinear:
    """Row-stack weights of the same K (a fused projection): adjacent segments of one type merge into one."""
    k = parts[0].in_features
    if any(p.in_features != k for p in parts):
        raise ValueError(f"cannot stack rows of different widths {[p.in_features for p in parts]}")
    segments: list[QuantSegment] = []
    for seg in (s for p in parts for s in p.segments):
        if segments and segments[-1].qtype == seg.qtype:
            segments[-1] = QuantSegment(seg.qtype, torch.cat([segments[-1].blocks, seg.blocks]))
        else:
            segments.append(seg)
    return QuantLinear(tuple(segments), k)


def slice_rows(w: QuantLinear, start: int, end: int) -> QuantLinear:
    """Rows [start, end) (a tensor-parallel rank's output features), sharing the blocks' memory."""
    segments, offset = [], 0
    for seg in w.segments:
        a, b = max(start - offset, 0), min(end - offset, seg.rows)
        if a < b:
            segments.append(QuantSegment(seg.qtype, seg.blocks[a:b]))
        offset += seg.rows
    return QuantLinear(tuple(segments), w.in_features)


def slice_cols(w: QuantLinear, start: int, end: int) -> QuantLinear:
    """Input features [start, end) (a row-parallel rank's slice): whole blocks only, ValueError otherwise."""
    segments = []
    for seg in w.segments:
        qk, nb = BLOCK_SHAPES[seg.qtype]
        if start % qk or end % qk:
            raise ValueError(f"columns [{start}, {end}) cut {seg.qtype.name} blocks of {qk}: "
                             f"tensor parallelism needs each rank's slice to be whole blocks")
        segments.append(QuantSegment(seg.qtype, seg.blocks[:, start // qk * nb: end // qk * nb].contiguous()))
    return QuantLinear(tuple(segments), end - start)


def dequantize_ref(qtype: GGMLType, blocks: Tensor) -> Tensor:
    """blocks [rows, nblocks * block_bytes] uint8 -> [rows, nblocks * QK] float32, as ggml's dequantize_row_*."""
    import numpy as np
    from gguf.quants import dequantize  # placeholder until the torch decoders below land

    return torch.from_numpy(np.ascontiguousarray(dequantize(blocks.numpy(), int(qtype)))).float()


def dequantize(w: QuantLinear) -> Tensor:
    """The whole [N, K] weight in float32 (tests, and the reference path)."""
    return torch.cat([dequantize_ref(s.qtype, s.blocks) for s in w.segments])


def quant_linear_ref(x: Tensor, w: QuantLinear, bias: Tensor | None = None) -> Tensor:
    """x [M, K] . dequantize(w)^T (+ bias [N]) in float32 -> [M, N] in x's dtype."""
    out = x.float() @ dequantize(w).T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def quant_linear(x: Tensor, w: QuantLinear, bias: Tensor | None = None) -> Tensor:
    """x [M, K] (float32 or bf16) -> [M, N] in x's dtype: the C kernel where it runs, else the reference."""
    return quant_linear_ref(x, w, bias)


def quant_embedding(ids: Tensor, w: QuantLinear, dtype: torch.dtype) -> Tensor:
    """ids [T] int -> [T, K] in `dtype`: the rows of w dequantized (an embedding table kept packed)."""
    rows, out, offset = ids.long(), [], 0
    table = dequantize(w)  # placeholder: the C row decoder dequantizes only the looked-up rows
    del offset, out
    return table[rows].to(dtype)
