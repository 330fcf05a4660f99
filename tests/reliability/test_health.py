"""/health_generate on a real server: one token through the engine answers 200; a worker stopped
with SIGSTOP (alive, but wedged) makes it answer 503 within --health_generate_timeout_s while the
cheap /health still answers 200; after SIGCONT it recovers and nothing stays held. Also the model
and server cards that routers read when a replica registers.

One server for the module, with `--data_type auto` as `make serve` runs it (the other served tests
name their dtype: float32, or bfloat16 in test_startup.py): the start-up log and the server card name
the dtype it resolved to, and greedy chat answers as transformers does in it. The server stops at the
end: exit code 0, and none of its segments or socket files left."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.e2e.server import RUNTIME_DIRS, files_left, lightserve_files, wait_until
from tests.reliability.helpers import assert_idle, child_pids, instance_files, start_server

PROBE_TIMEOUT_S = 3
SLACK_S = 3  # the HTTP round trip and a loaded machine


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    before = lightserve_files()
    srv = start_server(tmp_path_factory.mktemp("health"), "--data_type", "auto", "--max_total_token_num", "4096",
                       "--health_generate_timeout_s", str(PROBE_TIMEOUT_S))
    children = child_pids(srv)
    try:
        running = instance_files(srv.pid)  # the leak check below looks where these live
        assert any(f.endswith("-reqs") for f in running) and any(Path(f).parent == RUNTIME_DIRS[1] for f in running)
        yield srv
    finally:
        for pid in children.values():  # a test that failed with the worker stopped
            os.kill(pid, signal.SIGCONT)
        code = srv.stop()
    assert code == 0, srv.log_tail()
    assert files_left(before, [srv.pid, *children.values()]) == []


def test_data_type_auto_names_its_choice_and_answers_greedy(server):
    """auto: bfloat16 on CUDA (the bundled model's float conversion there); float32 on CPU, where the bundled model is
    its Q4_1 GGUF, whose packed weights multiply float32 activations (bf16 activations only on native-bf16 CPUs and
    float weights: tests/model/test_registry.py)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    log = server.log_path.read_text()
    assert f"device {device}, dtype {dtype}, tp 1" in log, log[:2000]
    assert f"torch.{dtype} on" in log  # the worker's KV cache line
    assert httpx.get(server.url + "/get_server_info", timeout=60).json()["dtype"] == dtype
    r = httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12,
        "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("The capital of France is Paris.", "stop")


def test_health_generate_sees_a_wedged_worker_and_recovers(server):
    worker = child_pids(server)["worker-tp0"]
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
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
        assert_idle(server.url)  # the abandoned probe's slot and KV came back
    finally:
        os.kill(worker, signal.SIGCONT)
