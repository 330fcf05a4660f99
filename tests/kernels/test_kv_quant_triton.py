"""The Triton kernels over an 8-bit KV cache (int8, fp8 e4m3, fp8 e5m2): the store byte for byte against
quantize_kv_ref, decode and prefill attention against the references over the same quantized cache, the MLA latent
pool's store, decode and prefill, and the quantization error against a float cache. Run in the interpreter on CPU."""
import pytest
import torch

from lightserve.kernels.decode_attention import decode_attention_ref, decode_attention_triton, decode_blocks
from lightserve.kernels.kv_store import FP8_MAX, dequantize_kv, quantize_kv_ref, store_kv_triton
from lightserve.kernels.mla_attention import (
    mla_decode_attention_ref,
    mla_decode_attention_triton,
    mla_decode_blocks,
    mla_prefill_attention,
    store_latent,
)
from lightserve.kernels.prefill_attention import (
    SMEM_LIMIT_BYTES,
    SMEM_SLACK_BYTES,
    attention_smem_bytes,
    prefill_attention_ref,
    prefill_attention_triton,
    prefill_blocks,
)
from tests.kernels.kernel_cases import DEVICE, TOL, make_kv_batch

QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
FP8_SCALES = (0.75, 0.37)  # (k, v): a power of two's multiple and one whose division rounds
# (num_heads, num_kv_heads, head_dim, q dtype): GQA groups 2 and 4, both head dims. The interpreter's bf16 tl.dot is
# garbage, so bf16 q runs on a GPU only and fp16 stands in for a 16-bit q here.
ATTN_CASES = [(4, 2, 64, torch.float32), (8, 2, 128, torch.float16), (4, 1, 128, torch.float32)] \
    + ([(8, 2, 128, torch.bfloat16)] if DEVICE.type == "cuda" else [])


def _scales(dtype, num_rows, num_kv_heads):
    """Empty (NaN) int8 scale tensors [rows, Hk], or fp8's per-tensor floats: 1 for K, whose special rows must stay
    ties after the division, and one whose division rounds for V."""
    if dtype == torch.int8:
        return tuple(torch.full((num_rows, num_kv_heads), float("nan"), device=DEVICE) for _ in range(2))
    return 1.0, FP8_SCALES[1]


def _special_rows(dtype, head_dim):
    """[n, D] float32 rows on rounding's edges. int8: a row whose x * (127 / amax) hits exact halves (amax 127, so the
    multiplier is 1), an all-zero row (scale 0), and a row whose x * (127 * (1 / amax)), the reference's two
    roundings, is exactly 0.5 where a correctly rounded 127 / amax would give 0.50000006 (and round up).
    fp8 (at scale 1): ties between neighbours, ties among the subnormals, values past the largest (saturate),
    -0 and tiny negatives (the sign byte)."""
    if dtype == torch.int8:
        ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 126.5, -3.5])
        one_ulp = torch.zeros(head_dim)
        one_ulp[:3] = torch.tensor([1.9702801704406738, 0.007757009007036686, -0.007757009007036686])
        return torch.stack([ties.repeat(head_dim // 8), torch.zeros(head_dim), one_ulp])
    mant = 3 if dtype == torch.float8_e4m3fn else 2
    tiny = 2.0 ** (-9 if dtype == torch.float8_e4m3fn else -16)  # the subnormal step
    big = FP8_MAX[dtype]
    edges = torch.tensor([1 + 2.0 ** -(mant + 1), 1 + 3 * 2.0 ** -(mant + 1), tiny / 2, 3 * tiny / 2, big * 1.04,
                          -1e9, -0.0, -tiny / 4])
    return torch.stack([edges.repeat(head_dim // 8), -edges.flip(0).repeat(head_dim // 8)])


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16])
def test_store_triton_is_quantize_kv_ref_byte_for_byte(dtype, act_dtype):
    num_tokens, num_kv_heads, head_dim, num_rows = 12, 2, 64, 20
    g = torch.Generator().manual_seed(0)
    # Magnitudes over 1e-3 .. 1e3 per (token, head), so int8 scales and fp8 exponents vary.
    x = torch.randn(2, num_tokens, num_kv_heads, head_dim, generator=g) \
        * 10 ** (6 * torch.rand(2, num_tokens, num_kv_heads, 1, generator=g) - 3)
    special = _special_rows(dtype, head_dim)
    x[0, :len(special), 0] = special
    x[1, 3, 1] = _special_rows(dtype, head_dim)[0]
    qkv = torch.cat([x[0], x[1], x[1]], dim=1).to(DEVICE, act_dtype)  # k and v: strided views, as the model's
    k, v = qkv[:, :num_kv_heads], qkv[:, num_kv_heads:2 * num_kv_heads]
    locs = torch.randperm(num_rows, generator=g)[:num_tokens].to(DEVICE)
    k_cache = torch.full((num_rows, num_kv_heads, head_dim), 0x55, dtype=torch.uint8, device=DEVICE).view(dtype)
    v_cache = k_cache.clone()
    k_scale, v_scale = _scales(dtype, num_rows, num_kv_heads)
    store_kv_triton(k, v, k_cache, v_cache, locs, k_scale, v_scale)

    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        # The reference on CPU tensors: CUDA's torch divides by a scalar as a multiply by its reciprocal.
        expect, expect_scale = quantize_kv_ref(x.cpu(), dtype, scale if isinstance(scale, float) else 1.0)
        got = cache.cpu().view(torch.uint8)
        assert torch.equal(got[locs.cpu()], expect.view(torch.uint8))
        untouched = torch.ones(num_rows, dtype=torch.bool)
        untouched[locs.cpu()] = False
        assert (got[untouched] == 0x55).all()  # no row but the locs' is written
        if dtype == torch.int8:
            assert torch.equal(scale.cpu()[locs.cpu()], expect_scale)
            assert scale.cpu()[untouched].isnan().all()
    if dtype == torch.int8:  # the tie row really is made of ties, and the zero row gets scale 0
        xf = k[:2, 0].float().cpu()
        assert ((xf[0] * (127.0 / xf[0].abs().amax())).frac().abs() == 0.5).sum() >= head_dim // 2
        assert k_scale[locs[1], 0] == 0 and (k_cache[locs[1], 0] == 0).all()
    else:  # the saturating values hit the format's largest value
        assert k_cache[locs[0], 0].float().abs().max().item() == FP8_MAX[dtype]


def _quantize_batch(batch, dtype):
    """A make_kv_batch's float cache quantized whole: its NaN rows (no request's) come out NaN-poisoned (NaN int8
    scales, NaN fp8 bytes), so a stray read shows up. -> (k_cache, v_cache, k_scale, v_scale)."""
    out = []
    for cache, fp8_scale in zip((batch.k_cache, batch.v_cache), FP8_SCALES):
        q, row_scale = quantize_kv_ref(cache.float().cpu(), dtype, fp8_scale)
        out.append((q.to(DEVICE), fp8_scale if row_scale is None else row_scale.to(DEVICE)))
    (k_cache, k_scale), (v_cache, v_scale) = out
    return k_cache, v_cache, k_scale, v_scale


def _decode_case(seq_lens, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    batch = make_kv_batch(seq_lens, num_kv_heads, head_dim, torch.float32, seed)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    meta = {"req_to_token": batch.req_to_token, "req_rows": batch.req_rows,
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), "max_seq_len": max(seq_lens),
            "sm_scale": head_dim ** -0.5}
    return batch, q.to(DEVICE, dtype), meta


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, q_dtype", ATTN_CASES)
def test_decode_triton_reads_quantized_cache_as_the_reference(dtype, num_heads, num_kv_heads, head_dim, q_dtype):
    batch, q, meta = _decode_case([1, 23, 40], num_heads, num_kv_heads, head_dim, q_dtype)
    k_cache, v_cache, k_scale, v_scale = _quantize_batch(batch, dtype)
    out = decode_attention_triton(q, k_cache, v_cache, **meta, num_splits=2, block_n=16, k_scale=k_scale,
                                  v_scale=v_scale)
    expect = decode_attention_ref(q, k_cache, v_cache, **meta, k_scale=k_scale, v_scale=v_scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expect, **TOL[q_dtype])


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("window, softcap", [(8, 0.0), (0, 1.5)])
def test_decode_triton_quantized_window_and_softcap(dtype, window, softcap):
    batch, q, meta = _decode_case([1, 23, 40], 4, 2, 64, torch.float32)
    meta = {**meta, "sm_scale": meta["sm_scale"] * (8.0 if softcap else 1.0), "window": window, "softcap": softcap}
    k_cache, v_cache, k_scale, v_scale = _quantize_batch(batch, dtype)
    out = decode_attention_triton(q, k_cache, v_cache, **meta, num_splits=2, block_n=16, k_scale=k_scale,
                                  v_scale=v_scale)
    expect = decode_attention_ref(q, k_cache, v_cache, **meta, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out, expect, **TOL[torch.float32])


def _prefill_case(reqs, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    batch = make_kv_batch([p + e for p, e in reqs], num_kv_heads, head_dim, torch.float32, seed)
    extend_lens = [e for _, e in reqs]
    q = torch.randn(sum(extend_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    meta = {"req_to_token": batch.req_to_token, "req_rows": batch.req_rows,
            "q_start_locs": torch.tensor([sum(extend_lens[:i]) for i in range(len(reqs))], dtype=torch.int32,
                                         device=DEVICE),
            "prefix_lens": torch.tensor([p for p, _ in reqs], dtype=torch.int32, device=DEVICE),
            "extend_lens": torch.tensor(extend_lens, dtype=torch.int32, device=DEVICE),
            "max_extend_len": max(extend_lens), "sm_scale": head_dim ** -0.5}
    return batch, q.to(DEVICE, dtype), meta


PREFILL_REQS = [(0, 9), (21, 6)]  # a fresh prompt, a chunk after a cached prefix (keys over two 16-row tiles)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, q_dtype", ATTN_CASES)
def test_prefill_triton_reads_quantized_cache_as_the_reference(dtype, num_heads, num_kv_heads, head_dim, q_dtype):
    batch, q, meta = _prefill_case(PREFILL_REQS, num_heads, num_kv_heads, head_dim, q_dtype)
    k_cache, v_cache, k_scale, v_scale = _quantize_batch(batch, dtype)
    out = prefill_attention_triton(q, k_cache, v_cache, **meta, block_m=16, block_n=16, k_scale=k_scale,
                                   v_scale=v_scale)
    expect = prefill_attention_ref(q, k_cache, v_cache, **meta, k_scale=k_scale, v_scale=v_scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expect, **TOL[q_dtype])


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("window, softcap", [(5, 0.0), (0, 1.5)])
def test_prefill_triton_quantized_window_and_softcap(dtype, window, softcap):
    batch, q, meta = _prefill_case(PREFILL_REQS, 4, 2, 64, torch.float32)
    meta = {**meta, "sm_scale": meta["sm_scale"] * (8.0 if softcap else 1.0), "window": window, "softcap": softcap}
    k_cache, v_cache, k_scale, v_scale = _quantize_batch(batch, dtype)
    out = prefill_attention_triton(q, k_cache, v_cache, **meta, block_m=16, block_n=16, k_scale=k_scale,
                                   v_scale=v_scale)
    expect = prefill_attention_ref(q, k_cache, v_cache, **meta, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out, expect, **TOL[torch.float32])


# Largest |quantized - float cache| of a decode over unit-normal K/V (|v| up to about 3.5). A one-token request's
# output is its V row, off by up to half a step: amax / 254 for int8, 2^-4 and 2^-3 of the value for e4m3 and e5m2;
# longer requests average the errors down (measured: 0.0096, 0.092, 0.18 for the one-token request).
QUANT_ERROR = {torch.int8: 2e-2, torch.float8_e4m3fn: 0.15, torch.float8_e5m2: 0.3}


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_quantized_cache_stays_close_to_the_float_cache(dtype):
    batch, q, meta = _decode_case([1, 23, 40], 4, 2, 64, torch.float32)
    k_cache, v_cache, k_scale, v_scale = _quantize_batch(batch, dtype)
    out = decode_attention_triton(q, k_cache, v_cache, **meta, num_splits=2, block_n=16, k_scale=k_scale,
                                  v_scale=v_scale)
    exact = decode_attention_triton(q, batch.k_cache, batch.v_cache, **meta, num_splits=2, block_n=16)
    error = (out - exact).abs().max().item()
    assert 0 < error < QUANT_ERROR[dtype], error  # 0: nothing was quantized


ROPE = 16


def _latent_pool(seq_lens, rank, dtype, seed=0):
    """A float latent pool [rows, 1, R + Dr] (make_kv_batch's, NaN in rows no request owns) and its quantized copy:
    (batch, pool, latent_scale) with int8's [rows, 1] scales or fp8's float."""
    batch = make_kv_batch(seq_lens, 1, rank + ROPE, torch.float32, seed)
    q, row_scale = quantize_kv_ref(batch.k_cache.cpu(), dtype, FP8_SCALES[1])
    return batch, q.to(DEVICE), FP8_SCALES[1] if row_scale is None else row_scale.to(DEVICE)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_store_latent_quantizes_whole_rows(dtype):
    rank, num_rows = 32, 10
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, rank + ROPE, generator=g) * torch.tensor([[1.0], [50.0], [1e-3]])
    rows = rows.to(DEVICE)
    cache = torch.zeros(num_rows, 1, rank + ROPE, device=DEVICE).to(dtype)
    scale = torch.full((num_rows, 1), float("nan"), device=DEVICE) if dtype == torch.int8 else FP8_SCALES[1]
    locs = torch.tensor([7, 2, 5], device=DEVICE)
    store_latent(rows[:, :rank], rows[:, rank:].view(3, 1, ROPE), cache, locs, latent_scale=scale)
    expect, expect_scale = quantize_kv_ref(rows.cpu()[:, None], dtype, FP8_SCALES[1])  # [3, 1, R + Dr]
    assert torch.equal(cache.cpu()[locs.cpu()].view(torch.uint8), expect.view(torch.uint8))
    assert (cache.cpu()[[0, 1, 3, 4, 6, 8, 9]].view(torch.uint8) == 0).all()
    if dtype == torch.int8:  # one scale per row over all R + Dr values
        assert torch.equal(scale.cpu()[locs.cpu()], expect_scale)
        assert scale.cpu()[[0, 1, 3]].isnan().all()


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("num_heads, rank, q_dtype", [(4, 32, torch.float32), (19, 48, torch.float16)]
                         + ([(16, 512, torch.bfloat16)] if DEVICE.type == "cuda" else []))
def test_mla_decode_triton_reads_quantized_pool_as_the_reference(dtype, num_heads, rank, q_dtype):
    """19 heads: a partial head block; rank 48: masked latent lanes."""
    seq_lens = [1, 23, 40]
    batch, pool, scale = _latent_pool(seq_lens, rank, dtype)
    meta = {"req_to_token": batch.req_to_token, "req_rows": batch.req_rows,
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), "max_seq_len": max(seq_lens),
            "sm_scale": 48 ** -0.5}
    q = torch.randn(len(seq_lens), num_heads, rank + ROPE, generator=torch.Generator().manual_seed(1))
    q = q.to(DEVICE, q_dtype)
    q_latent, q_pe = q[..., :rank], q[..., rank:]
    out = mla_decode_attention_triton(q_latent, q_pe, pool, **meta, num_splits=2, block_n=16, latent_scale=scale)
    expect = mla_decode_attention_ref(q_latent, q_pe, pool, **meta, latent_scale=scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expect, **TOL[q_dtype])
    # The reference itself reads the dequantized rows: the same as over a float pool holding them.
    dequantized = dequantize_kv(pool, scale).to(q_dtype)
    torch.testing.assert_close(expect, mla_decode_attention_ref(q_latent, q_pe, dequantized, **meta), **TOL[q_dtype])


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_mla_prefill_reads_quantized_pool_as_its_dequantized_rows(dtype):
    num_heads, rank, nope, vdim = 4, 32, 32, 32
    seq_lens, prefix_lens = [9, 23], [0, 17]
    batch, pool, scale = _latent_pool(seq_lens, rank, dtype)
    g = torch.Generator().manual_seed(1)
    kv_b = (torch.randn(num_heads * (nope + vdim), rank, generator=g) / rank ** 0.5).to(DEVICE)
    extend = [s - p for s, p in zip(seq_lens, prefix_lens)]
    q_nope = torch.randn(sum(extend), num_heads, nope, generator=g).to(DEVICE)
    q_pe = torch.randn(sum(extend), num_heads, ROPE, generator=g).to(DEVICE)
    host = ([0, extend[0]], prefix_lens, extend)
    out = mla_prefill_attention(q_nope, q_pe, pool, kv_b, vdim, batch.req_to_token, batch.req_rows, *host,
                                (nope + ROPE) ** -0.5, latent_scale=scale)
    dequantized = dequantize_kv(pool, scale)  # [rows, 1, R + Dr] float32
    expect = mla_prefill_attention(q_nope, q_pe, dequantized, kv_b, vdim, batch.req_to_token, batch.req_rows, *host,
                                   (nope + ROPE) ** -0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expect, **TOL[torch.float32])


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("elem", [2, 4])
def test_block_sizes_fit_shared_memory_with_an_8bit_cache(head_dim, elem):
    # The in-flight K/V tiles are 1 byte an element, plus one dequantized copy in q's size for the dots.
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    assert attention_smem_bytes(64, 64, block_d, 2, elem, kv_elem_size=1) \
        == elem * (64 * block_d + 64 * 64) + 2 * 64 * 2 * block_d + elem * 64 * 2 * block_d
    block_m, block_n, _, stages = prefill_blocks(head_dim, elem, 1)
    assert attention_smem_bytes(block_m, block_n, block_d, stages, elem, kv_elem_size=1) + SMEM_SLACK_BYTES \
        <= SMEM_LIMIT_BYTES
    block_n, stages = decode_blocks(head_dim, 8, elem, 1)
    assert attention_smem_bytes(16, block_n, block_d, stages, elem, kv_elem_size=1) + SMEM_SLACK_BYTES \
        <= SMEM_LIMIT_BYTES
    block_n, stages = mla_decode_blocks(512, 64, 16, elem, 1)  # DeepSeek-V3's latent rows
    assert block_n == 32
