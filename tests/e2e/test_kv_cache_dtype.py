"""Servers over an 8-bit KV cache (--kv_cache_dtype int8 and fp8): the format and its bytes a token in
/get_server_info and /metrics; a request's greedy tokens are the same alone, inside a concurrent batch and again
from the prefix cache (whose rows are the quantized ones), on a server that verifies n-gram drafts. A second int8
server whose KV pool is too small for the batch (requests pause and resume) and whose prompts go in chunks of 32
tokens serves every request to its end, KV accounted for after.

Two runs of a request agree token for token until a near tie, not to the bit: a token's K and V are quantized from
values that another chunking, a decode step in place of a verify step, or a prefix hit in place of the prompt's own
prefill (the float cache's logprobs move by ~2e-6 between a fresh and a cached run of the same prompt here) compute a
rounding apart; where one lands the other side of a quantization tie the code moves a step, the logits a few
thousandths, and a near tie between the two likeliest tokens may then go the other way ("Repeat exactly: ..." does,
17 tokens in, between a fresh and a cached run). So `_assert_same_until_a_tie` compares the runs' logprobs along
the way and lets them part only where both runs' chosen tokens were about as likely. The second server's tokens are
compared on their first three (its 32-token chunks move its roundings from the first layer on)."""
from __future__ import annotations

import asyncio

import aiohttp
import httpx
import pytest

from tests.e2e.server import ServerProc, chat_prompt, servers_together, wait_until

TIMEOUT = aiohttp.ClientTimeout(total=300)
# SmolLM2-135M: 30 layers x 3 KV heads x (64 values + int8's float32 scale), K and V
INT8_BYTES_PER_TOKEN = 2 * 30 * 3 * (64 + 4)
FP8_BYTES_PER_TOKEN = 2 * 30 * 3 * 64


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(int8 with room for everything and n-gram drafts, int8 on 320 KV tokens with 32-token prefill chunks, fp8 as
    vLLM spells it), started together."""
    with servers_together(tmp_path_factory.mktemp("kv_8bit"), ("--data_type", "float32"),
                          roomy=("--kv_cache_dtype", "int8", "--max_total_token_num", "8192",
                                 "--speculative_algorithm", "ngram"),
                          tight=("--kv_cache_dtype", "int8", "--max_total_token_num", "320", "--chunked_prefill_size",
                                 "32"),
                          fp8=("--kv-cache-dtype", "fp8", "--max_total_token_num", "4096")) as procs:
        yield procs


def _bodies(top_logprobs: int = 0) -> list[dict]:
    """top_logprobs: 2 shows where two runs part that each one's token is the other's runner-up (a request that asks
    for alternatives is not speculated, so the server that verifies drafts goes without)."""
    fruit = "apple, banana, cherry, grape, lemon, mango, orange, peach, pear, plum"
    prompts = [chat_prompt(f"Repeat exactly: {fruit}"), chat_prompt("Write a haiku about the sea."),
               "\n".join([fruit] * 3) + "\n", chat_prompt("List three prime numbers."),
               "The capital of France is", chat_prompt("Explain what a hash table is in one sentence."),
               chat_prompt("Name two rivers."), "Once upon a time"]
    # ignore_eos: every request runs its 40 tokens, so the small pool must pause some
    return [{"inputs": p, "parameters": {"max_new_tokens": 40, "ignore_eos": True, "return_details": True,
                                         "top_logprobs": top_logprobs, "add_special_tokens": False}} for p in prompts]


# How far apart two runs' logprobs of a token may be (a few thousandths measured) and still be the same computation
# a rounding apart: a misread row (a wrong scale, the wrong rows of a prefix) moves them by tenths.
LOGPROB_TOL = 0.05


def _run(url: str, bodies: list[dict]) -> list[list[dict]]:
    """Each body's greedy tokens ({"id", "logprob", ...}): the first alone, then all at once."""
    async def one(session, body):
        async with session.post(url + "/generate", json=body) as resp:
            data = await resp.json()
            assert resp.status == 200, data
            return data["tokens"]

    async def go():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            alone = [await one(session, bodies[0])]
            return alone + list(await asyncio.gather(*[one(session, b) for b in bodies]))
    return asyncio.run(go())


def _ids(tokens: list[dict]) -> list[int]:
    return [t["id"] for t in tokens]


def _assert_same_until_a_tie(got: list[dict], want: list[dict]) -> None:
    """One request's greedy tokens from two runs: the same ids with logprobs within LOGPROB_TOL, up to the end or to
    a step where the two chose different tokens about as likely as each other (a near tie the roundings decided:
    with alternatives shown, each run's token is the other's runner-up)."""
    assert len(got) == len(want), (len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g["logprob"] - w["logprob"]) <= LOGPROB_TOL, (i, _ids(got), _ids(want), g, w)
        if g["id"] != w["id"]:
            if "top_logprobs" in g:
                assert [a["id"] for a in g["top_logprobs"]] == [g["id"], w["id"]], (i, g, w)
                assert [a["id"] for a in w["top_logprobs"]] == [w["id"], g["id"]], (i, g, w)
            return


def _assert_runs_agree(got: list[list[dict]], want: list[list[dict]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        _assert_same_until_a_tie(g, w)


def _info(srv: ServerProc) -> dict:
    return httpx.get(srv.url + "/get_server_info", timeout=10).json()


def test_int8_server_reports_its_cache(servers):
    roomy, tight, _ = servers
    for srv in (roomy, tight):
        info = _info(srv)
        assert info["kv_cache_dtype"] == "int8" and info["kv_bytes_per_token"] == INT8_BYTES_PER_TOKEN, info
        assert srv.metrics()["lightserve_kv_bytes_per_token"] == INT8_BYTES_PER_TOKEN
    assert _info(tight)["max_total_num_tokens"] == 320


def test_int8_greedy_tokens_alone_batched_cached_speculated_and_paused(servers):
    roomy, tight, _ = servers
    bodies = _bodies()
    first = _run(roomy.url, bodies)
    _assert_same_until_a_tie(first[1], first[0])      # alone and inside the batch
    cached_before = roomy.metrics()["lightserve_prompt_tokens_cached_total"]
    again = _run(roomy.url, bodies)                   # the same prompts: prefix-cache hits on quantized rows
    _assert_runs_agree(again, first)
    assert roomy.metrics()["lightserve_prompt_tokens_cached_total"] > cached_before
    assert roomy.metrics()["lightserve_spec_accepted_tokens_total"] > 0
    tight_out = _run(tight.url, bodies)               # pauses, 32-token chunks
    for got, want in zip(map(_ids, tight_out), map(_ids, first)):
        assert got[:3] == want[:3] and len(got) == 40, (got, want)
    m = tight.metrics()
    assert m["lightserve_pauses_total"] > 0 and m["lightserve_resumes_total"] > 0
    assert wait_until(lambda: tight.metrics()["lightserve_requests_running"] == 0, 30)
    m = tight.metrics()
    assert m["lightserve_kv_tokens_free"] + m["lightserve_kv_tokens_cached"] == m["lightserve_kv_tokens_total"]


def test_fp8_server_serves_the_same_tokens_alone_batched_and_cached(servers):
    srv = servers[2]
    info = _info(srv)
    assert info["kv_cache_dtype"] == "fp8_e4m3" and info["kv_bytes_per_token"] == FP8_BYTES_PER_TOKEN, info
    assert "scale 1.0 (the checkpoint carries no k_scale / v_scale)" in srv.log_tail(20000)
    bodies = _bodies(top_logprobs=2)[:4]
    first = _run(srv.url, bodies)
    _assert_same_until_a_tie(first[1], first[0])
    _assert_runs_agree(_run(srv.url, bodies), first)
