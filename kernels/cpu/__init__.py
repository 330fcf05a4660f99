"""CPU kernels written in C, built on first use with the machine's C compiler and loaded with ctypes.

Why C and not a torch extension: a torch C++ extension compiles against the torch headers
(a minute per build); these kernels need only raw pointers, so gcc builds them in about a second.
The build is cached under $LIGHTSERVE_CACHE/kernels (default ~/.cache/lightserve/kernels), keyed by
the source, the flags and the compiler, and written atomically so concurrent processes (every
worker rank, every test) may build at once. They link the OpenMP runtime torch already loaded
(same soname, libgomp.so.1), so they share its thread pool instead of starting a second one.

Without a compiler, or when the build fails, `library()` returns None and callers use the torch
reference path, with one warning.
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch

from lightserve import envs
from lightserve.log import get_logger

logger = get_logger(__name__)

_SOURCES = ("decode_attention.c", "decoder_layers.c", "elementwise.c", "linear.c", "lora.c", "prefill_attention.c",
            "quant_linear.c", "quant_linear_q8.c", "sampling.c")
# -fno-math-errno and -fno-trapping-math: no errno or FP-exception semantics to keep, so gcc may
# vectorize loops with rint and compare-selects (exp in elementwise.c); results are unchanged.
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math")


# The builds the same sources make: `native` is what serving uses (-march=native: AVX-512 where the CPU has
# it); the others switch wide instructions off, so a machine that has them can test what narrower CPUs run. None of
# them multiplies on AMX tiles. `avx512` is 16-lane vectors without vdpbf16ps, as on Skylake-SP to Ice Lake Xeons:
# where the native build has AVX512-BF16 it is the only build that runs the 16-lane widening paths for bf16. `avx2` is
# an AVX2-only CPU's (no AVX-VNNI either, as on a Zen 3 or a Skylake client: int8 dot products as vpmaddubsw). Each
# needs the CPU flags listed (a build for a CPU without them would not run here).
NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")  # each named: -mno-amx-tile alone leaves the others on
BUILD_VARIANTS = {
    "native": ((), ()),
    "avx512": (("-mno-avx512bf16", *NO_AMX), ("avx512f",)),
    "avx2": (("-mno-avx512f", "-mno-avxvnni", *NO_AMX), ("avx2", "fma")),
    "portable": (("-mno-avx2", "-mno-fma", *NO_AMX), ()),
}


def _missing_flags(name: str) -> list[str]:
    """The CPU flags BUILD_VARIANTS[name] needs that this CPU lacks."""
    have = set(cpu_flags().split())
    return [f for f in BUILD_VARIANTS[name][1] if f not in have]


# Compile-time choices of decode_attention.c that a build may override with -DNAME=VALUE, and the values each takes:
# what scripts/bench_cpu_kernels.py --define measures on the CPU at hand before a default changes. PF_LOCALITY is the
# prefetch hint (-1: none, 0: prefetchnta, 1: prefetcht2, 2: prefetcht1, 3: prefetcht0), PF_DIST how many tokens
# ahead the rows are prefetched, PACK_MIN_GROUP the smallest query-head group scored head-packed (17: none is),
# DPV_MIN_GROUP the smallest whose V pass runs as vdpbf16ps (17: none does), SHARE_K whether the packed passes of groups
# over 4 go two at a time from one load of each K pair (0: each pass loads its own).
TUNABLES = {"PF_LOCALITY": range(-1, 4), "PF_DIST": range(0, 1025), "PACK_MIN_GROUP": range(3, 18),
            "DPV_MIN_GROUP": range(1, 18), "SHARE_K": range(0, 2), "HEAD_OUTER": range(0, 2)}


def tuning_flags(defines: dict[str, int]) -> tuple[str, ...]:
    """-D flags for TUNABLES overrides ({"PF_LOCALITY": 3}); ValueError naming an unknown name or a value out of
    range."""
    for name, value in defines.items():
        if name not in TUNABLES:
            raise ValueError(f"{name}: not a tunable (one of {', '.join(TUNABLES)})")
        if value not in TUNABLES[name]:
            allowed = TUNABLES[name]
            raise ValueError(f"{name}={value}: out of range ({allowed.start} to {allowed.stop - 1})")
    return tuple(f"-D{name}={value}" for name, value in sorted(defines.items()))


def variant_library(name: str, defines: dict[str, int] | None = None) -> ctypes.CDLL | None:
    """The kernel library built as BUILD_VARIANTS[name] (with `defines` of TUNABLES set), or None when this CPU
    cannot run that build's instructions (or nothing can be built here)."""
    extra = tuning_flags(defines or {})
    if _missing_flags(name):
        return None
    try:
        return load(build((*BUILD_VARIANTS[name][0], *extra)))
    except (OSError, subprocess.SubprocessError):
        return None


C_DTYPES = (torch.float32, torch.bfloat16)  # the activation dtypes the C kernels take (and lora.c's weights)


# Seconds by label of the labelled C calls made inside kernel_times() (None outside it).
_KERNEL_TIMES: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("kernel_times", default=None)


@contextlib.contextmanager
def kernel_times() -> Iterator[dict[str, float]]:
    """Within: every C call labelled with `profiled` adds its wall time to the yielded dict (seconds by label).
    A timed call costs under a microsecond more, where a torch.profiler range costs tens: the 61 RMSNorm calls of a
    SmolLM2 decode step at batch 64 in bf16 took 1.7 ms timed and 4.7 under the profiler, in one run of
    scripts/profile_step.py (Zen 4)."""
    times: dict[str, float] = defaultdict(float)
    token = _KERNEL_TIMES.set(times)
    try:
        yield times
    finally:
        _KERNEL_TIMES.reset(token)


def active_kernel_times() -> dict[str, float] | None:
    """The dict of the enclosing kernel_times() block, or None outside one (kernels/decoder_layers.py adds the
    times its C driver measures per kernel)."""
    return _KERNEL_TIMES.get()


class _Timed:
    def __init__(self, times: dict[str, float], name: str) -> None:
        self.times, self.name = times, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *_exc) -> None:
        self.times[self.name] += time.perf_counter() - self.start


def profiled(name: str) -> contextlib.AbstractContextManager:
    """A label for a C call: timed inside kernel_times(), a torch.profiler range while a profiler runs
    (scripts/profile_step.py attributes C kernels by it), else nothing: record_function costs about 12 us, and a
    step makes over a hundred C calls."""
    times = _KERNEL_TIMES.get()
    if times is not None:
        return _Timed(times, name)
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def _cache_dir() -> Path:
    return envs.cache_root() / "kernels"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel library (built now if needed), or None when it cannot be built here. The native build unless
    LIGHTSERVE_CPU_BUILD names another of BUILD_VARIANTS (ValueError for a name it does not know, or a build this
    CPU cannot run)."""
    if envs.no_c_kernels():
        return None
    name = envs.cpu_build()
    if name not in BUILD_VARIANTS:
        raise ValueError(f"LIGHTSERVE_CPU_BUILD={name!r}: not one of {', '.join(BUILD_VARIANTS)}")
    if missing := _missing_flags(name):
        raise ValueError(f"LIGHTSERVE_CPU_BUILD={name!r}: this CPU has no {', '.join(missing)}")
    try:
        return load(build(BUILD_VARIANTS[name][0]))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("CPU C kernels unavailable, falling back to torch ops: %s", detail)
        return None


def c_compiler() -> str | None:
    """The C compiler the kernels build with: $CC, else gcc, else cc; None when there is none."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def build(extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the sources (once per source/flags/compiler; cached) and return the .so path.
    Raises OSError when there is no compiler, CalledProcessError when the build fails."""
    cc = c_compiler()
    if cc is None:
        raise OSError("no C compiler (gcc or cc) on PATH")
    flags = (*_FLAGS, *extra_flags)
    sources = [Path(__file__).parent / name for name in _SOURCES]
    headers = sorted(Path(__file__).parent.glob("*.h"))  # in the cache key, not on the command line
    key = hashlib.sha256()
    # -march=native: a cache shared by machines with other CPUs must not hand them this build.
    for part in [cc, *flags, cpu_flags(), *(p.read_bytes() for p in [*sources, *headers])]:
        key.update(part if isinstance(part, bytes) else part.encode())
    target = _cache_dir() / f"lightserve_cpu_{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, "-o", tmp, *map(str, sources), "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)  # atomic: a concurrent builder's copy is identical
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def cpu_flags() -> str:
    """The CPU's flags line from /proc/cpuinfo ("" where there is none): what the builds may use. Read once: the
    model asks for every weight it packs."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


# The CPU flags of native bf16 products (vdpbf16ps, AMX tiles). Where neither is, a bf16 GEMM widens its operands to
# float32 and runs slower than a float32 GEMM on float32 weights.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16): the one rule behind --data_type auto's
    bfloat16 on CPU (lightserve/resolve_config.py) and oneDNN's bf16 GEMM (kernels/linear.py)."""
    return bool(NATIVE_BF16_FLAGS & set(cpu_flags().split()))


def memory_bytes(field: str = "MemAvailable") -> int:
    """A /proc/meminfo field ("MemAvailable", "MemTotal") in bytes; where there is none, half the physical
    memory for MemAvailable and all of it otherwise."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return physical // 2 if field == "MemAvailable" else physical


# C types of kernels.h's scalars; any pointer is a void pointer (a char pointer a string).
_C_TYPES = {"void": None, "int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
            "float": ctypes.c_float, "double": ctypes.c_double}


@functools.cache
def c_signatures() -> dict[str, tuple[type | None, list[type]]]:
    """Name -> (restype, argtypes) of every function kernels.h declares: the library's one declaration of its entry
    points, which the compiler checks each definition against and load() hands ctypes. KeyError for a type that
    _C_TYPES does not map."""
    text = (Path(__file__).parent / "kernels.h").read_text()
    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"^\s*#[^\n]*", "", text, flags=re.M)
    out = {}
    for decl in text.split(";"):
        match = re.fullmatch(r"\s*(.*?)\b(\w+)\s*\((.*)\)\s*", decl, flags=re.S)
        if match is None:  # a struct's forward declaration
            continue
        ret, name, params = match.groups()
        params = [] if params.strip() in ("", "void") else params.split(",")
        out[name] = (_c_type(ret), [_c_type(param.rsplit(None, 1)[0] if "*" not in param else param)
                                    for param in params])
    return out


def _c_type(decl: str) -> type | None:
    if "*" in decl:
        return ctypes.c_char_p if re.search(r"\bchar\b", decl) else ctypes.c_void_p
    return _C_TYPES[decl.replace("const", "").strip()]


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in c_signatures().items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib
