"""Two small-KV replicas behind sglang-router (an existing cache-aware load balancer, from the test
extras) on loopback: requests sharing a long prefix go to one replica and report the prefix as
cached_tokens, and when one replica is killed mid-load every request still ends (answered through
the router's retry, or with a clean error), never hangs, and the replica leaves nothing behind."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import RUNTIME_DIRS, ServerProc, files_left, free_port, lightserve_files, wait_until
from tests.reliability.helpers import alive

pytest.importorskip("sglang_router")
openai = pytest.importorskip("openai")

REPLICA_FLAGS = ("--data_type", "float32", "--max_total_token_num", "4096")
ROUTER_READY_S = 60
REQUEST_TIMEOUT_S = 180  # a hang, not a slow 2-core machine, should trip this
MAX_TOKENS = 8  # of each request of the kill test: a complete answer has all of them
PREFIX = "You are a careful assistant. " + " ".join(f"Rule {i}: be kind to item {i}." for i in range(40))


class Router:
    """`python -m sglang_router.launch_router` on free loopback ports."""

    def __init__(self, worker_urls: list[str], policy: str, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
             "--worker-urls", *worker_urls, "--policy", policy, "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(free_port()), "--shutdown-grace-period-secs", "1", "--log-level", "warn"],
            stdout=self._log, stderr=self._log, start_new_session=True)

    def wait_ready(self, model: str) -> Router:
        def registered() -> bool:  # the router lists a model once it has registered a worker
            try:
                data = httpx.get(self.url + "/v1/models", timeout=2).json()["data"]
            except (httpx.HTTPError, ValueError, KeyError):
                return False
            return any(m["id"] == model for m in data)

        assert self.proc.poll() is None
        assert wait_until(registered, ROUTER_READY_S), f"router not ready in {ROUTER_READY_S} s"
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def files_before() -> set[str]:
    """The lightserve-* segments and socket files before the replicas start: the leak check compares with it."""
    return lightserve_files()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, files_before):
    logs = tmp_path_factory.mktemp("replicas")
    replicas = [ServerProc(*REPLICA_FLAGS, log_path=logs / f"replica{i}.log") for i in range(2)]
    router = None
    try:
        for r in replicas:
            r.wait_ready()
        model = httpx.get(replicas[0].url + "/v1/models").json()["data"][0]["id"]
        router = Router([r.url for r in replicas], "cache_aware", logs / "router.log").wait_ready(model)
        yield replicas, router, model
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.stop()


def _served(replica: ServerProc) -> float:
    """Generation requests this replica answered (its requests_total, all statuses)."""
    text = httpx.get(replica.url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("lightserve_requests_total{"))


def test_shared_prefix_is_routed_to_one_replica_and_cached(fleet):
    replicas, router, model = fleet
    prefix_len = httpx.post(replicas[0].url + "/tokenize", json={"prompt": PREFIX}).json()["count"]
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)

    def ask(i: int):
        r = client.completions.create(model=model, prompt=f"{PREFIX} Question {i}: what is {i} plus {i}?",
                                      max_tokens=4, temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens

    before = [_served(r) for r in replicas]
    assert ask(0) < prefix_len  # the first computes the prefix
    with concurrent.futures.ThreadPoolExecutor(7) as pool:
        cached = list(pool.map(ask, range(1, 8)))
    assert all(c >= prefix_len - 1 for c in cached), (cached, prefix_len)
    served = sorted(_served(r) - b for r, b in zip(replicas, before))
    assert served == [0, 8], served


def test_router_keeps_answering_when_a_replica_dies_mid_load(fleet, files_before):
    replicas, router, model = fleet
    victim = replicas[1]
    victim_children = victim.children()
    victim_files = files_left(files_before, [victim.pid])  # its pool segment and ipc sockets, while it runs
    assert any(f.endswith("-reqs") for f in victim_files), victim_files
    assert any(Path(f).parent == RUNTIME_DIRS[1] for f in victim_files), victim_files
    num, in_flight, kill_after = 24, 12, 4

    async def run() -> list[tuple[str, float]]:
        sem = asyncio.Semaphore(in_flight)
        done: list[int] = []

        async def one(client: httpx.AsyncClient, i: int) -> tuple[str, float]:
            # Distinct prompts: cache_aware spreads them over both replicas.
            body = {"model": model, "prompt": f"{i} Tell me about the number {i}.", "max_tokens": MAX_TOKENS,
                    "ignore_eos": True, "stream": i % 4 == 0, "stream_options": {"include_usage": True}}
            async with sem:
                t0 = time.monotonic()
                try:
                    resp = await client.post(router.url + "/v1/completions", json=body)
                    outcome = _outcome(resp, body["stream"])
                except httpx.TransportError as exc:  # a stream cut with its replica: an error the client sees
                    outcome = f"transport error {type(exc).__name__}"
                done.append(i)
                return outcome, time.monotonic() - t0

        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
            tasks = [asyncio.ensure_future(one(client, i)) for i in range(num)]
            while len(done) < kill_after:
                await asyncio.sleep(0.02)
            os.kill(victim.pid, signal.SIGKILL)  # the launcher, as a lost machine or OOM kill would
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    outcomes = [o for o, _ in results]
    # Each request ended (none hit the timeout): complete ("ok"), or with an error the client sees (an
    # error status or event, a cut connection); never a 200 that passes an unfinished answer off as done.
    assert len(results) == num and max(t for _, t in results) < REQUEST_TIMEOUT_S
    assert all(o == "ok" or o.startswith(("transport error", "error ")) for o in outcomes), outcomes
    assert outcomes.count("ok") >= num - in_flight // 2, outcomes
    # The survivor takes the later requests.
    for i in range(4):
        r = httpx.post(router.url + "/v1/completions", json={"model": model, "prompt": f"after {i}", "max_tokens": 2},
                       timeout=REQUEST_TIMEOUT_S)
        assert r.status_code == 200, r.text
    # The killed replica's children notice their launcher is gone and leave no process, segment or socket file.
    assert wait_until(lambda: not [p for p in victim_children if alive(p)], 15), \
        (victim_children, [_state(p) for p in victim_children], victim.log_tail())
    victim_pids = [victim.pid, *victim_children]
    assert wait_until(lambda: not files_left(files_before, victim_pids), 15), files_left(files_before, victim_pids)


def _outcome(resp: httpx.Response, stream: bool) -> str:
    """"ok": the whole answer (all MAX_TOKENS tokens, finish_reason length); "error ...": an error status,
    or an error event in the stream; "incomplete ...": a 200 that ends without its whole answer."""
    if resp.status_code != 200:
        return f"error {resp.status_code}"
    if not stream:
        body = resp.json()
        if "error" in body:
            return f"error body {body['error']}"
        done = body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]
        return "ok" if done == ("length", MAX_TOKENS) else f"incomplete {done}"
    # Lines end at LF only, as SSE ends them: sampled text may hold U+2028 or U+0085, which JSON leaves
    # unescaped and str.splitlines would also split at.
    events = [line[5:].strip() for line in resp.text.split("\n") if line.startswith("data:")]
    if not events or events[-1] != "[DONE]":
        return f"incomplete stream, no [DONE]: {events[-2:]}"
    chunks = [json.loads(e) for e in events[:-1]]
    if errors := [c["error"] for c in chunks if "error" in c]:
        return f"error event {errors[0]}"
    finishes = [ch["finish_reason"] for c in chunks for ch in c.get("choices") or [] if ch.get("finish_reason")]
    usage = (chunks[-1].get("usage") or {}) if chunks else {}  # include_usage: the last chunk before [DONE]
    done = finishes, usage.get("completion_tokens")
    return "ok" if done == (["length"], MAX_TOKENS) else f"incomplete stream {done}"


def _state(pid: int) -> tuple[str, str, int] | None:
    """(name, state letter, parent pid) from /proc; None once the pid is gone."""
    try:
        name, rest = Path(f"/proc/{pid}/stat").read_text().split(" (", 1)[1].rsplit(")", 1)
    except OSError:
        return None
    state, ppid = rest.split()[:2]
    return name, state, int(ppid)
