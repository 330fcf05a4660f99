"""End-to-end: the real server process on the real model, driven over HTTP."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import httpx
import openai
import pytest
import torch

from tests.e2e.server import MODEL_DIR, ServerProc, wait_until
from tests.greedy_check import greedy_mismatch

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the ocean.",
    "Explain photosynthesis in one paragraph.",
    "List three prime numbers and explain why they are prime.",
    "Translate 'good morning' into Spanish, French and German.",
    "def fibonacci(n):",
    "The quick brown fox",
    "Once upon a time, in a small village,",
    "Q: What is 12 times 7?\nA:",
    "Summarize the plot of Romeo and Juliet.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "1, 1, 2, 3, 5, 8,",
    "Write a SQL query that counts rows in a table named users.",
    "The three laws of thermodynamics are",
    "import numpy as np\n# compute the mean of an array\n",
]
# Generous: a loaded 2-core machine is slow, and a timeout here would only hide the real assertion.
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=1200)


def _chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, torch_dtype=torch.float32).eval()


async def _generate_ids(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> list[int]:
    async with session.post(url + "/generate", json={
            "inputs": prompt, "parameters": {"max_new_tokens": max_tokens, "return_details": True}}) as resp:
        data = await resp.json()
        assert resp.status == 200, data
    return [t["id"] for t in data["tokens"]]


def test_greedy_output_matches_transformers(server, tokenizer, hf_model):
    """16 prompts x 64 new tokens, sent concurrently (they batch), token-exact against transformers
    (teacher-forced: tests/greedy_check.py)."""
    texts = [_chat(tokenizer, p) if i % 2 == 0 else p for i, p in enumerate(PROMPTS)]

    async def run_all():
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
            return await asyncio.gather(*[_generate_ids(session, server.url, t, 64) for t in texts])

    ours = asyncio.run(run_all())
    for text, got in zip(texts, ours):
        prompt = tokenizer(text)["input_ids"]
        assert len(got) == 64 or got[-1] == tokenizer.eos_token_id, (text, got)  # ends only at eos
        problem = greedy_mismatch(hf_model, prompt, got)
        assert problem is None, f"{problem}\nprompt {text!r}\nours {tokenizer.decode(got)!r}"


@pytest.mark.timeout(1200)
def test_64_concurrent_streams_complete_and_free_kv(server):
    async def one(session, i):
        n = 8 + (i * 7) % 57
        prompt = " ".join(["word"] * (5 + (i * 13) % 200))
        tokens, finished = 0, None
        async with session.post(server.url + "/generate_stream", json={
                "inputs": prompt, "parameters": {"max_new_tokens": n, "ignore_eos": True}}) as resp:
            assert resp.status == 200
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                tokens += 1
                if event["finished"]:
                    finished = event["finish_reason"]
        return n, tokens, finished

    async def run_all():
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
            return await asyncio.gather(*[one(session, i) for i in range(64)])

    for n, tokens, finished in asyncio.run(run_all()):
        assert tokens == n and finished == "length"
    assert wait_until(lambda: server.metrics()["lightserve_requests_running"] == 0, 10)
    m = server.metrics()
    assert m["lightserve_kv_tokens_free"] + m["lightserve_kv_tokens_cached"] == m["lightserve_kv_tokens_total"]


def test_openai_client_completions_and_chat(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=600)
    model = client.models.list().data[0].id
    comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert comp.choices[0].text and comp.usage.prompt_tokens > 0
    assert comp.usage.completion_tokens == 8 or comp.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == comp.choices[0].text
    chat = client.chat.completions.create(model=model, temperature=0, max_tokens=20,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in chat.choices[0].message.content
    chunks = list(client.chat.completions.create(
        model=model, temperature=0, max_tokens=20, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "What is the capital of France?"}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_unicode_streams_without_broken_characters(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=600)
    model = client.models.list().data[0].id
    prompts = ["Repeat exactly: 你好，世界！我爱北京天安门。", "Repeat exactly: 🌍🚀🎉 party time 🎂🍰",
               "Translate to Japanese: good morning, how are you?"]
    saw_multibyte = False
    for prompt in prompts:
        full = client.chat.completions.create(model=model, temperature=0, max_tokens=40,
                                              messages=[{"role": "user", "content": prompt}])
        pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model, temperature=0, max_tokens=40, stream=True,
            messages=[{"role": "user", "content": prompt}]) if c.choices]
        assert all("\ufffd" not in p for p in pieces), pieces
        assert "".join(pieces) == full.choices[0].message.content
        saw_multibyte |= any(len(ch.encode()) > 2 for ch in full.choices[0].message.content)
    assert saw_multibyte, "no output contained CJK or emoji: the test proved nothing"


def test_sigterm_leaves_no_process_or_shm(tmp_path):
    """SIGTERM stops the server by itself: exit code 0 (ServerProc.stop falls back to SIGKILL, -9,
    when its wait runs out). The wait is the longer of 20 s and the start-up time just measured:
    a clean stop takes a fraction of a start on an idle and on a loaded machine alike."""
    t0 = time.monotonic()
    srv = ServerProc("--data_type", "float32", "--max_total_token_num", "4096", log_path=tmp_path / "log").wait_ready()
    start_s = time.monotonic() - t0
    children = srv.children()
    assert len(children) >= 3 and srv.shm_segments()
    r = httpx.post(srv.url + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}}, timeout=60)
    assert r.status_code == 200
    assert srv.stop(signal.SIGTERM, timeout=max(20.0, start_s)) == 0, srv.log_tail()
    assert wait_until(lambda: not any(_alive(p) for p in children), 5)
    assert srv.shm_segments() == []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
