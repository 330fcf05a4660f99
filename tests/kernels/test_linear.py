"""linear: the CPU C kernel on packed weights (every build the CPU runs) against F.linear, over the
row counts its tiles split into (6-row tiles, row blocks of a large x), output features that leave the last
panel partial, bias and strided input rows; what it declines falls back to F.linear. Then the bf16 pair kernel
that runs bf16 models' linears at M <= PAIR_MAX_M, and its dispatch beside oneDNN."""
import pytest
import torch
import torch.nn.functional as F

from lightserve.kernels.cpu import cpu_flags, library, variant_library
from lightserve.kernels.linear import (
    PAIR_MAX_M,
    PAIR_PANEL,
    linear,
    linear_bf16_small,
    linear_cpu,
    linear_ref,
    onednn_available,
    pack_bf16_pairs,
    pack_linear_weight,
    prepack_onednn_weight,
    unpack_bf16_pairs,
    unpack_linear_weight,
)
from tests.kernels.kernel_cases import c_library_variants, portable_library

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: the CPU path is F.linear")

ROWS = [1, 2, 5, 6, 7, 47, 48, 49, 100]  # partial and whole 6-row tiles
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _case(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)


@pytest.mark.parametrize("variant", c_library_variants())
def test_packing_round_trips(variant):
    """Each build packs for its own panel width (two of its vectors: 32 features with AVX-512, 16 without)."""
    lib = variant_library(variant)
    _, w, _ = _case(1, 37, 24)
    packed = pack_linear_weight(w, lib=lib)
    p = lib.linear_panel_width()
    assert p in (16, 32) and packed.panels.shape == (-(-37 // p), 24, p)
    assert torch.equal(unpack_linear_weight(packed), w)
    assert torch.count_nonzero(packed.panels[-1, :, 37 % p:]) == 0


@pytest.mark.parametrize("variant", c_library_variants())
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n", [13, 64, 100])  # 13, 100: a partial last panel
def test_c_linear_matches_f_linear(m, n, variant):
    """Every build this CPU runs (AVX-512, AVX2, plain C)."""
    lib = variant_library(variant)
    x, w, b = _case(m, n, 72, seed=m * 1000 + n)
    packed = pack_linear_weight(w, lib=lib)
    torch.testing.assert_close(linear_cpu(x, packed, b, lib=lib), F.linear(x, w, b), **TOL)
    if variant == "native":
        torch.testing.assert_close(linear(x, packed), F.linear(x, w), **TOL)


def test_row_blocks_of_a_large_x():
    """x over the kernel's 4 MiB block (K 65536: 16 rows a block) is cut into equal row blocks, each
    a multiple of 6 rows, the last one partial: 100 rows -> 5 blocks of 18 and one of 10."""
    x, w, b = _case(100, 20, 65536)
    torch.testing.assert_close(linear_cpu(x, pack_linear_weight(w), b), F.linear(x, w, b), rtol=1e-4, atol=1e-3)


def test_strided_rows_and_model_shapes():
    """Rows of a wider tensor (the model passes views); SmolLM2's down_proj shape (K 1536)."""
    x, w, _ = _case(9, 576, 1536)
    wide = torch.randn(9, 1600)
    wide[:, :1536] = x
    view = wide[:, :1536]
    assert view.stride(0) == 1600
    torch.testing.assert_close(linear_cpu(view, pack_linear_weight(w)), linear_ref(x, w), rtol=1e-5, atol=1e-4)


def test_declines_what_it_does_not_take_and_dispatch_falls_back():
    x, w, b = _case(4, 16, 24)
    packed = pack_linear_weight(w)
    assert linear_cpu(x.double(), packed) is None  # float64
    assert linear_cpu(x[:, :20], packed) is None  # K differs from the weight's
    assert linear_cpu(torch.empty(0, 24), packed) is None
    narrow = pack_linear_weight(w, lib=portable_library())
    if narrow.panel != packed.panel:  # packed for another build's panel width
        assert linear_cpu(x, narrow) is None
    torch.testing.assert_close(linear(x.double(), packed, b.double()), F.linear(x.double(), w.double(), b.double()))
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b))  # a plain weight: F.linear


# bf16 weights at small M: linear.c's pair kernel (vdpbf16ps in an AVX512-BF16 native build, shift/mask and
# FMAs in every other build) against F.linear in float32 rounded to bf16. Sums in another order may move the
# rounded result by one bf16 ulp (2^-8 relative).
BF16_TOL = {"rtol": 8e-3, "atol": 1e-3}
needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN prepacking")


def _bf16_case(m, n, k, seed=0):
    x, w, b = _case(m, n, k, seed)
    return x.to(torch.bfloat16), w.to(torch.bfloat16), b.to(torch.bfloat16)


def _bf16_ref(x, w, b=None):
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(torch.bfloat16).float()


@pytest.mark.parametrize("n,k", [(37, 24), (64, 72), (100, 2)])  # 37, 100: a partial last panel; K = 2: one pair
def test_bf16_pairs_round_trip(n, k):
    _, w, _ = _bf16_case(1, n, k)
    pairs = pack_bf16_pairs(w)
    assert pairs.dtype == torch.int32 and pairs.shape == (-(-n // PAIR_PANEL), k // 2, PAIR_PANEL)
    assert torch.equal(unpack_bf16_pairs(pairs, n), w)
    # Element [p, j, f] is the pair (w[16p + f, 2j], w[16p + f, 2j + 1]), the low half first.
    bits = int(pairs[1, 0, 3]) & 0xFFFFFFFF
    assert bits & 0xFFFF == int(w[19, 0].view(torch.int16)) & 0xFFFF
    assert bits >> 16 == int(w[19, 1].view(torch.int16)) & 0xFFFF


@needs_onednn
@pytest.mark.parametrize("variant", c_library_variants())
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [13, 64, 100])
def test_bf16_small_m_matches_f_linear(m, n, variant):
    """Every build this CPU runs; the native one on an AVX512-BF16 CPU is the vdpbf16ps path."""
    lib = variant_library(variant)
    # The native build of an AVX512-BF16 CPU multiplies with vdpbf16ps; narrower builds split the pairs.
    assert lib.linear_bf16_pairs_dpbf16() == int(variant == "native" and "avx512_bf16" in cpu_flags())
    x, w, b = _bf16_case(m, n, 72, seed=m * 100 + n)
    weight = prepack_onednn_weight(w)
    assert weight.pairs is not None
    for bias in (None, b):
        torch.testing.assert_close(linear_bf16_small(x, weight, bias, lib=lib).float(), _bf16_ref(x, w, bias),
                                   **BF16_TOL)


@needs_onednn
def test_bf16_small_m_dispatch_strided_rows_and_lm_head_shape():
    """linear() takes the pair kernel up to PAIR_MAX_M rows and oneDNN above; rows of a wider tensor (the model
    passes views of qkv); a vocabulary-sized N over many panels."""
    x, w, b = _bf16_case(PAIR_MAX_M + 1, 1000, 576)
    weight = prepack_onednn_weight(w)
    small = x[:PAIR_MAX_M]
    assert torch.equal(linear(small, weight, b), linear_bf16_small(small, weight, b))
    torch.testing.assert_close(linear(x, weight, b).float(), _bf16_ref(x, w, b), rtol=2e-2, atol=2e-2)  # oneDNN
    wide = torch.zeros(2, 700, dtype=torch.bfloat16)
    wide[:, :576] = x[:2]
    torch.testing.assert_close(linear_bf16_small(wide[:, :576], weight).float(), _bf16_ref(x[:2], w), **BF16_TOL)


@needs_onednn
def test_bf16_pairs_decline_what_they_do_not_take():
    x, w, _ = _bf16_case(PAIR_MAX_M + 1, 16, 24)
    weight = prepack_onednn_weight(w)
    assert linear_bf16_small(x, weight) is None  # M over PAIR_MAX_M
    assert linear_bf16_small(x[:1].float(), weight) is None  # float32 activations
    assert linear_bf16_small(x[:1, :20], weight) is None  # K differs from the weight's
    assert prepack_onednn_weight(w[:, :23].contiguous()).pairs is None  # odd K: no pair layout
    assert prepack_onednn_weight(w.float()).pairs is None  # float32 weights keep oneDNN alone
