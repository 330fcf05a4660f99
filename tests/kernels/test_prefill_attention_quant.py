"""prefill_attention's C kernel over an 8-bit KV cache (int8 with per-row scales, fp8 e4m3 / e5m2 with per-tensor
scales) against the reference over the same cache: ragged requests with cached prefixes, GQA, window and softcap."""
import subprocess
from pathlib import Path

import pytest
import torch

from lightserve.kernels import cpu
from lightserve.kernels.cpu import c_compiler, library, variant_library
from lightserve.kernels.kv_store import quantize_kv_ref
from lightserve.kernels.prefill_attention import prefill_attention, prefill_attention_cpu, prefill_attention_ref
from tests.kernels.kernel_cases import (
    DEVICE,
    TOL,
    VARIANTS,
    c_library_variants,
    make_kv_batch,
    window_softcap_meta,
)

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu" or library() is None, reason="the C kernel is the CPU path")

KV_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
# fp8's per-tensor scales: values of randn / scale span e4m3's normals and subnormals (down to 2^-9) and reach e5m2's
# subnormals; K and V differ, so a swapped scale shows.
FP8_SCALES = {torch.float8_e4m3fn: (0.02, 0.05), torch.float8_e5m2: (0.5, 3.0)}
# (prefix_len, extend_len): every query-block and 96-key-block edge, a 1-token extend after a long prefix, a
# prefix ending inside a key block (as test_prefill_attention.py's C_REQS).
C_REQS = [(0, 130), (100, 40), (64, 1), (0, 1), (5, 17), (63, 66), (95, 98)]
W_REQS = [(0, 70), (50, 20), (3, 9), (33, 1)]


def _quantize_cache(cache, dtype, scale, head_major):
    """A float cache [rows, Hk, D] (head_major: a view of [Hk, rows, D]) -> the same layout in `dtype` and its
    scales: int8's [rows, Hk] float32 contiguous, or fp8's float."""
    q, row_scale = quantize_kv_ref(cache, dtype, scale if scale is not None else 1.0)  # [rows, Hk, D]
    rows, heads, dim = cache.shape
    out = torch.empty(heads, rows, dim, dtype=dtype).transpose(0, 1) if head_major else torch.empty_like(q)
    out.copy_(q)
    return out, (row_scale.contiguous() if dtype == torch.int8 else scale)


def _quant_case(reqs, num_heads, num_kv_heads, head_dim, kv_dtype, act_dtype, head_major=False, seed=0):
    batch = make_kv_batch([p + e for p, e in reqs], num_kv_heads, head_dim, torch.float32, seed, head_major)
    k_fp8, v_fp8 = FP8_SCALES.get(kv_dtype, (None, None))
    k_cache, k_scale = _quantize_cache(batch.k_cache, kv_dtype, k_fp8, head_major)
    v_cache, v_scale = _quantize_cache(batch.v_cache, kv_dtype, v_fp8, head_major)
    extend_lens = [e for _, e in reqs]
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(extend_lens), num_heads, head_dim, generator=gen).to(act_dtype)  # [Tq, Hq, D]
    starts = torch.tensor([0] + extend_lens[:-1]).cumsum(0)
    meta = {
        "req_to_token": batch.req_to_token, "req_rows": batch.req_rows, "q_start_locs": starts.to(torch.int32),
        "prefix_lens": torch.tensor([p for p, _ in reqs], dtype=torch.int32),
        "extend_lens": torch.tensor(extend_lens, dtype=torch.int32),
        "max_extend_len": max(extend_lens), "sm_scale": head_dim ** -0.5,
        "k_scale": k_scale, "v_scale": v_scale,
    }
    return q, k_cache, v_cache, meta


def _cpu_meta(meta):
    return {k: v for k, v in meta.items() if k != "max_extend_len"}


@pytest.mark.parametrize("variant", c_library_variants())
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, act_dtype, head_major", [
    (2, 2, 64, torch.float32, False), (9, 3, 64, torch.float32, True), (8, 1, 128, torch.float32, False),
    (4, 4, 128, torch.bfloat16, True), (9, 3, 128, torch.bfloat16, False), (8, 1, 64, torch.bfloat16, False),
])
def test_cpu_kernel_matches_reference_over_8bit_cache(num_heads, num_kv_heads, head_dim, act_dtype, head_major,
                                                      kv_dtype, variant):
    """Groups 1 / 3 / 8, head dims 64 / 128, float32 and bf16 q (as a strided view of qkv), token- and head-major
    caches, every build this CPU runs. The reference dequantizes K/V to q's dtype, so bf16 differs by bf16 rounding."""
    q, k_cache, v_cache, meta = _quant_case(C_REQS, num_heads, num_kv_heads, head_dim, kv_dtype, act_dtype,
                                            head_major)
    qkv = torch.cat([q.flatten(1), torch.zeros(q.shape[0], 2 * num_kv_heads * head_dim, dtype=act_dtype)], dim=1)
    q_view = qkv[:, :num_heads * head_dim].view(q.shape)  # [Tq, Hq, D], token stride (Hq + 2 Hk) * D
    out = prefill_attention_cpu(q_view, k_cache, v_cache, **_cpu_meta(meta), lib=variant_library(variant))
    assert out is not None and out.dtype == act_dtype
    expect = prefill_attention_ref(q, k_cache, v_cache, **meta)
    assert not expect.isnan().any()
    torch.testing.assert_close(out, expect, **TOL[act_dtype])


@pytest.mark.parametrize("variant", c_library_variants())
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("window, softcap", VARIANTS)
def test_cpu_kernel_window_and_softcap_over_8bit_cache(window, softcap, kv_dtype, variant):
    q, k_cache, v_cache, meta = _quant_case(W_REQS, 9, 3, 64, kv_dtype, torch.float32)
    meta = window_softcap_meta(meta, window, softcap)
    out = prefill_attention_cpu(q, k_cache, v_cache, **_cpu_meta(meta), lib=variant_library(variant))
    assert out is not None
    torch.testing.assert_close(out, prefill_attention_ref(q, k_cache, v_cache, **meta), **TOL[torch.float32])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_scales_are_read_per_row_and_head(kv_dtype):
    """The kernel reads each row's own scales (int8) or the tensor's (fp8): scaling one request's V rows' scales by
    2 doubles that request's output and leaves the others' alone."""
    reqs = [(20, 10), (0, 12)]
    q, k_cache, v_cache, meta = _quant_case(reqs, 4, 2, 64, kv_dtype, torch.float32)
    base = prefill_attention_cpu(q, k_cache, v_cache, **_cpu_meta(meta))
    v_scale = meta["v_scale"]
    if kv_dtype == torch.int8:
        first = meta["req_to_token"][meta["req_rows"][0], :30].long()
        v_scale = v_scale.clone()
        v_scale[first] *= 2
        changed = slice(0, 10)
    else:
        v_scale = v_scale * 2
        changed = slice(0, 22)
    out = prefill_attention_cpu(q, k_cache, v_cache, **{**_cpu_meta(meta), "v_scale": v_scale})
    torch.testing.assert_close(out[changed], 2 * base[changed], **TOL[torch.float32])
    assert torch.equal(out[changed.stop:], base[changed.stop:])


def test_dispatch_runs_the_kernel_and_declines_fp8_scales_it_cannot_take():
    q, k_cache, v_cache, meta = _quant_case([(7, 9)], 4, 1, 64, torch.float8_e4m3fn, torch.float32)
    out = prefill_attention(q, k_cache, v_cache, **meta)
    assert torch.equal(out, prefill_attention_cpu(q, k_cache, v_cache, **_cpu_meta(meta)))
    # 2e36 * 2^8 (e4m3's power of two folded into the scale) is no float32: the reference's job (whose scores
    # overflow as well: compared with their NaNs)
    huge = {**meta, "k_scale": 2e36}
    assert prefill_attention_cpu(q, k_cache, v_cache, **_cpu_meta(huge)) is None
    torch.testing.assert_close(prefill_attention(q, k_cache, v_cache, **huge),
                               prefill_attention_ref(q, k_cache, v_cache, **huge), rtol=0, atol=0, equal_nan=True)
    assert prefill_attention_cpu(q, k_cache, v_cache, **{**_cpu_meta(meta), "v_scale": None}) is None


def test_declines_int8_scales_it_cannot_read_in_place():
    q, k_cache, v_cache, meta = _quant_case([(7, 9)], 4, 2, 64, torch.int8, torch.float32)
    transposed = meta["k_scale"].t().contiguous().t()  # [rows, Hk] values, column-major
    assert prefill_attention_cpu(q, k_cache, v_cache, **{**_cpu_meta(meta), "k_scale": transposed}) is None
    assert prefill_attention_cpu(q, k_cache, v_cache, **{**_cpu_meta(meta), "k_scale": None}) is None


@pytest.mark.parametrize("march", ["x86-64-v4", "sapphirerapids"])
@pytest.mark.parametrize("source", ["prefill_attention.c", "elementwise.c"])
def test_8bit_paths_compile_for_avx512_hosts(source, march, tmp_path):
    """This CPU runs no AVX-512, so the 16-lane builds of the 8-bit reads and writes are compiled, not run: to
    assembly, where the sapphirerapids prefill keeps its vdpbf16ps tiles (taken by bf16 caches only)."""
    asm = tmp_path / "out.s"
    flags = ["-O3", f"-march={march}", "-fopenmp", "-fPIC", "-fno-math-errno", "-fno-trapping-math"]
    done = subprocess.run([c_compiler(), *flags, "-S", "-o", str(asm), str(Path(cpu.__file__).parent / source)],
                          capture_output=True, text=True, timeout=120)
    if "bad value" in done.stderr:  # an older gcc, or clang, without this -march
        pytest.skip(f"this compiler has no -march={march}")
    assert done.returncode == 0, done.stderr
    text = asm.read_text()
    assert "zmm" in text
    if source == "prefill_attention.c":
        assert ("vdpbf16ps" in text) == (march == "sapphirerapids")
