"""linear: the CPU C kernel (AVX2 and portable builds) against F.linear, over the row counts its
tiles split into (1-3 rows per tile, 4 weight rows per block, 96-row panels), a partial last
block, bias, strided input rows and bf16 weights; what it declines falls back to F.linear."""
import pytest
import torch
import torch.nn.functional as F
from lightserve.kernels.cpu import library
from lightserve.kernels.linear import SKINNY_MAX_M, linear, linear_cpu, linear_ref

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: the CPU path is F.linear")

ROWS = [1, 2, 3, 4, 5, 7, 96, 97, 100]  # tile remainders 0, 1, 2; one and two 96-row panels


def _case(m, n, k, w_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = (torch.randn(n, k, generator=g) * 0.05).to(w_dtype)
    b = torch.randn(n, generator=g)
    return x, w, b


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n", [13, 64])  # 13: a partial last block of weight rows
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_c_linear_matches_f_linear(m, n, w_dtype):
    x, w, b = _case(m, n, 72, w_dtype, seed=m * 100 + n)
    want = F.linear(x, w.float(), b)  # bf16 weights widen to float32 exactly: same math
    torch.testing.assert_close(linear_cpu(x, w, b), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear_cpu(x, w), F.linear(x, w.float()), rtol=1e-5, atol=1e-5)


def test_strided_rows_and_model_shapes():
    """Rows of a wider tensor (the model passes views); SmolLM2's gate_up shape."""
    x, w, _ = _case(9, 3072, 576)
    wide = torch.randn(9, 600)
    wide[:, :576] = x
    view = wide[:, :576]
    assert view.stride(0) == 600
    torch.testing.assert_close(linear_cpu(view, w), linear_ref(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_portable_c_path_matches_f_linear(w_dtype):
    """The plain-C loop (what a CPU without AVX2 runs), built here with AVX2 switched off."""
    from lightserve.kernels.cpu import build, load

    portable = load(build(("-mno-avx2", "-mno-fma")))
    for m in (1, 5):
        x, w, b = _case(m, 13, 40, w_dtype, seed=m)
        torch.testing.assert_close(linear_cpu(x, w, b, lib=portable), F.linear(x, w.float(), b), rtol=1e-5, atol=1e-5)


def test_declines_what_it_does_not_take_and_dispatch_falls_back():
    x, w, b = _case(4, 16, 20)  # K = 20: not a multiple of 8
    assert linear_cpu(x, w, b) is None
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b))
    assert linear_cpu(x.double(), w.double()) is None  # float64: F.linear's
    xb, wb, _ = _case(SKINNY_MAX_M + 1, 16, 64)
    torch.testing.assert_close(linear(xb, wb), F.linear(xb, wb))  # past SKINNY_MAX_M: MKL
    assert linear_cpu(torch.empty(0, 64), wb) is None
