"""linear: the CPU C kernel on packed weights (every build the CPU runs) against F.linear, over the
row counts its tiles split into (6-row tiles, row blocks of a large x), output features that leave the last
panel partial, bias and strided input rows; what it declines falls back to F.linear. Then the bf16 pair kernel
that runs bf16 models' linears at M <= PAIR_MAX_M in every build, its vdpbf16ps GEMM above that (AVX512-BF16
builds), and the dispatch between them and oneDNN. Also the float32 gate_up GEMM with SiLU-and-mul as its epilogue
against the two kernels."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from lightserve.kernels.activation import silu_and_mul_cpu
from lightserve.kernels.cpu import cpu_flags, library, variant_library
from lightserve.kernels.linear import (
    PAIR_MAX_M,
    PAIR_PANEL,
    linear,
    linear_bf16_pairs,
    linear_cpu,
    linear_ref,
    linear_silu_cpu,
    onednn_available,
    onednn_bf16_dot,
    onednn_runs_bf16,
    pack_bf16_pairs,
    pack_linear_weight,
    pairs_take_every_m,
    prepack_weight,
    unpack_bf16_pairs,
    unpack_linear_weight,
)
from tests.kernels.kernel_cases import c_library_variants, portable_library

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: the CPU path is F.linear")

ROWS = [1, 2, 5, 6, 7, 16, 47, 48, 49, 64, 100]  # partial and whole tiles of 6 rows and (AVX-512) of 8
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
    """Every build this CPU runs (AVX-512 with and without AVX512-BF16, AVX2, plain C)."""
    lib = variant_library(variant)
    x, w, b = _case(m, n, 72, seed=m * 1000 + n)
    packed = pack_linear_weight(w, lib=lib)
    torch.testing.assert_close(linear_cpu(x, packed, b, lib=lib), F.linear(x, w, b), **TOL)
    if variant == "native":
        torch.testing.assert_close(linear(x, packed), F.linear(x, w), **TOL)


@pytest.mark.parametrize("variant", c_library_variants())
@pytest.mark.parametrize("m", [1, 5, 8, 47, 64, 100, 1900])  # 1900 rows of K 576: two row blocks
@pytest.mark.parametrize("inter", [64, 96])
def test_gate_up_with_silu_epilogue_is_the_linear_then_silu_and_mul_bit_for_bit(m, inter, variant):
    """linear_packed_silu, float32 (what the decoder-layer driver runs for gate_up): the same bits as linear_cpu of
    the [2I, K] weight and then silu_and_mul, in every build this CPU runs, through partial tiles and row blocks,
    from strided rows."""
    lib = variant_library(variant)
    x, w, _ = _case(m, 2 * inter, 576, seed=m + inter)
    wide = torch.randn(m, 600)
    wide[:, :576] = x
    packed = pack_linear_weight(w, lib=lib)
    want = silu_and_mul_cpu(linear_cpu(x, packed, lib=lib), lib=lib)
    got = linear_silu_cpu(wide[:, :576], packed, lib=lib)
    assert got is not None and got.shape == (m, inter)
    assert torch.equal(got, want)


def test_gate_up_with_silu_epilogue_declines_what_it_does_not_take():
    """An I that is not a multiple of the panel width (a panel would hold gate and up features), and bf16: the
    caller then runs the linear and silu_and_mul."""
    x, w, _ = _case(8, 2 * 40, 64)
    assert linear_silu_cpu(x, pack_linear_weight(w)) is None
    assert linear_silu_cpu(x.bfloat16(), pack_linear_weight(w)) is None


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


@pytest.mark.parametrize("variant", c_library_variants())
# 7 and 70 threads on a machine of a few cores: the OS runs some threads late, and the others take panels from the
# back of their shares (share.h); 70 is more threads than there are shares (MAX_SHARES), so some own none.
@pytest.mark.parametrize("threads", [1, 2, 3, 7, 70])
# 1, 4 and 32 panels of 32 features (AVX-512): fewer panels than threads, an odd split, many panels a thread.
@pytest.mark.parametrize("n", [20, 100, 1000])
def test_every_panel_once_whatever_the_thread_count(n, threads, variant):
    """The panels are shared among the threads asked for: each output column is written once and exactly (the
    output starts as NaN, so a panel left out shows), the gate_up GEMM's SiLU epilogue too."""
    lib = variant_library(variant)
    x, w, b = _case(50, n, 64, seed=n + threads)
    packed = pack_linear_weight(w, lib=lib)
    out = torch.full((50, n), float("nan"))
    assert lib.linear_packed(x.data_ptr(), 64, 50, 64, packed.panels.data_ptr(), n, b.data_ptr(), out.data_ptr(), n,
                             threads) == 0
    torch.testing.assert_close(out, F.linear(x, w, b), **TOL)
    # The SiLU epilogue shares out gate panels: 1, 3 (AVX2: 6) and 31 (62) of them. Every panel's bits are the same
    # whichever thread computes it, so the output equals the two kernels' at torch's thread count bit for bit.
    inter = lib.linear_panel_width() * max(1, n // lib.linear_panel_width())
    gate_up = pack_linear_weight(torch.randn(2 * inter, 64, generator=torch.Generator().manual_seed(n)), lib=lib)
    act = torch.full((50, inter), float("nan"))
    assert lib.linear_packed_silu(x.data_ptr(), 64, 50, 64, gate_up.panels.data_ptr(), inter, act.data_ptr(),
                                  threads) == 0
    assert torch.equal(act, silu_and_mul_cpu(linear_cpu(x, gate_up, lib=lib), lib=lib))


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


# bf16 weights: linear.c's pair kernels (vdpbf16ps in an AVX512-BF16 native build, shift/mask and FMAs in every
# other build at small M) against F.linear in float32 rounded to bf16. Sums in another order may move the rounded
# result by one bf16 ulp (2^-8 relative).
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
    # Panels come in pairs (the GEMM's tile is two panels wide); the padding is zero.
    assert pairs.dtype == torch.int32 and pairs.shape == (-(-n // (2 * PAIR_PANEL)) * 2, k // 2, PAIR_PANEL)
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
    weight = prepack_weight(w)
    assert weight.pairs is not None
    for bias in (None, b):
        torch.testing.assert_close(linear_bf16_pairs(x, weight, bias, lib=lib).float(), _bf16_ref(x, w, bias),
                                   **BF16_TOL)


def _bf16_gemm(x, weight, bias=None):
    """linear_bf16_pairs over PAIR_MAX_M rows where the build has vdpbf16ps; elsewhere it declines (asserted), and
    linear() runs those rows on the CPU's other copy (oneDNN's, or float32 panels)."""
    out = linear_bf16_pairs(x, weight, bias)
    if library().linear_bf16_pairs_dpbf16():
        return out
    assert out is None
    return linear(x, weight, bias)


@needs_onednn
@pytest.mark.parametrize("m", [5, 11, 12, 13, 24, 47, 100])  # partial and whole 12-row tiles
@pytest.mark.parametrize("n,k", [(13, 72), (32, 2), (48, 24), (100, 576), (1000, 64)])  # a partial panel pair
def test_bf16_gemm_matches_f_linear(m, n, k):
    x, w, b = _bf16_case(m, n, k, seed=m * 1000 + n)
    weight = prepack_weight(w)
    for bias in (None, b):
        torch.testing.assert_close(_bf16_gemm(x, weight, bias).float(), _bf16_ref(x, w, bias), **BF16_TOL)


@needs_onednn
def test_bf16_gemm_row_blocks_and_strided_rows():
    """An x over the GEMM's 2 MB block (K = 1536: 682 rows a block) is cut into blocks; rows of a wider tensor with
    an even row stride run in place, an odd stride is declined (linear() then multiplies the unpacked weight)."""
    x, w, b = _bf16_case(700, 40, 1536)
    weight = prepack_weight(w)
    torch.testing.assert_close(_bf16_gemm(x, weight, b).float(), _bf16_ref(x, w, b), **BF16_TOL)
    wide = torch.zeros(30, 1538, dtype=torch.bfloat16)
    wide[:, :1536] = x[:30]
    torch.testing.assert_close(_bf16_gemm(wide[:, :1536], weight).float(), _bf16_ref(x[:30], w), **BF16_TOL)
    odd = torch.zeros(30, 1537, dtype=torch.bfloat16)
    odd[:, :1536] = x[:30]
    assert linear_bf16_pairs(odd[:, :1536], weight) is None
    torch.testing.assert_close(linear(odd[:, :1536], weight).float(), _bf16_ref(x[:30], w), **BF16_TOL)


@pytest.mark.skipif(library() is None or not library().linear_bf16_pairs_amx(), reason="no AMX tiles here")
@pytest.mark.parametrize("m", [5, 16, 17, 31, 32, 33, 100])  # whole and partial 16-row tiles and 32-row blocks
@pytest.mark.parametrize("n,k", [(1000, 576), (40, 1536), (96, 32)])  # a partial panel pair; one tile step of K
def test_bf16_amx_tiles_match_f_linear(m, n, k):
    """On an AMX CPU the pairs run every M over PAIR_MAX_M on the tile unit, and a bf16 weight keeps no other copy.
    Both entry points: bf16 output, and float32 sums left unrounded (the argmax head's); columns past N and rows
    past M are never written, and x rows past M (the last tile's) are never read into the output."""
    lib = library()
    x, w, b = _bf16_case(m + 16, n, k, seed=m * 7 + n)
    x[m:] = float("nan")  # rows a 16-row tile would cover past M: a read of them would poison a column
    weight = prepack_weight(w)
    assert weight.onednn is None and weight.widened is None and pairs_take_every_m(lib, k)
    ref = F.linear(x[:m].float(), w.float(), b.float())
    out = torch.full((m + 1, n + 8), 7.0, dtype=torch.bfloat16)
    outf = torch.full((m + 1, n + 8), 7.0)
    threads = torch.get_num_threads()
    assert lib.linear_bf16_pairs(x.data_ptr(), k, m, k, weight.pairs.data_ptr(), n, b.data_ptr(), out.data_ptr(),
                                 n + 8, threads) == 0
    assert lib.linear_bf16_pairs_f32(x.data_ptr(), k, m, k, weight.pairs.data_ptr(), n, b.data_ptr(),
                                     outf.data_ptr(), n + 8, threads) == 0
    torch.testing.assert_close(out[:m, :n].float(), ref.to(torch.bfloat16).float(), **BF16_TOL)
    torch.testing.assert_close(outf[:m, :n], ref, rtol=1e-5, atol=1e-4)
    assert (out[:m, n:] == 7).all() and (out[m] == 7).all() and (outf[:m, n:] == 7).all() and (outf[m] == 7).all()
    assert torch.equal(out[:m, :n], outf[:m, :n].to(torch.bfloat16))  # one rounding of the same sums


@pytest.mark.skipif(library() is None or not library().linear_bf16_pairs_amx(), reason="no AMX tiles here")
def test_bf16_amx_leaves_k_off_its_step_to_onednn():
    """A K that is not a multiple of AMX_K keeps oneDNN's copy for M over PAIR_MAX_M, as before the tiles."""
    x, w, b = _bf16_case(20, 64, 48)
    weight = prepack_weight(w)
    assert not pairs_take_every_m(library(), 48) and weight.onednn is not None and weight.pairs is not None
    torch.testing.assert_close(linear(x, weight, b).float(), _bf16_ref(x, w, b), **BF16_TOL)


@needs_onednn
@pytest.mark.parametrize("variant", c_library_variants())
def test_bf16_gemm_only_in_dpbf16_builds(variant):
    """Above PAIR_MAX_M rows the builds without vdpbf16ps decline (oneDNN runs those M); the vdpbf16ps one takes
    them."""
    lib = variant_library(variant)
    x, w, _ = _bf16_case(PAIR_MAX_M + 1, 40, 64)
    out = linear_bf16_pairs(x, prepack_weight(w), lib=lib)
    assert (out is not None) == bool(lib.linear_bf16_pairs_dpbf16())


@needs_onednn
def test_bf16_dispatch(monkeypatch):
    """Where the C GEMM takes every M (a build with AMX tiles, or with vdpbf16ps on a CPU without AMX) a bf16
    weight keeps only the pair layout and linear() runs it at every M; elsewhere, or with
    LIGHTSERVE_ONEDNN_BF16_GEMM=1, oneDNN's copy is made too and runs M over PAIR_MAX_M (float32 panels instead where
    oneDNN has no bf16 path: AVX2-only CPUs)."""
    x, w, b = _bf16_case(PAIR_MAX_M + 20, 1000, 576)
    lib = library()
    every_m = pairs_take_every_m(lib, 576)
    assert every_m == (bool(lib.linear_bf16_pairs_amx())
                       or (bool(lib.linear_bf16_pairs_dpbf16()) and "amx_bf16" not in cpu_flags().split()))
    weight = prepack_weight(w)
    assert weight.pairs is not None
    if every_m:
        assert weight.onednn is None and weight.widened is None
    else:
        assert (weight.onednn is not None, weight.widened is not None) == _large_m_copies()
    small = x[:PAIR_MAX_M]
    assert torch.equal(linear(small, weight, b), linear_bf16_pairs(small, weight, b))
    if every_m:
        assert torch.equal(linear(x, weight, b), linear_bf16_pairs(x, weight, b))
    torch.testing.assert_close(linear(x, weight, b).float(), _bf16_ref(x, w, b), rtol=2e-2, atol=2e-2)
    monkeypatch.setenv("LIGHTSERVE_ONEDNN_BF16_GEMM", "1")
    assert not pairs_take_every_m(library(), 576)
    both = prepack_weight(w)
    assert both.pairs is not None and (both.onednn is not None, both.widened is not None) == _large_m_copies()
    torch.testing.assert_close(linear(x, both, b).float(), _bf16_ref(x, w, b), rtol=2e-2, atol=2e-2)  # oneDNN


def _large_m_copies() -> tuple[bool, bool]:
    """(a oneDNN copy, float32 panels): what a bf16 weight carries for M over PAIR_MAX_M where the pairs do not run
    every M."""
    return (True, False) if onednn_runs_bf16() else (False, True)


def test_bf16_where_onednn_has_no_bf16_path(monkeypatch):
    """On a CPU where oneDNN does not multiply bf16 natively (AVX2 only, where its weight reorder raises; AVX-512
    without AVX512-BF16) a bf16 weight gets float32 panels beside its pairs: M over PAIR_MAX_M runs the float32 GEMM
    on widened rows and rounds the output, M up to PAIR_MAX_M the pairs. Forced with LIGHTSERVE_ONEDNN_BF16_GEMM (so
    a vdpbf16ps build splits the M range too)."""
    if library() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setattr(sys.modules["lightserve.kernels.linear"], "onednn_bf16_available", lambda: False)
    monkeypatch.setenv("LIGHTSERVE_ONEDNN_BF16_GEMM", "1")
    x, w, b = _bf16_case(PAIR_MAX_M + 20, 1000, 576)
    weight = prepack_weight(w)
    assert weight.onednn is None and weight.pairs is not None and weight.widened is not None
    want = linear_cpu(x.float(), pack_linear_weight(w.float()), b.float()).to(torch.bfloat16)
    assert torch.equal(linear(x, weight, b), want)
    small = x[:PAIR_MAX_M]
    assert torch.equal(linear(small, weight, b), linear_bf16_pairs(small, weight, b))
    torch.testing.assert_close(linear(x, weight, b).float(), _bf16_ref(x, w, b), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("flags, held, gemm_env, dot, runs", [
    ("avx2 fma", "", "", False, False),                               # AVX2 EPYC
    ("avx2 avx512f avx512bw", "", "", False, False),                  # Skylake-SP to Ice Lake
    ("avx2 avx512f avx512bw", "", "1", False, True),                  # ... oneDNN asked for
    ("avx2 avx512f avx512_bf16", "", "", True, True),                 # Zen 4 / 5, Cooper Lake
    ("avx2 avx512f amx_bf16 amx_tile", "", "", True, True),           # Sapphire Rapids and later
    ("avx2 avx512f avx512_bf16", "AVX512_CORE_VNNI", "", False, False),   # oneDNN held below its bf16
    ("avx2 avx512f avx512_bf16", "avx512_core_bf16", "", True, True),
    ("avx2 avx512f amx_bf16", "AVX2", "", False, False),
])
def test_onednn_runs_bf16_where_the_cpu_multiplies_bf16(monkeypatch, flags, held, gemm_env, dot, runs):
    """oneDNN runs bf16 linears over PAIR_MAX_M only with AVX512-BF16 or AMX-BF16 to run them on (and not held below
    them), or where LIGHTSERVE_ONEDNN_BF16_GEMM asks; elsewhere the float32 panels do."""
    monkeypatch.setattr(sys.modules["lightserve.kernels.cpu"], "cpu_flags", lambda: flags)
    monkeypatch.setattr(sys.modules["lightserve.kernels.linear"], "onednn_bf16_available", lambda: True)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", held)
    monkeypatch.setenv("LIGHTSERVE_ONEDNN_BF16_GEMM", gemm_env)
    assert onednn_bf16_dot() is dot
    assert onednn_runs_bf16() is runs


_HELD_ISAS = [  # (ONEDNN_MAX_CPU_ISA, C build, the CPU flag holding to it needs, oneDNN bf16 available there)
    ("AVX2", "avx2", "avx2", False),  # an AVX2-only CPU: no bf16 path, the reorder would raise
    ("AVX512_CORE_VNNI", "avx512", "avx512bw", True),  # Skylake-SP to Ice Lake: a bf16 path, but widening
]


# Only the ISAs this CPU can be held to: an AVX2-only CPU runs the first case and has no AVX-512 to hold to.
@pytest.mark.parametrize("held, build, flag, available",
                         [case for case in _HELD_ISAS if case[2] in cpu_flags().split()])
def test_onednn_bf16_follows_the_isa_it_is_held_to(held, build, flag, available):
    """Held to an older CPU's instructions (ONEDNN_MAX_CPU_ISA and that build of the C kernels, as
    scripts/compare_vllm.sh --isa runs) prepacking a bf16 weight makes the float32 panels, not a oneDNN copy."""
    if library() is None:
        pytest.skip("needs the C kernels")
    code = ("import torch; from lightserve.kernels.linear import onednn_bf16_available, prepack_weight; "
            "w = prepack_weight(torch.ones(64, 32, dtype=torch.bfloat16)); "
            "print(onednn_bf16_available(), w.onednn is None, w.widened is not None)")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": held, "LIGHTSERVE_CPU_BUILD": build}
    env.pop("LIGHTSERVE_ONEDNN_BF16_GEMM", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(available), "True", "True"]


def test_every_panel_once_when_the_team_is_smaller_than_asked():
    """OpenMP may give a region fewer threads than asked (here OMP_THREAD_LIMIT=2 against 7): the shares past the team
    have no owner, and the team computes every one of their panels, last ones included (float32 GEMM, SiLU epilogue,
    bf16 stream and GEMM)."""
    code = """
import torch, torch.nn.functional as F
from lightserve.kernels.cpu import library
from lightserve.kernels.linear import pack_bf16_pairs, pack_linear_weight
lib = library()
x, w = torch.randn(50, 64), torch.randn(1000, 64)
packed, out = pack_linear_weight(w), torch.full((50, 1000), float("nan"))
assert lib.linear_packed(x.data_ptr(), 64, 50, 64, packed.panels.data_ptr(), 1000, None, out.data_ptr(), 1000, 7) == 0
ok = [bool(torch.allclose(out, F.linear(x, w), rtol=1e-4, atol=1e-4))]
inter = 8 * lib.linear_panel_width()
gate_up, act = pack_linear_weight(w[:2 * inter]), torch.full((50, inter), float("nan"))
assert lib.linear_packed_silu(x.data_ptr(), 64, 50, 64, gate_up.panels.data_ptr(), inter, act.data_ptr(), 7) == 0
ok.append(not bool(act.isnan().any()))
pairs = pack_bf16_pairs(w.bfloat16())
for m in (2, 30):
    xb = x[:m].bfloat16()
    ob = torch.full((m, 1000), float("nan"), dtype=torch.bfloat16)
    rc = lib.linear_bf16_pairs(xb.data_ptr(), 64, m, 64, pairs.data_ptr(), 1000, None, ob.data_ptr(), 1000, 7)
    ok.append(rc == -1 or not bool(ob.isnan().any()))
print(*ok)
"""
    if library() is None:
        pytest.skip("needs the C kernels")
    env = {**os.environ, "OMP_THREAD_LIMIT": "2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True"] * 4


@pytest.mark.parametrize("threads", [1, 3, 7, 70])
@pytest.mark.parametrize("m", [2, 30])  # the small-M stream (every build); the GEMM (vdpbf16ps builds)
def test_bf16_every_panel_once_whatever_the_thread_count(m, threads):
    """As test_every_panel_once_whatever_the_thread_count, for the bf16 kernels' panels (M <= PAIR_MAX_M) and panel
    pairs (the GEMM): 160 features are 10 panels, 5 pairs."""
    lib = library()
    x, w, b = _bf16_case(m, 160, 64, seed=m + threads)
    pairs = pack_bf16_pairs(w)
    out = torch.full((m, 160), float("nan"), dtype=torch.bfloat16)
    rc = lib.linear_bf16_pairs(x.data_ptr(), 64, m, 64, pairs.data_ptr(), 160, b.data_ptr(), out.data_ptr(), 160,
                               threads)
    if m > PAIR_MAX_M and not lib.linear_bf16_pairs_dpbf16():
        assert rc == -1  # oneDNN runs this M in a build without vdpbf16ps
        return
    assert rc == 0
    torch.testing.assert_close(out.float(), _bf16_ref(x, w, b), **BF16_TOL)


@needs_onednn
def test_bf16_small_m_strided_rows_and_lm_head_shape():
    """Rows of a wider tensor (the model passes views of qkv); a vocabulary-sized N over many panels."""
    x, w, _ = _bf16_case(2, 1000, 576)
    weight = prepack_weight(w)
    wide = torch.zeros(2, 700, dtype=torch.bfloat16)
    wide[:, :576] = x
    torch.testing.assert_close(linear_bf16_pairs(wide[:, :576], weight).float(), _bf16_ref(x, w), **BF16_TOL)


@needs_onednn
def test_bf16_pairs_decline_what_they_do_not_take():
    x, w, _ = _bf16_case(PAIR_MAX_M + 1, 16, 24)
    weight = prepack_weight(w)
    assert linear_bf16_pairs(x[:0], weight) is None  # no rows
    assert linear_bf16_pairs(x[:1].float(), weight) is None  # float32 activations
    assert linear_bf16_pairs(x[:1, :20], weight) is None  # K differs from the weight's
    assert prepack_weight(w[:, :23].contiguous()).pairs is None  # odd K: no pair layout
    assert prepack_weight(w.float()).pairs is None  # float32 weights keep oneDNN alone
