"""A client that disconnects at any stage of its request leaves nothing behind: the router aborts
it, and its KV rows and request slot come back.

One server for the module, sized so that every stage is reachable and slow enough to hit:
8 request slots (a 9th request queues in the front), 128 KV tokens (a 120-token prompt keeps the
next request waiting in the router; eight growing requests force a pause), and 2-token prefill
chunks (a long prompt spends dozens of steps in prefill). Prompts are token ids, distinct per
request, so their lengths are exact and the prefix cache does not merge them.
"""
from __future__ import annotations

import asyncio

import pytest

from tests.reliability.helpers import (
    RawRequest,
    assert_idle,
    finished_by_reason,
    scrape,
    start_server,
    wait_metric,
)

POOL, KV, CHUNK = 8, 128, 2
C = "/v1/completions"
WAIT_S = 300  # for a state to be reached; generous on a loaded machine


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("disconnect"), "--max_total_token_num", str(KV),
                       "--chunked_prefill_size", str(CHUNK), "--req_pool_size", str(POOL),
                       "--max_queue_size", "4")
    yield srv
    srv.stop()


_next_base = iter(range(1000, 40000, 500))


def _ids(n: int) -> list[int]:
    """n token ids no other prompt of this module starts with."""
    base = next(_next_base)
    return list(range(base, base + n))


def _body(num_prompt: int, max_tokens: int, stream: bool = True) -> dict:
    return {"prompt": _ids(num_prompt), "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


async def _stream(url: str, num_prompt: int, max_tokens: int) -> RawRequest:
    return await RawRequest.post(url, C, _body(num_prompt, max_tokens))


async def _finish(req: RawRequest) -> int:
    """Read a stream (sent with include_usage) to its end; return its completion_tokens."""
    assert await req.read_head() == 200
    tokens = None
    while (event := await req.next_event()) is not None:
        assert "error" not in event, event
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    return tokens


def _in_thread(fn, *args):
    return asyncio.get_running_loop().run_in_executor(None, fn, *args)


def test_disconnect_while_queued_for_a_slot(server):
    """A 9th request waits in the front's queue behind 8 running ones; it leaves; the 8 finish."""
    async def run():
        holders = []
        for _ in range(POOL):
            body = _body(6, 6) | {"stream_options": {"include_usage": True}}
            holders.append(await RawRequest.post(server.url, C, body))
        await _in_thread(wait_metric, server.url, lambda m: m["req_slots_free"] == 0, WAIT_S)
        queued = await RawRequest.post(server.url, "/generate", {"inputs": "hello",
                                                                 "parameters": {"max_new_tokens": 4}})
        await _in_thread(wait_metric, server.url, lambda m: m["requests_queued"] == 1, WAIT_S)
        queued.abort()
        await _in_thread(wait_metric, server.url, lambda m: m["requests_queued"] == 0, WAIT_S)
        return await asyncio.gather(*[_finish(h) for h in holders])

    before = scrape(server.url)
    assert asyncio.run(run()) == [6] * POOL  # the others are untouched
    m = assert_idle(server.url)
    assert m["prompt_tokens_total"] - before["prompt_tokens_total"] == POOL * 6  # the 9th never started


def test_disconnect_while_waiting_behind_a_long_prefill_and_mid_prefill(server):
    """A: a 120-token prompt that prefills 2 tokens per step (60 steps). B: waits in the router for
    A's KV. B leaves while waiting, then A leaves mid-prefill: neither ever produces a token.

    B goes first, and A only once the router has dropped B: were both to leave at once, A's abort
    could free its KV before B's abort arrived, and B would be admitted for a moment."""
    before = scrape(server.url)

    async def run():
        a = await _stream(server.url, 120, 4)
        started = await _in_thread(wait_metric, server.url, lambda m: m["requests_running"] == 1, WAIT_S)
        b = await _stream(server.url, 30, 4)
        snap = await _in_thread(wait_metric, server.url, lambda m: m["requests_waiting"] == 1
                                and m["steps_total"] >= started["steps_total"] + 2, WAIT_S)
        b.abort()
        b_gone = await _in_thread(wait_metric, server.url, lambda m: m["requests_waiting"] == 0, WAIT_S)
        a.abort()
        return snap, b_gone

    snap, b_gone = asyncio.run(run())
    # The snapshots (each taken just before a disconnect) show A mid-prefill (running, no token
    # yet: its first token comes with its last chunk) with B waiting, then without B.
    assert snap["requests_running"] == 1 and snap["requests_waiting"] == 1, snap
    assert snap["generation_tokens_total"] == before["generation_tokens_total"], snap
    assert b_gone["requests_running"] == 1, b_gone
    assert b_gone["generation_tokens_total"] == before["generation_tokens_total"], b_gone
    m = assert_idle(server.url)
    assert m["generation_tokens_total"] == before["generation_tokens_total"], "a token was produced"
    assert m["prompt_tokens_total"] - before["prompt_tokens_total"] == 120  # B was never admitted


def test_disconnect_mid_decode(server):
    """A stream left after its 3rd token ends by the disconnect: the router aborts it before it
    reaches max_tokens (on a fast or a slow machine alike, whatever the tokens/s)."""
    max_tokens = 100
    before = scrape(server.url)
    ended_before = finished_by_reason(server.url)

    async def run():
        req = await _stream(server.url, 8, max_tokens)
        assert await req.read_head() == 200
        tokens = 0
        while tokens < 3:
            event = await req.next_event()
            assert event is not None and "error" not in event, event
            tokens += bool(event["choices"][0]["text"])
        req.abort()

    asyncio.run(run())
    m = assert_idle(server.url)
    ended = finished_by_reason(server.url)
    changed = {r: n - ended_before.get(r, 0) for r, n in ended.items() if n != ended_before.get(r, 0)}
    assert changed == {"disconnect": 1}, (ended_before, ended)  # not "length": it never ran to its end
    produced = m["generation_tokens_total"] - before["generation_tokens_total"]
    assert 3 <= produced < max_tokens, produced


def test_disconnect_while_paused(server):
    """Eight requests, admitted together on the estimate that each needs 4 + 0.7 x 17 rows, outgrow
    the 128-token KV at their 13th token (8 x (4 + 13) > 128): the newest is paused, 4 tokens before
    the others finish. Every client leaves while one is paused; the paused one never resumed."""
    before = scrape(server.url)

    async def run():
        streams = [await _stream(server.url, 4, 17) for _ in range(POOL)]
        # Polled tightly: the clients must leave within the few steps before the others finish and the paused
        # one would resume, and a 50 ms poll spent most of that on a fast machine.
        snap = await _in_thread(lambda: wait_metric(server.url, lambda m: m["requests_paused"] >= 1, WAIT_S,
                                                    interval=0.002))
        for s in reversed(streams):  # the newest, the paused one, first
            s.abort()
        return snap

    snap = asyncio.run(run())
    assert snap["pauses_total"] > before["pauses_total"]
    m = assert_idle(server.url)
    assert m["resumes_total"] == snap["resumes_total"], "the paused request resumed before it was aborted"
    assert m["generation_tokens_total"] - before["generation_tokens_total"] < POOL * 17
