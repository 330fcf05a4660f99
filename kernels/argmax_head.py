"""The float32 lm_head for rows of which only the argmax is read (greedy sampling that reports no logprob): logits
exact near each row's maximum and approximate elsewhere, from a bf16 GEMM at about half the float32 GEMM's time.

Reference: `argmax_logits_ref`, the float32 logits x . W^T. Fast (`argmax_logits`; CPU, a kernel build with
vdpbf16ps):
1. a = bf16(x) . bf16(W)^T, the products exact and summed in float32 (linear.c's pair GEMM with float32 output).
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
M = 1, 23.2 against 14.0 at M = 64 (of which the bf16 GEMM about 10.5), 111 against 74 at M = 256.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from lightserve.kernels.linear import PackedLinear, linear_cpu, pack_bf16_pairs, pairs_fit

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


def make_argmax_head(weight: Tensor, exact: PackedLinear) -> ArgmaxHead | None:
    """The head for weight [V, K] float32 on CPU (its packed float32 copy `exact`), or None where the kernel build
    has no vdpbf16ps (there the bf16 GEMM is no faster than the float32 one) or where the bf16 copy would leave less
    than half the machine's memory available."""
    from lightserve.kernels.cpu import library

    lib = library()
    if lib is None or not lib.linear_bf16_pairs_dpbf16() or weight.device.type != "cpu" \
            or weight.dtype != torch.float32 or weight.shape[1] % 2 or not pairs_fit(weight.numel() * 2):
        return None
    norms = (weight.double().norm(dim=1) * (1 + 2.0 ** -20)).float()
    return ArgmaxHead(weight, pack_bf16_pairs(weight.bfloat16()), norms, exact, _bound_constant(weight.shape[1]))


def argmax_logits_ref(x: Tensor, head: ArgmaxHead) -> Tensor:
    """x [S, K] float32 -> the float32 logits [S, V]."""
    return F.linear(x, head.weight)


def argmax_logits(x: Tensor, head: ArgmaxHead) -> Tensor:
    """x [S, K] float32 -> logits [S, V] float32 whose row argmax is argmax_logits_ref's (see the module)."""
    from lightserve.kernels.cpu import library, profiled

    lib = library()
    s, k = x.shape
    v = head.exact.out_features
    x = x.contiguous()
    xb = x.to(torch.bfloat16)
    out = torch.empty(s, v, dtype=torch.float32)  # [S, V]
    count = np.empty(s, np.int32)
    with profiled("argmax_head_cpu"):
        threads = torch.get_num_threads()
        rc = lib.linear_bf16_pairs_f32(xb.data_ptr(), k, s, k, head.pairs.data_ptr(), v, None, out.data_ptr(), v,
                                       threads)
        assert rc == 0, rc  # it declines only an odd K or row stride, which make_argmax_head does not build for
        lib.exact_near_max(out.data_ptr(), v, s, v, x.data_ptr(), k, k, head.weight.data_ptr(), head.norms.data_ptr(),
                           head.bound, MAX_CANDIDATES, count.ctypes.data, threads)
        over = np.flatnonzero(count > MAX_CANDIDATES)
        if over.size:
            rows = torch.from_numpy(over)
            out[rows] = _exact(x[rows], head)
    return out


def _exact(x: Tensor, head: ArgmaxHead) -> Tensor:
    out = linear_cpu(x, head.exact)
    return F.linear(x, head.weight) if out is None else out
