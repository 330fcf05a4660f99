"""The end-state checks of scripts/soak.py, without a server: each leak is named, and the launcher
is found from its listening socket."""
from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path

_spec = importlib.util.spec_from_file_location("soak", Path(__file__).parents[2] / "scripts" / "soak.py")
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)

IDLE = {"requests_running": 0, "requests_waiting": 0, "requests_paused": 0, "requests_in_front": 0,
        "requests_queued": 0, "kv_tokens_free": 900, "kv_tokens_cached": 124, "kv_tokens_total": 1024,
        "req_slots_free": 16, "req_slots_total": 16}


def test_idle_server_has_no_problems():
    assert soak.idle_problems(IDLE) == []


def test_each_leak_is_named():
    problems = soak.idle_problems(IDLE | {"requests_in_front": 1, "kv_tokens_free": 899, "req_slots_free": 15})
    assert len(problems) == 3
    assert "requests_in_front" in problems[0] and "KV leaked" in problems[1] and "slots leaked" in problems[2]


def test_listener_pid_finds_the_process_holding_the_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert soak.listener_pid(s.getsockname()[1]) == os.getpid()
