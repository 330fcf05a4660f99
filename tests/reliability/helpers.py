"""What the reliability tests share: a real server with known child pids, idle-state checks over
/metrics, and a raw HTTP/1.1 client that can drop its connection at an exact point of a request."""
from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx

from lightserve.engine.procs import child_pids_from_log
from lightserve.http.metrics import idle_problems
from tests.e2e.server import RUNTIME_DIRS, ServerProc, wait_until

CHILD_NAMES = ("worker-tp0", "router", "detokenizer")
IDLE_TIMEOUT_S = 180
HTTP_TIMEOUT_S = 600  # a loaded 2-core machine can take seconds per step; only a hang should trip this


def start_server(log_dir: Path, *args: str) -> ServerProc:
    """A float32 server on the bundled model; its log (with the child pids) in `log_dir`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    srv = ServerProc("--data_type", "float32", *args, log_path=log_dir / "server.log")
    try:
        return srv.wait_ready()
    except BaseException:
        srv.stop()
        raise


def child_pids(srv: ServerProc) -> dict[str, int]:
    """The server's children by name, from its log (engine.procs.child_pids_from_log)."""
    return child_pids_from_log(srv.log_path.read_text(errors="replace"))


def alive(pid: int) -> bool:
    """True for a running process (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def instance_files(launcher_pid: int) -> list[str]:
    """Shared-memory segments and ipc socket files of a launch (both are named lightserve-<pid>-...)."""
    return sorted(str(p) for d in RUNTIME_DIRS for p in d.glob(f"lightserve-{launcher_pid}-*"))


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """The unlabelled samples of /metrics."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=60).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("lightserve_")] = float(value)
    return out


def finished_by_reason(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """The requests_finished counter per reason (stop, length, abort, disconnect, error)."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=60).text
    return {m.group(1): float(m.group(2)) for m in _FINISHED_LINE.finditer(text)}


_FINISHED_LINE = re.compile(r'^lightserve_requests_finished_total\{reason="(\w+)"\} (\S+)$', re.MULTILINE)


def assert_idle(url: str, headers: dict[str, str] | None = None, timeout: float = IDLE_TIMEOUT_S) -> dict[str, float]:
    """Wait (the router frees an aborted request's KV between steps) until nothing is held; return
    the metrics. Fails naming what leaked."""
    last: dict[str, float] = {}

    def idle() -> bool:
        nonlocal last
        last = scrape(url, headers)
        return not idle_problems(last)

    wait_until(idle, timeout, interval=0.25)
    assert not idle_problems(last), f"not idle after {timeout} s: {idle_problems(last)}"
    return last


def wait_metric(url: str, cond, timeout: float, headers: dict[str, str] | None = None,
                interval: float = 0.05) -> dict[str, float]:
    """Poll /metrics until cond(metrics) holds; return those metrics (AssertionError on timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url, headers)
        if cond(m):
            return m
        assert time.monotonic() < deadline, f"condition not met in {timeout} s; metrics: {m}"
        time.sleep(interval)


class RawRequest:
    """One POST over its own TCP connection. `abort()` drops the connection (an RST, as a killed
    client would), at whatever point the test has reached: before the response, mid-stream."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.status: int | None = None
        self.headers: dict[str, str] = {}

    @classmethod
    async def post(cls, url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> RawRequest:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        head = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
                f"Content-Length: {len(data)}", "Connection: close"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        await writer.drain()
        return cls(reader, writer)

    async def read_head(self) -> int:
        status_line = await self.reader.readline()
        assert status_line, "connection closed before a status line"
        self.status = int(status_line.split()[1])
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            self.headers[name.strip().lower()] = value.strip()
        return self.status

    async def next_event(self) -> dict | None:
        """The next SSE `data:` payload (None at [DONE] or the end of the connection). Chunked
        framing lines are skipped: every chunk the server sends holds whole events."""
        while line := await self.reader.readline():
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return None
            return json.loads(payload)
        return None

    async def read_body(self) -> bytes:
        return await self.reader.read()

    def abort(self) -> None:
        self.writer.transport.abort()


def gen_body(prompt: str, max_new_tokens: int, **params: Any) -> dict:
    return {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True, **params}}


def distinct_prompt(i: int, num_words: int) -> str:
    """A prompt sharing no prefix with other values of i (so the radix cache does not merge them)."""
    return f"{i} " + " ".join(f"w{i}x{j}" for j in range(num_words))
