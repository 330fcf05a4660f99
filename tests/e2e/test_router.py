"""End-to-end router behaviour: pause/resume under KV pressure, prefix cache hits, chunked prefill.

Outputs under pressure are compared with the session's ample-KV server: greedy decoding must give
the same tokens whether a request was paused, chunked or served from the prefix cache.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp
import httpx
import pytest

from tests.e2e.server import ServerProc, wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import step_trace  # noqa: E402  (scripts/ is not a package)

TIMEOUT = aiohttp.ClientTimeout(total=1200)


async def _generate(session, url: str, prompt: str, max_new_tokens: int, **params) -> dict:
    async with session.post(url + "/generate", json={
            "inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "return_details": True,
                                             **params}}) as resp:
        data = await resp.json()
        assert resp.status == 200, data
        return data


def _run(url: str, prompts: list[str], max_new_tokens: int, **params) -> list[dict]:
    async def go():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            return await asyncio.gather(*[_generate(session, url, p, max_new_tokens, **params) for p in prompts])
    return asyncio.run(go())


def _ids(result: dict) -> list[int]:
    return [t["id"] for t in result["tokens"]]


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory):
    """KV for about 2,048 tokens and 64-token prefill chunks: 32 requests of ~100 tokens must pause. Logs at DEBUG, so
    its log holds a line per step (scripts/step_trace.py)."""
    log = tmp_path_factory.mktemp("tight") / "server.log"
    srv = ServerProc("--data_type", "float32", "--max_total_token_num", "2048", "--chunked_prefill_size", "64",
                     "--log_level", "debug", log_path=log).wait_ready()
    yield srv
    srv.stop()


def _idle_kv_is_free_or_cached(srv: ServerProc) -> None:
    assert wait_until(lambda: srv.metrics()["lightserve_requests_running"] == 0, 30)
    m = srv.metrics()
    assert m["lightserve_kv_tokens_free"] + m["lightserve_kv_tokens_cached"] == m["lightserve_kv_tokens_total"]


@pytest.mark.timeout(1800)
def test_pause_resume_under_kv_pressure_keeps_outputs(server, tight_server):
    prompts = [f"Request {i}: write a few sentences about the number {i * 17}." for i in range(32)]
    before = tight_server.metrics()
    tight = _run(tight_server.url, prompts, 64, ignore_eos=True)
    after = tight_server.metrics()
    assert after["lightserve_pauses_total"] > before["lightserve_pauses_total"]
    assert after["lightserve_resumes_total"] > before["lightserve_resumes_total"]
    ample = _run(server.url, prompts, 64, ignore_eos=True)
    for p, a, b in zip(prompts, ample, tight):
        assert _ids(a) == _ids(b), p
        assert b["count_output_tokens"] == 64
    _idle_kv_is_free_or_cached(tight_server)


@pytest.mark.timeout(1200)
def test_chunked_prefill_beside_running_streams_keeps_outputs(server, tight_server):
    long_prompt = "Here is a list of fruits: " + ", ".join(f"fruit number {i}" for i in range(230)) + ". Summarize."
    shorts = [f"Count from {i} to {i + 10}:" for i in range(4)]

    async def go(url):
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            short_tasks = [asyncio.create_task(_generate(session, url, p, 48, ignore_eos=True)) for p in shorts]
            await asyncio.sleep(0.5)  # the short streams are decoding when the long prompt arrives
            long_result = await _generate(session, url, long_prompt, 16)
            return long_result, await asyncio.gather(*short_tasks)

    log_start = tight_server.log_path.stat().st_size
    tight_long, tight_shorts = asyncio.run(go(tight_server.url))
    ample_long, ample_shorts = asyncio.run(go(server.url))
    assert tight_long["prompt_tokens"] > 1000  # 16+ chunks of 64 interleaved with the decodes
    assert _ids(tight_long) == _ids(ample_long)
    assert [_ids(r) for r in tight_shorts] == [_ids(r) for r in ample_shorts]
    _idle_kv_is_free_or_cached(tight_server)
    # The router's step lines show it: the long prompt's chunks, none over 64 tokens, ran in steps beside the short
    # streams' decodes (25 of its 26 chunk steps on a Zen 4), and those decoded their 47 tokens after the first.
    steps = step_trace.parse(tight_server.log_path.read_bytes()[log_start:].decode(errors="replace").splitlines())
    assert any(s.prefill and s.decode for s in steps)
    assert all(s.new <= 64 * s.prefill and s.forward_ms <= s.step_ms for s in steps)
    assert sum(s.new for s in steps) > 1000 and sum(s.decode for s in steps) >= 4 * 47


@pytest.mark.timeout(1200)
def test_shared_prefix_is_computed_once(server):
    prefix = "Background: " + " ".join(f"Fact {i} is that the value {i} maps to {i * 3}." for i in range(70))
    prompts = [f"{prefix}\nQuestion {i}: what does {i} map to?" for i in range(16)]
    # The first request fills the cache; the other 15 hit it.
    first = _run(server.url, prompts[:1], 8)[0]
    before = server.metrics()
    rest = _run(server.url, prompts[1:], 8)
    after = server.metrics()
    prompt_tokens = after["lightserve_prompt_tokens_total"] - before["lightserve_prompt_tokens_total"]
    cached = after["lightserve_prompt_tokens_cached_total"] - before["lightserve_prompt_tokens_cached_total"]
    assert first["prompt_tokens"] > 1000
    assert cached >= 15 * 1000 and prompt_tokens - cached < 15 * 40
    assert all(r["prompt_cache_len"] >= 1000 for r in rest)
    # Unchanged outputs: the same prompts with the cache off for the request.
    uncached = _run(server.url, prompts[1:4], 8, disable_prompt_cache=True)
    assert [_ids(r) for r in uncached] == [_ids(r) for r in rest[:3]]
    assert all(r["prompt_cache_len"] == 0 for r in uncached)


def test_multi_turn_chat_reports_cached_tokens(server):
    messages = [{"role": "user", "content": "Name three colors of the rainbow."}]
    r1 = httpx.post(server.url + "/v1/chat/completions", timeout=600, json={
        "messages": messages, "max_tokens": 32, "temperature": 0}).json()
    messages += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "Now name two more."}]
    r2 = httpx.post(server.url + "/v1/chat/completions", timeout=600, json={
        "messages": messages, "max_tokens": 16, "temperature": 0}).json()
    cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    # Turn 1's prompt is a prefix of turn 2's; its answer is too, up to the template's end marker.
    assert cached >= r1["usage"]["prompt_tokens"], (cached, r1["usage"])
