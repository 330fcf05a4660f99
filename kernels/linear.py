"""Linear layer y = x . w^T (+ b) of the projections and the lm_head.

On GPU it is F.linear (cuBLAS). On CPU, for float32 models, the weights are packed once at load
(`pack_linear_weight`: panels of two vectors' worth of output features, k-major) and a C kernel
(kernels/cpu/linear.c, one 6 x (2 vectors) register tile at the CPU's vector width) runs every M, decode
and prefill alike.
Measured on 2 AVX2 cores (Zen 3), float32, SmolLM2-135M's shapes, weights streamed from DRAM as in
the forward; GFLOP/s, medians, MKL's sgemm (F.linear) in the same run:
  gate_up [3072 x 576]  M=1: MKL 2.4, C 5.0 (memory-bound: 10 GB/s)   M=16: 25 / 70
                        M=256: 73 / 106-121   M=2048: 68 / 125
  down    [576 x 1536]  M=1: 5.9 / 6.1   M=64: 80 / 100   M=1024: 113 / 135
  qkv     [960 x 576]   M=4: 7.1 / 26   M=512: 101 / 134
There is no Triton version: on GPU the GEMMs belong to cuBLAS.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# Rows up to which a bf16 linear runs the C kernel instead of torch (linear_bf16_small_m). Measured on Zen 5
# (AVX512-BF16), 2 threads, SmolLM2's shapes over 30 layers of weights, ms per layer, C / torch:
#   gate_up [3072 x 576]  M=1 0.076 / 0.170   M=2 0.087 / 0.174   M=4 0.163 / 0.181   M=8 0.295 / 0.206
#   down    [576 x 1536]  M=1 0.042 / 0.087   M=2 0.063 / 0.071   M=4 0.092 / 0.072
#   lm_head [49152 x 576] M=1 1.01 / 2.40     M=2 1.11 / 2.63     M=4 1.65 / 2.67     M=8 3.02 / 3.02
BF16_SMALL_M = 2
DEFAULT_PANEL = 16  # without a C library: the AVX2 build's width (the torch path unpacks it anyway)


@dataclass(frozen=True)
class PackedLinear:
    """A [N, K] float32 weight in the C kernel's layout: panels [ceil(N / P), K, P], P = the panel width of
    the library it was packed for (NR in linear.c: 32 on AVX-512 CPUs, 16 on AVX2 ones)."""

    panels: Tensor  # [Np / P, K, P], zero rows past N
    out_features: int  # N
    in_features: int  # K

    @property
    def panel(self) -> int:
        return self.panels.shape[-1]


def pack_linear_weight(weight: Tensor, lib=None) -> PackedLinear:
    """weight [N, K] float32 (CPU) -> PackedLinear for `lib` (default: the serving build); the row-major
    tensor is not kept."""
    from lightserve.kernels.cpu import library

    lib = lib or library()
    panel = lib.linear_panel_width() if lib is not None else DEFAULT_PANEL
    n, k = weight.shape
    padded = torch.zeros(-(-n // panel) * panel, k, dtype=torch.float32)
    padded[:n] = weight
    panels = padded.view(-1, panel, k).transpose(1, 2).contiguous()  # [Np / P, K, P]
    return PackedLinear(panels, n, k)


def unpack_linear_weight(w: PackedLinear) -> Tensor:
    """The [N, K] weight back (tests, and the torch path)."""
    return w.panels.transpose(1, 2).reshape(-1, w.in_features)[: w.out_features]


def linear_ref(x: Tensor, weight: Tensor | PackedLinear, bias: Tensor | None = None) -> Tensor:
    """x [M, K] . weight [N, K]^T (+ bias [N]) -> [M, N]."""
    if isinstance(weight, PackedLinear):
        weight = unpack_linear_weight(weight).to(x.dtype)
    return F.linear(x, weight, bias)


def linear(x: Tensor, weight: Tensor | PackedLinear, bias: Tensor | None = None) -> Tensor:
    """x [M, K] -> [M, N]: the C kernel for a packed weight; for a bfloat16 weight on CPU and at most
    BF16_SMALL_M rows, the C kernel over the row-major weight; F.linear otherwise."""
    if isinstance(weight, PackedLinear):
        out = linear_cpu(x, weight, bias)
        if out is not None:
            return out
        return linear_ref(x, weight, bias)  # not reached by the model: it packs only what the kernel takes
    if x.shape[0] <= BF16_SMALL_M and weight.dtype == torch.bfloat16 and not x.is_cuda:
        out = linear_bf16_small_m(x, weight, bias)
        if out is not None:
            return out
    return F.linear(x, weight, bias)


def linear_bf16_small_m(x: Tensor, weight: Tensor, bias: Tensor | None = None, lib=None) -> Tensor | None:
    """The C kernel for few rows in bfloat16 (kernels/cpu/linear.c): x [M, K] (rows may be strided), weight
    [N, K] row-major, bias [N] or None, all bf16 -> [M, N] bf16 with float32 sums. None when it cannot run
    here (no compiler, M past the kernel's 16, K not a multiple of its 32-value chunks, another dtype)."""
    from lightserve.kernels.cpu import library, profiled

    lib = lib or library()
    if lib is None or x.dim() != 2 or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 \
            or x.stride(1) != 1 or weight.stride(1) != 1 or x.shape[1] != weight.shape[1] \
            or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous())):
        return None
    m, n = x.shape[0], weight.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16)  # [M, N]
    with profiled("linear_cpu"):  # visible in scripts/profile_step.py
        rc = lib.linear_bf16_small_m(
            x.data_ptr(), x.stride(0), m, x.shape[1], weight.data_ptr(), weight.stride(0), n,
            None if bias is None else bias.data_ptr(), out.data_ptr(), n, torch.get_num_threads())
    return out if rc == 0 else None


def linear_cpu(x: Tensor, weight: PackedLinear, bias: Tensor | None = None, lib=None) -> Tensor | None:
    """The C kernel: x [M, K] float32 (rows may be strided), bias [N] float32 or None -> [M, N]
    float32. None when it cannot run here (no compiler, another dtype or layout).
    `lib`: a loaded kernel library other than the default build (tests of the portable C path)."""
    from lightserve.kernels.cpu import library, profiled

    lib = lib or library()
    if lib is None or x.dim() != 2 or x.shape[0] == 0 or x.dtype != torch.float32 or x.stride(1) != 1 \
            or x.shape[1] != weight.in_features or weight.panel != lib.linear_panel_width() \
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous())):
        return None
    m, n = x.shape[0], weight.out_features
    out = torch.empty(m, n, dtype=torch.float32)  # [M, N]
    with profiled("linear_cpu"):  # visible in scripts/profile_step.py
        rc = lib.linear_packed(
            x.data_ptr(), x.stride(0), m, weight.in_features, weight.panels.data_ptr(), n,
            None if bias is None else bias.data_ptr(), out.data_ptr(), n, torch.get_num_threads())
    return out if rc == 0 else None
