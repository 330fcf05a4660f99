#!/usr/bin/env python3
"""Speculative decoding on against off, in one run on one machine: each workload against a server without and one
with --speculative_algorithm (scripts/bench_server.py starts and stops each), greedy, and the on/off ratios beside
their targets.

    W4-b1  copy-edit: a ~1,000-token JSON document written back with one edit, 256 output tokens, batch 1
    W4-b8  the same at batch 8
    W2     16 random prompts of 256 tokens, 64 output tokens, batch 1 (nothing to copy)
    W1     128 random prompts of 128-512 tokens, 128 output tokens, 64 in flight (nothing to copy)

Targets: W4-b1 inter-token latency (TPOT p50) <= 0.5x; W4-b8 output tok/s >= 1.5x; W2 and W1 output tok/s >= 0.95x.

    python scripts/bench_speculative.py --server="--data_type float32" --workloads W4-b1,W4-b8,W2,W1
    python scripts/bench_speculative.py --smoke      # a minute: small versions of each, to check the script runs
    python scripts/bench_speculative.py --server="--model_dir ~/.cache/lightserve/SmolLM2-135M-Instruct \
        --data_type float32" --speculative="--speculative_algorithm draft --num_speculative_tokens 3 \
        --speculative_draft_model_dir $GGUF"   # GGUF: model_prep.default_gguf(), the bundled Q4_1 file, drafting
        # for its own float32 conversion (or a draft of scripts/make_draft_model.py)

The "on" side reports its acceptance rate (accepted over proposed draft tokens, all measured runs).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench_rows import add_common_args, chosen_workloads, median, print_ratios, run_sides  # scripts/, beside this file

WORKLOADS = {
    "W4-b1": "--dataset copy-edit --num-prompts 4 --input-len 1000 --output-len 256 --max-concurrency 1",
    "W4-b8": "--dataset copy-edit --num-prompts 16 --input-len 1000 --output-len 256 --max-concurrency 8",
    "W2": "--dataset random --num-prompts 16 --input-len 256 --output-len 64 --max-concurrency 1",
    "W1": "--dataset random --num-prompts 128 --input-len-min 128 --input-len-max 512 --output-len 128 "
          "--max-concurrency 64",
}
SMOKE = {
    "W4-b1": "--dataset copy-edit --num-prompts 1 --input-len 200 --output-len 24 --max-concurrency 1",
    "W4-b8": "--dataset copy-edit --num-prompts 2 --input-len 200 --output-len 24 --max-concurrency 2",
    "W2": "--dataset random --num-prompts 1 --input-len 64 --output-len 8 --max-concurrency 1",
    "W1": "--dataset random --num-prompts 4 --input-len 64 --output-len 8 --max-concurrency 4",
}
# (workload, the row's field, how the on/off ratio must compare, bound)
TARGETS = (("W4-b1", "tpot_p50_ms", "<=", 0.5), ("W4-b8", "output_tok_s", ">=", 1.5),
           ("W2", "output_tok_s", ">=", 0.95), ("W1", "output_tok_s", ">=", 0.95))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", default="", help="lightserve flags both servers get (one string)")
    ap.add_argument("--speculative", default="--speculative_algorithm ngram --num_speculative_tokens 4",
                    help="the flags that turn speculation on")
    add_common_args(ap, WORKLOADS)
    args = ap.parse_args(argv)
    table, names = chosen_workloads(ap, args, WORKLOADS, SMOKE)
    result = {}
    for name in names:
        off, on = run_sides([(args.server, table[name]), (f"{args.server} {args.speculative}", table[name])], args)
        keys = ("output_tok_s", "tpot_p50_ms", "itl_p50_ms", "ttft_p50_ms")
        result[name] = {side: {k: median(rows, k) for k in keys} for side, rows in (("off", off), ("on", on))}
        drafted = sum(r.get("spec_draft_tokens_total", 0) for r in on)
        result[name]["on"]["acceptance"] = sum(r.get("spec_accepted_tokens_total", 0) for r in on) / max(drafted, 1)
        result[name]["on"]["draft_tokens"] = drafted
        print(f"{name}: off {result[name]['off']}  on {result[name]['on']}", file=sys.stderr)
    met = print_ratios(result, TARGETS, ("off", "on"))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if met or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
