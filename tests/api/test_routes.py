"""Happy paths of every route, stream and non-stream, against the FakeEngine over ASGI."""
from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lightserve.engine.generation import EngineDead, EngineOverloaded, RequestTimeout
from lightserve.messages import FinishReason

from .helpers import CONTEXT, MODEL_NAME, asgi_client, make_app

pytestmark = pytest.mark.anyio


def sse(text: str, prefix: str = "data: ") -> list:
    events = [chunk[len(prefix):] for chunk in text.split("\n\n") if chunk]
    assert all(chunk.startswith(prefix) for chunk in text.split("\n\n") if chunk), text
    return [e if e == "[DONE]" else json.loads(e) for e in events]


async def test_lifespan_health_and_model_info(engine, tokenizer):
    app = make_app(engine, tokenizer)
    async with asgi_client(app) as client:
        assert engine.started
        r = await client.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert (await client.get("/get_model_name")).json() == {"model_name": MODEL_NAME}
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == MODEL_NAME and models["data"][0]["max_model_len"] == CONTEXT
    assert engine.closed
    async with asgi_client(make_app(engine, tokenizer, health_reason="router died")) as client:
        r = await client.get("/health")
        assert r.status_code == 503 and r.json()["reason"] == "router died"


async def test_tokenize_detokenize(engine, tokenizer):
    async with asgi_client(make_app(engine, tokenizer)) as client:
        r = (await client.post("/tokenize", json={"prompt": "hello world"})).json()
        assert r["tokens"] == tokenizer.encode("hello world") and r["count"] == len(r["tokens"])
        assert (await client.post("/detokenize", json={"tokens": r["tokens"]})).json() == {"prompt": "hello world"}
        chat = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})).json()
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
        assert chat["tokens"] == tokenizer.encode(text, add_special_tokens=False)


async def test_lightllm_generate(engine, tokenizer):
    async with asgi_client(make_app(engine, tokenizer)) as client:
        r = await client.post("/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 3}})
        assert r.status_code == 200, r.text
        assert r.json() == {"generated_text": [" t0 t1 t2"], "count_output_tokens": 3, "finish_reason": "length",
                            "prompt_tokens": len(tokenizer.encode("hello")), "prompt_cache_len": 3}
        assert engine.calls[-1][1].temperature == 0.0  # do_sample defaults to false: greedy
        r = await client.post("/generate", json={"inputs": "hello", "parameters": {
            "max_new_tokens": 2, "do_sample": True, "return_details": True, "stop_sequences": "x"}})
        assert r.json()["tokens"] == [{"id": 100, "text": " t0", "logprob": -0.5},
                                      {"id": 101, "text": " t1", "logprob": -0.5}]
        params = engine.calls[-1][1]
        assert params.temperature == 1.0 and params.stop == ["x"]


async def test_lightllm_generate_stream_one_event_per_token(engine, tokenizer):
    engine.tokens_per_delta = 3  # a delta of several tokens still gives one event per token
    async with asgi_client(make_app(engine, tokenizer)) as client:
        r = await client.post("/generate_stream", json={"inputs": "hi", "parameters": {"max_new_tokens": 5}})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r.text, "data:")
        assert [e["token"]["id"] for e in events] == [100, 101, 102, 103, 104]
        assert [e["token"]["count_output_tokens"] for e in events] == [1, 2, 3, 4, 5]
        assert all(not e["finished"] and e["generated_text"] is None for e in events[:-1])
        last = events[-1]
        assert last["finished"] and last["finish_reason"] == "length" and last["generated_text"] == " t0 t1 t2 t3 t4"
        assert last["token"]["special"] is False and last["token"]["prompt_tokens"] == len(tokenizer.encode("hi"))


async def test_completions(engine, tokenizer):
    async with asgi_client(make_app(engine, tokenizer)) as client:
        r = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hello"})
        body = r.json()
        assert r.status_code == 200 and body["id"].startswith("cmpl-") and body["model"] == MODEL_NAME
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["choices"][0]["text"] == "".join(f" t{i}" for i in range(16))  # default max_tokens 16
        p = len(tokenizer.encode("hello"))
        assert body["usage"] == {"prompt_tokens": p, "completion_tokens": 16, "total_tokens": p + 16,
                                 "prompt_tokens_details": {"cached_tokens": 3}}
        assert engine.calls[-1][1].temperature == 1.0
        # several prompts of every shape -> several choices, each with its index
        for prompt in (["a", "b c"], [[5, 6], [7]], [5, 6, 7]):
            r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "logprobs": 0})
            choices = r.json()["choices"]
            assert [c["index"] for c in choices] == list(range(len(choices)))
            assert len(choices) == (1 if isinstance(prompt[0], int) else 2)
            assert choices[0]["logprobs"] == {"tokens": [" t0", " t1"], "token_logprobs": [-0.5, -0.5],
                                              "text_offset": [0, 3], "top_logprobs": None}
        assert engine.calls[-1][0] == [5, 6, 7]


async def test_completions_stream_with_usage(engine, tokenizer):
    async with asgi_client(make_app(engine, tokenizer)) as client:
        r = await client.post("/v1/completions", json={
            "prompt": ["a", "b"], "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}})
        events = sse(r.text)
        assert events[-1] == "[DONE]"
        usage = events[-2]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
        chunks = events[:-2]
        for index in (0, 1):
            mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
            assert "".join(c["text"] for c in mine) == " t0 t1 t2"
            assert mine[-1]["finish_reason"] == "length"
        assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)


async def test_chat(engine, tokenizer):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    async with asgi_client(make_app(engine, tokenizer)) as client:
        r = await client.post("/v1/chat/completions", json={"messages": messages, "logprobs": True})
        body = r.json()
        assert r.status_code == 200 and body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
        prompt_len = body["usage"]["prompt_tokens"]
        # default max_tokens: up to the context
        assert body["usage"]["completion_tokens"] == CONTEXT - prompt_len == engine.calls[-1][1].max_new_tokens
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["choices"][0]["logprobs"]["content"][0] == {"token": " t0", "logprob": -0.5,
                                                                "bytes": list(b" t0"), "top_logprobs": []}
        r = await client.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 4,
                                                            "max_tokens": 9, "stream": True})
        events = sse(r.text)
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == " t0 t1 t2 t3"
        assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"


async def test_engine_errors_map_to_statuses(engine, tokenizer):
    async with asgi_client(make_app(engine, tokenizer)) as client:
        for exc, status in ((EngineOverloaded("full"), 503), (EngineDead("worker died"), 503),
                            (RequestTimeout("too slow"), 408)):
            engine.fail = exc
            for path, body in (("/v1/completions", {"prompt": "x"}), ("/generate_stream", {"inputs": "x"}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                         "stream": True})):
                r = await client.post(path, json=body)
                assert r.status_code == status, (path, r.text)
                assert ("error" in r.json())
            if isinstance(exc, EngineOverloaded):
                assert r.headers["retry-after"] == "1"
        engine.fail = None
        engine.fail_mid = RequestTimeout("too slow")  # after the stream started: an error event, then the end
        events = sse((await client.post("/v1/completions", json={"prompt": "x", "stream": True})).text)
        assert events[-2]["error"]["code"] == "timeout" and events[-1] == "[DONE]"
        events = sse((await client.post("/generate_stream", json={"inputs": "x"})).text, "data:")
        assert events[-1]["error"] and events[-1]["finished"]


async def test_finish_without_a_token(engine, tokenizer):
    engine.empty_final, engine.finish = True, FinishReason.STOP
    async with asgi_client(make_app(engine, tokenizer)) as client:
        r = await client.post("/generate_stream", json={"inputs": "x", "parameters": {"max_new_tokens": 2}})
        events = sse(r.text, "data:")
        assert [e["token"]["id"] for e in events] == [100, 101, None]
        assert events[-1]["finished"] and events[-1]["finish_reason"] == "stop"
        assert events[-1]["generated_text"] == " t0 t1" and events[-1]["token"]["count_output_tokens"] == 2
        events = sse((await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True})).text)
        assert events[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.json()["choices"][0]["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] == 2


async def test_metrics_parse(engine, tokenizer):
    async with asgi_client(make_app(engine, tokenizer)) as client:
        await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        await client.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})
        text = (await client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("kv_tokens_total", "kv_tokens_free", "kv_tokens_cached", "requests_running", "requests_waiting",
                 "requests_paused", "requests_in_front", "requests_queued"):
        assert families[f"lightserve_{name}"].type == "gauge", name
    for name in ("pauses", "resumes", "prompt_tokens", "prompt_tokens_cached", "generation_tokens"):
        assert families[f"lightserve_{name}"].type == "counter", name
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_queue_time_seconds",
                 "e2e_request_latency_seconds"):
        assert families[f"lightserve_{name}"].type == "histogram", name
    statuses = {s.labels["status"]: s.value for s in families["lightserve_requests"].samples
                if s.name == "lightserve_requests_total"}
    assert statuses == {"200": 1.0, "400": 1.0}
    itl = next(s for s in families["lightserve_inter_token_latency_seconds"].samples if s.name.endswith("_count"))
    assert itl.value == 2.0


async def test_internal_error_hides_details(engine, tokenizer, caplog):
    engine.fail = RuntimeError("secret internals")
    app = make_app(engine, tokenizer)
    async with asgi_client(app, raise_app_exceptions=False) as client:
        r = await client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
        assert "secret" not in r.text and "Traceback" not in r.text
        metrics = (await client.get("/metrics")).text
    assert 'lightserve_requests_total{status="500"} 1.0' in metrics


@pytest.mark.parametrize("path, body, shown", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, False),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 0}, True),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 1, "best_of": 2}, True),  # ranks by logprob
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, False),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True},
     True),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}, False),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2, "return_details": True}}, True),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2, "best_of": 2}}, True),
    ("/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}, True),  # every event shows one
], ids=["completions", "completions_logprobs", "completions_best_of", "chat", "chat_logprobs", "generate",
        "generate_details", "generate_best_of", "generate_stream"])
async def test_requests_say_whether_their_logprobs_are_shown(engine, tokenizer, path, body, shown):
    """SamplingParams.report_logprobs: False lets a float32 model's greedy steps pick from logits exact only near
    their maximum, whose logprobs are approximate; only a route that shows or uses none may say so."""
    async with asgi_client(make_app(engine, tokenizer)) as client:
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
    assert engine.calls and all(params.report_logprobs is shown for _, params in engine.calls)
