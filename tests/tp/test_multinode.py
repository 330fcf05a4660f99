"""Two nodes simulated on one machine over loopback: node 0 (HTTP front, router, detokenizer, rank 0)
and node 1 (rank 1 only, plans over tcp) give the same outputs as --tp 2 on one node. Then node 0
dies (SIGKILL of its whole process group, like a lost machine) and node 1 stops on its own."""
from __future__ import annotations

import os
import random
import re
import signal
import socket
from pathlib import Path

from tests.e2e.server import ServerProc, wait_until
from tests.tp.conftest import TINY_NEW_TOKENS
from tests.tp.helpers import PROMPTS, SERVER_FLAGS, generate_greedy

NODE1_STOP_S = 30
NODE1_STOP_LINE = re.compile(r"ERROR \[launcher\] .*: (node 0 \(rank 0's store at 127\.0\.0\.1:\d+\) unreachable for "
                             r"\d+ probes|worker-tp1 \(pid \d+\) exited with code (-?\d+|None)); stopping this node")


def test_two_nodes_match_single_node_tp2(tiny_model_dir, tiny_tp2_outputs, tmp_path):
    port = _free_port_block(3)  # rendezvous store + one plan socket per rank
    common = (*SERVER_FLAGS, "--model_dir", str(tiny_model_dir), "--tp", "2", "--nnodes", "2",
              "--nccl_host", "127.0.0.1", "--nccl_port", str(port))
    block = range(port, port + 3)  # not bound until the servers start: their HTTP ports must stay outside it
    node0 = ServerProc(*common, "--node_rank", "0", log_path=tmp_path / "node0.log", avoid_ports=block)
    node1 = ServerProc(*common, "--node_rank", "1", log_path=tmp_path / "node1.log", avoid_ports=block)
    try:
        node0.wait_ready()
        assert node1.proc.poll() is None, node1.log_tail()
        assert generate_greedy(node0.url, PROMPTS, TINY_NEW_TOKENS) == tiny_tp2_outputs
        node1_log = node1.log_tail(100_000)
        assert "[worker-tp1]" in node1_log and "[worker-tp0]" not in node1_log
        assert "[router]" not in node1_log and "[detokenizer]" not in node1_log  # node 0's alone
        node1_children = node1.children()
        os.killpg(node0.pid, signal.SIGKILL)
        assert wait_until(lambda: node1.proc.poll() is not None, NODE1_STOP_S), node1.log_tail()
        assert node1.proc.returncode == 3, node1.log_tail()
        # Node 1's launcher says why it stopped: its probe of node 0's store failed, or its rank died
        # in a collective with the dead rank 0 (launch_server._serve_worker_node).
        assert NODE1_STOP_LINE.search(node1.log_tail(100_000)), node1.log_tail()
        assert wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in node1_children), 10), \
            "orphaned process on node 1"
    finally:
        node1.stop()
        node0.stop(signal.SIGKILL)
        for path in Path("/dev/shm").glob(f"lightserve-{node0.pid}-*"):  # node 0 was killed outright
            path.unlink(missing_ok=True)


def _free_port_block(n: int) -> int:
    """A base port with base .. base + n - 1 free, below the kernel's ephemeral range: a block taken from inside it
    once lost base + 1 to an outgoing connection (gloo's) between this check and the router's bind."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    for _ in range(50):
        base = random.randrange(10000, low - n)
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise RuntimeError("no free block of ports")
