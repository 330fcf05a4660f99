"""Debug knobs read from the environment, all in one place (LIGHTSERVE_ prefix).

Settings belong in ServerConfig; these only switch runtime tweaks off for debugging.
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """LIGHTSERVE_CACHE: where the bundled model and the built C kernels are kept (default
    ~/.cache/lightserve)."""
    env = os.environ.get("LIGHTSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lightserve"


def no_tcmalloc() -> bool:
    """LIGHTSERVE_NO_TCMALLOC=1: do not preload tcmalloc into CPU worker processes."""
    return os.environ.get("LIGHTSERVE_NO_TCMALLOC", "") not in ("", "0")


def no_c_kernels() -> bool:
    """LIGHTSERVE_NO_C_KERNELS=1: run the torch reference ops instead of the CPU C kernels."""
    return os.environ.get("LIGHTSERVE_NO_C_KERNELS", "") not in ("", "0")


def onednn_bf16_gemm() -> bool:
    """LIGHTSERVE_ONEDNN_BF16_GEMM=1: run bf16 linears of more than a few rows on oneDNN also where linear.c's
    vdpbf16ps GEMM would run them (to measure one against the other)."""
    return os.environ.get("LIGHTSERVE_ONEDNN_BF16_GEMM", "") not in ("", "0")


def per_kernel_forward() -> bool:
    """LIGHTSERVE_PER_KERNEL_FORWARD=1: run a Llama-family CPU forward's layers one kernel call at a time instead
    of in kernels/decoder_layers.py's one C call (to compare the two)."""
    return os.environ.get("LIGHTSERVE_PER_KERNEL_FORWARD", "") not in ("", "0")


def cpu_build() -> str:
    """LIGHTSERVE_CPU_BUILD=avx512|avx2|portable: run the CPU C kernels from that narrower build
    (kernels/cpu/__init__.py's BUILD_VARIANTS) instead of the native one, to measure on this CPU the code an older
    one runs. Unset or empty: native."""
    return os.environ.get("LIGHTSERVE_CPU_BUILD", "") or "native"


def onednn_max_cpu_isa() -> str:
    """ONEDNN_MAX_CPU_ISA (or its older name DNNL_MAX_CPU_ISA), oneDNN's own: the newest instruction set oneDNN may
    use, upper-case, e.g. AVX512_CORE_VNNI; "" when unset (oneDNN then uses all the CPU has)."""
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
