"""Linear layer y = x . w^T (+ b) of the projections and the lm_head.

On GPU (and for big CPU batches) it is F.linear: cuBLAS, or MKL's sgemm, which is near the CPU's
compute ceiling once M is in the hundreds (prefill). On CPU with few rows (decode: one row per
running request) a C kernel (kernels/cpu/linear.c) streams each weight row once on every thread.
Measured on 2 AVX2 cores, float32, SmolLM2-135M's shapes, weights streamed from DRAM as in the
forward (30 layers' worth), medians of 10:
  gate_up [3072 x 576]  M=1: MKL 1.37 ms, C 0.62 ms   M=16: 2.53 / 1.11 ms   M=64: 3.45 / 2.85 ms
  lm_head [49152 x 576] M=1: MKL 20.1 ms (oneDNN 10.2), C 8.7 ms   M=64: 114 / 48 (oneDNN) / 44 ms
  at M=256..2048 MKL (100-115 GFLOP/s) beats the C kernel (about 85), so the C path stops at
  SKINNY_MAX_M.
There is no Triton version: on GPU the GEMMs belong to cuBLAS.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Largest M the C kernel takes; above it MKL's blocked GEMM wins (see the table above).
SKINNY_MAX_M = 128


def linear_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K] . weight [N, K]^T (+ bias [N]) -> [M, N]."""
    return F.linear(x, weight, bias)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K] -> [M, N]: the C kernel for few float32 rows on CPU, else F.linear."""
    if not x.is_cuda and x.dim() == 2 and x.shape[0] <= SKINNY_MAX_M:
        out = linear_cpu(x, weight, bias)
        if out is not None:
            return out
    return F.linear(x, weight, bias)


def linear_cpu(x: Tensor, weight: Tensor, bias: Tensor | None = None, lib=None) -> Tensor | None:
    """The C kernel: x [M, K] float32 (rows may be strided), weight [N, K] float32 or bfloat16
    (contiguous), bias [N] float32 or None -> [M, N] float32. None when it cannot run here (no
    compiler, another dtype or layout, K not a multiple of 8): use F.linear.
    `lib`: a loaded kernel library other than the default build (tests of the portable C path)."""
    from lightserve.kernels.cpu import library, profiled

    lib = lib or library()
    m, k = x.shape
    if lib is None or m == 0 or x.dtype != torch.float32 or x.stride(1) != 1 \
            or weight.dtype not in (torch.float32, torch.bfloat16) or not weight.is_contiguous() \
            or weight.shape[1] != k or k % 8 != 0 \
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous())):
        return None
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)  # [M, N]
    with profiled("linear_cpu"):  # visible in scripts/profile_step.py
        rc = lib.linear_skinny(
            x.data_ptr(), x.stride(0), m, k, weight.data_ptr(), int(weight.dtype == torch.bfloat16), n,
            None if bias is None else bias.data_ptr(), out.data_ptr(), n, torch.get_num_threads())
    return out if rc == 0 else None
