"""silu_and_mul: the Triton kernel against the reference, the reference against silu written out."""
import pytest
import torch

from lightserve.kernels.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref, silu_and_mul_triton
from lightserve.kernels.cpu import variant_library
from tests.kernels.kernel_cases import DEVICE, TOL, c_library_variants


@pytest.mark.parametrize("dtype", TOL)
def test_reference_is_gate_silu_times_up(dtype):
    x = torch.randn(5, 2 * 48, dtype=dtype, device=DEVICE) * 4
    gate, up = x[:, :48].double(), x[:, 48:].double()
    expect = (gate / (1 + torch.exp(-gate)) * up).to(dtype)
    torch.testing.assert_close(silu_and_mul_ref(x), expect, **TOL[dtype])


@pytest.mark.parametrize("num_tokens, inter", [(1, 64), (5, 100), (2, 1536)])  # 1536: two column blocks
@pytest.mark.parametrize("dtype", TOL)
def test_silu_and_mul_triton_matches_reference(num_tokens, inter, dtype):
    x = torch.randn(num_tokens, 2 * inter, dtype=dtype, device=DEVICE) * 4
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), **TOL[dtype])


def test_silu_and_mul_triton_strided_rows_and_no_tokens():
    x = torch.randn(3, 2 * 100 + 7, dtype=torch.float16, device=DEVICE)[:, :200]  # row stride 207
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), **TOL[torch.float16])
    assert silu_and_mul_triton(x[:0]).shape == (0, 100)  # an empty step launches nothing


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the C kernel is the CPU path")
# 300: a bf16 chunk (CHUNK in elementwise.c) and a tail; 64 x 1536: parallel
@pytest.mark.parametrize("num_tokens, inter", [(1, 64), (5, 100), (3, 300), (64, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", c_library_variants())
def test_silu_and_mul_c_kernel_matches_reference(num_tokens, inter, dtype, variant):
    """Every build this CPU runs; bfloat16 rounds silu before the product, as torch's two ops do."""
    from lightserve.kernels.activation import silu_and_mul_cpu

    lib = variant_library(variant)
    g = torch.Generator().manual_seed(inter)
    x = (torch.randn(num_tokens, 2 * inter + 4, generator=g) * 6).to(dtype)[:, : 2 * inter]  # strided; large |x|
    x[0, 0], x[0, 1] = -120.0, 120.0  # exp's clamps
    x[-1, 2], x[-1, inter + 3] = float("nan"), float("nan")  # a NaN gate and a NaN up, in both lanes of a bf16 pair
    out = silu_and_mul_cpu(x, lib=lib)
    assert out.dtype == dtype
    ref = silu_and_mul_ref(x)
    assert out[-1, 2:4].isnan().all()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-6)
    torch.testing.assert_close(out, ref, equal_nan=True, **tol)
    if dtype == torch.bfloat16:
        # Rounded where torch's two ops round, the bits are torch's (1.5M elements of [512, 3,072] at 6 sigma: all),
        # but for the clamped exp (silu(-120) is -7e-37 here, -0 in torch) and NaN payloads.
        plain = ~ref.isnan()
        plain[0, :2] = False
        assert torch.equal(out[plain], ref[plain])
    assert silu_and_mul_cpu(x.double()) is None


@pytest.mark.parametrize("num_tokens, inter", [(1, 64), (5, 100)])
@pytest.mark.parametrize("dtype", TOL)
def test_gelu_tanh_and_mul_triton_matches_reference(num_tokens, inter, dtype):
    x = torch.randn(num_tokens, 2 * inter, dtype=dtype, device=DEVICE) * 4
    x[0, 0], x[0, 1] = -60.0, 60.0  # tanh's saturated ends
    torch.testing.assert_close(silu_and_mul_triton(x, gelu=True), gelu_tanh_and_mul_ref(x), **TOL[dtype])


def test_gelu_tanh_reference_is_the_tanh_formula():
    x = torch.randn(4, 2 * 32, dtype=torch.float64) * 3
    gate, up = x[:, :32], x[:, 32:]
    expect = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate ** 3))) * up
    torch.testing.assert_close(gelu_tanh_and_mul_ref(x), expect)
