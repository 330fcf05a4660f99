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
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path

from lightserve.config import SHM_PREFIX, ServerConfig
from lightserve.engine.host_tuning import worker_env
from lightserve.log import get_logger
from lightserve.procutil import remove_instance_files
from lightserve.shm.req_pool import ReqPool
from lightserve.shm.segment import SHM_DIR, remove_stale_segments

logger = get_logger(__name__)

STOP_GRACE_S = 5.0
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


def check_shm_room(needed: int, shm_dir: Path = SHM_DIR) -> None:
    """Refuse a request pool larger than the free space of shm_dir. The segment is sparse, so creating it
    succeeds anyway; the first write past the space left would kill the writer with SIGBUS mid-serving."""
    st = os.statvfs(shm_dir)
    free = st.f_bavail * st.f_frsize
    if needed > free:
        raise StartError(f"the request pool needs {needed / 2**20:.0f} MiB of {shm_dir} but {free / 2**20:.0f} MiB "
                         "are free: lower --req_pool_size, --max_req_total_len or --max_top_logprobs, or enlarge "
                         f"{shm_dir} (docker: --shm-size)")


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
            with worker_env(config):
                first = config.node_rank * config.ranks_per_node
                workers = [self._spawn(f"worker-tp{rank}", run_worker, config, rank)
                           for rank in range(first, first + config.ranks_per_node)]
            # The detokenizer needs nothing from the workers: it loads its tokenizer while they load
            # the model (start-up time is mostly imports, and they overlap).
            detok = [self._spawn("detokenizer", run_detokenizer, config)] \
                if config.is_master_node else []
            infos = self._wait_ready(workers)
            if not config.is_master_node:
                return config
            self.kv_size = min(info["kv_size"] for info in infos)
            config = replace(config, kv_size=self.kv_size, kv_bytes_per_token=infos[0]["kv_bytes_per_token"],
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


def _runtime_dir() -> str:
    import tempfile
    return tempfile.gettempdir()
