"""quant_linear: the torch decoders of GGML's block formats against the gguf package's dequantizer, bit for bit; the C
kernels (quant_linear.c: the GEMV at small M, the dequantized panels and register tile above it; quant_linear_q8.c,
int8 activations: its GEMV and its GEMM over decoded panels) against the reference in every build this CPU runs,
over block types, row counts, K that the 256-element super-blocks do not
divide, output rows that leave partial tiles, strided x and a bias; multi-type weights and their row and column
slices through the dispatch; and the embedding lookup over packed rows. lightserve's own formats (Q8_0F, Q4_1F: HF
checkpoints repacked) against their definition s * (q - zero), and weights whose input columns are reordered. The
int8-activation path (quant_linear_q8): its quantizer bit for bit the reference's, its products the dequantized int8
activations' with the weight's, in every build, and its error against the float32 activations' product on realistic
weights."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from lightserve.kernels.cpu import library, variant_library
from lightserve.kernels.quant_linear import (
    BLOCK_SHAPES,
    INT8_DOT_MAX_M,
    INT8_DOT_TYPES,
    OWN_TYPES,
    GGMLType,
    QuantLinear,
    cat_rows,
    dequantize,
    dequantize_ref,
    pack_q4_1f,
    pack_q8_0f,
    quant_embedding,
    quant_linear,
    quant_linear_cpu,
    quant_linear_q8_ref,
    quant_linear_ref,
    quant_tensor,
    quantize_activations_ref,
    slice_cols,
    slice_rows,
)
from tests.kernels.kernel_cases import c_library_variants

TYPES = list(BLOCK_SHAPES)
GGML_TYPES = [t for t in TYPES if t not in OWN_TYPES]  # gguf decodes these
GGUF_QUANTIZES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0)
# Byte offsets of each format's fp16 scales (d, and the min or dmin): random bytes there could be NaN or inf.
HALF_SCALES = {GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,), GGMLType.Q5_1: (0, 2),
               GGMLType.Q8_0: (0,), GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,)}
# Float32 ones; those of the own formats widened from fp16, as the checkpoints' scales are (q * s exact, so the
# kernel's FMA and the reference's product and sum round alike).
FLOAT_SCALES = {GGMLType.Q8_K: (0,), GGMLType.Q8_0F: (0,), GGMLType.Q4_1F: (0, 4)}
needs_c = pytest.mark.skipif(library() is None, reason="no C compiler: quant_linear runs the reference")


def random_blocks(qtype: GGMLType, rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """[rows, K / QK * block_bytes] random bytes (every quant pattern) with finite scales of about 1e-2."""
    qk, nb = BLOCK_SHAPES[qtype]
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows * (k // qk), nb), dtype=torch.uint8, generator=g)
    n = blocks.shape[0]
    for at in FLOAT_SCALES.get(qtype, ()):
        scale = (torch.rand(n, generator=g) - 0.5) * 0.02
        scale = scale.half().float() if qtype in OWN_TYPES else scale
        blocks[:, at:at + 4] = scale.view(torch.uint8).reshape(n, 4)
    for at in HALF_SCALES.get(qtype, ()):
        blocks[:, at:at + 2] = ((torch.rand(n, generator=g) - 0.5) * 0.02).half().view(torch.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


@functools.cache
def weight(qtype: GGMLType, n: int, k: int, seed: int = 0) -> QuantLinear:
    return quant_tensor(qtype, random_blocks(qtype, n, k, seed), k)


def gguf_dequantize(qtype: GGMLType, blocks: torch.Tensor) -> torch.Tensor:
    if qtype == GGMLType.Q8_K:  # gguf has no Q8_K decoder: ggml's dequantize_row_q8_K, y = d * q, in numpy
        b = blocks.numpy().reshape(-1, 292)
        d, q = b[:, :4].copy().view(np.float32), b[:, 4:260].view(np.int8).astype(np.float32)
        return torch.from_numpy(d * q).reshape(blocks.shape[0], -1)
    out = gguf_quants.dequantize(blocks.numpy(), GGMLQuantizationType(int(qtype)))
    return torch.from_numpy(np.ascontiguousarray(out))


@pytest.mark.parametrize("qtype", GGML_TYPES, ids=lambda t: t.name)
def test_dequantize_ref_matches_gguf_bit_for_bit(qtype):
    """Random bytes (every nibble and high-bit pattern, scales of both signs, subnormal fp16 included), and where
    gguf quantizes the format, its blocks of random floats: each block decodes to gguf's float32 values exactly."""
    cases = [random_blocks(qtype, 16, 512, seed=1)]
    if qtype in GGUF_QUANTIZES:
        floats = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32)
        cases.append(torch.from_numpy(gguf_quants.quantize(floats, GGMLQuantizationType(int(qtype)))))
    qk, nb = BLOCK_SHAPES[qtype]
    for blocks in cases:
        got = dequantize_ref(qtype, blocks)
        assert got.shape == (16, 512) and got.dtype == torch.float32
        want = gguf_dequantize(qtype, blocks)
        assert torch.isfinite(want).all()
        for i in np.ndindex(16, 512 // qk):  # block by block, so a failure names the block
            row, blk = i
            assert torch.equal(got[row, blk * qk:(blk + 1) * qk], want[row, blk * qk:(blk + 1) * qk]), (row, blk)


def assert_matches_product(got: torch.Tensor, x: torch.Tensor, w: QuantLinear, bias: torch.Tensor | None) -> None:
    """got [M, N] within 1e-5 of each output's sum of |x| |w| of the float64 product with the dequantized weight
    (float32 sums in another order)."""
    wd = dequantize(w).double()
    want = x.double() @ wd.T + (0 if bias is None else bias.double())
    tol = 1e-5 * (x.double().abs() @ wd.abs().T) + 1e-6
    err = (got.double() - want).abs()
    assert bool((err <= tol).all()), f"max error {float(err.max()):.3g}, at {(err / tol).argmax()} over tolerance"


def ks_of(qtype: GGMLType) -> list[int]:
    """K a multiple of 256 (two K chunks of the tiles), and for the 32-element formats 288 (9 blocks: a chunk and a
    partial one)."""
    return [512] if BLOCK_SHAPES[qtype][0] == 256 else [512, 288]


@needs_c
@pytest.mark.parametrize("variant", c_library_variants())
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_c_kernel_matches_reference(qtype, variant):
    """Every build this CPU runs; M = 1 and 3 (the GEMV: 4 output rows a group, two at a time, rows of x in pairs and
    a last single one), 8 and 70 (the tiles: 6- or 8-row tiles, a partial last one); N = 37 leaves a partial row group
    and panel; x rows strided; with and without a bias."""
    lib = variant_library(variant)
    n = 37
    for k in ks_of(qtype):
        w = weight(qtype, n, k)
        for m in (1, 3, 8, 70):
            g = torch.Generator().manual_seed(m + k)
            wide = torch.randn(m, k + 24, generator=g)
            x, bias = wide[:, 8:8 + k], torch.randn(n, generator=g)
            for b in (None, bias):
                got = quant_linear_cpu(x, w, b, lib=lib)
                assert got is not None and got.shape == (m, n) and got.dtype == torch.float32
                assert_matches_product(got, x, w, b)


@needs_c
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_every_output_once_whatever_the_thread_count(threads):
    """Row groups (GEMV) and panels (tiles) shared among more threads than there are items: each output written
    once (out starts as NaN)."""
    lib = library()
    w = weight(GGMLType.Q4_K, 20, 512)
    for m in (1, 9):
        x = torch.randn(m, 512)
        out = torch.full((m, 20), float("nan"))
        blocks = w.segments[0].blocks
        assert lib.quant_linear_f32(x.data_ptr(), 512, m, 512, blocks.data_ptr(), blocks.stride(0),
                                    int(GGMLType.Q4_K), 20, None, out.data_ptr(), 20, threads) == 0
        assert_matches_product(out, x, w, None)


@needs_c
def test_multi_type_weights_and_their_slices():
    """A fused projection of three segments (Q4_K, Q8_0, Q6_K rows): each segment's call writes its own output
    columns, with its part of the bias; rows sliced across a segment boundary (a tensor-parallel rank), columns
    sliced by whole super-blocks; bf16 x is computed in float32 and rounded back."""
    k = 768
    w = cat_rows([weight(GGMLType.Q4_K, 40, k), weight(GGMLType.Q8_0, 24, k), weight(GGMLType.Q6_K, 9, k)])
    assert [s.qtype for s in w.segments] == [GGMLType.Q4_K, GGMLType.Q8_0, GGMLType.Q6_K]
    bias = torch.randn(w.out_features)
    for m in (1, 5):
        x = torch.randn(m, k)
        assert_matches_product(quant_linear(x, w, bias), x, w, bias)
        rows = slice_rows(w, 30, 70)  # 10 Q4_K rows, 24 Q8_0, 6 Q6_K
        assert [s.rows for s in rows.segments] == [10, 24, 6]
        assert_matches_product(quant_linear(x, rows), x, rows, None)
        cols = slice_cols(w, 256, 768)
        assert torch.equal(dequantize(cols), dequantize(w)[:, 256:768])
        assert_matches_product(quant_linear(x[:, 256:], cols, bias), x[:, 256:], cols, bias)
        got = quant_linear(x.bfloat16(), w, bias.bfloat16())
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, quant_linear_ref(x.bfloat16(), w, bias.bfloat16()), rtol=1e-2, atol=1e-2)


def test_dispatch_runs_the_reference_without_the_c_library(monkeypatch):
    import lightserve.kernels.cpu as cpu

    monkeypatch.setattr(cpu, "library", lambda: None)
    w, x = weight(GGMLType.Q4_1, 8, 64), torch.randn(2, 64)
    assert quant_linear_cpu(x, w) is None
    assert torch.equal(quant_linear(x, w), quant_linear_ref(x, w))
    ids = torch.tensor([7, 0, 7])
    assert torch.equal(quant_embedding(ids, w, torch.float32), dequantize(w)[ids])


@needs_c
def test_c_kernel_declines_what_it_does_not_take():
    """A type it has no decoder for (F16), a K that is not whole blocks: -1, and the dispatch runs the reference."""
    lib = library()
    x, out, blocks = torch.randn(1, 64), torch.empty(1, 4), torch.zeros(4, 40, dtype=torch.uint8)
    assert lib.quant_linear_f32(x.data_ptr(), 64, 1, 64, blocks.data_ptr(), 40, int(GGMLType.F16), 4, None,
                                out.data_ptr(), 4, 1) == -1
    assert lib.quant_linear_f32(x.data_ptr(), 64, 1, 48, blocks.data_ptr(), 40, int(GGMLType.Q4_1), 4, None,
                                out.data_ptr(), 4, 1) == -1
    assert lib.quant_dequant_rows(blocks.data_ptr(), 40, int(GGMLType.BF16), 64, x.data_ptr(), 0, out.data_ptr(),
                                  64) == -1


@needs_c
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_embedding_decodes_the_rows_looked_up_exactly(qtype):
    """quant_dequant_rows: the looked-up rows, repeated and in any order, bit for bit the reference's values."""
    w = weight(qtype, 50, 512)
    ids = torch.tensor([[3, 49, 0], [3, 17, 2]])
    got = quant_embedding(ids, w, torch.float32)
    assert got.shape == (2, 3, 512)
    assert torch.equal(got, dequantize(w)[ids])


def test_embedding_over_segments_and_bad_ids():
    w = cat_rows([weight(GGMLType.Q8_0, 10, 256), weight(GGMLType.Q6_K, 6, 256)])
    ids = torch.tensor([15, 0, 9, 10, 3])
    got = quant_embedding(ids, w, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, dequantize(w)[ids].bfloat16())
    with pytest.raises(IndexError):
        quant_embedding(torch.tensor([16]), w, torch.float32)


def test_own_formats_decode_to_scale_times_q_minus_zero():
    """Q8_0F and Q4_1F packed from integer quants and fp16 scales per group of 32 (o = -s * zero): every value is the
    checkpoint's float32 s * (q - zero), bit for bit."""
    g = torch.Generator().manual_seed(3)
    n, k = 6, 128
    s = ((torch.rand(n, k // 32, generator=g) + 0.01) * 0.02).half().float()  # [N, K / 32]
    per_col = s.repeat_interleave(32, dim=1)  # [N, K]
    q8 = torch.randint(-128, 128, (n, k), generator=g)
    assert torch.equal(dequantize_ref(GGMLType.Q8_0F, pack_q8_0f(q8, s)), per_col * q8.float())
    q4, zero = torch.randint(0, 16, (n, k), generator=g), torch.randint(0, 17, (n, k // 32), generator=g).float()
    got = dequantize_ref(GGMLType.Q4_1F, pack_q4_1f(q4, s, -(s * zero)))
    assert torch.equal(got, per_col * (q4.float() - zero.repeat_interleave(32, dim=1)))
    with pytest.raises(ValueError, match="Q8_0F"):
        pack_q8_0f(q8 * 2, s)
    with pytest.raises(ValueError, match="Q4_1F"):
        pack_q4_1f(q4[:, :48], s, s)


@needs_c
def test_reordered_input_columns():
    """A weight whose blocks hold its columns in another order (in_perm): the kernel gathers x, dequantize and the
    embedding give the weight in its own order, rows slice and stack with it; columns do not slice, and weights of
    different orders do not stack."""
    k = 256
    base = weight(GGMLType.Q4_1F, 9, k)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(5))
    w = QuantLinear(base.segments, k, perm)
    wd = dequantize(w)
    assert torch.equal(wd[:, perm], dequantize(base))
    bias = torch.randn(9)
    for m in (1, 6):
        x = torch.randn(m, k)
        assert_matches_product(quant_linear(x, w, bias), x, w, bias)
        torch.testing.assert_close(quant_linear_ref(x, w), x @ wd.T)
    assert torch.equal(quant_embedding(torch.tensor([4, 0]), w, torch.float32), wd[[4, 0]])
    both = cat_rows([w, slice_rows(w, 2, 5)])
    assert torch.equal(both.in_perm, perm) and torch.equal(dequantize(both), torch.cat([wd, wd[2:5]]))
    with pytest.raises(ValueError, match="act-order"):
        slice_cols(w, 0, 128)
    with pytest.raises(ValueError, match="ordered differently"):
        cat_rows([w, base])


def int8(w: QuantLinear) -> QuantLinear:
    return dataclasses.replace(w, int8_dot=True)


def awkward_activations(m: int, k: int, seed: int) -> torch.Tensor:
    """[m, k] floats of mixed magnitudes with an all-zero block, a block of exact ties (x / d = n + 1/2, which
    rounds half to even) and one of negative ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, k, generator=g) * 4
    x[0, :32] = 0
    ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 3.5, 126.5] * 4)  # d = 1
    x[-1, 32:64] = ties
    x[-1, 64:96] = -ties
    return x


@needs_c
@pytest.mark.parametrize("variant", c_library_variants())
def test_activation_quantizer_matches_reference_bit_for_bit(variant):
    """quant_activations_q8 (the quantizer quant_linear_q8 runs) against quantize_activations_ref: the same int8
    quants and float32 scales, ties rounded half to even, strided rows, K of 9 blocks."""
    lib = variant_library(variant)
    for m, k in ((1, 512), (3, 288)):
        wide = torch.zeros(m, k + 40)
        wide[:, 8:8 + k] = awkward_activations(m, k, seed=k)
        x = wide[:, 8:8 + k]
        q, d = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // 32)
        assert lib.quant_activations_q8(x.data_ptr(), x.stride(0), m, k, q.data_ptr(), d.data_ptr()) == 0
        want_q, want_d = quantize_activations_ref(x)
        assert torch.equal(q, want_q) and torch.equal(d, want_d)
        assert q[-1, 32:40].tolist() == [127, 0, 2, 2, -2, 0, 4, 126]


def assert_matches_q8_product(got: torch.Tensor, x: torch.Tensor, w: QuantLinear, bias: torch.Tensor | None):
    """got [M, N] within 1e-5 of each output's sum of |xq| |w| of quant_linear_q8_ref (float32 sums of the exact
    integer block dots, in another order)."""
    q, d = quantize_activations_ref(x)
    xq = (q.double().reshape(x.shape[0], -1, 32) * d.double().unsqueeze(-1)).reshape(x.shape)
    want = quant_linear_q8_ref(x, w, bias).double()
    tol = 1e-5 * (xq.abs() @ dequantize(w).double().abs().T) + 1e-6
    err = (got.double() - want).abs()
    assert bool((err <= tol).all()), f"max error {float(err.max()):.3g}, at {(err / tol).argmax()} over tolerance"


@needs_c
@pytest.mark.parametrize("variant", c_library_variants())
@pytest.mark.parametrize("qtype", sorted(INT8_DOT_TYPES), ids=lambda t: t.name)
def test_int8_path_matches_its_reference(qtype, variant):
    """quant_linear_q8 in every build: the GEMV at M = 1 (four output rows a pass, one for the K-quants) and 3 (a pair
    of x rows by two output rows, then one), the GEMM at M = 6 and 13 (tiles of 4 rows and the rest) and 35 (on AMX
    tiles: two 16-row blocks and a 3-row one); N = 37 (a partial row group, a partial panel of 8 in a
    partial work item of 32, a 5-feature AMX tile), K of super-blocks, of 9 blocks of 32 (AMX steps in fours and one)
    and past the GEMM's 1,024-element pieces, strided x, with and without a bias; against the dequantized int8
    activations times the dequantized weight."""
    lib = variant_library(variant)
    n = 37
    for k in ks_of(qtype) + [1280]:
        w = int8(weight(qtype, n, k))
        for m in (1, 3, 6, 13, 35):
            wide = torch.zeros(m, k + 24)
            wide[:, 8:8 + k] = awkward_activations(m, k, seed=m + k)
            x, bias = wide[:, 8:8 + k], torch.randn(n, generator=torch.Generator().manual_seed(k))
            for b in (None, bias):
                got = quant_linear_cpu(x, w, b, lib=lib)
                assert got is not None and got.shape == (m, n)
                assert_matches_q8_product(got, x, w, b)


@needs_c
def test_int8_dispatch_over_segments_slices_and_the_cut_over():
    """An int8_dot weight of Q4_K, Q8_0 and Q8_K rows: the Q8_K segment runs float32 activations (bit for bit the
    weight-only kernel) at every M, the others int8 ones on both sides of INT8_DOT_MAX_M; slices and stacks keep
    int8_dot; the reference runs without the C library."""
    k = 512
    w = int8(cat_rows([weight(GGMLType.Q4_K, 20, k), weight(GGMLType.Q8_0, 12, k), weight(GGMLType.Q8_K, 5, k)]))
    assert w.int8_dot and slice_rows(w, 3, 30).int8_dot and slice_cols(w, 0, 256).int8_dot
    assert cat_rows([w, w]).int8_dot and not dataclasses.replace(w, int8_dot=False).int8_dot
    bias = torch.randn(w.out_features)
    for m in (1, INT8_DOT_MAX_M, INT8_DOT_MAX_M + 1):
        x = torch.randn(m, k)
        got, flt = quant_linear(x, w, bias), quant_linear(x, dataclasses.replace(w, int8_dot=False), bias)
        assert_matches_q8_product(got, x, w, bias)
        assert torch.equal(got[:, 32:], flt[:, 32:])  # Q8_K rows
        assert not torch.equal(got[:, :32], flt[:, :32])
    import lightserve.kernels.cpu as cpu

    x = torch.randn(2, k)
    want = quant_linear(x, w, bias)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu, "library", lambda: None)
        assert_matches_q8_product(quant_linear(x, w, bias), x, w, bias)
        torch.testing.assert_close(quant_linear(x, w, bias), want, rtol=1e-5, atol=1e-4)


@needs_c
@pytest.mark.parametrize("qtype", sorted(INT8_DOT_TYPES), ids=lambda t: t.name)
def test_int8_activations_stay_close_to_the_float_product(qtype):
    """Realistic weights (the exporter's quantizer over Gaussian rows) and activations (Gaussian with a few large
    channels, as a transformer's are): the int8 path's output within 1.5% (relative norm) of the float32
    activations' product."""
    import gguf

    from lightserve.engine.gguf_export import quantize

    g = torch.Generator().manual_seed(int(qtype))
    n, k = 64, 1024
    dense = torch.randn(n, k, generator=g) * 0.05
    w = quant_tensor(qtype, torch.from_numpy(quantize(dense, gguf.GGMLQuantizationType(int(qtype)))), k)
    x = torch.randn(2, k, generator=g)
    x[:, ::97] *= 8
    got, want = quant_linear(x, int8(w)), quant_linear(x, w)
    rel = float((got - want).norm() / want.norm())
    assert rel < 0.015, rel
