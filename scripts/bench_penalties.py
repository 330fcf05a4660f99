"""Micro-benchmark behind logits_process.apply_penalties' NOTE: the cost of rebuilding the penalties
from the token history each step, against a softmax of the same batch (64 rows of 1024 tokens over
a 49152-token vocabulary by default). Prints medians; not a test (timings on a shared CPU are noisy).

    python scripts/bench_penalties.py [--rows 64] [--length 1024] [--vocab 49152] [--repeats 7]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightserve.model_infer.logits_process import apply_penalties


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    rows, length = args.rows, args.length
    logits = torch.randn(rows, args.vocab)
    history = torch.randint(0, args.vocab, (rows, length))
    penalty_args = (torch.arange(rows), history, torch.full((rows,), length), torch.full((rows,), length // 2),
                    torch.full((rows,), 1.1), torch.full((rows,), 0.1), torch.full((rows,), 0.1))
    penalty_s = median_s(lambda: apply_penalties(logits, *penalty_args), args.repeats)
    softmax_s = median_s(lambda: torch.softmax(logits, -1), args.repeats)
    print(f"rows {rows}, length {length}, vocab {args.vocab}, {torch.get_num_threads()} threads: "
          f"penalties {penalty_s * 1e3:.2f} ms, softmax {softmax_s * 1e3:.2f} ms, "
          f"ratio {penalty_s / softmax_s:.1f}x")


if __name__ == "__main__":
    main()
