"""y = x @ w^T (+ bias): every projection of the model (qkv, o, gate_up, down, lm_head).

The reference is F.linear. On CPU in float32, a decode step of a small batch (M <= SMALL_M_MAX
rows) goes to a C kernel (kernels/cpu/linear.c) that streams each weight row once for all rows:
there MKL's sgemm, built for large M, runs 2-5x below memory bandwidth. Larger M stays on
F.linear (compute-bound, where MKL is good), except callers may pass a oneDNN-packed weight for
the lm_head (see LlamaForCausalLM).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

SMALL_M_MAX = 16  # rows of x up to which the C kernel beats MKL (measured on AVX2 and AVX-512 CPUs)


def linear_ref(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K], w [N, K] -> [M, N]."""
    return F.linear(x, w, bias)


def linear_small_m_cpu(x: Tensor, w: Tensor) -> Tensor | None:
    """The C kernel for x [M <= SMALL_M_MAX, K] float32 on CPU; None when it does not apply here."""
    from lightserve.kernels.cpu import library

    if x.dim() != 2 or x.shape[0] > SMALL_M_MAX or x.dtype != torch.float32 or w.dtype != torch.float32 \
            or x.device.type != "cpu" or not w.is_contiguous():
        return None
    lib = library()
    if lib is None:
        return None
    x = x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    with torch.profiler.record_function("linear_small_m_cpu"):  # visible in scripts/profile_step.py
        lib.small_m_linear(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, k, n, torch.get_num_threads())
    return y


def linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K], w [N, K] -> [M, N]."""
    if x.device.type == "cpu" and x.dim() == 2 and 0 < x.shape[0] <= SMALL_M_MAX:
        y = linear_small_m_cpu(x, w)
        if y is not None:
            return y if bias is None else y + bias
    return F.linear(x, w, bias)
