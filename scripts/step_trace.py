#!/usr/bin/env python3
"""Where a served workload's time went, step by step, from a server log written with --log_level debug.

The router logs one line per step at DEBUG (router/process.py, step_line): its tokens, the requests decoding and the
KV tokens they read, the prompt chunks, the model forward and the whole step. This groups the steps of a log (or of
a time window of it) by kind (decode only, by batch; with prompt chunks, by tokens) and prints, per group, the
steps, their time and tokens, and what of each step was not the forward (sampling, shm writes, messages, and
the router's own planning between steps is not in it). Run a workload against a server started with
`--log_level debug`, then:

    python scripts/step_trace.py server.log
    python scripts/step_trace.py server.log --start 10:12:52 --end 10:14:24   # one run of several
    LIGHTSERVE_EXTRA_ARGS="--log_level debug" bash scripts/compare_vllm.sh --only lightserve --workloads W1
        # then the lightserve-server.log in the runs folder it names
"""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass

# router/process.py step_line, after the logger's "HH:MM:SS.mmm LEVEL [process] module: " prefix.
STEP_RE = re.compile(
    r"^(?P<time>\d\d:\d\d:\d\d)\.\d+ .*?step (?P<step>\d+): tokens (?P<tokens>\d+) decode (?P<decode>\d+)"
    r" kv (?P<kv>\d+) prefill (?P<prefill>\d+) new (?P<new>\d+) before (?P<before>\d+)"
    r" forward (?P<forward>[\d.]+) ms step (?P<step_ms>[\d.]+) ms$")


@dataclass(frozen=True)
class Step:
    time: str          # HH:MM:SS the line was logged (the step's end)
    tokens: int        # computed this step
    decode: int        # requests decoding
    kv: int            # KV tokens their attention reads
    prefill: int       # prompt chunks
    new: int           # their tokens
    before: int        # KV tokens before those chunks
    forward_ms: float
    step_ms: float


def parse(lines, start: str | None = None, end: str | None = None) -> list[Step]:
    """The step lines of a log, those logged within [start, end] (HH:MM:SS, inclusive) when given."""
    steps = []
    for line in lines:
        m = STEP_RE.match(line.rstrip("\n"))
        if not m or (start and m["time"] < start) or (end and m["time"] > end):
            continue
        steps.append(Step(m["time"], *(int(m[k]) for k in ("tokens", "decode", "kv", "prefill", "new", "before")),
                          float(m["forward"]), float(m["step_ms"])))
    return steps


def group_of(step: Step, max_decode: int) -> str:
    """Decode-only steps by batch, in quarters of the largest decode batch in the log; steps with prompt chunks by
    their tokens."""
    if step.prefill == 0:
        q = max(1, -(-max_decode // 4))  # ceil(max / 4)
        lo = min((step.decode - 1) // q, 3) * q + 1
        return f"decode only, {lo}-{min(lo + q - 1, max_decode)} requests"
    for hi in (128, 256, 512, 1024, 2048):
        if step.tokens <= hi:
            return f"with prompt chunks, {hi // 2 + 1 if hi > 128 else 1}-{hi} tokens"
    return "with prompt chunks, over 2048 tokens"


def summarize(steps: list[Step]) -> dict:
    """Per group and in all (steps: at least one): steps, seconds of step, mean step and forward ms, tokens (decoded,
    prompt), mean KV tokens read, and the time outside the forward."""
    max_decode = max(s.decode for s in steps)
    groups: dict[str, list[Step]] = {}
    for s in sorted(steps, key=lambda s: (s.prefill > 0, s.tokens if s.prefill else s.decode)):
        groups.setdefault(group_of(s, max_decode), []).append(s)
    groups["all"] = steps

    def row(ss: list[Step]) -> dict:  # ss: never empty
        n, total = len(ss), sum(s.step_ms for s in ss)
        return {"steps": n, "seconds": total / 1e3, "mean_step_ms": total / n,
                "mean_forward_ms": sum(s.forward_ms for s in ss) / n,
                "decode_tokens": sum(s.decode for s in ss), "prompt_tokens": sum(s.new for s in ss),
                "mean_kv_tokens": sum(s.kv for s in ss) / n,
                "outside_forward_s": sum(s.step_ms - s.forward_ms for s in ss) / 1e3}
    return {name: row(ss) for name, ss in groups.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="a lightserve server log written with --log_level debug")
    ap.add_argument("--start", help="only steps logged at or after HH:MM:SS")
    ap.add_argument("--end", help="only steps logged at or before HH:MM:SS")
    ap.add_argument("--json", help="also write the table here")
    args = ap.parse_args()
    with open(args.log, errors="replace") as f:
        steps = parse(f, args.start, args.end)
    if not steps:
        raise SystemExit(f"{args.log}: no step lines (start the server with --log_level debug)")
    table = summarize(steps)
    print(f"{len(steps)} steps, {steps[0].time} to {steps[-1].time}")
    print(f"{'':38s} {'steps':>6s} {'seconds':>8s} {'share':>6s} {'step ms':>8s} {'forward':>8s} "
          f"{'decoded':>8s} {'prompt':>8s} {'KV read':>8s} {'outside s':>9s}")
    total = table["all"]["seconds"]
    for name, r in table.items():
        print(f"{name:38s} {r['steps']:6d} {r['seconds']:8.2f} {100 * r['seconds'] / total:5.1f}% "
              f"{r['mean_step_ms']:8.1f} {r['mean_forward_ms']:8.1f} {r['decode_tokens']:8d} {r['prompt_tokens']:8d} "
              f"{r['mean_kv_tokens']:8.0f} {r['outside_forward_s']:9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
