"""What the scripts that compare servers side by side share (bench_kv_cache.py, bench_speculative.py,
bench_lora.py): their common flags and workload choice, each side's figures for one workload (bench_server.py run as
a child per server with greedy OpenAI-client flags, its JSON rows read back; or, with --in-turn, every side's server
up at once and their runs taken in turn), and the median of a field over the runs. Imported from scripts/, beside
them.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

import bench_server  # scripts/, beside this file

REPO = Path(__file__).resolve().parent.parent
COMMON = ["--backend", "openai", "--temperature", "0", "--ignore-eos"]  # greedy, every output token counted


def run_side(server_flags: str, bench: str, runs: int) -> list[dict]:
    """bench_server.py's JSON rows for one server and one workload."""
    cmd = [sys.executable, str(REPO / "scripts" / "bench_server.py"), f"--server={server_flags}", "--runs", str(runs),
           "--", *COMMON, *shlex.split(bench)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def run_sides_in_turn(sides: list[tuple[str, str]], runs: int) -> list[list[dict]]:
    """Each side's rows for (server flags, workload) sides served at once: every server started, one warm-up run
    each, then `runs` rounds in which each side runs once in turn, so that a shared host's slow drift falls on
    every side alike instead of on whichever ran later (bench_server.py's start_server, measure and stop_server)."""
    servers = []
    try:
        for flags, _ in sides:
            servers.append(bench_server.start_server(flags))
        for server, (_, bench) in zip(servers, sides):
            bench_server.measure(server, [*COMMON, *shlex.split(bench)], seed=1000)
        rows: list[list[dict]] = [[] for _ in sides]
        for i in range(runs):
            for side, server, (_, bench) in zip(rows, servers, sides):
                side.append({"run": i, **bench_server.measure(server, [*COMMON, *shlex.split(bench)], 1001 + i)})
        return rows
    finally:
        for server in servers:
            bench_server.stop_server(server)


def run_sides(sides: list[tuple[str, str]], args: argparse.Namespace) -> list[list[dict]]:
    """Each side's rows for (server flags, workload) sides: with --in-turn from servers up at once
    (run_sides_in_turn), else from one server after another (run_side)."""
    if args.in_turn:
        return run_sides_in_turn(sides, args.runs)
    return [run_side(flags, bench, args.runs) for flags, bench in sides]


def median(rows: list[dict], key: str) -> float:
    """The middle value of `key` over the rows that have it (the upper one of an even count); NaN if none do."""
    values = sorted(float(r[key]) for r in rows if r.get(key) is not None)
    return values[len(values) // 2] if values else float("nan")


def add_common_args(ap: argparse.ArgumentParser, workloads: dict[str, str]) -> None:
    """--workloads (names of `workloads`, all by default), --runs, --smoke and --out."""
    ap.add_argument("--workloads", default=",".join(workloads))
    ap.add_argument("--runs", type=int, default=1, help="measured runs per server and workload (after a warm-up)")
    ap.add_argument("--smoke", action="store_true", help="tiny workloads: checks the script, measures nothing")
    ap.add_argument("--in-turn", action="store_true", help="serve the sides at once and take their runs in turn "
                    "(run_sides_in_turn) instead of one server after another")
    ap.add_argument("--out", help="write the result JSON here")


def chosen_workloads(ap: argparse.ArgumentParser, args: argparse.Namespace, workloads: dict[str, str],
                     smoke: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """(the table to run from: `smoke` with --smoke, else `workloads`; the names --workloads chose, in its order).
    An unknown name is a usage error."""
    table = smoke if args.smoke else workloads
    names = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in names if w not in table]
    if unknown:
        ap.error(f"unknown workloads {unknown} (known: {', '.join(table)})")
    return table, names


def print_ratios(result: dict, targets: tuple[tuple[str, str, str, float], ...], sides: tuple[str, str]) -> bool:
    """The table of each target's ratio, the second side over the first (result[workload][side][field]), beside its
    bound; records the ratio in result[workload]["ratio"]. `targets`: (workload, field, "<=" or ">=", bound), those of
    workloads not in `result` skipped. Returns whether every target was met."""
    first, second = sides
    print(f"{'workload':8} {'metric':14} {first:>10} {second:>10} {'ratio':>8}  target")
    met = True
    for name, key, op, bound in targets:
        if name not in result:
            continue
        a, b = result[name][first][key], result[name][second][key]
        ratio = b / a if a else float("nan")
        ok = ratio <= bound if op == "<=" else ratio >= bound
        met &= ok
        result[name]["ratio"] = {key: ratio, "target": f"{op} {bound}", "met": ok}
        print(f"{name:8} {key:14} {a:10.2f} {b:10.2f} {ratio:8.3f}  {op} {bound} {'ok' if ok else 'MISSED'}")
    return met
