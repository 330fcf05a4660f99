"""Shared pieces of the tensor-parallel server tests: a tiny random Llama folder that TP 2 can split,
greedy generation over HTTP, and a server start that records its start-up time."""
from __future__ import annotations

import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.e2e.server import MODEL_DIR, ServerProc
from tests.model.tiny_models import make_tiny_model

# Short prompts (few prefill tokens) keep a CPU run short; 16 of them batch together.
PROMPTS = [
    "What is the capital of France?", "Write a poem about the ocean.", "Why is the sky blue?",
    "def fibonacci(n):", "The quick brown fox", "Once upon a time,", "Q: What is 12 times 7?\nA:",
    "1, 1, 2, 3, 5, 8,", "List three prime numbers.", "Translate 'good morning' into Spanish.",
    "The three laws of thermodynamics are", "import numpy as np\n", "Give me a recipe for pancakes.",
    "Summarize Romeo and Juliet.", "SELECT COUNT(*) FROM", "Hello, my name is",
]
SERVER_FLAGS = ("--data_type", "float32", "--max_total_token_num", "4096")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_tiny_llama(out_dir: Path, **overrides) -> Path:
    """2 layers, hidden 64, 4 query heads, 2 KV heads (so TP 2 splits them) unless overridden, random weights,
    with SmolLM2's tokenizer (hence its vocabulary size) so the HTTP front can serve it."""
    make_tiny_model("llama3", out_dir, vocab_size=49152, max_position_embeddings=1024, **overrides)
    for name in TOKENIZER_FILES:
        if (MODEL_DIR / name).exists():
            shutil.copy(MODEL_DIR / name, out_dir / name)
    return out_dir


def generate_greedy(url: str, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """All prompts at once (so they batch), greedy; returns the output token ids of each."""
    def one(prompt: str) -> list[int]:
        resp = httpx.post(url + "/generate", timeout=600, json={"inputs": prompt, "parameters": {
            "max_new_tokens": max_new_tokens, "do_sample": False, "return_details": True}})
        assert resp.status_code == 200, resp.text
        return [t["id"] for t in resp.json()["tokens"]]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def start_server(log_path: Path, *args: str) -> tuple[ServerProc, float]:
    """A ready server and its start-up time (launch to /health 200) in seconds."""
    t0 = time.monotonic()
    srv = ServerProc(*SERVER_FLAGS, *args, log_path=log_path)
    try:
        srv.wait_ready()
    except BaseException:
        srv.stop()
        raise
    return srv, time.monotonic() - t0


def child_pid(log_text: str, tp_rank: int) -> int:
    """The pid of worker rank tp_rank, from its 'pid N joined the ... group' log line."""
    m = re.search(rf"\[worker-tp{tp_rank}\].* pid (\d+) joined the", log_text)
    assert m, f"no join line of worker-tp{tp_rank} in the log"
    return int(m.group(1))


def run_server(log_path: Path, prompts: list[str], max_new_tokens: int, *args: str) -> list[list[int]]:
    """Start a server, generate, stop it cleanly; the greedy outputs."""
    srv, _ = start_server(log_path, *args)
    try:
        return generate_greedy(srv.url, prompts, max_new_tokens)
    finally:
        assert srv.stop() == 0, srv.log_tail()
