"""EngineProcs: starts and stops the engine's processes (worker ranks, router, detokenizer) and the
shared-memory request pool they share. Used by the server launcher and the offline pipeline.

Start-up is a ready-or-error handshake per child under a timeout: a child that fails shows its
traceback here, never a silent hang. Stop is SIGTERM, a bounded join, then SIGKILL, and the pool
segment is unlinked. `watch` reports the first child that dies on its own.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import socket
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path

from lightserve import envs
from lightserve.config import (
    DEFAULT_MAX_REQ_TOTAL_LEN,
    SHM_PREFIX,
    Device,
    DType,
    KernelBackend,
    KVCacheDType,
    ServerConfig,
)
from lightserve.log import get_logger
from lightserve.procutil import remove_instance_files
from lightserve.shm.req_pool import ReqPool
from lightserve.shm.segment import SHM_DIR, remove_stale_segments

logger = get_logger(__name__)

STOP_GRACE_S = 5.0
# On CPU a prompt token costs ~2.5 ms of one step (SmolLM2-135M, 2 cores), and 512-row GEMMs already run
# at the kernel's full rate: a bigger budget buys no throughput, only longer steps, during which every
# running request's next token and every later prompt's first token wait (a 2,048-token step is ~5 s).
CPU_BATCH_MAX_TOKENS = 512
GPU_BATCH_MAX_TOKENS = 8192
# On CPU a step's time grows with every prompt token (its rows of every GEMM, its attention over the prefix), so a
# step that gathers ten 48-token prompts takes as long as one 480-token prompt, and every prompt arriving
# meanwhile waits for all of it. Past 128 prompt tokens a step takes in no further prompt: short prompts
# arriving apart start within a short step (W3's TTFT p50 fell to 0.46-0.60 of the old figure on Zen 4,
# docs/benchmarks.md), while a long prompt still fills the step alone.
CPU_PREFILL_JOIN_TOKENS = 128
# The launcher's log line for each child it starts (EngineProcs._spawn): /proc/<pid>/cmdline shows only the
# multiprocessing spawn command, so operators, the fault tests and scripts/bench_server.py map roles to pids by it.
CHILD_LOG_LINE = "started %s pid %d"
_CHILD_LOG_PATTERN = re.compile(re.escape(CHILD_LOG_LINE).replace("%s", r"(\S+)").replace("%d", r"(\d+)"))


def child_pids_from_log(text: str) -> dict[str, int]:
    """Child name ("worker-tp0", "router", "detokenizer") -> pid, from a launcher log's CHILD_LOG_LINE lines (the fault
    tests and scripts/bench_server.py read them)."""
    return {name: int(pid) for name, pid in _CHILD_LOG_PATTERN.findall(text)}


class StartError(RuntimeError):
    """A child failed or timed out during start-up; the message carries its traceback."""


@dataclass
class Child:
    name: str
    proc: mp.Process
    conn: Connection


def resolve_config(config: ServerConfig) -> ServerConfig:
    """Fill in the defaults that need the machine or the model: the model folder, its facts (config.json,
    read here once for every process), device, dtype, batch sizes, ports. Raises StartError naming what
    cannot be served."""
    import torch

    from lightserve.kernels.cpu import cpu_has_native_bf16
    from lightserve.model_infer.models import check_tp, read_model_config

    if config.model_dir is None:
        from lightserve.model_prep import ensure_default_model
        model_dir = str(ensure_default_model())
    else:
        model_dir = str(Path(config.model_dir).expanduser())
        if not (Path(model_dir) / "config.json").is_file():
            raise StartError(f"--model_dir {model_dir}: no config.json there (expected a Hugging Face model folder)")
    try:
        model_config = read_model_config(model_dir)
    except (ValueError, KeyError) as exc:
        raise StartError(f"--model_dir {model_dir}: {exc}") from None
    device = config.device
    if device is Device.AUTO:
        device = Device.CUDA if torch.cuda.is_available() else Device.CPU
    if device is Device.CUDA and not torch.cuda.is_available():
        raise StartError("--device cuda: no CUDA device is available")
    backend = config.kernel_backend
    if backend is KernelBackend.AUTO:
        backend = KernelBackend.TRITON if device is Device.CUDA else KernelBackend.CPU
    if backend is KernelBackend.CPU and device is Device.CUDA:
        raise StartError("--kernel_backend cpu: the C kernels run on CPU only; use triton (or auto) with --device cuda")
    dtype = config.data_type
    if dtype is DType.AUTO:
        dtype = DType.BFLOAT16 if device is Device.CUDA or cpu_has_native_bf16() else DType.FLOAT32
    kv_dtype = config.kv_cache_dtype
    if kv_dtype is KVCacheDType.AUTO:
        kv_dtype = KVCacheDType(dtype.value)
    batch_max = config.batch_max_tokens or (GPU_BATCH_MAX_TOKENS if device is Device.CUDA else CPU_BATCH_MAX_TOKENS)
    join = config.prefill_join_tokens or (batch_max if device is Device.CUDA else CPU_PREFILL_JOIN_TOKENS)
    max_len = min(config.max_req_total_len or DEFAULT_MAX_REQ_TOTAL_LEN, model_config.max_context_len)
    nccl_port = config.nccl_port
    if config.tp > 1 and nccl_port == 0:
        if config.nnodes > 1:
            raise StartError("--nccl_port must be given when --nnodes > 1 (every node must use the same one)")
        nccl_port = _free_port_block(config.tp + 1)
    try:  # the model family's rules, before any rank starts (and hangs its peers)
        check_tp(model_config, config.tp)
    except ValueError as exc:
        raise StartError(f"--tp {config.tp} cannot split this model: {exc}") from None
    return replace(config, model_dir=model_dir, model=model_config, device=device, kernel_backend=backend,
                   data_type=dtype, kv_cache_dtype=kv_dtype,
                   batch_max_tokens=batch_max, chunked_prefill_size=config.chunked_prefill_size or batch_max,
                   prefill_join_tokens=join,
                   max_req_total_len=max_len, nccl_port=nccl_port,
                   served_model_name=config.served_model_name or (Path(model_dir).name,))


def check_shm_room(needed: int, shm_dir: Path = SHM_DIR) -> None:
    """Refuse a request pool larger than the free space of shm_dir. The segment is sparse, so creating it
    succeeds anyway; the first write past the space left would kill the writer with SIGBUS mid-serving."""
    st = os.statvfs(shm_dir)
    free = st.f_bavail * st.f_frsize
    if needed > free:
        raise StartError(f"the request pool needs {needed / 2**20:.0f} MiB of {shm_dir} but {free / 2**20:.0f} MiB "
                         "are free: lower --req_pool_size, --max_req_total_len or --max_top_logprobs, or enlarge "
                         f"{shm_dir} (docker: --shm-size)")


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


class EngineProcs:
    """The engine's child processes and the request pool of one launch (node 0 runs them all;
    other nodes run only their worker ranks)."""

    def __init__(self, config: ServerConfig):
        """`config`: resolved (resolve_config): it carries the model folder and facts to every child."""
        assert config.model is not None and config.model_dir is not None, "resolve_config first"
        self.config = config
        self.model_dir = config.model_dir
        self.children: list[Child] = []
        self.pool: ReqPool | None = None
        self.kv_size = 0
        self._ctx = mp.get_context("spawn")

    def start(self) -> ServerConfig:
        """Start everything; returns the config with the KV size the workers allocated (`kv_size`) and
        max_req_total_len capped by it."""
        from lightserve.detokenizer.process import run_detokenizer
        from lightserve.model_infer.process import run_worker
        from lightserve.router.process import run_router

        config = self.config
        stale = remove_stale_segments(SHM_PREFIX)
        remove_stale_segments(SHM_PREFIX, Path(_runtime_dir()))
        if stale:
            logger.warning("removed shared memory left by crashed launches: %s", ", ".join(stale))
        try:
            if config.is_master_node:
                check_shm_room(ReqPool.size_bytes(config.req_pool_size, config.max_req_total_len,
                                                  config.max_top_logprobs))
                self.pool = ReqPool.create(config.shm_name, config.req_pool_size, config.max_req_total_len,
                                            config.max_top_logprobs)
            saved_env = {name: os.environ.get(name) for name in WORKER_ENV}
            try:
                if config.device is Device.CPU:
                    preload_tcmalloc()
                    bound_omp_spin()
                    if config.kernel_backend is KernelBackend.TRITON:
                        interpret_triton()
                first = config.node_rank * config.ranks_per_node
                workers = [self._spawn(f"worker-tp{rank}", run_worker, config, rank)
                           for rank in range(first, first + config.ranks_per_node)]
            finally:
                for name, value in saved_env.items():  # the caller's own environment stays as it was
                    _restore_env(name, value)
            # The detokenizer needs nothing from the workers: it loads its tokenizer while they load
            # the model (start-up time is mostly imports, and they overlap).
            detok = [self._spawn("detokenizer", run_detokenizer, config)] \
                if config.is_master_node else []
            infos = self._wait_ready(workers)
            if not config.is_master_node:
                return config
            self.kv_size = min(info["kv_size"] for info in infos)
            config = replace(config, kv_size=self.kv_size,
                             max_req_total_len=min(config.max_req_total_len, self.kv_size))
            self.config = config
            self._wait_ready([self._spawn("router", run_router, config), *detok])
            return config
        except BaseException:
            self.stop()
            raise

    def _spawn(self, name: str, target, *args) -> Child:
        parent_conn, child_conn = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=target, args=(*args, child_conn), name=f"lightserve-{name}")
        proc.start()
        child_conn.close()
        logger.info(CHILD_LOG_LINE, name, proc.pid)  # child_pids_from_log reads it back
        child = Child(name, proc, parent_conn)
        self.children.append(child)
        return child

    def _wait_ready(self, children: list[Child]) -> list[dict]:
        deadline = time.monotonic() + self.config.start_timeout_s
        infos: dict[str, dict] = {}
        while len(infos) < len(children):
            pending = [c for c in children if c.name not in infos]
            waitables = [c.conn for c in pending] + [c.proc.sentinel for c in pending]
            if not wait(waitables, timeout=max(deadline - time.monotonic(), 0)):
                raise StartError(f"{', '.join(c.name for c in pending)} not ready after "
                                 f"{self.config.start_timeout_s:.0f} s")
            for c in pending:
                if c.conn.poll():
                    try:
                        kind, payload = c.conn.recv()
                    except EOFError:
                        kind, payload = "error", f"{c.name} exited with code {c.proc.exitcode} during start-up"
                    if kind == "error":
                        raise StartError(f"{c.name} failed to start:\n{payload}")
                    infos[c.name] = payload
                elif not c.proc.is_alive():
                    raise StartError(f"{c.name} exited with code {c.proc.exitcode} during start-up")
        return [infos[c.name] for c in children]

    def dead_child(self) -> Child | None:
        """The first child that has exited. Safe from any thread: it polls the sentinels and reaps
        nothing. (Process.is_alive reaps: called from /health while the watcher thread reaps too,
        its waitpid could fail and report a dead child alive, or the watcher's exit code None.)"""
        return self.watch(timeout=0)

    def watch(self, timeout: float | None = None) -> Child | None:
        """Block until a child exits (or timeout); return it, not yet reaped: join it for its exit
        code (the sentinel closes a moment before the kernel has the exit status)."""
        ready = wait([c.proc.sentinel for c in self.children], timeout=timeout)
        return next((c for c in self.children if c.proc.sentinel in ready), None)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM every child, join them for up to `grace_s`, SIGKILL stragglers, unlink the pool.
        Idempotent."""
        for c in self.children:
            if c.proc.is_alive():
                os.kill(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in self.children:
            c.proc.join(max(deadline - time.monotonic(), 0.05))
            if c.proc.is_alive():
                logger.warning("%s did not stop in %.0f s; killing it", c.name, grace_s)
                c.proc.kill()
                c.proc.join(2.0)
            c.conn.close()
        self.children.clear()
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        remove_instance_files(self.config)  # the pool segment and the zmq ipc socket files


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _runtime_dir() -> str:
    import tempfile
    return tempfile.gettempdir()


def _free_port_block(n: int) -> int:
    """A port p such that p .. p+n-1 look free (the TP rendezvous and the plan sockets)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base + 1, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise StartError("no free block of ports for the tensor-parallel group")
