"""A real server started with `--kernel_backend triton` on CPU: its worker runs the GPU code path (Triton kernels,
token-major KV, F.linear) in Triton's interpreter, which the launcher switches on for the worker alone. Greedy tokens
of a batch of requests, prompts in chunks, a prefix-cache hit: each token is transformers' float32 argmax after the
same tokens. A tiny Llama with SmolLM2's tokenizer keeps the interpreter's steps short."""
from __future__ import annotations

import asyncio
import os
import re
import shutil
from pathlib import Path

import aiohttp
import httpx
import pytest
import torch

from tests.e2e.server import MODEL_DIR, ServerProc, wait_until
from tests.model.tiny_models import make_tiny_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
NEW_TOKENS = 5
WORDS = "river stone apple window quiet seven orange bright table music cloud paper garden silver".split()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = make_tiny_model("llama3", tmp_path_factory.mktemp("llama3") / "model", vocab_size=49152)
    for name in TOKENIZER_FILES:
        if (MODEL_DIR / name).exists():
            shutil.copy(MODEL_DIR / name, model_dir / name)
    # Started without TRITON_INTERPRET (which this test session sets for itself): the launcher must set it.
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        srv = ServerProc("--model_dir", str(model_dir), "--data_type", "float32", "--kernel_backend", "triton",
                         "--max_total_token_num", "512", "--chunked_prefill_size", "16", "--req_pool_size", "8",
                         log_path=model_dir.parent / "server.log")
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    try:  # the reference loads while the server starts
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        yield srv.wait_ready(), hf, tokenizer
    finally:
        srv.stop()
    assert srv.shm_segments() == []


def _prompt(i: int, num_words: int) -> str:
    return " ".join(WORDS[(i * 5 + k * 3) % len(WORDS)] for k in range(num_words)) + f" {i}"


def _generate(url: str, prompts: list[str]) -> list[dict]:
    async def one(session, prompt):
        async with session.post(url + "/generate", json={"inputs": prompt, "parameters": {
                "max_new_tokens": NEW_TOKENS, "ignore_eos": True, "return_details": True}}) as resp:
            data = await resp.json()
            assert resp.status == 200, data
            return data

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            return await asyncio.gather(*[one(session, p) for p in prompts])
    return asyncio.run(go())


def _assert_transformers_greedy(hf, tokenizer, prompt: str, result: dict) -> None:
    got = [t["id"] for t in result["tokens"]]
    prompt_ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():  # teacher-forced on our tokens: the argmax after each prefix
        logits = hf(torch.tensor([prompt_ids + got])).logits[0, len(prompt_ids) - 1:-1]
    assert got == logits.argmax(-1).tolist(), prompt


@pytest.mark.timeout(600)
def test_triton_backend_server_answers_greedy_requests_as_transformers(served):
    srv, hf, tokenizer = served
    prompts = [_prompt(i, 6 + 7 * i) for i in range(3)]  # 7 to 21 tokens: the longest in two chunks
    for prompt, result in zip(prompts, _generate(srv.url, prompts)):
        assert len(result["tokens"]) == NEW_TOKENS
        _assert_transformers_greedy(hf, tokenizer, prompt, result)
    follow = prompts[2] + " " + _prompt(9, 3)
    second, = _generate(srv.url, [follow])
    assert second["prompt_cache_len"] >= 16  # the first prompt's KV, computed by the Triton kernels, reused
    _assert_transformers_greedy(hf, tokenizer, follow, second)
    assert wait_until(lambda: srv.metrics()["lightserve_requests_running"] == 0, 30)


def test_the_worker_alone_runs_triton_in_the_interpreter(served):
    srv, _, _ = served
    log = srv.log_path.read_text()
    assert re.search(r"KV cache: KVCache of 512 tokens, .* on cpu, triton kernels", log), srv.log_tail()
    assert httpx.get(srv.url + "/get_server_info", timeout=10).json()["kernel_backend"] == "triton"
    pids = dict(re.findall(r"started (\S+) pid (\d+)", log))
    environ = {name: Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") for name, pid in pids.items()}
    assert b"TRITON_INTERPRET=1" in environ["worker-tp0"]
    # The launcher's own environment is restored once the workers are spawned: the other processes never define a
    # kernel, and a user's own setting stays theirs.
    assert not any(v.startswith(b"TRITON_INTERPRET=") for v in environ["router"] + environ["detokenizer"])
