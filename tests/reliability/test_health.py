"""/health_generate on a real server: one token through the engine answers 200; a worker stopped
with SIGSTOP (alive, but wedged) makes it answer 503 within --health_generate_timeout_s while the
cheap /health still answers 200; after SIGCONT it recovers and nothing stays held. Also the model
and server cards that routers read when a replica registers."""
from __future__ import annotations

import os
import signal
import time

import httpx

from tests.e2e.server import wait_until
from tests.reliability.helpers import assert_idle, child_pids, instance_files, start_server

PROBE_TIMEOUT_S = 3
SLACK_S = 3  # the HTTP round trip and a loaded machine


def test_health_generate_sees_a_wedged_worker_and_recovers(tmp_path):
    srv = start_server(tmp_path, "--max_total_token_num", "4096", "--health_generate_timeout_s", str(PROBE_TIMEOUT_S))
    worker = child_pids(srv)["worker-tp0"]
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            assert client.get("/health_generate").json() == {"status": "ok"}
            info = client.get("/get_model_info").json()
            assert info["served_model_name"] == "SmolLM2-135M-Instruct" and info["is_generation"] is True
            assert os.path.isfile(os.path.join(info["tokenizer_path"], "tokenizer.json"))
            server_info = client.get("/server_info").json()
            assert server_info["served_model_name"] == info["served_model_name"] and server_info["tp_size"] == 1
            assert client.get("/get_server_info").json() == server_info

            os.kill(worker, signal.SIGSTOP)
            t0 = time.monotonic()
            wedged = client.get("/health_generate")
            took = time.monotonic() - t0
            assert wedged.status_code == 503, wedged.text
            assert "no output token" in wedged.json()["reason"]
            assert PROBE_TIMEOUT_S - 0.5 <= took <= PROBE_TIMEOUT_S + SLACK_S, took
            assert client.get("/health").status_code == 200  # the processes are all alive

            os.kill(worker, signal.SIGCONT)
            assert wait_until(lambda: client.get("/health_generate").status_code == 200, 60)
        assert_idle(srv.url)  # the abandoned probe's slot and KV came back
    finally:
        os.kill(worker, signal.SIGCONT)
        code = srv.stop()
    assert code == 0, srv.log_tail()
    assert instance_files(srv.pid) == []
