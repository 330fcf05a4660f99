"""Linear layer y = x . w^T (+ b) of the projections and the lm_head.

On GPU it is F.linear (cuBLAS). On CPU, for float32 models, the weights are packed once at load
(`pack_linear_weight`: panels of two vectors' worth of output features, k-major) and a C kernel
(kernels/cpu/linear.c, one 6 x (2 vectors) register tile at the CPU's vector width) runs every M, decode
and prefill alike. For bfloat16 models the weights are reordered once at load into oneDNN's blocked layout
(`prepack_onednn_weight`), and oneDNN's GEMM runs them (AVX512-BF16 or AMX where the CPU has them): torch's
F.linear on plain bf16 weights repacks them on every call. Measured on Zen 5 (AVX512-BF16), 2 threads, SmolLM2's
gate_up over 30 layers, ms per layer, prepacked / F.linear: M=1 0.060 / 0.163, M=4 0.073 / 0.174,
M=64 0.292 / 0.456; lm_head M=1 0.77 / 2.42, M=64 4.37 / 7.26; in GFLOP/s at M=256 934 / 778. A C kernel
for bf16 weights (widened by shift/mask) lost to the prepacked GEMM at every M, 1 included. In float32 the C
kernel and prepacked oneDNN measured within 5% of each other there, so float32 keeps the C kernel.
At M <= PAIR_MAX_M (decoding one to four requests) bf16 weights run linear.c's pair kernel instead, on a second
copy in a layout made for vdpbf16ps (no widening: each 64-byte row is 16 features times a pair of k). On Zen 4,
2 threads, SmolLM2's shapes from DRAM, M=1: 32-35 GB/s against oneDNN's 17-23 (qkv 0.034 / 0.063 ms a layer,
gate_up 0.110 / 0.160, lm_head 1.66 / 2.42); at M=4 0.57-0.94x oneDNN's time.
Measured on 2 AVX2 cores (Zen 3), float32, SmolLM2-135M's shapes, weights streamed from DRAM as in
the forward; GFLOP/s, medians, MKL's sgemm (F.linear) in the same run:
  gate_up [3072 x 576]  M=1: MKL 2.4, C 5.0 (memory-bound: 10 GB/s)   M=16: 25 / 70
                        M=256: 73 / 106-121   M=2048: 68 / 125
  down    [576 x 1536]  M=1: 5.9 / 6.1   M=64: 80 / 100   M=1024: 113 / 135
  qkv     [960 x 576]   M=4: 7.1 / 26   M=512: 101 / 134
There is no Triton version: on GPU the GEMMs belong to cuBLAS.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

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


@dataclass(frozen=True)
class OneDNNLinear:
    """A [N, K] weight reordered for oneDNN's CPU GEMM (an opaque mkldnn tensor), and for bf16 weights also
    in linear.c's pair layout, which runs M <= PAIR_MAX_M (decode of a few requests) at the read bandwidth."""

    packed: Tensor
    out_features: int  # N
    in_features: int  # K
    pairs: Tensor | None = None  # [ceil(N / 16), K / 2, 16] int32, pack_bf16_pairs; None: oneDNN at every M


def onednn_available() -> bool:
    """Whether this torch build can prepack linear weights for oneDNN (its CPU builds can)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def prepack_onednn_weight(weight: Tensor) -> OneDNNLinear:
    """weight [N, K] (CPU, bf16 or float32) -> OneDNNLinear; the row-major tensor is not kept. A bf16 weight
    with an even K also gets the pair layout (the weights' memory twice), unless that would leave less than
    PAIR_MIN_FREE_FRACTION of the machine's available memory."""
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    pairs = None
    if weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and _pairs_fit(weight):
        pairs = pack_bf16_pairs(weight)
    return OneDNNLinear(packed, *weight.shape, pairs=pairs)


PAIR_MAX_M = 4  # linear.c's limit: above it oneDNN's GEMM is as fast (Zen 4: 0.89-0.94x at M = 4) and then faster
PAIR_PANEL = 16  # output features per panel of the pair layout (linear.c's PAIR_PW), on every CPU
PAIR_MIN_FREE_FRACTION = 0.5  # the second copy is made only while MemAvailable stays over half the total


def pack_bf16_pairs(weight: Tensor) -> Tensor:
    """weight [N, K] bf16, K even -> [ceil(N / 16), K / 2, 16] int32: element [p, j, f] holds the bf16 pair
    (w[16p + f, 2j], w[16p + f, 2j + 1]), low half first (linear.c's layout); padding rows are zero."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // PAIR_PANEL) * PAIR_PANEL, k, dtype=torch.bfloat16)
    padded[:n] = weight
    # [Np, K] -> [Np / 16, 16, K / 2, 2] -> [Np / 16, K / 2, 16, 2]; each trailing pair is one int32.
    return padded.view(-1, PAIR_PANEL, k // 2, 2).transpose(1, 2).contiguous().view(torch.int32).squeeze(-1)


def unpack_bf16_pairs(pairs: Tensor, n: int) -> Tensor:
    """The [N, K] bf16 weight back from pack_bf16_pairs (tests)."""
    panels, half_k, width = pairs.shape
    return pairs.unsqueeze(-1).view(torch.bfloat16).transpose(1, 2).reshape(panels * width, 2 * half_k)[:n]


def _pairs_fit(weight: Tensor) -> bool:
    from lightserve.kernels.cpu import library, memory_bytes

    need = weight.numel() * weight.element_size()
    return library() is not None and memory_bytes() - need > PAIR_MIN_FREE_FRACTION * memory_bytes("MemTotal")


def cpu_pack_for(weight: Tensor) -> Callable[[Tensor], PackedLinear | OneDNNLinear] | None:
    """How a model packs its linear weights of weight's dtype at load on CPU: the C kernel's panels for float32
    (when the C library builds here), oneDNN's layout for bfloat16; None on GPU or where neither applies."""
    from lightserve.kernels.cpu import library

    if weight.device.type != "cpu":
        return None
    if weight.dtype == torch.float32 and library() is not None:
        return pack_linear_weight
    if weight.dtype == torch.bfloat16 and onednn_available():
        return prepack_onednn_weight
    return None


def linear(x: Tensor, weight: Tensor | PackedLinear | OneDNNLinear, bias: Tensor | None = None) -> Tensor:
    """x [M, K] -> [M, N]: the C kernel for a packed weight, oneDNN for a prepacked one, F.linear for a
    plain one."""
    if isinstance(weight, PackedLinear):
        out = linear_cpu(x, weight, bias)
        if out is not None:
            return out
        return linear_ref(x, weight, bias)  # not reached by the model: it packs only what the kernel takes
    if isinstance(weight, OneDNNLinear):
        if weight.pairs is not None and x.shape[0] <= PAIR_MAX_M:
            out = linear_bf16_small(x, weight, bias)
            if out is not None:
                return out
        return torch.ops.mkldnn._linear_pointwise(x, weight.packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def linear_bf16_small(x: Tensor, weight: OneDNNLinear, bias: Tensor | None = None, lib=None) -> Tensor | None:
    """linear.c's pair kernel: x [M, K] bf16 (rows may be strided), M <= PAIR_MAX_M, bias [N] bf16 or None ->
    [M, N] bf16. None when it cannot run here (no pair layout, another dtype, layout or M).
    `lib`: a loaded kernel library other than the default build (tests of the portable C path)."""
    from lightserve.kernels.cpu import library, profiled

    lib = lib or library()
    if lib is None or weight.pairs is None or x.dim() != 2 or not 1 <= x.shape[0] <= PAIR_MAX_M \
            or x.dtype != torch.bfloat16 or x.stride(1) != 1 or x.shape[1] != weight.in_features \
            or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous())):
        return None
    m, n = x.shape[0], weight.out_features
    out = torch.empty(m, n, dtype=torch.bfloat16)  # [M, N]
    with profiled("linear_bf16_cpu"):  # visible in scripts/profile_step.py
        rc = lib.linear_bf16_pairs(x.data_ptr(), x.stride(0), m, weight.in_features, weight.pairs.data_ptr(), n,
                                   None if bias is None else bias.data_ptr(), out.data_ptr(), n,
                                   torch.get_num_threads())
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
