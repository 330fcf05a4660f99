#!/usr/bin/env python3
"""Multi-LoRA serving against the base model alone, in one run on one machine: each workload against a server
without adapters and one serving --num-adapters random rank-R adapters of the bundled model (every projection
targeted), whose requests go to the adapters in turn (scripts/bench_server.py starts and stops each server), greedy.

    W1  128 random prompts of 128-512 tokens, 128 output tokens, 64 in flight, spread over the adapters
    W2  16 random prompts of 256 tokens, 64 output tokens, batch 1, every request on one adapter

Targets: W1 output tok/s >= 0.8x of the base alone; W2 inter-token latency p50 <= 1.15x.

    python scripts/bench_lora.py --server="--data_type float32"
    python scripts/bench_lora.py --smoke      # a minute: small versions of each, to check the script runs
    python scripts/bench_lora.py --runs 7 --workloads W2 --in-turn   # both servers up, their runs alternating

On a shared host the machine's speed drifts over minutes by as much as the W2 target's margin: --in-turn keeps both
servers up and alternates their measured runs, so the drift falls on both sides alike.

The adapters are written once under $LIGHTSERVE_CACHE/bench_lora (random A and B of the model's shapes, PEFT's file
layout); they change the output, which is why the workloads ignore eos.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from bench_rows import add_common_args, chosen_workloads, median, print_ratios, run_sides  # scripts/, beside this file
from benchmark_serving import default_model_dir
from safetensors.torch import save_file

WORKLOADS = {
    "W1": "--dataset random --num-prompts 128 --input-len-min 128 --input-len-max 512 --output-len 128 "
          "--max-concurrency 64",
    "W2": "--dataset random --num-prompts 16 --input-len 256 --output-len 64 --max-concurrency 1",
}
SMOKE = {
    "W1": "--dataset random --num-prompts 8 --input-len 64 --output-len 8 --max-concurrency 8",
    "W2": "--dataset random --num-prompts 1 --input-len 64 --output-len 8 --max-concurrency 1",
}
# (workload, the row's field, how the adapters/base ratio must compare, bound)
TARGETS = (("W1", "output_tok_s", ">=", 0.8), ("W2", "itl_p50_ms", "<=", 1.15))
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def make_adapters(config_dir: Path, out: Path, count: int, rank: int) -> list[tuple[str, Path]]:
    """`count` random adapters of rank `rank` over the model whose config.json is in `config_dir` (written once)."""
    cfg = json.loads((config_dir / "config.json").read_text())
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    dims = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    made = []
    for i in range(count):
        folder = out / f"r{rank}-{i}"
        made.append((f"lora{i}", folder))
        if (folder / "adapter_model.safetensors").exists():
            continue
        folder.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(layers):
            for module, block in MODULES.items():
                n_in, n_out = dims[module]
                name = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in ** 0.5
                tensors[f"{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.01
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
            "target_modules": list(MODULES)}))
    return made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", default="", help="lightserve flags both servers get (one string)")
    ap.add_argument("--num-adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    add_common_args(ap, WORKLOADS)
    args = ap.parse_args(argv)
    table, names = chosen_workloads(ap, args, WORKLOADS, SMOKE)
    cache = Path(os.environ.get("LIGHTSERVE_CACHE", Path.home() / ".cache" / "lightserve"))
    adapters = make_adapters(Path(default_model_dir()), cache / "bench_lora", args.num_adapters, args.rank)
    lora_flags = (f"--enable_lora --max_loras {len(adapters)} --max_lora_rank {args.rank} --lora_modules "
                  + " ".join(f"{name}={path}" for name, path in adapters))
    result = {}
    for name in names:
        # W1 spreads its requests over every adapter; W2 (batch 1) runs on one.
        models = ",".join(n for n, _ in adapters) if name == "W1" else adapters[0][0]
        base, lora = run_sides([(args.server, table[name]),
                                (f"{args.server} {lora_flags}", f"{table[name]} --model {models}")], args)
        keys = ("output_tok_s", "tpot_p50_ms", "itl_p50_ms", "ttft_p50_ms")
        result[name] = {side: {**{k: median(rows, k) for k in keys},
                               "runs": [{k: r.get(k) for k in keys} for r in rows]}
                        for side, rows in (("base", base), ("lora", lora))}
        for side in ("base", "lora"):
            print(f"{name} {side}: " + "  ".join(f"{k} {result[name][side][k]:.2f}" for k in keys) + "; runs' ITL p50 "
                  + " ".join(f"{r['itl_p50_ms']:.2f}" for r in result[name][side]["runs"]), file=sys.stderr)
    met = print_ratios(result, TARGETS, ("base", "lora"))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if met or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
