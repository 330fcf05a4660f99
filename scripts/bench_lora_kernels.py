"""Micro benchmark of the LoRA product (kernels/lora.py's lora_apply: lora.c's shrink and expand in one call) against
the base projection it rides on (kernels.linear over the packed weight: the float32 GEMM of linear.c, or the bf16
prepacked path), per projection shape, batch pattern and rank: median ms a call and the LoRA's share of the base.

    python scripts/bench_lora_kernels.py [--dtype float32|bfloat16] [--ranks 16 64] [--batches decode1 ...]

Batches: decode1 (one token under one adapter), decode64 (64 tokens, 8 adapters of 8), prefill512 (one chunk of 512
tokens under one adapter). The adapters' A and BT stay cache-resident here (a step reads each once); the base
weights are the model's size. Timings vary run to run on a shared machine: compare within one run. Prints the CPU
model first.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time

import numpy as np
import torch

from lightserve.kernels.cpu import library
from lightserve.kernels.linear import linear, pack_linear_weight, prepack_weight
from lightserve.kernels.lora import LoraSegments, lora_apply

# (label, K, output widths of the fused projection's parts)
SHAPES = [("smollm2 qkv", 576, (576, 192, 192)), ("smollm2 gate_up", 576, (1536, 1536)),
          ("smollm2 down", 1536, (576,)), ("llama1b qkv", 2048, (2048, 512, 512)), ("wide 5632", 2048, (5632,))]
BATCHES = {"decode1": (1, 1), "decode64": (64, 8), "prefill512": (512, 1)}  # (tokens, adapters)
NUM_SLOTS = 8


def median_ms(fn, *args, budget_s: float = 0.3) -> float:
    """The median ms of fn(*args) over as many calls as fit in about budget_s (3 to 50)."""
    fn(*args)
    t = time.perf_counter()
    fn(*args)
    first = time.perf_counter() - t
    times = []
    for _ in range(max(3, min(50, int(budget_s / max(first, 1e-6))))):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[16, 64])
    parser.add_argument("--batches", nargs="+", default=list(BATCHES), choices=list(BATCHES))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    assert library() is not None, "no C kernel library here"
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")),
        platform.processor())
    print(f"CPU: {model}, torch threads {torch.get_num_threads()}, activations {args.dtype}")
    print(f"{'shape':>16s} {'batch':>10s} {'R':>3s} | {'lora ms':>8s} {'base ms':>8s} {'lora/base':>9s}")
    gen = torch.Generator().manual_seed(0)
    for label, k, widths in SHAPES:
        n = sum(widths)
        dense = torch.randn(n, k, generator=gen) * 0.05
        weight = pack_linear_weight(dense) if dtype == torch.float32 else prepack_weight(dense.bfloat16())
        for batch in args.batches:
            tokens, adapters = BATCHES[batch]
            segs = LoraSegments.from_token_slots(np.repeat(np.arange(adapters, dtype=np.int32), tokens // adapters))
            x = torch.randn(tokens, k, generator=gen).to(dtype)
            base = median_ms(linear, x, weight)
            y = linear(x, weight)
            for r in args.ranks:
                # One rank block per part of the projection: A stacked along R, each part's BT rows its own.
                a = torch.randn(NUM_SLOTS, r * len(widths), k, generator=gen) * 0.05
                bt = torch.randn(NUM_SLOTS, r * len(widths), n, generator=gen) * 0.05
                starts = np.cumsum((0, *widths[:-1]))
                slices = tuple((j * r, r, int(n0), w) for j, (n0, w) in enumerate(zip(starts, widths)))
                ms = median_ms(lora_apply, y, x, a, bt, segs, slices)
                print(f"{label:>16s} {batch:>10s} {r:>3d} | {ms:8.3f} {base:8.3f} {ms / base:9.3f}")


if __name__ == "__main__":
    main()
