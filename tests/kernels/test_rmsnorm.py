"""rmsnorm / add_rmsnorm: the Triton kernel against the reference, the reference against HF's LlamaRMSNorm code."""
import pytest
import torch

from lightserve.kernels.activation import silu_and_mul_cpu
from lightserve.kernels.cpu import kernel_times, library, variant_library
from lightserve.kernels.rmsnorm import (
    add_rmsnorm_ref,
    add_rmsnorm_triton,
    rmsnorm_cpu,
    rmsnorm_ref,
    rmsnorm_triton,
)
from tests.kernels.kernel_cases import DEVICE, TOL, c_library_variants

EPS = 1e-6


def _hf_llama_rmsnorm(hidden_states, weight, eps):
    # transformers' LlamaRMSNorm.forward, copied line for line (importing modeling_llama costs seconds).
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def _randn(*shape, dtype):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", TOL)
def test_reference_is_hf_rmsnorm_bit_for_bit(dtype):
    x, w = _randn(5, 96, dtype=dtype), _randn(96, dtype=dtype)
    assert torch.equal(rmsnorm_ref(x, w, EPS), _hf_llama_rmsnorm(x, w, EPS))
    # And against the textbook formula in float64, to within the output rounding.
    x64 = x.double()
    expect = (w.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    torch.testing.assert_close(rmsnorm_ref(x, w, EPS), expect, **TOL[dtype])


@pytest.mark.parametrize("num_tokens, hidden", [(1, 64), (7, 100), (3, 576)])  # 100 and 576: masked tail
@pytest.mark.parametrize("dtype", TOL)
def test_rmsnorm_triton_matches_reference(num_tokens, hidden, dtype):
    x, w = _randn(num_tokens, hidden, dtype=dtype), _randn(hidden, dtype=dtype)
    torch.testing.assert_close(rmsnorm_triton(x, w, EPS), rmsnorm_ref(x, w, EPS), **TOL[dtype])


def test_rmsnorm_triton_strided_rows_and_fp32_weight():
    x = _randn(4, 200, dtype=torch.bfloat16)[:, :100]  # row stride 200: a slice of a wider activation
    w = _randn(100, dtype=torch.float32)
    out = rmsnorm_triton(x, w, EPS)
    assert out.dtype == torch.float32  # weight * y promotes, as in HF
    torch.testing.assert_close(out, rmsnorm_ref(x, w, EPS), **TOL[torch.bfloat16])


@pytest.mark.parametrize("num_tokens, hidden", [(1, 64), (6, 100)])
@pytest.mark.parametrize("dtype", TOL)
def test_add_rmsnorm_triton_matches_reference(num_tokens, hidden, dtype):
    x, w = _randn(num_tokens, hidden, dtype=dtype), _randn(hidden, dtype=dtype)
    residual = _randn(num_tokens, hidden, dtype=dtype)
    res_triton, res_ref = residual.clone(), residual.clone()
    out_triton = add_rmsnorm_triton(x, res_triton, w, EPS)
    out_ref = add_rmsnorm_ref(x, res_ref, w, EPS)
    assert torch.equal(res_ref, residual + x)
    if dtype == torch.bfloat16:
        # The interpreter truncates fp32 -> bf16 where GPUs round to nearest: allow one bf16 ulp.
        torch.testing.assert_close(res_triton, res_ref, atol=0, rtol=2 ** -7)
    else:
        assert torch.equal(res_triton, res_ref)  # one rounded add
    torch.testing.assert_close(out_triton, out_ref, **TOL[dtype])


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the C kernel is the CPU path")
# 100: a tail past 16 lanes; 200 x 576: parallel
@pytest.mark.parametrize("num_tokens, hidden", [(1, 64), (7, 100), (200, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", c_library_variants())
def test_rmsnorm_c_kernel_matches_reference(num_tokens, hidden, dtype, variant):
    """Every build this CPU runs. bfloat16 rounds where the reference rounds: the residual add is exact, the
    output is within one bf16 ulp (the sum of squares runs in another order)."""
    lib = variant_library(variant)
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(num_tokens, hidden + 8, generator=g).to(dtype)[:, :hidden]  # strided rows
    res = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-6)
    torch.testing.assert_close(rmsnorm_cpu(x, None, w, EPS, lib=lib), rmsnorm_ref(x, w, EPS), **tol)
    got_res = res.clone()
    want_res = res.clone()
    got = rmsnorm_cpu(x, got_res, w, EPS, lib=lib)
    want = add_rmsnorm_ref(x, want_res, w, EPS)
    assert got.dtype == dtype
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)  # the in-place add is exact
    torch.testing.assert_close(got, want, **tol)
    assert rmsnorm_cpu(x.double(), None, w.double(), EPS) is None  # float64: the reference's


@pytest.mark.skipif(library() is None, reason="no C compiler: nothing is labelled")
def test_kernel_times_time_labelled_c_calls_only_inside():
    """kernels.cpu.kernel_times (scripts/profile_step.py): each labelled C call inside adds its wall time under its
    label; outside, and after the block, nothing is recorded."""
    x, r, w = (torch.randn(64, 576), torch.randn(64, 576), torch.randn(576))
    assert rmsnorm_cpu(x, None, w, EPS) is not None  # untimed
    with kernel_times() as times:
        assert not times
        rmsnorm_cpu(x, None, w, EPS)
        once = times["rmsnorm_cpu"]
        rmsnorm_cpu(x, r, w, EPS)
        silu_and_mul_cpu(torch.randn(8, 64))
    assert set(times) == {"rmsnorm_cpu", "silu_and_mul_cpu"}
    assert 0 < once < times["rmsnorm_cpu"] and times["silu_and_mul_cpu"] > 0
    after = dict(times)
    rmsnorm_cpu(x, None, w, EPS)
    assert times == after
