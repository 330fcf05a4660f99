"""The router's overlap schedule end to end: a server that plans every step while the one before it runs gives the
same tokens and finish reasons as one that plans each step after the one before (--disable_overlap_schedule), for
requests that end by eos, by a stop id and by length in one batch. Both have fewer request slots than requests,
so slots are reused while steps planned ahead may still name the request that held them."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.e2e.server import bundled_tokenizer, chat_prompt, servers_together, wait_until

TIMEOUT = aiohttp.ClientTimeout(total=600)
SLOTS = 6


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    common = ("--data_type", "float32", "--max_total_token_num", "8192", "--req_pool_size", str(SLOTS))
    # Every step planned ahead (after the first from idle), prompt steps too, whatever this CPU's step times.
    with servers_together(tmp_path_factory.mktemp("overlap"), common, ahead=("--overlap_max_step_ms", "100000"),
                          after=("--disable_overlap_schedule",)) as pair:
        yield pair


def _requests() -> list[dict]:
    comma = bundled_tokenizer().convert_tokens_to_ids(",")
    out = []
    for i in range(6):
        out.append({"inputs": chat_prompt(["Say OK.", "Say yes.", "Say hi."][i % 3]),
                    "parameters": {"max_new_tokens": 40}})
        out.append({"inputs": chat_prompt(f"Count from {i + 1} to {i + 20}, with commas."),
                    "parameters": {"max_new_tokens": 40, "stop_token_ids": [comma]}})
        out.append({"inputs": ["The capital of France is", "def add(a, b):", "Once upon a time"][i % 3],
                    "parameters": {"max_new_tokens": 8 + 3 * i}})
        out.append({"inputs": chat_prompt(f"Write a sentence about the number {i}."),
                    "parameters": {"max_new_tokens": 12}})
    for body in out:
        body["parameters"] |= {"return_details": True, "add_special_tokens": False}
    return out


def _run(url: str, bodies: list[dict]) -> list[tuple[list[int], str]]:
    async def one(session, body):
        async with session.post(url + "/generate", json=body) as resp:
            data = await resp.json()
            assert resp.status == 200, data
            return [t["id"] for t in data["tokens"]], data["finish_reason"]

    async def go():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            return await asyncio.gather(*[one(session, b) for b in bodies])
    return asyncio.run(go())


def test_planning_ahead_gives_the_same_tokens_and_finish_reasons(servers):
    ahead, after = servers
    bodies = _requests()
    assert len(bodies) > 3 * SLOTS
    got, want = _run(ahead.url, bodies), _run(after.url, bodies)
    assert got == want
    # The batch ended every way a request can: eos and a stop id ("stop") and length.
    reasons = [reason for _, reason in want]
    assert reasons.count("length") >= 6 and reasons.count("stop") >= 6, reasons
    for srv in servers:
        assert wait_until(lambda srv=srv: srv.metrics()["lightserve_requests_running"] == 0, 30)
        m = srv.metrics()
        assert m["lightserve_kv_tokens_free"] + m["lightserve_kv_tokens_cached"] == m["lightserve_kv_tokens_total"]
        assert m["lightserve_generation_tokens_total"] == sum(len(ids) for ids, _ in want)
    assert "plans a step ahead after steps under 100000 ms" in ahead.log_tail(100_000)
    assert "plans each step after the one before" in after.log_tail(100_000)
