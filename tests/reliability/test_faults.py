"""kill -9 of one engine process (worker, router, detokenizer) while requests are in flight:
/health turns 503, the in-flight requests end with an error instead of hanging, and the launcher
stops every process, removes every shm segment and ipc file, and exits non-zero with a log line
naming the dead process. One server per victim (the server does not survive it).

How fast: on an idle machine within 10 s of the kill. A loaded machine slows the stop as it slows
everything, so the bound is the longer of 10 s and the same server's start-up time, measured in the
test: stopping (no model to load, a 1 s grace for the other children) takes a fraction of a start,
while a stop that waited on a hang or a timeout would take far longer.

Child pids come from the launcher's "started <name> pid <pid>" log lines (see helpers.child_pids).
"""
from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import threading
import time

import httpx
import pytest

from lightserve.launch_server import EXIT_CHILD_DIED
from tests.e2e.server import wait_until
from tests.reliability.helpers import (
    CHILD_NAMES,
    RawRequest,
    alive,
    child_pids,
    gen_body,
    instance_files,
    start_server,
    wait_metric,
)

STOP_WITHIN_S = 10  # on an idle machine; see the module docstring for a loaded one


class HealthPoller(threading.Thread):
    """Polls /health over one kept-alive connection from before the kill until the port closes,
    recording (time sent, status or None for a transport error)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.seen, self.bodies, self.stop = url, [], {}, threading.Event()

    def run(self) -> None:
        errors = 0
        with httpx.Client(timeout=5) as client:
            while not self.stop.is_set() and errors < 3:  # 3 transport errors in a row: it is gone
                sent = time.monotonic()
                try:
                    r = client.get(self.url + "/health")
                    self.seen.append((sent, r.status_code))
                    self.bodies[r.status_code] = r.json()
                    errors = 0
                except httpx.TransportError:
                    self.seen.append((sent, None))
                    errors += 1
                time.sleep(0.01)

    def after(self, t: float) -> list[int | None]:
        return [status for at, status in self.seen if at > t]


async def _stream_outcome(req: RawRequest) -> list[dict]:
    events = []
    while (event := await req.next_event()) is not None:
        events.append(event)
        if event.get("finished"):
            break
    return events


async def _kill_under_load(url: str, pid: int, bound_s: float) -> tuple[float, float, list[dict], int, bytes]:
    """Start a stream (wait for its first token) and a non-streaming request, kill -9 `pid`, and
    collect what the clients see (each must hear of the failure within bound_s)."""
    stream = await RawRequest.post(url, "/generate_stream", gen_body("Tell me a long story about a dragon.", 500))
    assert await stream.read_head() == 200
    assert "token" in (await stream.next_event())
    plain = await RawRequest.post(url, "/generate", gen_body("Write an essay about rivers.", 500))
    await asyncio.get_running_loop().run_in_executor(
        None, lambda: wait_metric(url, lambda m: m["requests_in_front"] == 2, 120))
    # A pidfd turns readable once the whole process has exited (all its threads, memory torn
    # down), which is when its parent can see it: /proc's zombie state of the main thread comes
    # earlier, while the other threads of a big process still exit.
    pidfd = os.pidfd_open(pid)
    try:
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        while not select.select([pidfd], [], [], 0)[0]:
            await asyncio.sleep(0.005)
        t_dead = time.monotonic()
    finally:
        os.close(pidfd)
    events = await asyncio.wait_for(_stream_outcome(stream), bound_s)
    status = await asyncio.wait_for(plain.read_head(), bound_s)
    body = await asyncio.wait_for(plain.read_body(), bound_s)
    return t_kill, t_dead, events, status, body


@pytest.mark.parametrize("victim", CHILD_NAMES)
def test_kill_9_stops_everything_and_names_the_dead(tmp_path, victim):
    t0 = time.monotonic()
    srv = start_server(tmp_path, "--max_total_token_num", "4096")
    bound_s = max(STOP_WITHIN_S, time.monotonic() - t0)
    health = HealthPoller(srv.url)
    try:
        pids = child_pids(srv)
        assert set(pids) == set(CHILD_NAMES), srv.log_tail()
        kids = srv.children()  # the three, and multiprocessing's resource tracker
        assert set(pids.values()) <= set(kids), (pids, kids)
        assert instance_files(srv.pid)  # the pool segment and ipc sockets exist while it runs
        health.start()
        t_kill, t_dead, events, status, body = asyncio.run(_kill_under_load(srv.url, pids[victim], bound_s))
        # The stream ended with an error event, the plain request with 503: both name the cause.
        assert events and "error" in events[-1] and victim in events[-1]["error"], events
        assert status == 503 and victim.encode() in body, (status, body)
        # The launcher stops everything and exits non-zero within the bound of the kill.
        try:
            code = srv.proc.wait(timeout=max(bound_s - (time.monotonic() - t_kill), 0.1))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher still runs {bound_s:.1f} s after {victim} died:\n{srv.log_tail()}")
        assert code == EXIT_CHILD_DIED, srv.log_tail()
        health.join(10)
        # /health: 503 for every request sent once the process was gone, naming it, until the port closed.
        answers = [s for s in health.after(t_dead) if s is not None]
        assert answers and set(answers) == {503}, (t_dead - t_kill, health.after(t_kill))
        assert victim in health.bodies[503]["reason"], health.bodies
        assert f"{victim} (pid {pids[victim]}) exited with code -9" in srv.log_tail(20000)
        # The resource tracker leaves when it reads EOF from the gone launcher: give it a moment.
        assert wait_until(lambda: not [p for p in kids if alive(p)], 5), srv.log_tail()
        assert instance_files(srv.pid) == []
    finally:
        health.stop.set()
        srv.stop()
