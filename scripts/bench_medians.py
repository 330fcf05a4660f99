"""The medians of the side-by-side server comparisons (scripts/compare_vllm.sh, scripts/compare_llamacpp.sh): which
figures each workload reports, and one side's medians over its per-run JSONs (scripts/benchmark_serving.py's
output, named SIDE-WORKLOAD-RUN.json with RUN `warmup` or 1..runs). Imported by those scripts' summary step with
scripts/ on sys.path.
"""
from __future__ import annotations

import json
import os
import statistics
import time

# workload -> [(label, aggregate key, sub key or None, higher is better)]
METRICS = {
    "W1": [("output tok/s", "output_throughput", None, True), ("requests/s", "request_throughput", None, True),
           ("TTFT mean ms", "ttft_ms", "mean", False), ("TTFT p99 ms", "ttft_ms", "p99", False),
           ("TPOT mean ms", "tpot_ms", "mean", False), ("E2E mean ms", "e2e_ms", "mean", False)],
    "W2": [("TTFT p50 ms", "ttft_ms", "p50", False), ("TTFT mean ms", "ttft_ms", "mean", False),
           ("TTFT p99 ms", "ttft_ms", "p99", False), ("ITL p50 ms", "itl_ms", "p50", False),
           ("ITL mean ms", "itl_ms", "mean", False), ("TPOT mean ms", "tpot_ms", "mean", False),
           ("E2E mean ms", "e2e_ms", "mean", False), ("output tok/s", "output_throughput", None, True)],
    "W3": [("TTFT p50 ms", "ttft_ms", "p50", False), ("TTFT mean ms", "ttft_ms", "mean", False),
           ("TTFT p99 ms", "ttft_ms", "p99", False), ("TPOT mean ms", "tpot_ms", "mean", False),
           ("E2E mean ms", "e2e_ms", "mean", False), ("output tok/s", "output_throughput", None, True),
           ("requests/s", "request_throughput", None, True)],
}
# The concurrency sweep's points (C<concurrency>).
SWEEP = [("output tok/s", "output_throughput", None, True), ("ITL p50 ms", "itl_ms", "p50", False),
         ("TPOT mean ms", "tpot_ms", "mean", False), ("TTFT p50 ms", "ttft_ms", "p50", False)]


def metrics_for(workloads: list[str]) -> dict[str, list[tuple]]:
    """METRICS with the sweep points among `workloads` added."""
    out = dict(METRICS)
    for w in workloads:
        if w.startswith("C"):
            out[w] = SWEEP
    return out


def cpu_flags() -> list[str]:
    """The CPU features the comparisons name beside their figures."""
    if not os.path.exists("/proc/cpuinfo"):
        return []
    with open("/proc/cpuinfo") as f:
        flags = {fl for line in f if line.startswith("flags") for fl in line.split()[2:]}
    return sorted(flags & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"})


def _pick(agg: dict, key: str, sub: str | None):
    v = agg[key]
    return v[sub] if sub else v


def side_workloads(run_dir: str, side: str, runs: int, workloads: list[str]) -> tuple[dict, str | None]:
    """(workload -> {median, num_runs, failed, runs, warmup}, time of the newest run file) of one side. Runs that are
    missing (an interrupted run) are left out and counted; a workload without any is left out with a note."""
    metrics = metrics_for(workloads)
    result: dict = {}
    measured_at = None
    for w in workloads:
        paths = [f"{run_dir}/{side}-{w}-{r}.json" for r in range(1, runs + 1)]
        paths = [p for p in paths if os.path.exists(p)]
        aggs = [json.load(open(p))["aggregates"] for p in paths]
        if not aggs:
            print(f"note: no measured runs of {w} for {side}; left out")
            continue
        wpath = f"{run_dir}/{side}-{w}-warmup.json"
        warm = json.load(open(wpath))["aggregates"] if os.path.exists(wpath) else None
        med = {}
        for label, key, sub, _ in metrics[w]:
            vals = [_pick(a, key, sub) for a in aggs]
            med[label] = statistics.median(vals) if all(v is not None for v in vals) else None
        last = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(max(os.path.getmtime(p) for p in paths)))
        measured_at = max(measured_at or last, last)
        result[w] = {"median": med, "num_runs": len(aggs), "failed": sum(a["failed"] for a in aggs), "runs": aggs,
                     "warmup": warm}
    return result, measured_at
