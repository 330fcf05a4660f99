"""Linear layer y = x . w^T (+ b) of the projections and the lm_head.

On GPU it is F.linear (cuBLAS). On CPU, for float32 models, the weights are packed once at load
(`pack_linear_weight`: panels of two vectors' worth of output features, k-major) and a C kernel
(kernels/cpu/linear.c, a register tile of 6 or 8 rows by 2 vectors at the CPU's vector width) runs every M, decode
and prefill alike: it beats MKL's sgemm at every M measured, most at small M. For bfloat16 models the weights are
laid out once at load (`prepack_weight`):
- linear.c's pair layout (each 64-byte row is 16 output features times a pair of k, what vdpbf16ps multiplies
  against a broadcast pair of x, and 16 of them one AMX B tile) runs every M where the C build has vdpbf16ps
  (AVX512-BF16) and the CPU has no AMX: a 12-row by 32-feature register tile above PAIR_MAX_M rows, a weight stream
  at or below it. Measured faster than oneDNN's prepacked GEMM at every M on Zen 4, near the CPU's vdpbf16ps
  ceiling at large M.
- On AMX CPUs the same layout runs every M on the tile unit above PAIR_MAX_M rows (a weight with K a multiple of
  AMX_K), the only copy: on an AMX Xeon, over SmolLM2's projections and lm_head, 0.74-0.93x oneDNN's time at
  M = 5-128 (0.87-1.08x at 9-72 in a noisier run), 1.10-1.17x at 256, 0.94-1.09x at 512, 1.27x at 2,048 (past the
  512 tokens a CPU step takes by default).
- Elsewhere on AMX CPUs (the tiles not granted, a K they do not take) oneDNN's blocked layout runs M over
  PAIR_MAX_M (about twice the vdpbf16ps rate), and the pair layout, a second copy, the decode of one to four
  requests (its builds without vdpbf16ps widen each pair by a shift and a mask).
- Where oneDNN does not multiply bf16 natively (`onednn_bf16_dot`: no AVX512-BF16 or AMX-BF16, as on AVX2-only
  EPYCs and Skylake-SP to Ice Lake Xeons), a float32 copy in the C GEMM's panels runs M over PAIR_MAX_M on x
  widened to float32, the output rounded to bf16: the float32 GEMM's rate. oneDNN's bf16 GEMM runs far slower there
  or has no bf16 path at all (AVX2: its weight reorder raises), and so does torch's own bf16 matmul.
torch's F.linear on plain bf16 weights repacks them on every call, so every bf16 layout above is made once at load.
Measurements: docs/benchmarks.md, "Measured while writing the CPU kernels".
There is no Triton version: on GPU the GEMMs belong to cuBLAS.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lightserve.kernels.quant_linear import QuantLinear, quant_linear

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
class PrepackedLinear:
    """A [N, K] weight laid out once at load for the CPU GEMMs that run it: oneDNN's blocked layout (an opaque
    mkldnn tensor), and for bf16 weights linear.c's pair layout. Where the C kernel takes every M (its vdpbf16ps
    build, on a CPU without AMX) only the pairs are kept; elsewhere oneDNN runs M over PAIR_MAX_M (where it does not
    multiply bf16 natively, float32 panels instead: `widened`), and the pairs (when they fit in memory) the decode
    of one to a few requests. At least one of onednn, pairs and widened is set."""

    onednn: Tensor | None
    out_features: int  # N
    in_features: int  # K
    pairs: Tensor | None = None  # [ceil(N / 32) * 2, K / 2, 16] int32, pack_bf16_pairs
    widened: PackedLinear | None = None  # float32 panels, where oneDNN does not multiply bf16 natively (then no onednn)


def onednn_available() -> bool:
    """Whether this torch build can prepack linear weights for oneDNN (its CPU builds can)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def onednn_bf16_available() -> bool:
    """Whether oneDNN runs bf16 GEMMs on this CPU: it needs AVX512-BW/VL/DQ or AVX-NE-CONVERT (torch answers from
    the CPU, held to ONEDNN_MAX_CPU_ISA where that is set)."""
    return onednn_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# oneDNN's instruction sets without bf16 dot products (its ONEDNN_MAX_CPU_ISA names, oldest first). Held to one of
# these, oneDNN's bf16 GEMM widens each operand to float32 itself, where it has a bf16 path at all.
ONEDNN_ISAS_WITHOUT_BF16_DOT = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def onednn_bf16_dot() -> bool:
    """Whether oneDNN's bf16 GEMM multiplies bf16 natively here: the CPU has AVX512-BF16 or AMX-BF16 and oneDNN is
    not held below them (ONEDNN_MAX_CPU_ISA). Elsewhere its bf16 GEMM widens to float32 and loses to linear.c's
    float32 GEMM on widened rows: held to AVX512_CORE_VNNI (the Zen 5, 2 threads, SmolLM2's linears over 30 layers)
    it ran 134 GFLOP/s at M = 64 and 139 at M = 512, against 383 and 443 for the float32 GEMM."""
    from lightserve import envs
    from lightserve.kernels.cpu import cpu_has_native_bf16

    return onednn_bf16_available() and cpu_has_native_bf16() \
        and envs.onednn_max_cpu_isa() not in ONEDNN_ISAS_WITHOUT_BF16_DOT


def onednn_runs_bf16() -> bool:
    """Whether bf16 linears over PAIR_MAX_M rows that the pairs do not take go to oneDNN (where it multiplies bf16
    natively, or LIGHTSERVE_ONEDNN_BF16_GEMM asks for it where it has a bf16 path) rather than to float32 panels."""
    from lightserve import envs

    return onednn_bf16_dot() or (envs.onednn_bf16_gemm() and onednn_bf16_available())


def pairs_take_every_m(lib, in_features: int | None = None) -> bool:
    """Whether linear.c's pair layout runs bf16 linears of `in_features` (None: any multiple of AMX_K) at every M
    with `lib`, unless LIGHTSERVE_ONEDNN_BF16_GEMM asks for oneDNN: where the build runs the pairs on AMX tiles and
    K is a multiple of AMX_K, or where it has vdpbf16ps and the CPU has no AMX (on the AMX Xeon measured the
    vdpbf16ps GEMM took 1.4-8x oneDNN's time at M = 16-256). Zen 4, 2 threads, SmolLM2's projections and lm_head
    from DRAM, the vdpbf16ps kernels' time over oneDNN's: 0.58 at M = 1, 0.54-0.68 at M = 8-16, 0.79 at M = 64,
    0.95-0.96 at M = 256-512."""
    from lightserve import envs
    from lightserve.kernels.cpu import cpu_flags

    if lib is None or envs.onednn_bf16_gemm():
        return False
    if lib.linear_bf16_pairs_amx():
        return in_features is None or in_features % AMX_K == 0
    return bool(lib.linear_bf16_pairs_dpbf16()) and "amx_bf16" not in cpu_flags().split()


def prepack_weight(weight: Tensor) -> PrepackedLinear:
    """weight [N, K] (CPU, bf16 or float32) -> PrepackedLinear; the row-major tensor is not kept. A bf16 weight with
    an even K gets the pair layout: alone where the C kernel runs every M (pairs_take_every_m), else beside oneDNN's
    (the weights' memory twice), or beside float32 panels where oneDNN does not multiply bf16 natively (three times),
    unless that would leave less than PAIR_MIN_FREE_FRACTION of the machine's memory available."""
    from lightserve.kernels.cpu import library

    n, k = weight.shape
    pairs_ok = weight.dtype == torch.bfloat16 and k % 2 == 0 and library() is not None
    if pairs_ok and pairs_take_every_m(library(), k):
        return PrepackedLinear(None, n, k, pairs=pack_bf16_pairs(weight))
    if weight.dtype == torch.bfloat16 and not onednn_runs_bf16():
        pairs = pack_bf16_pairs(weight) if pairs_ok and pairs_fit(weight.numel() * 2) else None
        return PrepackedLinear(None, n, k, pairs=pairs, widened=pack_linear_weight(weight.float()))
    with torch.no_grad():
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    pairs = pack_bf16_pairs(weight) if pairs_ok and pairs_fit(weight.numel() * 2) else None
    return PrepackedLinear(onednn, n, k, pairs=pairs)


PAIR_MAX_M = 4  # up to here the pair kernel streams the weights (0.50-0.69x oneDNN's time at M = 1 on Zen 4)
PAIR_PANEL = 16  # output features per panel of the pair layout (linear.c's PAIR_PW), on every CPU
AMX_K = 32  # the K a tile step of linear.c's AMX GEMM, which takes K in multiples of it
PAIR_MIN_FREE_FRACTION = 0.5  # a second copy beside oneDNN's is made only while MemAvailable stays over half the total


def pack_bf16_pairs(weight: Tensor) -> Tensor:
    """weight [N, K] bf16, K even -> [ceil(N / 32) * 2, K / 2, 16] int32: element [p, j, f] holds the bf16 pair
    (w[16p + f, 2j], w[16p + f, 2j + 1]), low half first (linear.c's layout); padding rows are zero. The panels come
    in pairs (the GEMM's tile is two panels wide)."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // (2 * PAIR_PANEL)) * 2 * PAIR_PANEL, k, dtype=torch.bfloat16)
    padded[:n] = weight
    # [Np, K] -> [Np / 16, 16, K / 2, 2] -> [Np / 16, K / 2, 16, 2]; each trailing pair is one int32.
    return padded.view(-1, PAIR_PANEL, k // 2, 2).transpose(1, 2).contiguous().view(torch.int32).squeeze(-1)


def unpack_bf16_pairs(pairs: Tensor, n: int) -> Tensor:
    """The [N, K] bf16 weight back from pack_bf16_pairs (tests, and inputs the C kernel declines)."""
    panels, half_k, width = pairs.shape
    return pairs.unsqueeze(-1).view(torch.bfloat16).transpose(1, 2).reshape(panels * width, 2 * half_k)[:n]


def pairs_fit(nbytes: int) -> bool:
    """Whether a further copy of `nbytes` leaves over PAIR_MIN_FREE_FRACTION of the machine's memory available."""
    from lightserve.kernels.cpu import memory_bytes

    return memory_bytes() - nbytes > PAIR_MIN_FREE_FRACTION * memory_bytes("MemTotal")


def cpu_pack_for(weight: Tensor) -> Callable[[Tensor], PackedLinear | PrepackedLinear] | None:
    """How a model packs its linear weights of weight's dtype at load on CPU: the C kernel's panels for float32
    (when the C library builds here), prepack_weight for bfloat16; None on GPU or where neither applies."""
    from lightserve.kernels.cpu import library

    if weight.device.type != "cpu":
        return None
    if weight.dtype == torch.float32 and library() is not None:
        return pack_linear_weight
    if weight.dtype == torch.bfloat16 and onednn_available():
        return prepack_weight
    return None


def linear(x: Tensor, weight: Tensor | PackedLinear | PrepackedLinear | QuantLinear, bias: Tensor | None = None
           ) -> Tensor:
    """x [M, K] -> [M, N]: the C kernel for a packed weight, linear.c's pair kernels or oneDNN for a prepacked one,
    quant_linear.c for one kept in GGML blocks, F.linear for a plain one."""
    if isinstance(weight, QuantLinear):
        return quant_linear(x, weight, bias)
    if isinstance(weight, PackedLinear):
        out = linear_cpu(x, weight, bias)
        if out is not None:
            return out
        return linear_ref(x, weight, bias)  # not reached by the model: it packs only what the kernel takes
    if isinstance(weight, PrepackedLinear):
        alone = weight.onednn is None and weight.widened is None  # the pairs run every M
        if weight.pairs is not None and (alone or x.shape[0] <= PAIR_MAX_M):
            out = linear_bf16_pairs(x, weight, bias)
            if out is not None:
                return out
        if weight.widened is not None:  # no native bf16 here: the float32 GEMM on widened rows, rounded back
            xf, bf = x.float(), None if bias is None else bias.float()
            out = linear_cpu(xf, weight.widened, bf)
            return (linear_ref(xf, weight.widened, bf) if out is None else out).to(x.dtype)
        if weight.onednn is None:  # an input the C kernel declines (odd row stride, float32 x): slow, not reached
            return F.linear(x, unpack_bf16_pairs(weight.pairs, weight.out_features).to(x.dtype), bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight.onednn, bias, "none", [], "")
    return F.linear(x, weight, bias)


def linear_bf16_pairs(x: Tensor, weight: PrepackedLinear, bias: Tensor | None = None, lib=None) -> Tensor | None:
    """linear.c's pair kernels: x [M, K] bf16 (rows may be strided), bias [N] bf16 or None -> [M, N] bf16. None
    when they cannot run here: no pair layout, another dtype or layout, or M over PAIR_MAX_M in a build without
    vdpbf16ps. `lib`: a loaded kernel library other than the default build (tests of the portable C path)."""
    from lightserve.kernels.cpu import library, profiled

    lib = lib or library()
    if lib is None or weight.pairs is None or x.dim() != 2 or x.shape[0] < 1 or x.dtype != torch.bfloat16 \
            or x.stride(1) != 1 or x.shape[1] != weight.in_features \
            or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous())):
        return None
    # M over PAIR_MAX_M in a build without vdpbf16ps, or an odd row stride there: the kernel returns -1.
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


def linear_silu_cpu(x: Tensor, gate_up: PackedLinear, lib=None) -> Tensor | None:
    """silu(gate) * up of x . gate_up^T in one C call (linear.c's linear_packed_silu, the float32 GEMM with
    SiLU-and-mul as its epilogue): x [M, K] float32 (rows may be strided), gate_up [2I, K] packed (gate rows, then up
    rows) -> [M, I], bit for bit silu_and_mul of linear_cpu's output. None where it does not run (I not a multiple of
    the panel width, another dtype or layout) and the caller runs the two. The decoder-layer driver calls the same
    kernel."""
    from lightserve.kernels.cpu import library, profiled

    lib = lib or library()
    if lib is None or x.dim() != 2 or x.shape[0] == 0 or x.dtype != torch.float32 or x.stride(1) != 1 \
            or x.shape[1] != gate_up.in_features or gate_up.panel != lib.linear_panel_width() \
            or gate_up.out_features % 2:
        return None
    m, inter = x.shape[0], gate_up.out_features // 2
    out = torch.empty(m, inter, dtype=torch.float32)  # [M, I]
    with profiled("linear_silu_cpu"):  # visible in scripts/profile_step.py
        rc = lib.linear_packed_silu(x.data_ptr(), x.stride(0), m, gate_up.in_features, gate_up.panels.data_ptr(),
                                    inter, out.data_ptr(), torch.get_num_threads())
    return out if rc == 0 else None
