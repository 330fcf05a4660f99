#!/usr/bin/env python3
"""Start a lightserve server with the given flags, time its start, run scripts/benchmark_serving.py
against it (a warm-up, then --runs measured runs), read /metrics after each, stop it.

One JSON line per measured run goes to stdout (and --out): the server flags, the start time, the
client's aggregates, the router's counters (pauses, resumes, prompt tokens computed/cached), the
CPU seconds each process spent in the run (the HTTP front, the router, the detokenizer, every worker
rank, and the benchmark client) and the seconds each server process's threads waited for a CPU while
runnable. With --perf the model workers are sampled with `perf record` during each measured run, and
the row carries their samples' shares by kind of work (GEMM, decode and prefill attention, the other
C kernels, the OpenMP runtime's waiting, Python).

    python scripts/bench_server.py --server="--max_total_token_num 4096" -- \\
        --dataset random --num-prompts 64 --input-len 256 --output-len 128 --max-concurrency 64

Used for the figures in docs/benchmarks.md (prefix cache on/off, KV pressure, tp 1 vs 2, where a
workload's CPU time goes).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from lightserve.engine.procs import child_pids_from_log

REPO = Path(__file__).resolve().parent.parent
COUNTERS = ("pauses_total", "resumes_total", "prompt_tokens_total", "prompt_tokens_cached_total",
            "generation_tokens_total", "kv_tokens_total", "kv_tokens_free", "spec_draft_tokens_total",
            "spec_accepted_tokens_total")


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


def server_pids(log_text: str, launcher: int) -> dict[str, int]:
    """Role -> pid of the server's processes: the launcher, which serves HTTP, and its children from its log."""
    return {"http": launcher, **child_pids_from_log(log_text)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far; 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def wait_seconds(pid: int) -> float:
    """Seconds the threads of a process now alive have spent runnable but waiting for a CPU (the scheduler's
    run-queue delay, /proc/PID/task/TID/schedstat's second field); 0 when it is gone. For the model worker this is
    the time other processes held its cores: at a fork-join step's barrier the other thread waits as long."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended while listed
    return total / 1e9


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # children waited for: the benchmark clients
    return usage.ru_utime + usage.ru_stime


# What a worker's perf sample is doing, by its shared object and symbol (first match wins). The C kernels' symbols
# are their functions or their OpenMP bodies (`linear_packed._omp_fn.0`); decode attention's per-shape tasks are
# `task_<bf16>_<dim>_<group>`; oneDNN's generated GEMM code has no shared object.
PERF_KINDS = (
    ("decode attention", r"^lightserve_cpu", r"^(task_\d|decode_attention)"),
    ("prefill attention", r"^lightserve_cpu", r"^(run_task|prefill_attention|score_tile|pv_tile)"),
    ("GEMM (linear.c)", r"^lightserve_cpu", r"^tile$|linear|gemm|pair_panel"),
    ("other C kernels", r"^lightserve_cpu", r""),
    ("GEMM (oneDNN)", r"^\[unknown\]$|dnnl|mkldnn", r""),
    ("GEMM (oneDNN)", r"torch_cpu", r"brgemm|jit_|dnnl|mkldnn"),
    ("OpenMP runtime (waiting)", r"gomp|iomp", r""),
    ("Python and ctypes", r"libpython|_ctypes|libffi", r""),
    ("torch ops and dispatch", r"torch|c10", r""),
)


def perf_kinds(perf_data: str) -> dict[str, float]:
    """Percent of a `perf record` file's samples by PERF_KINDS."""
    report = subprocess.run(["perf", "report", "-i", perf_data, "--no-children", "--stdio", "--sort", "dso,sym",
                             "-g", "none", "-t", "|"], capture_output=True, text=True, check=True).stdout
    return report_kinds(report)


def report_kinds(report: str) -> dict[str, float]:
    """`perf report --sort dso,sym -t '|'` text -> percent of samples by PERF_KINDS, largest first (the rest is
    "other": libc, the allocator, the kernel)."""
    shares: dict[str, float] = {}
    for line in report.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if line.startswith("#") or len(parts) != 3 or not parts[0].endswith("%"):
            continue
        dso, sym = parts[1], parts[2].split("] ", 1)[-1]
        kind = next((k for k, d, f in PERF_KINDS if re.search(d, dso) and re.search(f, sym)), "other")
        shares[kind] = shares.get(kind, 0.0) + float(parts[0].rstrip("%"))
    return {k: round(v, 2) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])}


@dataclasses.dataclass
class Running:
    """A server started by start_server: its launcher process, URL, log file, start time and process pids."""
    flags: str
    proc: subprocess.Popen
    url: str
    log_path: str
    start_s: float
    pids: dict[str, int]


def start_server(flags: str) -> Running:
    """Start lightserve.launch_server with `flags` (one string) on a free port and wait for /health; RuntimeError with
    the log's tail if it exits first."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w", prefix="bench_server_", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "lightserve.launch_server", "--port", str(port), *shlex.split(flags)]
    t0 = time.monotonic()
    # cwd outside the repo: its top-level folders (kernels/, router/) must not shadow installed packages.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
                            start_new_session=True)
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            break
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(Path(log.name).read_text()[-3000:]) from None
            time.sleep(0.2)
    start_s = time.monotonic() - t0
    print(f"# server ready in {start_s:.1f} s: {' '.join(cmd[2:])} (log {log.name})", file=sys.stderr)
    return Running(flags, proc, url, log.name, start_s, server_pids(Path(log.name).read_text(), proc.pid))


def stop_server(server: Running) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s."""
    try:
        os.killpg(server.proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        server.proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()


def measure(server: Running, bench_args: list[str], seed: int, perf: bool = False) -> dict:
    """One benchmark_serving.py run against the server: its row (the client's aggregates, the router's counters,
    each process's CPU and run-queue seconds, and with `perf` the workers' perf shares)."""
    pids, url = server.pids, server.url
    workers = [pid for role, pid in pids.items() if role.startswith("worker")]
    before = metrics(url)
    cpu_before = {role: cpu_seconds(pid) for role, pid in pids.items()}
    wait_before = {role: wait_seconds(pid) for role, pid in pids.items()}
    client_before = children_cpu_seconds()
    recorder = perf_data = None
    if perf:
        perf_data = tempfile.NamedTemporaryFile(prefix="bench_server_", suffix=".perf", delete=False).name
        recorder = subprocess.Popen(["perf", "record", "-q", "-F", "499", "-o", perf_data,
                                     "-p", ",".join(map(str, workers))], stderr=subprocess.DEVNULL)
    try:
        with tempfile.NamedTemporaryFile(suffix=".json") as res:
            seeded = ["--seed", str(seed)] if "--seed" not in bench_args else []
            subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark_serving.py"), "--base-url",
                            url, "--output-json", res.name, "--no-progress", "--quiet", *seeded, *bench_args],
                           check=True)
            agg = json.loads(Path(res.name).read_text())["aggregates"]
    finally:
        if recorder is not None:
            recorder.send_signal(signal.SIGINT)  # perf writes its file and exits
            recorder.wait(60)
    after = metrics(url)
    row = {"server": server.flags, "start_s": round(server.start_s, 2),
           "output_tok_s": agg["output_throughput"], "duration_s": agg.get("duration_s"),
           "ttft_p50_ms": agg["ttft_ms"]["p50"], "itl_p50_ms": agg.get("itl_ms", {}).get("p50"),
           "tpot_p50_ms": agg.get("tpot_ms", {}).get("p50"), "completed": agg["completed"],
           **{k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS if k.endswith("_total")},
           "kv_tokens_free_after": after.get("kv_tokens_free"), "kv_tokens_total": after.get("kv_tokens_total"),
           "cpu_s": {**{role: round(cpu_seconds(pid) - cpu_before[role], 2) for role, pid in pids.items()},
                     "benchmark client": round(children_cpu_seconds() - client_before, 2)},
           "cpu_wait_s": {role: round(wait_seconds(pid) - wait_before[role], 2) for role, pid in pids.items()}}
    if perf_data is not None:
        row["worker_perf_pct"] = perf_kinds(perf_data)
        os.unlink(perf_data)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", default="", help="lightserve.launch_server flags (one string)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--warmup-runs", type=int, default=1)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", help="append the JSON lines here too")
    ap.add_argument("--perf", action="store_true", help="sample the model workers with `perf record` in each "
                    "measured run and report where their time went")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then benchmark_serving.py flags")
    args = ap.parse_args()
    bench_args = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if args.perf and shutil.which("perf") is None:
        ap.error("--perf needs the `perf` tool on PATH (linux-tools)")
    try:
        server = start_server(args.server)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    try:
        for i in range(args.warmup_runs + args.runs):
            warm_up = i < args.warmup_runs
            row = measure(server, bench_args, 1000 + i, args.perf and not warm_up)
            if warm_up:
                continue
            line = json.dumps({"label": args.label, "run": i - args.warmup_runs, **row})
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
    finally:
        stop_server(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
