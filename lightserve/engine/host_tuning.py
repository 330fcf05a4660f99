"""The host's tuning for the CPU worker ranks: tcmalloc preloaded, OpenMP threads that sleep soon after a
parallel region, Triton's interpreter for `--kernel_backend triton` on CPU. Each is an environment variable a
spawned worker reads at exec or import; `EngineProcs.start` sets them around the workers' spawn (`worker_env`).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lightserve import envs
from lightserve.config import Device, KernelBackend, ServerConfig
from lightserve.log import get_logger

logger = get_logger(__name__)

TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                  "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
                  "/usr/lib64/libtcmalloc_minimal.so.4")


def preload_tcmalloc() -> str | None:
    """Make spawned children load tcmalloc (LD_PRELOAD is read at exec). With glibc malloc, torch's
    large per-op temporaries on CPU are mmapped and unmapped on every call: ~1,700 page faults for
    one rmsnorm over 1,024 tokens, 10x slower than with tcmalloc, which keeps them cached."""
    if envs.no_tcmalloc():
        return None
    path = next((p for p in TCMALLOC_PATHS if Path(p).exists()), None)
    if path is None:
        logger.info("tcmalloc not found (Debian: libtcmalloc-minimal4); CPU workers use glibc malloc")
        return None
    current = os.environ.get("LD_PRELOAD", "")
    if path not in current.split(":"):
        os.environ["LD_PRELOAD"] = f"{path}:{current}" if current else path
    return path


# Rounds an idle OpenMP thread spins before it sleeps (GOMP_SPINCOUNT), in CPU workers: at most 0.3 ms on a Zen 5.
# libgomp's default, 300,000 rounds (4.2-4.5 ms there), outlasts the gap between two decode steps, so the worker's
# second thread spun through all of it; the router, detokenizer and HTTP front that the step's messages wake then
# preempted the worker's main thread, not the spinner. Zen 5, 2 vCPUs, batch-1 float32 decode: the output writer
# (sampling, shm writes, two zmq sends) took 1.0-1.2 ms a step with the default, 0.56 with this, and a step's time
# outside the forward fell from 1.42-1.44 to 1.06-1.13 ms. W1 throughput, alternated runs, did not move, so the
# regions within a forward still find their threads awake.
OMP_SPIN_ROUNDS = "10000"
# What preload_tcmalloc, bound_omp_spin and interpret_triton set for the worker ranks, restored once they are spawned.
WORKER_ENV = ("LD_PRELOAD", "GOMP_SPINCOUNT", "TRITON_INTERPRET")


def bound_omp_spin() -> None:
    """Make spawned CPU workers' OpenMP threads sleep soon after a parallel region (OMP_SPIN_ROUNDS); libgomp reads
    GOMP_SPINCOUNT when it loads. A user's own GOMP_SPINCOUNT or OMP_WAIT_POLICY stays in charge."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = OMP_SPIN_ROUNDS


def interpret_triton() -> None:
    """Make spawned workers run Triton kernels in Triton's interpreter (--kernel_backend triton on CPU): triton.jit
    reads TRITON_INTERPRET when a kernel is defined, at the worker's first import of lightserve.kernels."""
    os.environ["TRITON_INTERPRET"] = "1"


@contextmanager
def worker_env(config: ServerConfig) -> Iterator[None]:
    """The tuning of `config`'s workers in os.environ while they are spawned; the caller's own values after."""
    saved = {name: os.environ.get(name) for name in WORKER_ENV}
    try:
        if config.device is Device.CPU:
            preload_tcmalloc()
            bound_omp_spin()
            if config.kernel_backend is KernelBackend.TRITON:
                interpret_triton()
        yield
    finally:
        for name, value in saved.items():
            _restore_env(name, value)


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
