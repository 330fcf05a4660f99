"""Start-up hygiene and the request timeout, on one server: shm segments and ipc files left by a
crashed earlier launch are removed at start (a live process's are not), the CPU worker starts with
OpenMP threads that sleep soon after a parallel region, and --request_timeout_s ends a running
request and one still queued for the (single) request slot. The server runs --data_type bfloat16
(the other served tests run float32, or auto in test_health.py): its start-up log names the dtype,
and greedy chat answers as transformers' bf16 does."""
from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from lightserve.engine.host_tuning import OMP_SPIN_ROUNDS, bound_omp_spin
from tests.e2e.server import RUNTIME_DIRS
from tests.reliability.helpers import (
    HTTP_TIMEOUT_S,
    RawRequest,
    assert_idle,
    child_pids,
    gen_body,
    start_server,
    wait_metric,
)

TIMEOUT_S = 8
# A timeout never fires early; how late it may end a request is the longer of SLACK_S and the
# server's start-up time measured by the fixture (a loaded machine slows both alike).
SLACK_S = 15


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert not Path(f"/proc/{proc.pid}").exists()
    return proc.pid


@pytest.fixture(scope="module")
def leftovers():
    """Files named like a crashed launcher's (dead pid) and like a live one's (this test's pid)."""
    dead = _dead_pid()
    shm, sockets = RUNTIME_DIRS
    stale = [shm / f"lightserve-{dead}-abcdef-reqs", sockets / f"lightserve-{dead}-abcdef-router"]
    live = [shm / f"lightserve-{os.getpid()}-abcdef-reqs", sockets / f"lightserve-{os.getpid()}-abcdef-router"]
    for path in stale + live:
        path.write_bytes(b"\0" * 4096)
    yield stale, live
    for path in stale + live:
        path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory, leftovers):
    t0 = time.monotonic()
    srv = start_server(tmp_path_factory.mktemp("startup"), "--data_type", "bfloat16", "--max_total_token_num", "4096",
                       "--req_pool_size", "1", "--request_timeout_s", str(TIMEOUT_S))
    srv.start_s = time.monotonic() - t0
    yield srv
    srv.stop()


def test_stale_files_of_dead_launchers_removed_live_ones_kept(server, leftovers):
    stale, live = leftovers
    assert [p for p in stale if p.exists()] == []
    assert all(p.exists() and p.stat().st_size == 4096 for p in live)
    assert stale[0].name in server.log_tail(20000)  # the launcher says what it removed


def test_serves_bfloat16_as_its_start_up_log_says(server):
    log = server.log_path.read_text()
    assert "device cpu, dtype bfloat16, tp 1" in log or "device cuda, dtype bfloat16, tp 1" in log, log[:2000]
    assert "torch.bfloat16 on" in log  # the worker's KV cache line
    assert httpx.get(server.url + "/get_server_info", timeout=HTTP_TIMEOUT_S).json()["dtype"] == "bfloat16"
    r = httpx.post(server.url + "/v1/chat/completions", timeout=HTTP_TIMEOUT_S, json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12,
        "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("The capital of France is Paris.", "stop")


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def test_cpu_worker_openmp_threads_sleep_soon_after_a_region(server):
    """host_tuning.bound_omp_spin: the worker starts with GOMP_SPINCOUNT, the router and the detokenizer (spawned
    after the launcher restored its own environment) without it, unless the caller set it."""
    pids = child_pids(server)
    caller = {k: os.environ[k] for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY") if k in os.environ}
    expected = caller.get("GOMP_SPINCOUNT", None if caller else OMP_SPIN_ROUNDS)
    assert _environ(pids["worker-tp0"]).get("GOMP_SPINCOUNT") == expected
    for name in ("router", "detokenizer"):
        assert _environ(pids[name]).get("GOMP_SPINCOUNT") == caller.get("GOMP_SPINCOUNT"), name


@pytest.mark.parametrize("user", [{}, {"GOMP_SPINCOUNT": "7"}, {"OMP_WAIT_POLICY": "active"}])
def test_bound_omp_spin_leaves_a_users_own_choice(monkeypatch, user):
    # A copy of the environment stands in for it: the variable bound_omp_spin sets must not outlive the test.
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")} | user
    monkeypatch.setattr(os, "environ", env)
    bound_omp_spin()
    assert env.get("GOMP_SPINCOUNT") == user.get("GOMP_SPINCOUNT", None if user else OMP_SPIN_ROUNDS)
    assert env.get("OMP_WAIT_POLICY") == user.get("OMP_WAIT_POLICY")


def test_request_timeout_ends_running_and_queued_requests(server):
    late_s = max(SLACK_S, server.start_s)

    async def run():
        t0 = time.monotonic()
        running = await RawRequest.post(server.url, "/generate_stream", gen_body("Tell me a story.", 2000))
        # The second request queues only once the first holds the single request slot.
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: wait_metric(server.url, lambda m: m["req_slots_free"] == 0, TIMEOUT_S))
        t1 = time.monotonic()
        queued = await RawRequest.post(server.url, "/generate", gen_body("And another one.", 2000))
        status = await asyncio.wait_for(running.read_head(), TIMEOUT_S + late_s)
        events = []
        if status == 200:  # the stream started before the deadline: it ends with an error event
            while (event := await asyncio.wait_for(running.next_event(), TIMEOUT_S + late_s)) is not None:
                events.append(event)
        running_s = time.monotonic() - t0
        queued_status = await asyncio.wait_for(queued.read_head(), TIMEOUT_S + late_s)
        queued_body = await queued.read_body()
        return status, events, running_s, queued_status, queued_body, time.monotonic() - t1

    status, events, running_s, queued_status, queued_body, queued_s = asyncio.run(run())
    assert status == 408 or ("error" in events[-1] and events[-1]["finish_reason"] == "abort"), (status, events[-3:])
    assert TIMEOUT_S - 0.5 <= running_s <= TIMEOUT_S + late_s, running_s
    assert queued_status == 408, queued_body
    assert TIMEOUT_S - 0.5 <= queued_s <= TIMEOUT_S + late_s, queued_s
    assert_idle(server.url)
