"""kill -9 of one TP rank while requests run: the launcher stops the whole server within a bounded
time, names the rank, and leaves no child process and no shm segment behind."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx

from tests.e2e.server import wait_until
from tests.tp.helpers import child_pid, start_server

STOP_BOUND_S = 30


def test_killing_a_rank_stops_the_server(tiny_model_dir, tmp_path):
    log = tmp_path / "server.log"
    srv, _ = start_server(log, "--model_dir", str(tiny_model_dir), "--tp", "2")
    try:
        children = srv.children()
        # The request pool's segment exists while the server runs, so the check after the crash
        # that none is left proves the launcher removed it (not that it was named otherwise).
        assert srv.shm_segments(), "no /dev/shm/lightserve-<launcher pid>-* segment while the server runs"
        assert len(children) >= 4  # 2 ranks, router, detokenizer (+ uvicorn's helpers, if any)
        rank1 = child_pid(log.read_text(), 1)
        assert rank1 in children
        statuses: list[int | str] = []

        def long_request() -> None:
            try:
                statuses.append(httpx.post(srv.url + "/generate", timeout=120, json={
                    "inputs": "Once upon a time", "parameters": {"max_new_tokens": 500, "ignore_eos": True}}
                ).status_code)
            except httpx.HTTPError as exc:
                statuses.append(type(exc).__name__)

        clients = [threading.Thread(target=long_request) for _ in range(2)]
        for t in clients:
            t.start()
        assert wait_until(lambda: srv.metrics().get("lightserve_generation_tokens_total", 0) > 0, 60)
        os.kill(rank1, signal.SIGKILL)
        t0 = time.monotonic()
        assert wait_until(lambda: srv.proc.poll() is not None, STOP_BOUND_S), srv.log_tail()
        assert time.monotonic() - t0 < STOP_BOUND_S
        assert srv.proc.returncode == 3
        text = log.read_text()
        assert f"worker-tp1 (pid {rank1}) exited with code -9; stopping the server" in text, srv.log_tail()
        for t in clients:
            t.join(30)
        assert statuses and 200 not in statuses  # the requests in flight ended with an error
        assert wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children), 10), "orphans"
        assert srv.shm_segments() == []
    finally:
        srv.stop(signal.SIGKILL)
