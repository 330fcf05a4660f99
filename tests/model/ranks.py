"""run_ranks: a function run as each rank of a tensor-parallel group of spawned processes (gloo on CPU), for the
model tests that compare tp > 1 against tp 1."""
from __future__ import annotations

import multiprocessing as mp
import socket
from collections.abc import Callable


def run_ranks(target: Callable, tp: int, *args, timeout_s: float = 120) -> list[int]:
    """Start `target(rank, port, *args)` for every rank in spawned processes (port: a free one for the group's
    rendezvous), wait for them, kill any still alive after `timeout_s`. Returns their exit codes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(rank, port, *args)) for rank in range(tp)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [p.exitcode for p in procs]
