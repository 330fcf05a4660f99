#!/usr/bin/env python3
"""Baseline for the serving benchmarks: transformers `generate`, one request at a time.

Runs the same shape of workload as `benchmark_serving.py --dataset random` (random token prompts
of an exact length, greedy, a fixed number of new tokens with eos ignored) and prints output
tokens/s, so a lightserve figure can be given as a ratio to it from the same machine and run.

    python scripts/bench_hf_generate.py --num-prompts 8 --input-len 256 --output-len 128 --dtype float32
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=str(Path(os.environ.get(
        "LIGHTSERVE_CACHE", Path.home() / ".cache" / "lightserve")) / "SmolLM2-135M-Instruct"))
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1, help="static batches of this many prompts")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json")
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).eval()
    rng = np.random.default_rng(args.seed)
    vocab = model.config.vocab_size
    # Ids from the ordinary vocabulary only (the first 17 are special tokens in SmolLM2).
    prompts = rng.integers(100, vocab, size=(args.num_prompts, args.input_len))
    # Forbid eos so every request generates exactly output_len tokens, like ignore_eos on a server.
    gen = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
               pad_token_id=model.config.eos_token_id)
    with torch.inference_mode():
        model.generate(torch.tensor(prompts[:1]), max_new_tokens=4, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        for start in range(0, args.num_prompts, args.batch_size):
            batch = torch.tensor(prompts[start:start + args.batch_size])
            out = model.generate(batch, attention_mask=torch.ones_like(batch), **gen)
            assert out.shape[1] == args.input_len + args.output_len
        elapsed = time.perf_counter() - t0
    tokens = args.num_prompts * args.output_len
    result = dict(vars(args), elapsed_s=elapsed, output_tokens=tokens, output_tok_per_s=tokens / elapsed,
                  ms_per_token=1e3 * elapsed / tokens * args.batch_size, torch_threads=torch.get_num_threads())
    print(json.dumps(result, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
