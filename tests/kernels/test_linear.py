"""kernels.linear: the small-M C kernel against F.linear (its reference), across row counts that
do and do not fill its 2-row groups and 4-row weight tiles, and K with and without a tail."""
import pytest
import torch

from lightserve.kernels.cpu import library
from lightserve.kernels.linear import SMALL_M_MAX, linear, linear_ref, linear_small_m_cpu

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: the torch path is the only one")


@pytest.mark.parametrize("m", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("k, n", [(576, 960), (1536, 5), (100, 3), (7, 1)])
def test_small_m_kernel_matches_reference(m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    got = linear_small_m_cpu(x, w)
    assert got is not None and got.shape == (m, n)
    torch.testing.assert_close(got, linear_ref(x, w), atol=1e-4 * k ** 0.5, rtol=1e-5)


def test_strided_x_and_bias_through_dispatch():
    x = torch.randn(4, 2 * 64)[:, ::2]          # [4, 64], non-contiguous rows
    w, b = torch.randn(9, 64), torch.randn(9)
    torch.testing.assert_close(linear(x, w, b), linear_ref(x, w, b), atol=1e-4, rtol=1e-5)


def test_declines_what_it_does_not_cover():
    w = torch.randn(8, 32)
    assert linear_small_m_cpu(torch.randn(SMALL_M_MAX + 1, 32), w) is None       # large M: F.linear
    assert linear_small_m_cpu(torch.randn(2, 32).bfloat16(), w.bfloat16()) is None
    assert linear_small_m_cpu(torch.randn(2, 32), torch.randn(32, 8).t()) is None  # strided weight
