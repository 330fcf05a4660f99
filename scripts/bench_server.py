#!/usr/bin/env python3
"""Start a lightserve server with the given flags, time its start, run scripts/benchmark_serving.py
against it (a warm-up, then --runs measured runs), read /metrics after each, stop it.

One JSON line per measured run goes to stdout (and --out): the server flags, the start time, the
client's aggregates and the router's counters (pauses, resumes, prompt tokens computed/cached).

    python scripts/bench_server.py --server="--max_total_token_num 4096" -- \\
        --dataset random --num-prompts 64 --input-len 256 --output-len 128 --max-concurrency 64

Used for the figures in docs/benchmarks.md (prefix cache on/off, KV pressure, tp 1 vs 2).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COUNTERS = ("pauses_total", "resumes_total", "prompt_tokens_total", "prompt_tokens_cached_total",
            "generation_tokens_total", "kv_tokens_total", "kv_tokens_free")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out = {}
    for name in COUNTERS:
        m = re.search(rf"^lightserve_{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        if m:
            out[name] = float(m.group(1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", default="", help="lightserve.launch_server flags (one string)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--warmup-runs", type=int, default=1)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", help="append the JSON lines here too")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then benchmark_serving.py flags")
    args = ap.parse_args()
    bench_args = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w", prefix="bench_server_", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "lightserve.launch_server", "--port", str(port), *shlex.split(args.server)]
    t0 = time.monotonic()
    # cwd outside the repo: its top-level folders (kernels/, router/) must not shadow installed packages.
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
                              start_new_session=True)
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None:
                    print(Path(log.name).read_text()[-3000:], file=sys.stderr)
                    return 1
                time.sleep(0.2)
        start_s = time.monotonic() - t0
        print(f"# server ready in {start_s:.1f} s: {' '.join(cmd[2:])} (log {log.name})", file=sys.stderr)
        for i in range(args.warmup_runs + args.runs):
            before = metrics(url)
            with tempfile.NamedTemporaryFile(suffix=".json") as res:
                seed = ["--seed", str(1000 + i)] if "--seed" not in bench_args else []
                subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark_serving.py"), "--base-url", url,
                                "--output-json", res.name, "--no-progress", "--quiet", *seed, *bench_args],
                               check=True)
                agg = json.loads(Path(res.name).read_text())["aggregates"]
            after = metrics(url)
            if i < args.warmup_runs:
                continue
            row = {"label": args.label, "server": args.server, "start_s": round(start_s, 2),
                   "run": i - args.warmup_runs,
                   "output_tok_s": agg["output_throughput"], "duration_s": agg.get("duration_s"),
                   "ttft_p50_ms": agg["ttft_ms"]["p50"], "itl_p50_ms": agg.get("itl_ms", {}).get("p50"),
                   "tpot_p50_ms": agg.get("tpot_ms", {}).get("p50"), "completed": agg["completed"],
                   **{k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS if k.endswith("_total")},
                   "kv_tokens_free_after": after.get("kv_tokens_free"), "kv_tokens_total": after.get("kv_tokens_total")}
            line = json.dumps(row)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
