"""Micro-benchmark of the detokenizer loop: cost per output token with 64 live requests.

Measures what the process does per TokensReady except the zmq transport (one send/recv per step,
not per token): unpickle the message, read the pool, decode incrementally, check stop strings,
build and pickle the DeltaBatch. Not a test (pytest does not collect it); belongs in scripts/.

    python tests/detokenizer/bench_detokenizer.py [--steps 200] [--reqs 64]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from lightserve.config import ServerConfig
from lightserve.detokenizer.process import Detokenizer
from lightserve.engine.model_prep import ensure_default_model
from lightserve.messages import TokensReady, decode, encode
from lightserve.sampling import SamplingParams
from lightserve.shm.req_pool import ReqPool

TEXT = ("The detokenizer turns token ids into text pieces: café, naïve, 你好世界, emoji 😀🎉, "
        "code `x = f(y)  # ok`, numbers 3.14159 and newlines.\n") * 40


def bench(tokenizer, num_reqs: int, num_steps: int, stop: list[str]) -> tuple[float, float]:
    """(CPU seconds per output token, of which pickling the DeltaBatch), best of 3 runs."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:num_steps]
    prompt = tokenizer.encode("Write a short paragraph about tokenizers.", add_special_tokens=False)
    best = (float("inf"), 0.0)
    for _ in range(3):
        config = ServerConfig()
        pool = ReqPool.create(config.shm_name, num_slots=num_reqs, max_len=len(prompt) + len(ids) + 1)
        try:
            for i in range(num_reqs):
                pool.acquire(i, 1000 + i)
                pool.write_request(i, prompt, SamplingParams(stop=stop), seed=0)
            detok = Detokenizer(tokenizer, pool)
            slots, req_ids = np.arange(num_reqs, dtype=np.int32), np.arange(1000, 1000 + num_reqs, dtype=np.int64)
            msg = encode(TokensReady(slots, req_ids))
            elapsed = pickling = 0.0
            for step, token in enumerate(ids):
                pool.token_ids[:, len(prompt) + step] = token  # rank 0's writes are not timed
                pool.num_output[:] = step + 1
                start = time.process_time()  # CPU time: other processes share these cores
                batch, _ = detok.on_tokens_ready(decode(msg))
                mid = time.process_time()
                encode(batch)
                end = time.process_time()
                elapsed += end - start
                pickling += end - mid
            best = min(best, (elapsed / (num_reqs * len(ids)), pickling / (num_reqs * len(ids))))
            del detok
        finally:
            pool.close()
            pool.segment.unlink()
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--reqs", type=int, default=64)
    args = parser.parse_args()
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    for label, stop in (("no stop strings", []), ("3 stop strings", ["\n\n", "User:", "</answer>"])):
        per_token, pickling = bench(tokenizer, args.reqs, args.steps, stop)
        print(f"{label:16s}: {per_token * 1e6:6.1f} us/token CPU ({pickling * 1e6:4.1f} of it pickling the "
              f"DeltaBatch), {1 / per_token:6.0f} tokens/s on one core ({args.reqs} requests, {args.steps} steps)")


if __name__ == "__main__":
    main()
