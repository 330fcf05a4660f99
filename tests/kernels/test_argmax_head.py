"""kernels/argmax_head.py: the float32 lm_head for greedy rows, screened with a bf16 GEMM, against the float32
logits, in every kernel build this CPU runs: with vdpbf16ps the head screens any number of rows, in the other builds
up to PAIR_MAX_M rows a call (more are computed in float32)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lightserve.kernels.argmax_head import MAX_CANDIDATES, argmax_logits, argmax_logits_ref, make_argmax_head
from lightserve.kernels.cpu import kernel_times, library, variant_library
from lightserve.kernels.linear import PAIR_MAX_M, linear_cpu, pack_linear_weight
from tests.kernels.kernel_cases import c_library_variants

pytestmark = pytest.mark.skipif(library() is None, reason="no C kernels: float32 models keep the float32 lm_head")

VOCAB, HIDDEN, ROWS = 4099, 576, 64  # a vocabulary that is no multiple of any panel or vector width


def _near_ties(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [V, K], x [ROWS, K] where row b's two best logits (about 190), at tokens 2b and 2b + 1, differ by 0.01
    (the larger one alternating): far below a bf16 product's error at these magnitudes (x's norm near SmolLM2's final
    hidden states, about 50), far above float32's rounding (about 1e-4 here)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(VOCAB, HIDDEN, generator=g) * 0.1
    x = torch.randn(ROWS, HIDDEN, generator=g) * 2
    for b in range(ROWS):
        top = x[b] / x[b].norm() * 4 + torch.randn(HIDDEN, generator=g) * 0.05
        # The second: the first plus noise orthogonal to x_b (so that the two round to bf16 differently) and the
        # gap along x_b.
        unit = x[b] / x[b].norm()
        noise = torch.randn(HIDDEN, generator=g) * 3e-3
        w[2 * b] = top
        w[2 * b + 1] = top + noise - (noise @ unit) * unit + (0.01 if b % 2 else -0.01) * unit / x[b].norm()
    return w, x


def _head(w: torch.Tensor, lib):
    head = make_argmax_head(w, pack_linear_weight(w, lib), lib)
    assert head is not None
    assert head.any_rows == bool(lib.linear_bf16_pairs_dpbf16())
    return head


def _screened(x: torch.Tensor, head, lib) -> torch.Tensor:
    """argmax_logits over x in calls of as many rows as the head screens at once."""
    step = ROWS if head.any_rows else PAIR_MAX_M
    with kernel_times() as times:
        out = torch.cat([argmax_logits(x[i: i + step], head, lib) for i in range(0, x.shape[0], step)])
    assert "argmax_head_cpu" in times
    return out


@pytest.mark.parametrize("variant", c_library_variants())
def test_the_argmax_is_the_float32_logits_where_bf16_alone_gets_it_wrong(variant):
    lib = variant_library(variant)
    w, x = _near_ties()
    head = _head(w, lib)
    want = linear_cpu(x, head.exact, lib=lib)                                  # what the model computes otherwise
    got = _screened(x, head, lib)
    assert torch.equal(got.argmax(dim=1), want.argmax(dim=1))
    assert torch.equal(got.argmax(dim=1), argmax_logits_ref(x, head).argmax(dim=1))
    rows = torch.arange(ROWS)
    torch.testing.assert_close(got[rows, got.argmax(dim=1)], want.max(dim=1).values, rtol=1e-5, atol=1e-5)
    plain = (x.bfloat16().float() @ w.bfloat16().float().T).argmax(dim=1)
    assert (plain != want.argmax(dim=1)).sum() >= 5  # the near-ties do fool a bf16 GEMM alone
    assert not torch.equal(got, want)  # the other entries did come from the bf16 GEMM


@pytest.mark.parametrize("variant", c_library_variants())
def test_rows_the_bf16_gemm_does_not_take_are_the_float32_logits(variant):
    """Without vdpbf16ps the pair GEMM takes up to PAIR_MAX_M rows: a call with more gets the float32 GEMM's
    logits, bit for bit, and no screening; with vdpbf16ps every row count is screened."""
    lib = variant_library(variant)
    w, x = _near_ties(seed=3)
    head = _head(w, lib)
    rows = PAIR_MAX_M + 1
    assert head.takes(PAIR_MAX_M) and head.takes(rows) == head.any_rows
    with kernel_times() as times:
        got = argmax_logits(x[:rows], head, lib)
    want = linear_cpu(x[:rows], head.exact, lib=lib)
    assert torch.equal(got.argmax(dim=1), want.argmax(dim=1))
    assert ("argmax_head_cpu" in times) == head.any_rows
    assert torch.equal(got, want) != head.any_rows


@pytest.mark.parametrize("variant", c_library_variants())
def test_every_bf16_entry_lies_within_the_bound(variant):
    """The screening's premise: |a - l| <= C |x_b| |w_v| for the pair GEMM's float32 sums a (vdpbf16ps, or the
    widened pairs' FMAs at up to PAIR_MAX_M rows)."""
    lib = variant_library(variant)
    w, x = _near_ties(seed=1)
    x[:3] *= 40  # large activations too
    head = _head(w, lib)
    rows = ROWS if head.any_rows else PAIR_MAX_M
    x = x[:rows]
    approx = torch.empty(rows, VOCAB)
    xb = x.bfloat16()
    assert lib.linear_bf16_pairs_f32(xb.data_ptr(), HIDDEN, rows, HIDDEN, head.pairs.data_ptr(), VOCAB, None,
                                     approx.data_ptr(), VOCAB, 2) == 0
    exact = x.double() @ w.double().T
    bound = head.bound * x.double().norm(dim=1)[:, None] * head.norms.double()[None, :]
    err = (approx.double() - exact).abs()
    assert bool((err <= bound).all())
    assert float((err / bound).max()) > 0.01  # and is not vacuous by orders of magnitude


@pytest.mark.parametrize("variant", c_library_variants())
def test_a_row_with_too_many_candidates_is_computed_in_float32_whole(variant):
    lib = variant_library(variant)
    w, x = _near_ties(seed=2)
    w[1000: 1000 + MAX_CANDIDATES + 10] = w[0]  # row 0's best token, many times over: all tie
    head = _head(w, lib)
    got = _screened(x, head, lib)
    want = linear_cpu(x, head.exact, lib=lib)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got.argmax(dim=1), want.argmax(dim=1))


def _near_max_ref(a: np.ndarray, x: np.ndarray, w: np.ndarray, norm: np.ndarray, c: float) -> list[list[int]]:
    e = c * np.linalg.norm(x.astype(np.float64), axis=1)[:, None] * norm[None, :] + 1e-30
    lo = np.where(np.isnan(a), -np.inf, a - e).max(axis=1)
    return [np.flatnonzero(a[b] + e[b] >= lo[b]).tolist() for b in range(a.shape[0])]


@pytest.mark.parametrize("variant", c_library_variants())
@pytest.mark.parametrize("vocab, cap", [(1, 64), (33, 64), (4099, 64), (4099, 3)])
def test_exact_near_max_computes_the_entries_whose_upper_bound_reaches_the_best_lower_bound(vocab, cap, variant):
    """The kernel against a float64 reference: the candidates (and only they, the first `cap` of a row) hold their
    exact dot afterwards, every other entry its approximation, and count says how many there were."""
    rng = np.random.default_rng(vocab + cap)
    rows, k, c = 7, 70, 0.1
    a = rng.standard_normal((rows, vocab)).astype(np.float32) * 3   # stands in for the bf16 GEMM's output
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[0] = 0.0                                                        # a zero bound: the maximum alone
    w = rng.standard_normal((vocab, k)).astype(np.float32)
    norm = np.abs(rng.standard_normal(vocab)).astype(np.float32) + 0.5
    a[1, ::5] = np.nan
    out = a.copy()
    count = np.empty(rows, np.int32)
    variant_library(variant).exact_near_max(out.ctypes.data, vocab, rows, vocab, x.ctypes.data, k, k, w.ctypes.data,
                             norm.ctypes.data, c, cap, count.ctypes.data, 2)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    for b, want in enumerate(_near_max_ref(a, x, w, norm, c)):
        assert count[b] == len(want), b
        done = want[:cap]
        np.testing.assert_allclose(out[b, done], exact[b, done], rtol=1e-5, atol=1e-5)
        rest = np.setdiff1d(np.arange(vocab), done)
        np.testing.assert_array_equal(out[b, rest], a[b, rest])
    assert count[0] == 1
    assert count.max() > cap or cap == 64  # the small cap is exceeded somewhere
