"""store_kv's C kernel writing an 8-bit KV cache (int8 with per-row scales, fp8 e4m3 / e5m2 with per-tensor scales):
byte for byte what the reference (quantize_kv_ref) writes, from strided views of a fused qkv, into token- and
head-major caches; the fp8 rounding over every code, tie and edge."""
import pytest
import torch

from lightserve.kernels.cpu import library, variant_library
from lightserve.kernels.kv_store import FP8_MAX, quantize_kv_ref, store_kv, store_kv_cpu, store_kv_ref
from tests.kernels.kernel_cases import DEVICE, c_library_variants

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu" or library() is None, reason="the C kernel is the CPU path")

KV_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def _qkv_views(x_k, x_v, num_q_heads=3):
    """k, v [T, Hk, D] as the model passes them: views of one [T, (Hq + 2 Hk) * D] qkv buffer."""
    num_tokens, num_kv_heads, head_dim = x_k.shape
    q = torch.zeros(num_tokens, num_q_heads * head_dim, dtype=x_k.dtype)
    qkv = torch.cat([q, x_k.flatten(1), x_v.flatten(1)], dim=1)
    start, width = num_q_heads * head_dim, num_kv_heads * head_dim
    k = qkv[:, start:start + width].view(x_k.shape)  # strided view, token stride (Hq + 2 Hk) * D
    v = qkv[:, start + width:].view(x_v.shape)
    return k, v


def _empty_cache(num_rows, num_kv_heads, head_dim, dtype, head_major):
    """A cache [rows, Hk, D] filled with byte 0x55 (head_major: a view of [Hk, rows, D] storage), and int8's scales
    [rows, Hk] float32 filled with -1: anything the store did not write stays recognizable."""
    shape = (num_kv_heads, num_rows, head_dim) if head_major else (num_rows, num_kv_heads, head_dim)
    cache = torch.full(shape, 0x55, dtype=torch.uint8).view(dtype)
    if head_major:
        cache = cache.transpose(0, 1)
    return cache


def _bytes(cache):
    return cache.contiguous().view(torch.uint8)


def _store_both(k, v, kv_dtype, num_rows, kv_locs, head_major, k_scale=None, v_scale=None, lib=None):
    """Store k, v with the C kernel and with the reference into fresh caches; returns both (caches, scales)."""
    _, num_kv_heads, head_dim = k.shape
    results = []
    for c_kernel in (True, False):
        k_cache, v_cache = (_empty_cache(num_rows, num_kv_heads, head_dim, kv_dtype, head_major) for _ in range(2))
        ks, vs = k_scale, v_scale
        if kv_dtype == torch.int8:
            ks, vs = (torch.full((num_rows, num_kv_heads), -1.0) for _ in range(2))
        if c_kernel:
            assert store_kv_cpu(k, v, k_cache, v_cache, kv_locs, lib=lib, k_scale=ks, v_scale=vs)
        else:
            store_kv_ref(k, v, k_cache, v_cache, kv_locs, ks, vs)
        results.append((k_cache, v_cache, ks, vs))
    return results


def _assert_same_bytes(got, want):
    for g, w in zip(got, want):
        if isinstance(g, torch.Tensor):
            if g.dtype == torch.float32:  # int8's scales: equal floats, NaN-free
                assert torch.equal(g, w)
            else:
                assert torch.equal(_bytes(g), _bytes(w))
        else:
            assert g == w


@pytest.mark.parametrize("variant", c_library_variants())
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("num_tokens, locs_dtype", [(5, torch.int64), (600, torch.int32)])  # 600: both threads
def test_c_store_writes_the_reference_bytes(num_tokens, locs_dtype, head_major, src_dtype, kv_dtype, variant):
    gen = torch.Generator().manual_seed(num_tokens)
    num_rows, num_kv_heads, head_dim = 700, 2, 64
    x_k = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 4).to(src_dtype)
    x_v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(src_dtype)
    x_k[0, 1] = 0  # int8: a row of zeros has scale 0 and codes 0
    k, v = _qkv_views(x_k, x_v)
    kv_locs = torch.randperm(num_rows, generator=gen)[:num_tokens].to(locs_dtype)
    k_scale, v_scale = (0.37, 3.1) if kv_dtype in FP8_MAX else (None, None)  # fp8: K/V each its own scale
    got, want = _store_both(k, v, kv_dtype, num_rows, kv_locs, head_major, k_scale, v_scale,
                            lib=variant_library(variant))
    _assert_same_bytes(got, want)
    k_cache = got[0]
    untouched = torch.ones(num_rows, dtype=torch.bool)
    untouched[kv_locs.long()] = False
    assert (_bytes(k_cache[untouched]) == 0x55).all()  # and nothing else is written
    if kv_dtype == torch.int8:
        assert (got[2][untouched] == -1).all() and (got[2][kv_locs.long()[0], 1] == 0)


def test_int8_rounds_half_to_even():
    """amax 127 makes 127 / amax exactly 1, so x itself is the rounded value: halves go to the even code."""
    row = torch.tensor([127.0, 2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -127.0] + [0.0] * 6)
    x = row.view(1, 1, 16)
    got, want = _store_both(*_qkv_views(x, x), torch.int8, 4, torch.tensor([2]), head_major=False)
    _assert_same_bytes(got, want)
    assert got[0][2, 0, :10].tolist() == [127, 2, 4, -2, -4, 0, 0, 2, 126, -127]
    assert got[2][2, 0].item() == 1.0


def test_int8_near_ties_over_many_row_maxima():
    """Values at (n + 1/2) / 127 of their row's max, for 512 maxima: x * (127 / amax) lands within an ulp of a tie,
    where how 127 / amax is rounded decides the code (the reference's is 1 / amax, then times 127)."""
    gen = torch.Generator().manual_seed(5)
    amax = torch.rand(512, 1, generator=gen) * 20 + 0.01  # [rows, 1]
    halves = (torch.arange(63) + 0.5) / 127  # [63]
    x = torch.cat([amax, amax * halves, -amax * halves.flip(0)], dim=1).view(512, 1, 127)
    got, want = _store_both(*_qkv_views(x, x), torch.int8, 512, torch.arange(512), head_major=False)
    _assert_same_bytes(got, want)


def _fp8_probe_values(dtype):
    """Every finite value of the format, the midpoints between neighbours (ties to even), the floats just above
    and below each, zeros of both signs, the float32 subnormals, and values past the max (saturation), inf and NaN:
    float32 [N]."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = codes[codes.isfinite()].unique()  # sorted, -max .. max (one zero)
    mids = ((finite[1:].double() + finite[:-1].double()) / 2).float()  # exact: one more mantissa bit
    bound = FP8_MAX[dtype]
    extra = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, 2.0 ** -126, bound * 1.03, bound * 1.0625, -bound * 1.07,
                          bound * 2, 1e30, -1e30, float("inf"), float("-inf"), float("nan")])
    base = torch.cat([finite, mids, extra])
    up = torch.nextafter(base, torch.tensor(float("inf")))
    down = torch.nextafter(base, torch.tensor(float("-inf")))
    return torch.cat([base, up, down])


@pytest.mark.parametrize("variant", c_library_variants())
@pytest.mark.parametrize("kv_dtype", FP8_DTYPES)
def test_fp8_encoding_is_torchs_on_every_code_tie_and_edge(kv_dtype, variant):
    values = _fp8_probe_values(kv_dtype)
    head_dim = 64
    values = torch.cat([values, values.new_zeros(-len(values) % head_dim)])
    x = values.view(-1, 1, head_dim)  # [T, 1, D]
    num_tokens = x.shape[0]
    k, v = _qkv_views(x, -x)
    got, want = _store_both(k, v, kv_dtype, num_tokens, torch.arange(num_tokens), False, 1.0, 1.0,
                            lib=variant_library(variant))
    _assert_same_bytes(got, want)
    # the spec itself: torch's own cast of the clamped values
    bound = FP8_MAX[kv_dtype]
    expect = values.clamp(-bound, bound).to(kv_dtype).view(torch.uint8)
    assert torch.equal(_bytes(got[0]).flatten(), expect)
    assert torch.equal(_bytes(quantize_kv_ref(x, kv_dtype)[0]).flatten(), expect)


def test_refuses_a_loc_out_of_range_and_writes_nothing():
    x = torch.randn(4, 2, 64)
    k, v = _qkv_views(x, x + 1)
    for kv_dtype in KV_DTYPES:
        k_cache, v_cache = (_empty_cache(10, 2, 64, kv_dtype, False) for _ in range(2))
        ks, vs = (torch.full((10, 2), -1.0), torch.full((10, 2), -1.0)) if kv_dtype == torch.int8 else (0.5, 0.5)
        bad = torch.tensor([1, 3, 5, 10])  # 10: past the last row
        assert not store_kv_cpu(k, v, k_cache, v_cache, bad, k_scale=ks, v_scale=vs)
        assert (_bytes(k_cache) == 0x55).all() and (_bytes(v_cache) == 0x55).all()
        if kv_dtype == torch.int8:
            assert (ks == -1).all() and (vs == -1).all()
        with pytest.raises((IndexError, RuntimeError)):  # the dispatch's reference raises
            store_kv(k, v, k_cache, v_cache, bad, k_scale=ks, v_scale=vs)


def test_dispatch_runs_the_kernel_and_declines_what_it_cannot_take():
    x = torch.randn(3, 2, 64, dtype=torch.bfloat16)
    k, v = _qkv_views(x, x)
    locs = torch.tensor([4, 0, 2])
    k_cache, v_cache = (_empty_cache(6, 2, 64, torch.int8, True) for _ in range(2))
    ks, vs = torch.full((6, 2), -1.0), torch.full((6, 2), -1.0)
    store_kv(k, v, k_cache, v_cache, locs, k_scale=ks, v_scale=vs)
    _, want = _store_both(k, v, torch.int8, 6, locs, True)
    _assert_same_bytes((k_cache, v_cache, ks, vs), want)
    # float16 k/v: no C kernel for that source dtype; fp8 caches of two formats: no single kind
    assert not store_kv_cpu(k.half(), v.half(), k_cache, v_cache, locs, k_scale=ks, v_scale=vs)
    e4m3, e5m2 = _empty_cache(6, 2, 64, torch.float8_e4m3fn, False), _empty_cache(6, 2, 64, torch.float8_e5m2, False)
    assert not store_kv_cpu(k, v, e4m3, e5m2, locs, k_scale=1.0, v_scale=1.0)
    # int8 scales it cannot write in place (none, or not [rows, Hk] float32 contiguous): the reference's job
    assert not store_kv_cpu(k, v, k_cache, v_cache, locs)
    assert not store_kv_cpu(k, v, k_cache, v_cache, locs, k_scale=ks.t().contiguous().t(), v_scale=vs)
    assert not store_kv_cpu(k, v, e4m3, e4m3.clone(), locs)  # fp8 without its float scales
