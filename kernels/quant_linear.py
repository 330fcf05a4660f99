"""Linear layers over weights kept packed in GGML's block formats (GGUF files): y = x . w^T (+ b) where w stays in its
quantized blocks in memory and the kernel dequantizes in registers (kernels/cpu/quant_linear.c; quant_linear_q8.c for
int8 activations), never a full dequantized copy. Also the embedding lookup over the same packed rows (a tied lm_head
and the embedding share them).

Layout: a [N, K] weight is N rows of K / QK blocks each, exactly as a GGUF file stores it (ne0 = K runs fastest), so
a tensor is taken from the file's mapping unchanged and its resident size is the file's. A fused projection (q | k |
v, gate | up) is a list of row segments, each of one block type, because a Q4_K_M file mixes types within a layer
(attn_v in Q6_K beside attn_q in Q4_K).

The reference (`dequantize_ref`, `quant_linear_ref`) is the spec: each block format decoded in torch from the
GGML definitions (ggml-quants.c's dequantize_row_*), checked block by block against the `gguf` package's own
dequantizer in tests/kernels/test_quant_linear.py. The C kernels take float32 activations (weight-only
quantization: the result is the float32 product with the dequantized weight, up to summation order). A weight with
`int8_dot` instead runs llama.cpp's scheme at every M: the activations quantized to int8 per 32-element block
(`quantize_activations_ref`), integer dot products with the weight's quants (`quant_linear_q8_ref` is its spec;
a GEMV at M <= INT8_DOT_MAX_M, a GEMM over panels decoded once per call above): faster at every batch, not
token-exact against the float32 product.
There is no Triton version: quantized weights are served on CPU (the launcher refuses them elsewhere).

Two block formats are lightserve's own (OWN_TYPES, numbers past GGML's): Q8_0 and Q4_1 with float32 scales, into
which HF int8 / 4-bit checkpoints (compressed-tensors, AWQ, GPTQ) are repacked at load (`pack_q8_0f`, `pack_q4_1f`,
called by model_infer/hf_quant_reader.py). A GPTQ act-order weight has its input columns sorted by group so each block
has one scale; its QuantLinear keeps the order (`in_perm`) and the kernel's x is gathered by it.
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
    # lightserve's own (kernels.h's LS_*), never in a GGUF file: Q8_0 with a float32 scale (36 bytes: s, 32 int8) and
    # Q4_1 with a float32 scale and offset (24 bytes: s, o, Q4_1's 16 bytes of nibbles).
    Q8_0F = 100
    Q4_1F = 101


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
    GGMLType.Q8_0F: (32, 36),
    GGMLType.Q4_1F: (32, 24),
}
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)  # tensors read as plain torch tensors
OWN_TYPES = (GGMLType.Q8_0F, GGMLType.Q4_1F)  # not GGML's: a GGUF file holding one is refused
# int8_dot weights: the most rows of x that run the int8 GEMV (quant_linear.c's GEMV_MAX_M); above, the int8 GEMM
# over panels decoded once per call. Q8_K weights and lightserve's own formats always run float32 activations.
INT8_DOT_MAX_M = 4
INT8_DOT_TYPES = frozenset(BLOCK_SHAPES) - {GGMLType.Q8_K, *OWN_TYPES}


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
    """A [N, K] weight kept in GGML blocks: row segments stacked in order (N = the sum of their rows).

    `in_perm` [K] int64, or None: the blocks hold the weight's input columns in this order (block column j is the
    weight's column in_perm[j]; a GPTQ act-order weight sorted by group), so the kernel multiplies x[:, in_perm].
    `int8_dot`: multiplied with int8-quantized activations (quant_linear_q8_ref), else with float32 ones."""

    segments: tuple[QuantSegment, ...]
    in_features: int  # K, a multiple of every segment's block size
    in_perm: Tensor | None = None
    int8_dot: bool = False

    @property
    def out_features(self) -> int:
        return sum(s.rows for s in self.segments)

    @property
    def nbytes(self) -> int:
        return sum(s.blocks.numel() for s in self.segments)


def quant_tensor(qtype: GGMLType, blocks: Tensor, in_features: int) -> QuantLinear:
    """One segment's QuantLinear; ValueError when the byte width does not match in_features' blocks."""
    qk, nb = BLOCK_SHAPES[qtype]
    if in_features % qk or blocks.dim() != 2 or blocks.shape[1] != in_features // qk * nb \
            or blocks.dtype != torch.uint8:
        raise ValueError(f"{qtype.name} rows of {in_features} elements take {in_features // qk * nb} bytes; "
                         f"got {tuple(blocks.shape)} {blocks.dtype}")
    return QuantLinear((QuantSegment(qtype, blocks),), in_features)


def cat_rows(parts: list[QuantLinear]) -> QuantLinear:
    """Row-stack weights of the same K (a fused projection): adjacent segments of one type merge into one.
    ValueError for different widths or input orders (in_perm)."""
    k, perm = parts[0].in_features, parts[0].in_perm
    if any(p.in_features != k for p in parts):
        raise ValueError(f"cannot stack rows of different widths {[p.in_features for p in parts]}")
    if any((p.in_perm is None) != (perm is None) or (perm is not None and not torch.equal(p.in_perm, perm))
           for p in parts):
        raise ValueError("cannot stack rows whose input columns are ordered differently (act-order weights with "
                         "different g_idx)")
    segments: list[QuantSegment] = []
    for seg in (s for p in parts for s in p.segments):
        if segments and segments[-1].qtype == seg.qtype:
            segments[-1] = QuantSegment(seg.qtype, torch.cat([segments[-1].blocks, seg.blocks]))
        else:
            segments.append(seg)
    return QuantLinear(tuple(segments), k, perm, parts[0].int8_dot)


def slice_rows(w: QuantLinear, start: int, end: int) -> QuantLinear:
    """Rows [start, end) (a tensor-parallel rank's output features), sharing the blocks' memory."""
    segments, offset = [], 0
    for seg in w.segments:
        a, b = max(start - offset, 0), min(end - offset, seg.rows)
        if a < b:
            segments.append(QuantSegment(seg.qtype, seg.blocks[a:b]))
        offset += seg.rows
    return QuantLinear(tuple(segments), w.in_features, w.in_perm, w.int8_dot)


def slice_cols(w: QuantLinear, start: int, end: int) -> QuantLinear:
    """Input features [start, end) (a row-parallel rank's slice): whole blocks only, ValueError otherwise (and for a
    weight whose columns are reordered: a rank's columns are not a range of its blocks)."""
    if w.in_perm is not None:
        raise ValueError("an act-order weight (input columns reordered by group) cannot be split by columns")
    segments = []
    for seg in w.segments:
        qk, nb = BLOCK_SHAPES[seg.qtype]
        if start % qk or end % qk:
            raise ValueError(f"columns [{start}, {end}) cut {seg.qtype.name} blocks of {qk}: "
                             f"tensor parallelism needs each rank's slice to be whole blocks")
        segments.append(QuantSegment(seg.qtype, seg.blocks[:, start // qk * nb: end // qk * nb].contiguous()))
    return QuantLinear(tuple(segments), end - start, int8_dot=w.int8_dot)


def dequantize_ref(qtype: GGMLType, blocks: Tensor) -> Tensor:
    """blocks [rows, nblocks * block_bytes] uint8 -> [rows, nblocks * QK] float32, as ggml's dequantize_row_*: the
    same float32 operations in the same order, so the values are bit for bit those of `gguf.quants.dequantize`."""
    _, nb = BLOCK_SHAPES[qtype]
    b = blocks.reshape(-1, nb)  # [rows * nblocks, nb], one block a row
    return _DECODERS[qtype](b).reshape(blocks.shape[0], -1)


def dequantize(w: QuantLinear) -> Tensor:
    """The whole [N, K] weight in float32, its columns in the weight's order (tests, and the reference path)."""
    out = torch.cat([dequantize_ref(s.qtype, s.blocks) for s in w.segments])
    if w.in_perm is None:
        return out
    unsorted = torch.empty_like(out)
    unsorted[:, w.in_perm] = out
    return unsorted


def pack_q8_0f(q: Tensor, scales: Tensor) -> Tensor:
    """q [N, K] integers in [-128, 127], scales [N, K / 32] (each 32-block's) -> Q8_0F blocks [N, K / 32 * 36] uint8,
    value = q * float32(scale). ValueError for a K that is not whole blocks or quants out of int8's range."""
    n, k = q.shape
    if k % 32 or scales.shape != (n, k // 32) or (q.numel() and (int(q.min()) < -128 or int(q.max()) > 127)):
        raise ValueError(f"Q8_0F takes int8 quants [N, K] with K a multiple of 32 and [N, K / 32] scales; got "
                         f"{tuple(q.shape)} quants in [{int(q.min())}, {int(q.max())}], {tuple(scales.shape)} scales")
    s = scales.float().contiguous().view(torch.uint8).reshape(n, k // 32, 4)
    qs = q.to(torch.int8).reshape(n, k // 32, 32).view(torch.uint8)
    return torch.cat([s, qs], dim=-1).reshape(n, -1)


def pack_q4_1f(q: Tensor, scales: Tensor, offsets: Tensor) -> Tensor:
    """q [N, K] integers in [0, 15], scales and offsets [N, K / 32] -> Q4_1F blocks [N, K / 32 * 24] uint8,
    value = q * float32(scale) + float32(offset). ValueError as pack_q8_0f's."""
    n, k = q.shape
    if k % 32 or scales.shape != (n, k // 32) or offsets.shape != (n, k // 32) \
            or (q.numel() and (int(q.min()) < 0 or int(q.max()) > 15)):
        raise ValueError(f"Q4_1F takes 4-bit quants [N, K] with K a multiple of 32 and [N, K / 32] scales and "
                         f"offsets; got {tuple(q.shape)}, {tuple(scales.shape)}, {tuple(offsets.shape)}")
    s = scales.float().contiguous().view(torch.uint8).reshape(n, k // 32, 4)
    o = offsets.float().contiguous().view(torch.uint8).reshape(n, k // 32, 4)
    nib = q.to(torch.uint8).reshape(n, k // 32, 2, 16)  # quants 0-15 in the low nibbles, 16-31 in the high ones
    return torch.cat([s, o, nib[:, :, 0] | (nib[:, :, 1] << 4)], dim=-1).reshape(n, -1)


def quant_linear_ref(x: Tensor, w: QuantLinear, bias: Tensor | None = None) -> Tensor:
    """x [M, K] . dequantize(w)^T (+ bias [N]) in float32 -> [M, N] in x's dtype."""
    out = x.float() @ dequantize(w).T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def quantize_activations_ref(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] (K a multiple of 32) -> (q [M, K] int8, d [M, K / 32] float32): per block of 32, d = amax / 127 and
    q = round(x * (1 / d)), half to even (0 where the block is all zero); bit for bit quant_linear.c's quantizer.
    The block's values are q * d."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 32, 32)
    d = xb.abs().amax(-1) / torch.tensor(127.0)
    inv = torch.where(d != 0, torch.tensor(1.0) / d, torch.zeros(()))
    return torch.round(xb * inv.unsqueeze(-1)).to(torch.int8).reshape(m, k), d


def quant_linear_q8_ref(x: Tensor, w: QuantLinear, bias: Tensor | None = None) -> Tensor:
    """What quant_linear_q8.c's quant_linear_q8 computes, in float64 -> [M, N] float32: each segment of a type it takes
    (INT8_DOT_TYPES) multiplies the dequantized int8 activations by the dequantized weight, at every M; the others
    the float32 activations (quant_linear_ref's product)."""
    m = x.shape[0]
    q, d = quantize_activations_ref(x)
    xq = (q.double().reshape(m, -1, 32) * d.double().unsqueeze(-1)).reshape(m, -1)
    parts = [(xq if s.qtype in INT8_DOT_TYPES else x.double())
             @ dequantize_ref(s.qtype, s.blocks).double().T for s in w.segments]
    out = torch.cat(parts, dim=1)
    if bias is not None:
        out += bias.double()
    return out.float()


def quant_linear(x: Tensor, w: QuantLinear, bias: Tensor | None = None) -> Tensor:
    """x [M, K] (float32 or bf16) -> [M, N] in x's dtype: the C kernel where it runs, else the reference (of
    int8_dot weights, quant_linear_q8_ref's)."""
    out = quant_linear_cpu(x, w, bias)
    if out is not None:
        return out
    if w.int8_dot:
        return quant_linear_q8_ref(x.float(), w, None if bias is None else bias.float()).to(x.dtype)
    return quant_linear_ref(x, w, bias)


def quant_linear_cpu(x: Tensor, w: QuantLinear, bias: Tensor | None = None, lib=None) -> Tensor | None:
    """quant_linear.c or quant_linear_q8.c, one call per segment (each writes its own output columns): x [M, K]
    float32 or bf16 (rows may be strided; bf16 is widened to float32 and the output rounded back), bias [N] or None
    -> [M, N] in x's dtype; quant_linear_f32, or for an int8_dot weight quant_linear_q8 (which runs
    quant_linear_f32 where it does not take the type). None where it does not run (no C library, a CUDA tensor,
    another dtype or shape). `lib`: a loaded kernel library other than the default build (tests of each build)."""
    from lightserve.kernels.cpu import library, profiled

    lib = lib or library()
    m, n = (x.shape[0], w.out_features) if x.dim() == 2 else (0, 0)
    if lib is None or x.device.type != "cpu" or m == 0 or x.shape[1] != w.in_features \
            or x.dtype not in (torch.float32, torch.bfloat16) or (bias is not None and bias.shape != (n,)):
        return None
    if w.in_perm is not None:
        x = x.index_select(1, w.in_perm)  # [M, K] in the blocks' column order
    xf = x.float() if x.dtype != torch.float32 or x.stride(1) != 1 else x
    bf = None if bias is None else bias.float().contiguous()
    out = torch.empty(m, n, dtype=torch.float32)  # [M, N]
    threads, row0 = torch.get_num_threads(), 0
    kernel = lib.quant_linear_q8 if w.int8_dot else lib.quant_linear_f32
    with profiled("quant_linear_cpu"):  # visible in scripts/profile_step.py
        for seg in w.segments:
            blocks = seg.blocks if seg.blocks.stride(1) == 1 else seg.blocks.contiguous()
            rc = kernel(xf.data_ptr(), xf.stride(0), m, w.in_features, blocks.data_ptr(),
                                      blocks.stride(0), int(seg.qtype), seg.rows,
                                      None if bf is None else bf.data_ptr() + 4 * row0, out.data_ptr() + 4 * row0, n,
                                      threads)
            if rc != 0:
                return None
            row0 += seg.rows
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def quant_embedding(ids: Tensor, w: QuantLinear, dtype: torch.dtype) -> Tensor:
    """ids [T] int -> [T, K] in `dtype`: the rows of w dequantized (an embedding table kept packed); only the rows
    looked up are decoded. IndexError for an id outside [0, N)."""
    from lightserve.kernels.cpu import library

    lib = library()
    rows, k = ids.reshape(-1).long(), w.in_features
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= w.out_features):
        raise IndexError(f"embedding ids must lie in [0, {w.out_features})")
    out = torch.empty(rows.numel(), k, dtype=torch.float32)  # [T, K]
    offset = 0
    for seg in w.segments:
        picked = ((rows >= offset) & (rows < offset + seg.rows)).nonzero().squeeze(1)  # positions in ids
        local = (rows[picked] - offset).contiguous()  # rows of this segment
        offset += seg.rows
        if local.numel() == 0:
            continue
        if lib is None or seg.blocks.stride(1) != 1:
            out[picked] = dequantize_ref(seg.qtype, seg.blocks[local])
            continue
        part = out if len(w.segments) == 1 else torch.empty(local.numel(), k, dtype=torch.float32)
        rc = lib.quant_dequant_rows(seg.blocks.data_ptr(), seg.blocks.stride(0), int(seg.qtype), k, local.data_ptr(),
                                    local.numel(), part.data_ptr(), k)
        assert rc == 0, f"quant_dequant_rows declined {seg.qtype.name} rows of {k}"
        if part is not out:
            out[picked] = part
    if w.in_perm is not None:  # back to the weight's column order
        out = torch.empty_like(out).index_copy_(1, w.in_perm, out)
    return out.to(dtype).reshape(*ids.shape, k)


# The block decoders: b [nblocks, block_bytes] uint8 -> [nblocks, QK] float32. Transcribed from ggml-quants.c's
# dequantize_row_* (gguf's quants.py computes the same float32 operations in the same order).


def _f16(b: Tensor) -> Tensor:
    return b.contiguous().view(torch.float16).float()  # [n, 2] bytes -> [n, 1]


def _nibbles(qs: Tensor) -> Tensor:
    """[n, 16] bytes -> [n, 32]: the low nibbles (quants 0-15), then the high ones (16-31)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _bits(qh: Tensor) -> Tensor:
    """[n, B] bytes -> [n, 8B] 0/1: bit j of the little-endian integer they form at position j."""
    return ((qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(qh.shape[0], -1)


def _q4_0(b: Tensor) -> Tensor:
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(b: Tensor) -> Tensor:
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _q5_0(b: Tensor) -> Tensor:
    q = _nibbles(b[:, 6:]) | (_bits(b[:, 2:6]) << 4)
    return _f16(b[:, :2]) * (q.to(torch.int8) - 16).float()


def _q5_1(b: Tensor) -> Tensor:
    q = _nibbles(b[:, 8:]) | (_bits(b[:, 4:8]) << 4)
    return _f16(b[:, :2]) * q.float() + _f16(b[:, 2:4])


def _q8_0(b: Tensor) -> Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _k_scales(b: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K / Q5_K: d * sc and dmin * m of the 8 sub-blocks ([n, 8, 1] each), from the 12 packed 6-bit bytes."""
    s = b[:, 4:16].reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1).float()  # [n, 8]
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1).float()
    return (_f16(b[:, :2]) * sc).unsqueeze(-1), (_f16(b[:, 2:4]) * mn).unsqueeze(-1)


def _q4_k(b: Tensor) -> Tensor:
    d, dm = _k_scales(b)
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    q = (qs & 15).reshape(-1, 8, 32).float()  # sub-block 2j: low nibbles of bytes 32j.., 2j + 1: high ones
    return (d * q - dm).reshape(-1, 256)


def _q5_k(b: Tensor) -> Tensor:
    d, dm = _k_scales(b)
    ql = (b[:, 48:].reshape(-1, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)) & 15
    qh = (b[:, 16:48].reshape(-1, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)) & 1  # [n, 8, 32]
    q = (ql.reshape(-1, 8, 32) | (qh << 4)).float()
    return (d * q - dm).reshape(-1, 256)


def _q6_k(b: Tensor) -> Tensor:
    ql, qh = b[:, :128], b[:, 128:192]
    d = (_f16(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).float()).reshape(-1, 16, 1)
    lo = (ql.reshape(-1, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)) & 15
    hi = (qh.reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)) & 3
    q = (lo.reshape(-1, 8, 32) | (hi.reshape(-1, 8, 32) << 4)).to(torch.int8) - 32
    return (d * q.reshape(-1, 16, 16).float()).reshape(-1, 256)


def _q8_k(b: Tensor) -> Tensor:
    return b[:, :4].contiguous().view(torch.float32) * b[:, 4:260].contiguous().view(torch.int8).float()


def _f32(b: Tensor) -> Tensor:
    return b.contiguous().view(torch.float32)  # [n, 4] bytes -> [n, 1]


def _q8_0f(b: Tensor) -> Tensor:
    return b[:, 4:].contiguous().view(torch.int8).float() * _f32(b[:, :4])


def _q4_1f(b: Tensor) -> Tensor:
    return _f32(b[:, :4]) * _nibbles(b[:, 8:]).float() + _f32(b[:, 4:8])


_DECODERS = {GGMLType.Q4_0: _q4_0, GGMLType.Q4_1: _q4_1, GGMLType.Q5_0: _q5_0, GGMLType.Q5_1: _q5_1,
             GGMLType.Q8_0: _q8_0, GGMLType.Q4_K: _q4_k, GGMLType.Q5_K: _q5_k, GGMLType.Q6_K: _q6_k,
             GGMLType.Q8_K: _q8_k, GGMLType.Q8_0F: _q8_0f, GGMLType.Q4_1F: _q4_1f}
