#!/usr/bin/env python3
"""Graceful-drain check: rounds of "start a server, load it with streams, signal it", counting
how every request ended. The target is that none is cut silently.

Each round starts `python -m lightserve.launch_server`, opens --streams streaming requests (the
OpenAI completion and chat APIs and LightLLM's /generate_stream in turn, half of them short, half
long) plus two non-streaming ones, and signals the launcher at a seeded moment. Rounds rotate
through three plans:
  - drain: SIGTERM, a long grace, medium requests: every request must finish normally;
  - grace: SIGTERM, a 2 s grace: short requests finish, long ones end with finish_reason "abort";
  - cut:   Ctrl-C (SIGINT to the process group, as a terminal sends it), then SIGTERM: the second
           signal aborts at once, well before the 60 s grace.
During the drain, /health must answer 503 "draining" and a new request 503 with Retry-After. After
it, the launcher must exit 0 with no child process, shared-memory segment or socket file left.

A request ends in one of: finished (finish_reason stop/length, then [DONE]), aborted (finish_reason
"abort" then [DONE], or a 503 JSON error), refused (503 before it started), or cut (anything else:
a stream that stops without a finish and [DONE], a transport error). Exit status 1 if any request
was cut or any round broke a rule.

    python scripts/drain_check.py --rounds 20 --streams 16
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
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

SHORT_TOKENS = 8    # finishes within the 2 s grace
DRAIN_TOKENS = 128  # the drain plan's requests: still running at the signal and the /health probe after it (16 tokens
                    # were all done by then on a quiet 2-core Zen 5), done well within the 60 s grace
LONG_TOKENS = 400   # cannot finish within the 2 s grace
START_TIMEOUT_S = 300
EXIT_SLACK_S = 20  # after the grace: the abort, uvicorn's shutdown and the children's stop
CHILD_EXIT_S = 10
PLANS = ("drain", "grace", "cut")


@dataclass
class RoundResult:
    plan: str
    outcomes: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    draining_seen: bool = False  # /health answered 503 "draining" (the drain may end before the probe)
    exit_code: int | None = None
    stop_s: float = 0.0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--plans", default=",".join(PLANS), help="the plans rounds rotate through, comma-separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="--data_type float32 --max_total_token_num 8192",
                   help="extra launcher flags (one string)")
    p.add_argument("--log-dir", default=None, help="keep each round's server log here")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    plans = args.plans.split(",")
    if set(plans) - set(PLANS):
        p.error(f"--plans: unknown {sorted(set(plans) - set(PLANS))}; choose from {PLANS}")
    results = []
    for r in range(args.rounds):
        plan = plans[r % len(plans)]
        log = Path(args.log_dir) / f"round{r}.log" if args.log_dir else None
        res = asyncio.run(run_round(plan, args.streams, rng.uniform(0.2, 1.0), args.server_args.split(), log))
        results.append(res)
        if not args.quiet:
            print(f"round {r} ({plan}): {dict(res.outcomes)} exit {res.exit_code} in {res.stop_s:.1f} s"
                  + (f" PROBLEMS {res.problems}" if res.problems else ""), flush=True)
    total = sum((res.outcomes for res in results), Counter())
    summary = {"rounds": len(results), "outcomes": dict(total), "plans": [res.plan for res in results],
               "outcomes_by_round": [dict(res.outcomes) for res in results],
               "draining_seen": sum(res.draining_seen for res in results),
               "problems": [f"round {i} ({res.plan}): {p}" for i, res in enumerate(results) for p in res.problems]}
    if not args.quiet:
        print(json.dumps(summary, indent=1))
    return summary


async def run_round(plan: str, num_streams: int, signal_after_s: float, server_args: list[str],
                    log_path: Path | None) -> RoundResult:
    res = RoundResult(plan)
    grace = {"drain": 60, "grace": 2, "cut": 60}[plan]
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "lightserve.launch_server", "--port", str(port),
                             "--shutdown_grace_s", str(grace), *server_args],
                            stdout=log, stderr=log, start_new_session=True)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(grace + EXIT_SLACK_S + 60)) as client:
            await _wait_ready(client, url, proc)
            children = _children(proc.pid)
            model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
            requests = [asyncio.ensure_future(_one_request(client, url, model, i, plan))
                        for i in range(num_streams + 2)]
            await asyncio.sleep(signal_after_s)
            t_signal = time.monotonic()
            if plan == "cut":
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)  # the drain starts on the server's next tick
            await _check_draining(client, url, model, res)
            if plan == "cut":
                proc.send_signal(signal.SIGTERM)
            for outcome in await asyncio.gather(*requests):
                res.outcomes[outcome] += 1
        try:
            res.exit_code = await asyncio.to_thread(proc.wait, grace + EXIT_SLACK_S)
        except subprocess.TimeoutExpired:
            res.problems.append(f"the launcher still ran {grace + EXIT_SLACK_S} s after the signal")
        res.stop_s = time.monotonic() - t_signal
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if log is not subprocess.DEVNULL:
            log.close()
    if res.exit_code not in (0, None):
        res.problems.append(f"exit code {res.exit_code}")
    if res.outcomes["cut"]:
        res.problems.append(f"{res.outcomes['cut']} requests cut silently")
    if plan == "drain" and set(res.outcomes) - {"finished", "refused"}:
        res.problems.append(f"a drain with a long grace must finish every request: {dict(res.outcomes)}")
    if plan == "cut" and res.stop_s > grace / 2:
        res.problems.append(f"the second signal did not cut the {grace} s grace short ({res.stop_s:.1f} s)")
    # A child SIGKILLed by the stop takes a moment to be torn down, and multiprocessing's resource
    # tracker leaves when it reads EOF from the gone launcher: give them a few seconds.
    deadline = time.monotonic() + CHILD_EXIT_S
    while (left := [pid for pid in children if not _gone(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        res.problems.append(f"child processes left: {left}")
    files = [str(f) for d in (Path("/dev/shm"), Path("/tmp")) for f in d.glob(f"lightserve-{proc.pid}-*")]
    if files:
        res.problems.append(f"files left: {files}")
    return res


async def _check_draining(client: httpx.AsyncClient, url: str, model: str, res: RoundResult) -> None:
    try:
        health = await client.get(url + "/health")
        new = await client.post(url + "/v1/completions", json={"model": model, "prompt": "late", "max_tokens": 2})
    except httpx.TransportError:
        return  # the drain already ended and the port closed: nothing was in flight any more
    res.draining_seen = health.status_code == 503 and health.json().get("status") == "draining"
    if not res.draining_seen:
        res.problems.append(f"/health while draining: {health.status_code} {health.text}")
    if new.status_code != 503 or "retry-after" not in new.headers:
        res.problems.append(f"a new request while draining: {new.status_code} {dict(new.headers)}")


async def _one_request(client: httpx.AsyncClient, url: str, model: str, i: int, plan: str) -> str:
    """Send request i and classify how it ended: finished, aborted, refused or cut."""
    max_tokens = DRAIN_TOKENS if plan == "drain" else LONG_TOKENS if i % 2 else SHORT_TOKENS
    kind = ("completions", "chat", "lightllm")[i % 3]
    stream = i >= 2  # the first two are the non-streaming ones
    if kind == "lightllm":
        path = "/generate_stream" if stream else "/generate"
        body = {"inputs": f"Story {i}: once upon a time", "parameters": {"max_new_tokens": max_tokens,
                                                                         "ignore_eos": True}}
    elif kind == "chat":
        path = "/v1/chat/completions"
        body = {"model": model, "messages": [{"role": "user", "content": f"Tell story {i}."}], "max_tokens": max_tokens,
                "ignore_eos": True, "stream": stream}
    else:
        path = "/v1/completions"
        body = {"model": model, "prompt": f"Story {i}: once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": stream}
    try:
        async with client.stream("POST", url + path, json=body) as resp:
            if resp.status_code == 503:
                await resp.aread()
                if "retry on another replica" in resp.text:  # arrived after the drain began
                    return "refused"
                return "aborted" if "shutting down" in resp.text else "cut"
            if resp.status_code != 200:
                return "cut"
            if not stream:
                data = json.loads(await resp.aread())
                reason = data["finish_reason"] if kind == "lightllm" else data["choices"][0]["finish_reason"]
                return "finished" if reason in ("stop", "length") else "cut"
            events = sse_data("".join([chunk async for chunk in resp.aiter_text()]))
    except httpx.HTTPError:
        return "cut"
    return _classify_stream(kind, events)


def sse_data(body: str) -> list[str]:
    """The data fields of an SSE body, its lines ended by LF or CRLF only, as the SSE spec and the openai client end
    them. (httpx's aiter_lines also ends a line at U+0085, U+2028 and the other str.splitlines breaks, which JSON
    leaves unescaped inside generated text: a streamed token holding one read as a cut-off event.)"""
    return [line[5:].strip() for line in body.replace("\r\n", "\n").split("\n") if line.startswith("data:")]


def _classify_stream(kind: str, events: list[str]) -> str:
    if kind == "lightllm":
        last = json.loads(events[-1]) if events else {}
        if not last.get("finished"):
            return "cut"
        return {"stop": "finished", "length": "finished", "abort": "aborted"}.get(last.get("finish_reason"), "cut")
    if not events or events[-1] != "[DONE]":
        return "cut"
    reasons = [c.get("finish_reason") for e in events[:-1] for c in json.loads(e).get("choices", [])]
    reasons = [r for r in reasons if r]
    if len(reasons) != 1:
        return "cut"
    return {"stop": "finished", "length": "finished", "abort": "aborted"}.get(reasons[0], "cut")


async def _wait_ready(client: httpx.AsyncClient, url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} during start-up")
        try:
            if (await client.get(url + "/health", timeout=2)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.3)
    raise TimeoutError(f"the server was not ready in {START_TIMEOUT_S} s")


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: its parent, the launcher, is gone too)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(1 if main()["problems"] else 0)
