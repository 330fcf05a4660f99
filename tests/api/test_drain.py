"""The drain's shapes over ASGI with the FakeEngine: while draining, generation routes answer 503
with Retry-After and /health 503 "draining" (other routes still work); a request aborted at the end
of the grace (ShuttingDown) ends a stream with finish_reason "abort" then [DONE] (OpenAI) or a
final event with the same reason (LightLLM), and a non-streaming request with a 503 JSON error."""
from __future__ import annotations

import pytest

from lightserve.engine.generation import ShuttingDown

from .helpers import asgi_client, make_app
from .test_routes import sse

pytestmark = pytest.mark.anyio
CHAT = [{"role": "user", "content": "x"}]


async def test_draining_refuses_new_generation_and_fails_health(engine, tokenizer):
    app = make_app(engine, tokenizer)
    async with asgi_client(app) as client:
        app.state.front.drain.draining = True
        for path, body in (("/v1/completions", {"prompt": "x"}), ("/generate", {"inputs": "x"}),
                           ("/v1/chat/completions", {"messages": CHAT, "stream": True})):
            r = await client.post(path, json=body)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", (path, r.text)
            assert "shutting down" in r.text
        assert engine.calls == []  # refused before the engine saw anything
        r = await client.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "draining"}
        assert (await client.get("/health_generate")).status_code == 503
        assert (await client.post("/tokenize", json={"prompt": "x"})).status_code == 200


async def test_abort_at_the_end_of_the_grace_is_visible(engine, tokenizer):
    engine.fail_mid = ShuttingDown("the server is shutting down")  # after the first delta
    async with asgi_client(make_app(engine, tokenizer)) as client:
        events = sse((await client.post("/v1/completions", json={
            "prompt": "x", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}})).text)
        assert events[0]["choices"][0]["text"] == " t0"
        assert events[-3]["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "abort"}
        assert events[-2]["usage"]["completion_tokens"] == 1 and events[-1] == "[DONE]"

        events = sse((await client.post("/v1/chat/completions", json={
            "messages": CHAT, "max_tokens": 5, "n": 2, "stream": True})).text)
        finishes = [c for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
        assert sorted((c["index"], c["finish_reason"]) for c in finishes) == [(0, "abort"), (1, "abort")]
        assert events[-1] == "[DONE]"

        events = sse((await client.post("/generate_stream", json={
            "inputs": "x", "parameters": {"max_new_tokens": 5}})).text, "data:")
        assert events[-1]["finished"] and events[-1]["finish_reason"] == "abort"
        assert events[-1]["generated_text"] == " t0" and events[-1]["token"]["count_output_tokens"] == 1

        for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 5}),
                           ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 5}})):
            r = await client.post(path, json=body)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert "shutting down" in r.text
