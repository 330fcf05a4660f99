"""The C decode attention over an 8-bit KV cache (int8 with per-row scales, fp8 e4m3 / e5m2 with per-tensor scales)
against decode_attention_ref over the same quantized cache, written by store_kv_ref."""
import pytest
import torch

from lightserve.kernels.cpu import library, variant_library
from lightserve.kernels.decode_attention import decode_attention_cpu, decode_attention_ref
from lightserve.kernels.kv_store import FP8_MAX, dequantize_kv, store_kv_ref
from tests.kernels.kernel_cases import DECODE_TUNINGS, DEVICE, TOL, VARIANTS, c_library_variants, window_softcap_meta

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu" or library() is None, reason="the C kernel is the CPU path")

KV_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
# fp8's per-tensor (k_scale, v_scale): off 1.0, so that folding them into the kernel's scales is tested, and small
# enough that randn values use most of each format's range.
FP8_SCALES = {torch.float8_e4m3fn: (0.013, 0.011), torch.float8_e5m2: (0.0021, 0.0017)}
SEQ_LENS = [1, 31, 32, 33, 70, 7, 129, 2, 300]  # batch 9: off and on the 32-token blocks; 300 is split and merged


def _quant_case(seq_lens, num_heads, num_kv_heads, head_dim, kv_dtype, act_dtype, head_major=False, seed=0):
    """A ragged batch whose K/V rows are scattered through an 8-bit cache. Rows no request owns hold values that
    would show if read: NaN scales (int8), the largest fp8 code (fp8). Returns (q, k_cache, v_cache, k_scale,
    v_scale, meta); head_major: the cache is the [Hk, rows, D] view a CPU KVCache makes."""
    gen = torch.Generator().manual_seed(seed)
    num_used = sum(seq_lens)
    num_rows = num_used + 7
    shape = (num_kv_heads, num_rows, head_dim) if head_major else (num_rows, num_kv_heads, head_dim)
    k_cache, v_cache = torch.empty(shape, dtype=kv_dtype), torch.empty(shape, dtype=kv_dtype)
    if head_major:
        k_cache, v_cache = k_cache.transpose(0, 1), v_cache.transpose(0, 1)  # [rows, Hk, D], head stride rows * D
    if kv_dtype == torch.int8:
        k_cache.fill_(127), v_cache.fill_(127)
        k_scale = torch.full((num_rows, num_kv_heads), float("nan"))  # [rows, Hk] float32, token-major
        v_scale = torch.full((num_rows, num_kv_heads), float("nan"))
    else:
        k_cache.fill_(FP8_MAX[kv_dtype]), v_cache.fill_(FP8_MAX[kv_dtype])
        k_scale, v_scale = FP8_SCALES[kv_dtype]
    locs = torch.randperm(num_rows, generator=gen)[:num_used]  # requests' tokens scattered through the cache
    k = torch.randn(num_used, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_used, num_kv_heads, head_dim, generator=gen)
    # Some values far below the scale: fp8 subnormals (e4m3 under 2^-6 of its scale), int8 zeros.
    for x in (k, v):
        x[torch.rand(x.shape, generator=gen) < 0.1] *= 1e-4
    store_kv_ref(k, v, k_cache, v_cache, locs, k_scale, v_scale)
    batch = len(seq_lens)
    req_to_token = torch.full((batch + 2, max(seq_lens) + 3), num_rows - 1, dtype=torch.int32)
    req_rows = torch.randperm(batch + 2, generator=gen)[:batch].to(torch.int32)
    offset = 0
    for row, n in zip(req_rows.tolist(), seq_lens):
        req_to_token[row, :n] = locs[offset:offset + n].to(torch.int32)
        offset += n
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(act_dtype)
    meta = {"req_to_token": req_to_token, "req_rows": req_rows,
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32), "max_seq_len": max(seq_lens),
            "sm_scale": head_dim ** -0.5}
    return q, k_cache, v_cache, k_scale, v_scale, meta


def _check(q, k_cache, v_cache, k_scale, v_scale, meta, lib=None):
    meta_cpu = {k: v for k, v in meta.items() if k != "max_seq_len"}
    out = decode_attention_cpu(q, k_cache, v_cache, **meta_cpu, lib=lib, k_scale=k_scale, v_scale=v_scale)
    assert out is not None and out.dtype == q.dtype
    expect = decode_attention_ref(q, k_cache, v_cache, **meta, k_scale=k_scale, v_scale=v_scale)
    assert not expect.isnan().any()
    torch.testing.assert_close(out, expect, **TOL[q.dtype])
    return out


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (9, 3), (8, 1)])  # groups 1, 3, 8
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_major", [False, True])
def test_cpu_kernel_matches_reference_over_an_8bit_cache(kv_dtype, num_heads, num_kv_heads, head_dim, act_dtype,
                                                         head_major):
    """Batch 9 of ragged lengths over scattered rows, token-major and head-major caches, float32 and bf16 queries:
    the native build's widened 8-bit rows, int8's per-row K and V scales and fp8's per-tensor ones."""
    _check(*_quant_case(SEQ_LENS, num_heads, num_kv_heads, head_dim, kv_dtype, act_dtype, head_major))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_cpu_kernel_head_dim_256_and_a_run_time_group(kv_dtype):
    """Gemma's head_dim, and groups of 12 (no compiled-in instance: the group is a run-time value)."""
    _check(*_quant_case([1, 45, 300], 4, 2, 256, kv_dtype, torch.bfloat16))
    _check(*_quant_case([1, 45, 300], 12, 1, 64, kv_dtype, torch.float32))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_kernel_long_request_is_chunked_and_merged(kv_dtype, threads):
    """Batch 1 at 2,000 tokens: several tasks of one request, merged by log-sum-exp (fp8's V scale is applied
    after the merge)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        _check(*_quant_case([2000], 9, 3, 64, kv_dtype, torch.float32, head_major=True))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("window, softcap", VARIANTS)
def test_cpu_kernel_window_and_softcap_over_an_8bit_cache(kv_dtype, window, softcap):
    """A window reads only the last rows; a softcap applies to scores that carry the K scales."""
    q, k_cache, v_cache, k_scale, v_scale, meta = _quant_case([1, 23, 70, 8, 300], 9, 3, 64, kv_dtype,
                                                              torch.float32)
    _check(q, k_cache, v_cache, k_scale, v_scale, window_softcap_meta(meta, window, softcap))


@pytest.mark.parametrize("variant", c_library_variants())
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (8, 1, 128), (4, 2, 256)])
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16])
def test_every_build_reads_an_8bit_cache(variant, kv_dtype, num_heads, num_kv_heads, head_dim, act_dtype):
    """Each build this CPU runs (AVX-512 with and without AVX512-BF16, AVX2, plain C): the 8-bit kinds never take
    the bf16 paths (vdpbf16ps) and widen with each build's own instructions."""
    _check(*_quant_case(SEQ_LENS, num_heads, num_kv_heads, head_dim, kv_dtype, act_dtype, head_major=True),
           lib=variant_library(variant))


@pytest.mark.parametrize("tuning", DECODE_TUNINGS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("head_major", [False, True])
def test_other_compile_time_choices_read_an_8bit_cache(tuning, kv_dtype, head_major):
    """The builds of tests/kernels/test_decode_attention.py's other compile-time choices: a head at a time and block
    by block (the int8 scales' prefetches follow either), other prefetch distances."""
    _check(*_quant_case([1, 31, 33, 300, 129], 9, 3, 64, kv_dtype, torch.bfloat16, head_major),
           lib=variant_library("native", tuning))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_every_8bit_code_reads_back_exactly(kv_dtype):
    """One-token requests whose V rows hold every code of the format (NaN and inf codes left out) and a zero query:
    each output is its V row, dequantized, bit for bit as the reference dequantizes it: the fp8 bit trick and its
    power of two (subnormals included), and the int8 widening."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(kv_dtype)
    if kv_dtype != torch.int8:
        codes = codes[codes.float().isfinite()]
    head_dim = 64
    num_rows = -(-codes.numel() // head_dim)
    rows = torch.cat([codes, codes[:num_rows * head_dim - codes.numel()]]).view(num_rows, 1, head_dim)
    v_cache = rows.flip(0).contiguous()  # [rows, 1, D]
    k_cache = torch.zeros_like(v_cache)
    if kv_dtype == torch.int8:
        k_scale, v_scale = torch.ones(num_rows, 1), torch.rand(num_rows, 1) + 0.5
    else:
        k_scale, v_scale = 1.0, 0.37
    meta = {"req_to_token": torch.arange(num_rows, dtype=torch.int32)[:, None], "req_rows":
            torch.arange(num_rows, dtype=torch.int32), "seq_lens": torch.ones(num_rows, dtype=torch.int32),
            "sm_scale": 0.125}
    q = torch.zeros(num_rows, 2, head_dim)
    out = decode_attention_cpu(q, k_cache, v_cache, **meta, k_scale=k_scale, v_scale=v_scale)
    assert out is not None
    expect = dequantize_kv(v_cache, v_scale)  # [rows, 1, D]
    torch.testing.assert_close(out, expect.expand(-1, 2, -1), atol=0, rtol=0)


def test_cpu_kernel_declines_scales_it_cannot_read():
    """int8 scales other than float32 [rows, Hk] contiguous, fp8 scales as tensors, K and V in two formats: None,
    so that the reference runs."""
    q, k_cache, v_cache, k_scale, v_scale, meta = _quant_case([5, 9], 4, 2, 64, torch.int8, torch.float32)
    meta_cpu = {k: v for k, v in meta.items() if k != "max_seq_len"}
    for ks in (k_scale.double(), k_scale.t().contiguous().t(), k_scale[:, :1], None):
        assert decode_attention_cpu(q, k_cache, v_cache, **meta_cpu, k_scale=ks, v_scale=v_scale) is None
    assert decode_attention_cpu(q, k_cache, v_cache, **meta_cpu, k_scale=k_scale, v_scale=v_scale) is not None
    fp8 = k_cache.to(torch.float8_e4m3fn)
    assert decode_attention_cpu(q, fp8, fp8, **meta_cpu, k_scale=torch.tensor(1.0), v_scale=1.0) is None
    assert decode_attention_cpu(q, fp8, fp8.view(torch.int8), **meta_cpu, k_scale=1.0, v_scale=1.0) is None
    assert decode_attention_cpu(q, fp8, fp8, **meta_cpu, k_scale=1.0, v_scale=1.0) is not None
