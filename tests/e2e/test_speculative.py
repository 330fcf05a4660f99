"""Speculative decoding end to end: a server with --speculative_algorithm ngram, and one with a draft model (the
bundled model's GGUF file, which the servers serve too: the draft path at full acceptance; tests/model/
test_draft_model.py has drafts rejected), give the same greedy tokens and finish reasons as one without, on prompts
with something to copy (a list written out again, where drafts are accepted) and with nothing to copy, with requests
that end by eos, a stop id, a stop string and max_tokens inside a burst, beside a sampling request (which speculates
too, so its tokens differ from the plain server's); its metrics count accepted drafts. A seeded sampling request
speculates and gives the same text on every run."""
from __future__ import annotations

import asyncio

import aiohttp
import httpx
import pytest

from lightserve.engine.model_prep import default_gguf
from tests.e2e.server import bundled_tokenizer, chat_prompt, servers_together, wait_until

TIMEOUT = aiohttp.ClientTimeout(total=300)


@pytest.fixture(scope="module")
def all_servers(tmp_path_factory, server):
    """(with ngram speculation, without: the e2e tests' shared float32 server, with a draft model); the two that
    speculate started together."""
    tmp = tmp_path_factory.mktemp("speculative")
    config = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    draft = ("--speculative_algorithm", "draft", "--speculative_draft_model_dir", str(default_gguf()),
             "--num_speculative_tokens", "3")
    with servers_together(tmp, ("--data_type", "float32", "--max_total_token_num", "8192"),
                          spec=("--speculative-config", config), draft=draft) as (spec, draft_server):
        yield spec, server, draft_server


@pytest.fixture(scope="module")
def servers(all_servers):
    """(with ngram speculation, without)."""
    return all_servers[:2]


def _bodies() -> list[dict]:
    fruit = "apple, banana, cherry, grape, lemon, mango, orange, peach, pear, plum"
    listing = "\n".join([fruit] * 3) + "\n"
    comma = bundled_tokenizer().convert_tokens_to_ids(",")
    bodies = [
        {"inputs": listing, "parameters": {"max_new_tokens": 32}},                              # copies: length
        {"inputs": listing, "parameters": {"max_new_tokens": 13}},                              # length mid-burst
        {"inputs": listing + "apple, banana,", "parameters": {"max_new_tokens": 40, "stop_token_ids": [comma]}},
        {"inputs": listing, "parameters": {"max_new_tokens": 40, "stop_sequences": ["mango"]}},  # stop string
        {"inputs": chat_prompt(f"Repeat exactly: {fruit}"), "parameters": {"max_new_tokens": 64}},      # eos at the end
        {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 16}},          # nothing to copy
        {"inputs": chat_prompt("Say hi."), "parameters": {"max_new_tokens": 24}},
        {"inputs": listing, "parameters": {"max_new_tokens": 12, "do_sample": True, "temperature": 0.8,
                                           "seed": 7}},                                         # samples: last
    ]
    for body in bodies:
        body["parameters"] |= {"return_details": True, "add_special_tokens": False}
    return bodies


def _run(url: str, bodies: list[dict]) -> list[tuple[list[int], str, str]]:
    async def one(session, body):
        async with session.post(url + "/generate", json=body) as resp:
            data = await resp.json()
            assert resp.status == 200, data
            return [t["id"] for t in data["tokens"]], data["finish_reason"], data["generated_text"]

    async def go():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            alone = [await one(session, bodies[0])]                      # batch 1
            return alone + list(await asyncio.gather(*[one(session, b) for b in bodies]))  # continuous batching
    return asyncio.run(go())


def test_ngram_speculation_gives_the_same_greedy_output(servers):
    spec_server, plain = servers
    bodies = _bodies()
    got, want = _run(spec_server.url, bodies), _run(plain.url, bodies)
    got, want = got[:-1], want[:-1]        # the sampling request's tokens differ with speculation (spec_verify.py)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert [g[2] for g in got] == [w[2] for w in want]
    reasons = [reason for _, reason, _ in want]
    assert reasons.count("length") >= 3 and reasons.count("stop") >= 4, reasons   # eos, a stop id, a stop string
    assert wait_until(lambda: spec_server.metrics()["lightserve_requests_running"] == 0, 30)
    m = spec_server.metrics()
    assert m["lightserve_kv_tokens_free"] + m["lightserve_kv_tokens_cached"] == m["lightserve_kv_tokens_total"]
    assert m["lightserve_spec_accepted_tokens_total"] > 0
    assert m["lightserve_spec_accepted_tokens_total"] <= m["lightserve_spec_draft_tokens_total"]
    text = httpx.get(spec_server.url + "/metrics", timeout=10).text
    accepted = [line for line in text.splitlines() if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]
    assert accepted and float(accepted[0].rsplit(" ", 1)[1]) > 0
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=' in text


def test_draft_model_speculation_gives_the_same_greedy_output(all_servers):
    _, plain, draft_server = all_servers
    bodies = _bodies()[:-1]               # greedy only
    got, want = _run(draft_server.url, bodies), _run(plain.url, bodies)
    assert got == want
    assert wait_until(lambda: draft_server.metrics()["lightserve_requests_running"] == 0, 30)
    m = draft_server.metrics()
    assert m["lightserve_kv_tokens_free"] + m["lightserve_kv_tokens_cached"] == m["lightserve_kv_tokens_total"]
    assert m["lightserve_spec_accepted_tokens_total"] > 0


def _num_drafts(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    line = [line for line in text.splitlines() if line.startswith("vllm:spec_decode_num_drafts_total")]
    assert line, "no vllm:spec_decode_num_drafts_total"
    return float(line[0].rsplit(" ", 1)[1])


def test_seeded_sampling_speculates_and_repeats(servers):
    """Temperature 0.8 with a seed on a prompt to copy: the request carries drafts, and its text is the same on
    every run (the random numbers are keyed by seed and output index, spec_verify.py), with drafts accepted.
    NOTE: a different text than the server without speculation gives for the seed (vLLM's behaviour too)."""
    spec_server, _ = servers
    fruit = "apple, banana, cherry, grape, lemon, mango, orange, peach, pear, plum"
    body = {"inputs": "\n".join([fruit] * 4) + "\n", "parameters": {
        "max_new_tokens": 24, "do_sample": True, "temperature": 0.8, "top_p": 0.95, "seed": 11,
        "add_special_tokens": False}}
    assert wait_until(lambda: spec_server.metrics()["lightserve_requests_running"] == 0, 30)
    before, accepted_before = _num_drafts(spec_server), spec_server.metrics()["lightserve_spec_accepted_tokens_total"]
    texts = []
    for _ in range(2):
        resp = httpx.post(spec_server.url + "/generate", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        texts.append(resp.json()["generated_text"])
    assert texts[0] == texts[1] and texts[0]
    assert _num_drafts(spec_server) > before
    assert spec_server.metrics()["lightserve_spec_accepted_tokens_total"] > accepted_before
