"""The float32 lm_head for rows of which only the argmax is read (greedy sampling that reports no logprob): logits
exact near each row's maximum and approximate elsewhere, from a bf16 GEMM at about half the float32 GEMM's time.

Reference: `argmax_logits_ref`, the float32 logits x . W^T. Fast (`argmax_logits`; CPU):
1. a = bf16(x) . bf16(W)^T, the products exact and summed in float32 (linear.c's pair GEMM with float32 output).
   Where the kernel build has vdpbf16ps that GEMM runs at about twice the float32 FMA rate, for any number of rows.
   Elsewhere (AVX2-only CPUs, AVX-512 without AVX512-BF16) it widens each bf16 pair to float32 and takes up to
   PAIR_MAX_M rows, the decode of one to a few requests, where the lm_head is bound by reading its weights and bf16
   halves the bytes; over PAIR_MAX_M rows `argmax_logits` computes the float32 logits.
2. Every entry is within e(b, v) = C |x_b|_2 |w_v|_2 of the float32 logit (the bound below), so the exact maximum
   of row b is among the v with a[b, v] + e(b, v) >= max over u of (a[b, u] - e(b, u)). SmolLM2-135M over a page
   of text: 5 such entries of 49,152 at the median, 84 at the 99th percentile, 147 at most.
3. Those entries are computed in float32 from the row-major weight and written over a (2 and 3: sampling.c's
   exact_near_max). A row with more than MAX_CANDIDATES of them gets the float32 GEMM instead.
The result's row argmax is the float32 logits' (the exact maximum is a candidate, each candidate now holds its
exact value, and every other entry lies below the lower bound some candidate's exact value reaches). The other
entries, and so the row's logsumexp, are approximate: the worker takes this path only for steps whose sampled rows
all sample greedily, unprocessed, and report no logprob (OutputWriter.argmax_only).

The bound. With u = 2^-8 (bf16's unit roundoff), |bf(x) bf(w) - x w| <= (2u + u^2) |x w|; float32 sums of K terms,
in any order, lie within g = 2K 2^-24 / (1 - 2K 2^-24) of the sum of the terms' magnitudes, for a and for the exact
dot alike; and sum_i |x_i w_i| <= |x|_2 |w|_2 (Cauchy-Schwarz). So C = (2u + u^2)(1 + g) + 2g, raised by a factor
1.001 and 2^-20 for the roundings of the bound itself and of the kernel's comparisons; vdpbf16ps's flushes of
denormals add under 1e-33, which the kernel adds as 1e-30.

SmolLM2-135M's lm_head ([49,152 x 576]) from memory on 2 Zen 4 cores: 4.36 ms in float32 against 2.25 screened at
M = 1, 23.2 against 14.0 at M = 64 (of which the bf16 GEMM about 10.5), 111 against 74 at M = 256. The same CPU's
builds without vdpbf16ps (LIGHTSERVE_CPU_BUILD): AVX2 4.37 against 2.51 ms at M = 1, 4.15 against 2.75 at M = 2, 4.25
against 3.85 at M = 4; AVX-512 4.32 / 2.23, 4.50 / 2.69, 4.38 / 3.65.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from lightserve.kernels.linear import PAIR_MAX_M, PackedLinear, linear_cpu, pack_bf16_pairs, pairs_fit

MAX_CANDIDATES = 512  # per row; past it the row is computed in float32 whole


def _bound_constant(k: int) -> float:
    u = 2.0 ** -8
    g = 2 * k * 2.0 ** -24 / (1 - 2 * k * 2.0 ** -24)
    return 1.001 * ((2 * u + u * u) * (1 + g) + 2 * g) + 2.0 ** -20


@dataclass(frozen=True)
class ArgmaxHead:
    """The lm_head's weight three ways: row-major (the candidates' exact dots), bf16 pairs (the screening GEMM) and
    the float32 GEMM's panels (rows with too many candidates), with each vocabulary row's norm."""

    weight: Tensor   # [V, K] float32, row-major
    pairs: Tensor    # pack_bf16_pairs of bf16(weight)
    norms: Tensor    # [V] float32, |w_v|_2 rounded up
    exact: PackedLinear
    bound: float     # C above, for this K
    any_rows: bool   # the bf16 GEMM takes any number of rows (vdpbf16ps); else up to PAIR_MAX_M

    def takes(self, rows: int) -> bool:
        """Whether argmax_logits screens `rows` rows (else it computes them in float32)."""
        return self.any_rows or rows <= PAIR_MAX_M


def make_argmax_head(weight: Tensor, exact: PackedLinear, lib=None) -> ArgmaxHead | None:
    """The head for weight [V, K] float32 on CPU (its packed float32 copy `exact`, packed for `lib`: the kernel
    library, library() by default), or None where there is no kernel library, K is odd or the bf16 copy would leave
    less than half the machine's memory available."""
    from lightserve.kernels.cpu import library

    lib = lib or library()
    if lib is None or weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.shape[1] % 2 \
            or not pairs_fit(weight.numel() * 2):
        return None
    norms = (weight.double().norm(dim=1) * (1 + 2.0 ** -20)).float()
    return ArgmaxHead(weight, pack_bf16_pairs(weight.bfloat16()), norms, exact, _bound_constant(weight.shape[1]),
                      any_rows=bool(lib.linear_bf16_pairs_dpbf16()))


def argmax_logits_ref(x: Tensor, head: ArgmaxHead) -> Tensor:
    """x [S, K] float32 -> the float32 logits [S, V]."""
    return F.linear(x, head.weight)


def argmax_logits(x: Tensor, head: ArgmaxHead, lib=None) -> Tensor:
    """x [S, K] float32 -> logits [S, V] float32 whose row argmax is argmax_logits_ref's (see the module); `lib`: the
    kernel library the head was made for."""
    from lightserve.kernels.cpu import library, profiled

    lib = lib or library()
    s, k = x.shape
    if not head.takes(s):
        return _exact(x, head, lib)
    v = head.exact.out_features
    x = x.contiguous()
    xb = x.to(torch.bfloat16)
    out = torch.empty(s, v, dtype=torch.float32)  # [S, V]
    count = np.empty(s, np.int32)
    with profiled("argmax_head_cpu"):
        threads = torch.get_num_threads()
        rc = lib.linear_bf16_pairs_f32(xb.data_ptr(), k, s, k, head.pairs.data_ptr(), v, None, out.data_ptr(), v,
                                       threads)
        assert rc == 0, rc  # it declines an odd K (make_argmax_head builds no head then) and rows head.takes not
        lib.exact_near_max(out.data_ptr(), v, s, v, x.data_ptr(), k, k, head.weight.data_ptr(), head.norms.data_ptr(),
                           head.bound, MAX_CANDIDATES, count.ctypes.data, threads)
        over = np.flatnonzero(count > MAX_CANDIDATES)
        if over.size:
            rows = torch.from_numpy(over)
            out[rows] = _exact(x[rows], head, lib)
    return out


def _exact(x: Tensor, head: ArgmaxHead, lib) -> Tensor:
    out = linear_cpu(x, head.exact, lib=lib)
    return F.linear(x, head.weight) if out is None else out
