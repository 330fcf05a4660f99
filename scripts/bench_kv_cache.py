#!/usr/bin/env python3
"""The KV cache's storage format against the activation dtype's, in one run on one machine: each workload against a
server per --kv_cache_dtype (scripts/bench_server.py starts and stops each), greedy, with the ratios to the first.

    W1     128 random prompts of 128-512 tokens, 128 output tokens, 64 in flight (throughput)
    W2     16 random prompts of 256 tokens, 64 output tokens, batch 1 (latency)
    W3     64 prompts of one 1,024-token prefix + 32-64 own tokens, 32 output tokens, 16 in flight (prefix cache)

Each row also gives the server's KV pool (tokens and bytes a token, from /metrics and the start-up log's figures) and
what that makes of 8 GiB: the tokens and the W1-sized requests (~448 tokens each at the end) it holds.
Decode attention alone (time and bytes a step at 64 x 384, 16 x 1,100, 1 x 2,000) is scripts/bench_cpu_kernels.py's
`--kv` comparison.

    python scripts/bench_kv_cache.py --server="--data_type float32" --kv auto,int8,fp8_e4m3 --workloads W1,W2,W3
    python scripts/bench_kv_cache.py --smoke      # a minute: small versions of each, to check the script runs

For vLLM's CPU build on the same loads, scripts/compare_vllm.sh with LIGHTSERVE_EXTRA_ARGS="--kv_cache_dtype int8".
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from bench_rows import add_common_args, chosen_workloads, median, run_sides  # scripts/, beside this file

WORKLOADS = {
    "W1": "--dataset random --num-prompts 128 --input-len-min 128 --input-len-max 512 --output-len 128 "
          "--max-concurrency 64",
    "W2": "--dataset random --num-prompts 16 --input-len 256 --output-len 64 --max-concurrency 1",
    "W3": "--dataset shared-prefix --num-prompts 64 --prefix-len 1024 --suffix-len-min 32 --suffix-len-max 64 "
          "--output-len 32 --max-concurrency 16",
}
SMOKE = {
    "W1": "--dataset random --num-prompts 4 --input-len 64 --output-len 8 --max-concurrency 4",
    "W2": "--dataset random --num-prompts 1 --input-len 64 --output-len 8 --max-concurrency 1",
    "W3": "--dataset shared-prefix --num-prompts 4 --prefix-len 128 --suffix-len-min 8 --suffix-len-max 16 "
          "--output-len 8 --max-concurrency 2",
}
KEYS = ("output_tok_s", "tpot_p50_ms", "itl_p50_ms", "ttft_p50_ms", "kv_tokens_total")
W1_REQUEST_TOKENS = 448  # a W1 request at its end: 320 prompt tokens on average + 128 output
EIGHT_GIB = 8 << 30


def bytes_per_token(kv: str, server_flags: str) -> int:
    """The worker's KV bytes a token for this cache format (the model's own rule, model_infer/kv_cache.py)."""
    code = ("import sys, torch; from lightserve.cli import parse_args; from lightserve.resolve_config import "
            "resolve_config; from lightserve.model_infer.kv_cache import KVCache; "
            "from lightserve.model_infer.process import torch_dtype; "
            "c = resolve_config(parse_args(sys.argv[1:])); m = c.model_config; "
            "print(KVCache.bytes_per_token(m, m.num_kv_heads, torch_dtype(c.kv_cache_dtype.value)))")
    out = subprocess.run([sys.executable, "-c", code, *shlex.split(server_flags), "--kv_cache_dtype", kv],
                         check=True, capture_output=True, text=True, cwd="/").stdout
    return int(out.split()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", default="", help="lightserve flags every server gets (one string)")
    ap.add_argument("--kv", default="auto,int8,fp8_e4m3", help="--kv_cache_dtype values, the first the baseline")
    add_common_args(ap, WORKLOADS)
    args = ap.parse_args(argv)
    table, names = chosen_workloads(ap, args, WORKLOADS, SMOKE)
    kvs = [k for k in args.kv.split(",") if k]
    result: dict = {"server": args.server, "capacity": {}, "workloads": {}}
    for kv in kvs:
        per_token = bytes_per_token(kv, args.server)
        result["capacity"][kv] = {"bytes_per_token": per_token, "tokens_in_8gib": EIGHT_GIB // per_token,
                                  "w1_requests_in_8gib": EIGHT_GIB // per_token // W1_REQUEST_TOKENS}
    for name in names:
        result["workloads"][name] = {}
        sides = run_sides([(f"{args.server} --kv_cache_dtype {kv}", table[name]) for kv in kvs], args)
        for kv, rows in zip(kvs, sides):
            result["workloads"][name][kv] = {k: median(rows, k) for k in KEYS}
            print(f"{name} {kv}: {result['workloads'][name][kv]}", file=sys.stderr)
    base = kvs[0]
    print(f"{'kv cache':10} {'bytes/token':>11} {'tokens in 8 GiB':>16} {'W1 requests':>12}")
    for kv, cap in result["capacity"].items():
        print(f"{kv:10} {cap['bytes_per_token']:11d} {cap['tokens_in_8gib']:16d} {cap['w1_requests_in_8gib']:12d}")
    print(f"\n{'workload':8} {'kv cache':10} {'tok/s':>9} {'TPOT p50':>9} {'TTFT p50':>9} {'tok/s vs ' + base:>14}")
    for name, sides in result["workloads"].items():
        for kv, row in sides.items():
            ratio = row["output_tok_s"] / sides[base]["output_tok_s"] if sides[base]["output_tok_s"] else float("nan")
            print(f"{name:8} {kv:10} {row['output_tok_s']:9.1f} {row['tpot_p50_ms']:9.2f} {row['ttft_p50_ms']:9.1f} "
                  f"{ratio:14.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
