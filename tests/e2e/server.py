"""ServerProc: a real `python -m lightserve.launch_server` subprocess for end-to-end tests."""
from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from lightserve.config import SHM_PREFIX

# Where a launch keeps its files, all named lightserve-<launcher pid>-...: its shm segments, and its
# zmq ipc socket files (ServerConfig's addresses, in the temp dir, which TMPDIR may move off /tmp).
RUNTIME_DIRS = (Path("/dev/shm"), Path(tempfile.gettempdir()))
MODEL_DIR = Path(os.environ.get("LIGHTSERVE_CACHE", Path.home() / ".cache" / "lightserve")) / "SmolLM2-135M-Instruct"
START_TIMEOUT_S = 300


def free_port(avoid: range = range(0)) -> int:
    """A port free now, outside `avoid` (ports a test has set aside for other sockets but not bound yet)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


class ServerProc:
    def __init__(self, *args: str, log_path: Path | None = None, avoid_ports: range = range(0)):
        self.port = free_port(avoid_ports)
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "lightserve.launch_server", "--port", str(self.port), *args]
        self.log_path = log_path
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        # A new session: a test can signal the launcher alone, like a user's kill, or the group.
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=self._log, start_new_session=True)
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> ServerProc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready in {timeout} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def children(self) -> list[int]:
        return [int(p) for p in _pgrep_children(self.pid)]

    def shm_segments(self) -> list[str]:
        return sorted(p.name for p in Path("/dev/shm").glob(f"lightserve-{self.pid}-*"))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        return self.proc.returncode


@contextmanager
def servers_together(log_dir: Path, common: tuple[str, ...], **variants: tuple[str, ...]) -> Iterator[list[ServerProc]]:
    """One ready server per variant (its flags after `common`, its log `<name>.log` in log_dir), started together so
    their start-ups overlap, in the order given; every one stopped however the block ends."""
    procs = [ServerProc(*common, *args, log_path=log_dir / f"{name}.log") for name, args in variants.items()]
    try:
        yield [proc.wait_ready() for proc in procs]
    finally:
        for proc in procs:
            proc.stop()


@functools.cache
def bundled_tokenizer():
    """The bundled model's tokenizer (transformers'), loaded once per test process."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


def chat_prompt(text: str) -> str:
    """The bundled model's chat template around one user message, ready for generation."""
    return bundled_tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True)


def _pgrep_children(pid: int) -> list[str]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return out.split()


def lightserve_files() -> set[str]:
    """Every lightserve-* shm segment and ipc socket file present now: the snapshot a leak check takes
    before its test starts anything."""
    return {str(p) for d in RUNTIME_DIRS for p in d.glob(f"{SHM_PREFIX}*")}


def files_left(before: set[str], pids: Iterable[int]) -> list[str]:
    """The lightserve-* files present now, absent from the snapshot `before`, and named after one of
    `pids` (a launcher, its children, or this process for the pipelines it started): what this test's
    processes left behind. Files older than the snapshot, or of tests running beside this one (other
    pids), are not blamed."""
    mine = tuple(f"{SHM_PREFIX}{pid}-" for pid in pids)
    return sorted(f for f in lightserve_files() - before if Path(f).name.startswith(mine))


def wait_until(cond, timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return cond()
