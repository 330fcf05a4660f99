"""Bounded soak test: valid, invalid and disconnecting clients against a lightserve server for
--minutes, then checks that nothing was lost or leaked. Exits 1 on any failure, after a summary.

    python scripts/soak.py --minutes 2                         # starts (and stops) its own server
    python scripts/soak.py --url http://127.0.0.1:8000 [--api_key KEY]

Lost: a valid request that neither completed with exactly its max tokens nor got 503 with
Retry-After (a hang counts, after --client_timeout_s). At the end, once idle: no request held
anywhere, KV free + cached == total, every request slot free, the launcher's children unchanged.
The launcher's pid (for the children) is found from the listening socket, or --launcher_pid.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from lightserve.http.metrics import idle_problems

# Small enough to be overloaded (16 slots, 16 queued) and to pause now and then (1024 KV tokens).
OWN_SERVER_ARGS = ["--data_type", "float32", "--max_total_token_num", "1024", "--req_pool_size", "16",
                   "--max_queue_size", "16", "--max_req_total_len", "512", "--max_body_bytes", "65536"]
OWN_BODY_LIMIT = 65536
TOPICS = ["the sea", "a dragon", "prime numbers", "bread", "the moon", "rivers", "chess", "volcanoes"]
# Valid request kinds and how often a valid client picks each.
WEIGHTS = {"generate": 3, "generate_stream": 3, "completions": 2, "chat_stream": 2}


class Soak:
    def __init__(self, url: str, args: argparse.Namespace, body_limit: int | None):
        self.url, self.args, self.body_limit = url, args, body_limit
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.rng = random.Random(args.seed)
        self.outcomes: Counter[str] = Counter()
        self.failures: list[str] = []
        self.context = 0
        self.model = ""

    # ---- clients -----------------------------------------------------------------------------------
    async def run(self, seconds: float) -> None:
        timeout = aiohttp.ClientTimeout(total=self.args.client_timeout_s)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=self.headers) as session:
            async with session.get(self.url + "/v1/models") as resp:
                card = (await resp.json())["data"][0]
            self.model, self.context = card["id"], card["max_model_len"]
            deadline = time.monotonic() + seconds
            # Invalid and disconnecting clients get their own loops: they are quick, and on a slow
            # machine a shared loop would spend the soak waiting for valid requests.
            a = self.args
            workers = ([self._worker(session, deadline, list(WEIGHTS)) for _ in range(a.valid_clients)]
                       + [self._worker(session, deadline, ["invalid"]) for _ in range(a.invalid_clients)]
                       + [self._worker(session, deadline, ["disconnect"]) for _ in range(a.disconnect_clients)])
            await asyncio.gather(*workers, self._bursts(session, deadline))

    async def _worker(self, session: aiohttp.ClientSession, deadline: float, kinds: list[str]) -> None:
        weights = [WEIGHTS.get(k, 1) for k in kinds]
        while time.monotonic() < deadline:
            outcome = await self._one(session, self.rng.choices(kinds, weights)[0])
            if "503" in outcome:
                await asyncio.sleep(1.0)  # as Retry-After asks
            elif kinds == ["invalid"]:
                await asyncio.sleep(0.05)  # invalid requests are instant; do not spin

    async def _bursts(self, session: aiohttp.ClientSession, deadline: float) -> None:
        """Every --burst_every_s, --burst_size valid requests at once: overload, 503s expected."""
        bursts: list[asyncio.Future] = []
        while time.monotonic() + self.args.burst_every_s < deadline:
            await asyncio.sleep(self.args.burst_every_s)
            bursts += [asyncio.ensure_future(self._one(session, "generate")) for _ in range(self.args.burst_size)]
        await asyncio.gather(*bursts)

    async def _one(self, session: aiohttp.ClientSession, kind: str) -> str:
        try:
            outcome = await getattr(self, "_" + kind)(session)
        except TimeoutError:
            outcome = "LOST: no answer within --client_timeout_s (a hang)"
        except aiohttp.ClientError as exc:
            outcome = f"LOST: {type(exc).__name__}: {exc}"
        self.outcomes[f"{kind}: {outcome}"] += 1
        if outcome.startswith(("LOST", "WRONG")) and len(self.failures) < 50:
            self.failures.append(f"{kind}: {outcome}")
        return outcome

    def _prompt(self) -> str:
        return f"Tell me about {self.rng.choice(TOPICS)} in {self.rng.randint(1, 10**6)} words."

    def _max_tokens(self) -> int:
        return self.rng.randint(self.args.min_tokens, self.args.max_tokens)

    async def _generate(self, session: aiohttp.ClientSession) -> str:
        n = self._max_tokens()
        body = {"inputs": self._prompt(), "parameters": {"max_new_tokens": n, "ignore_eos": True}}
        async with session.post(self.url + "/generate", json=body) as resp:
            data = await resp.json(content_type=None)
            return _overloaded(resp) or _expect(resp.status == 200 and data.get("count_output_tokens") == n,
                                                f"{resp.status} {str(data)[:200]}, wanted {n} tokens")

    async def _generate_stream(self, session: aiohttp.ClientSession) -> str:
        n = self._max_tokens()
        body = {"inputs": self._prompt(), "parameters": {"max_new_tokens": n, "ignore_eos": True}}
        async with session.post(self.url + "/generate_stream", json=body) as resp:
            if resp.status != 200:
                return _overloaded(resp) or f"WRONG: status {resp.status}"
            events = [e async for e in _events(resp)]
        tokens = sum(1 for e in events if e.get("token", {}).get("id") is not None)
        last = events[-1] if events else {}
        return _expect(tokens == n and last.get("finished") and last.get("finish_reason") == "length",
                       f"{tokens} tokens of {n}, last event {str(last)[:200]}")

    async def _completions(self, session: aiohttp.ClientSession) -> str:
        n = self._max_tokens()
        body = {"model": self.model, "prompt": self._prompt(), "max_tokens": n, "ignore_eos": True}
        async with session.post(self.url + "/v1/completions", json=body) as resp:
            data = await resp.json(content_type=None)
            usage = data.get("usage") or {}
            return _overloaded(resp) or _expect(resp.status == 200 and usage.get("completion_tokens") == n,
                                                f"{resp.status} {str(data)[:200]}, wanted {n} tokens")

    async def _chat_stream(self, session: aiohttp.ClientSession) -> str:
        n = self._max_tokens()
        body = {"messages": [{"role": "user", "content": self._prompt()}], "max_tokens": n, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        async with session.post(self.url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                return _overloaded(resp) or f"WRONG: status {resp.status}"
            events = [e async for e in _events(resp)]
        usage = events[-1].get("usage") if events else None
        return _expect(bool(usage) and usage["completion_tokens"] == n and not any("error" in e for e in events),
                       f"usage {usage}, wanted {n} tokens; last event {str(events[-1:])[:200]}")

    async def _invalid(self, session: aiohttp.ClientSession) -> str:
        path, body, status, param = self.rng.choice(self._bad_inputs())
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with session.post(self.url + path, data=data, headers={"Content-Type": "application/json"}) as resp:
            got = await resp.json(content_type=None)
        named = got.get("param") if path.startswith("/generate") else got.get("error", {}).get("param")
        return _expect(resp.status == status and named == param, f"{path} {str(body)[:60]}: {resp.status} {got}")

    def _bad_inputs(self) -> list[tuple[str, Any, int, str]]:
        rows = [("/v1/completions", b'{"prompt": "hi", ', 400, "body"),
                ("/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 2}', 400, "body"),
                ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
                ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": 1e9}, 400, "temperature"),
                ("/v1/completions", {"prompt": "", "max_tokens": 4}, 400, "prompt"),
                ("/v1/completions", {"prompt": [1, 10**7], "max_tokens": 4}, 400, "prompt"),
                ("/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
                 404, "model"),
                ("/generate", {"inputs": "hi", "parameters": {"top_p": 0}}, 400, "parameters.top_p"),
                ("/generate", {"parameters": {}}, 400, "inputs")]
        if self.context and (self.body_limit is None or 6 * self.context < self.body_limit):
            rows.append(("/generate", {"inputs": "hello " * (self.context + 10)}, 400, "inputs"))
        if self.body_limit is not None:
            rows.append(("/v1/completions", {"prompt": "x" * (self.body_limit + 1)}, 413, "body"))
        return rows

    async def _disconnect(self, session: aiohttp.ClientSession) -> str:
        """Leave at a random point: before any answer (queued, prefill) or after a few stream events."""
        body = {"inputs": self._prompt(), "parameters": {"max_new_tokens": 64, "ignore_eos": True}}
        if self.rng.random() < 0.5:
            task = asyncio.ensure_future(session.post(self.url + "/generate", json=body))
            done, _ = await asyncio.wait([task], timeout=self.rng.uniform(0.05, 2.0))
            if done:
                resp = task.result()
                resp.close()
                return f"answered {resp.status} before the disconnect"
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return "left before the answer"
        keep = self.rng.randint(0, 3)
        async with session.post(self.url + "/generate_stream", json=body) as resp:
            if resp.status != 200:
                return f"answered {resp.status} before the disconnect"
            seen = 0
            if keep:
                async for _ in _events(resp):
                    seen += 1
                    if seen >= keep:
                        break
            resp.close()
        return f"left after {seen} stream events"

    # ---- the end state --------------------------------------------------------------------------------
    async def metrics(self) -> dict[str, float]:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(headers=self.headers,
                                         timeout=timeout) as s, s.get(self.url + "/metrics") as resp:
            text = await resp.text()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                out[name.removeprefix("lightserve_")] = float(value)
        return out

    async def wait_idle(self, timeout: float) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = await self.metrics()
            busy = sum(m[k] for k in ("requests_running", "requests_waiting", "requests_paused",
                                      "requests_in_front", "requests_queued"))
            if busy == 0 or time.monotonic() > deadline:
                return m
            await asyncio.sleep(0.5)


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout
    return sorted(int(p) for p in out.split())


def listener_pid(port: int) -> int | None:
    """The process holding the listening TCP socket on `port` (the launcher runs the HTTP front)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{cols[9]}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                return int(proc.name)
        except OSError:
            continue
    return None


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str, Path]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
    cmd = [sys.executable, "-m", "lightserve.launch_server", "--port", str(port), *OWN_SERVER_ARGS, *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"soak: the server exited with {proc.returncode} during start-up; log {log}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                pass
            import urllib.request
            if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                return proc, url, log
        except OSError:
            time.sleep(1)
    proc.kill()
    sys.exit(f"soak: the server did not start in 600 s; log {log}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--url", help="an already running server; default: start one")
    p.add_argument("--api_key")
    p.add_argument("--launcher_pid", type=int, help="with --url: the launcher (default: found from the port)")
    p.add_argument("--body_limit", type=int, help="with --url: the server's --max_body_bytes (enables the 413 case)")
    p.add_argument("--server_args", default="", help="extra flags for the server this script starts")
    p.add_argument("--valid_clients", type=int, default=10)
    p.add_argument("--invalid_clients", type=int, default=2)
    p.add_argument("--disconnect_clients", type=int, default=3)
    p.add_argument("--burst_every_s", type=float, default=30.0)
    p.add_argument("--burst_size", type=int, default=48)
    p.add_argument("--min_tokens", type=int, default=4)
    p.add_argument("--max_tokens", type=int, default=12)
    p.add_argument("--client_timeout_s", type=float, default=600.0)
    p.add_argument("--idle_timeout_s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    proc = log = None
    if args.url:
        url, body_limit = args.url.rstrip("/"), args.body_limit
        launcher = args.launcher_pid or listener_pid(int(url.rsplit(":", 1)[1]))
    else:
        proc, url, log = start_server(args.server_args.split())
        body_limit, launcher = OWN_BODY_LIMIT, proc.pid
    soak = Soak(url, args, body_limit)
    before = children(launcher) if launcher else []
    t0 = time.monotonic()
    try:
        asyncio.run(soak.run(args.minutes * 60))
        elapsed = time.monotonic() - t0  # the soak, then the requests still in flight at its end
        m = asyncio.run(soak.wait_idle(args.idle_timeout_s))
        after = children(launcher) if launcher else []
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)

    problems = list(soak.failures) + idle_problems(m)
    if launcher and before != after:
        problems.append(f"launcher children changed: {before} -> {after}")
    if proc is not None and proc.returncode != 0:
        problems.append(f"the server exited with {proc.returncode} on SIGTERM (log {log})")
    lost = sum(v for k, v in soak.outcomes.items() if ": LOST" in k)
    wrong = sum(v for k, v in soak.outcomes.items() if ": WRONG" in k)
    print(f"soak: {args.minutes:g} min of clients + {elapsed - args.minutes * 60:.0f} s for the last requests, "
          f"against {url}{' (own server, log ' + str(log) + ')' if log else ''}")
    for key, count in sorted(soak.outcomes.items()):
        print(f"  {count:6d}  {key}")
    print(f"  total {sum(soak.outcomes.values())}, lost {lost}, wrong {wrong}")
    print(f"  idle: KV free {m['kv_tokens_free']:g} + cached {m['kv_tokens_cached']:g} "
          f"/ total {m['kv_tokens_total']:g};"
          f" slots free {m['req_slots_free']:g}/{m['req_slots_total']:g}; running {m['requests_running']:g};"
          f" in front {m['requests_in_front']:g}; pauses {m['pauses_total']:g}")
    print(f"  launcher {launcher}: children before {before}, after {after}" if launcher
          else "  launcher pid unknown: process check skipped (give --launcher_pid)")
    for problem in problems:
        print(f"  FAIL {problem}")
    print("PASS" if not problems else "FAIL")
    return 0 if not problems else 1


def _overloaded(resp: aiohttp.ClientResponse) -> str | None:
    """'503' for a proper refusal; a 503 without Retry-After is wrong."""
    if resp.status != 503:
        return None
    return "503 + Retry-After" if resp.headers.get("Retry-After") else "WRONG: 503 without Retry-After"


def _expect(ok: Any, detail: str) -> str:
    return "ok" if ok else f"WRONG: {detail}"


async def _events(resp: aiohttp.ClientResponse):
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
            yield json.loads(line[5:])


if __name__ == "__main__":
    sys.exit(main())
