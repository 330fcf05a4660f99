"""Every bad input gets 400 (404 unknown model, 413 oversized body) naming the field, in the route's
error shape; afterwards a valid request still succeeds."""
from __future__ import annotations

import copy

import pytest

from .helpers import CONTEXT, VOCAB, asgi_client, make_app

pytestmark = pytest.mark.anyio

BODY_LIMIT = 1 << 20
C, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
USER = [{"role": "user", "content": "hi"}]
FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def comp(**kw):
    return {"prompt": "hello", **kw}


def chat(**kw):
    return {"messages": USER, **kw}


def gen(**params):
    return {"inputs": "hello", "parameters": params}


CASES = [
    # body-level: malformed JSON, invalid UTF-8, not an object, empty, NaN (not JSON), oversized
    (C, b'{"prompt": ', 400, "body"),
    (C, b'{"prompt": "\xff\xfe"}', 400, "body"),
    (C, b"[1, 2]", 400, "body"),
    (C, b"", 400, "body"),
    (C, b'{"prompt": "x", "temperature": NaN}', 400, "body"),
    (C, comp(prompt="x" * (BODY_LIMIT + 1)), 413, "body"),
    (GEN, {"inputs": "x" * (BODY_LIMIT + 1)}, 413, "body"),
    # missing fields and wrong types
    (C, {}, 400, "prompt"),
    (C, comp(prompt=5), 400, "prompt"),
    (C, comp(prompt=["a", 1]), 400, "prompt"),
    (C, comp(max_tokens="16"), 400, "max_tokens"),
    (C, comp(max_tokens=1.5), 400, "max_tokens"),
    (C, comp(temperature="hot"), 400, "temperature"),
    (C, comp(stream="yes"), 400, "stream"),
    (C, comp(stream_options={"include_usage": "yes"}), 400, "stream_options.include_usage"),
    (C, comp(stop=5), 400, "stop"),
    (C, comp(stop_token_ids=[True]), 400, "stop_token_ids.0"),
    # out of range (SamplingParams.validate and the edge's bounds)
    (C, comp(max_tokens=-1), 400, "max_tokens"),
    (C, comp(max_tokens=0), 400, "max_tokens"),
    (C, comp(max_tokens=CONTEXT + 1), 400, "max_tokens"),
    (C, comp(max_tokens=10**12), 400, "max_tokens"),
    (C, comp(temperature=-1), 400, "temperature"),
    (C, comp(temperature=1e9), 400, "temperature"),
    (C, comp(top_p=0), 400, "top_p"),
    (C, comp(top_p=1.5), 400, "top_p"),
    (C, comp(top_k=-5), 400, "top_k"),
    (C, comp(top_k=10**12), 400, "top_k"),
    (C, comp(min_p=2), 400, "min_p"),
    (C, comp(repetition_penalty=0), 400, "repetition_penalty"),
    (C, comp(presence_penalty=3), 400, "presence_penalty"),
    (C, comp(frequency_penalty=-3), 400, "frequency_penalty"),
    (C, comp(seed=-1), 400, "seed"),
    (C, comp(stop=[""]), 400, "stop"),
    (C, comp(stop_token_ids=[VOCAB]), 400, "stop_token_ids"),
    (C, comp(max_tokens=5, min_tokens=6), 400, "min_tokens"),
    (C, comp(logprobs=50), 400, "logprobs"),
    (C, comp(logprobs=-1), 400, "logprobs"),
    # prompts: empty, too long, token ids outside the vocab
    (C, comp(prompt=""), 400, "prompt"),
    (C, comp(prompt=[]), 400, "prompt"),
    (C, comp(prompt=[[]]), 400, "prompt"),
    (C, comp(prompt="hello " * 2000), 400, "prompt"),
    (C, comp(prompt=[VOCAB]), 400, "prompt"),
    (C, comp(prompt=[[1, 2], [-1]]), 400, "prompt"),
    # unknown model, unsupported options
    (C, comp(model="gpt-4"), 404, "model"),
    (C, comp(n=1000), 400, "n"),
    (C, comp(n=0), 400, "n"),
    (C, comp(n=3, best_of=2), 400, "best_of"),
    (C, comp(echo=True, max_tokens=0, stream=True), 400, "max_tokens"),
    (C, comp(prompt_logprobs=-1), 400, "prompt_logprobs"),
    (C, comp(prompt_logprobs=6), 400, "prompt_logprobs"),
    (C, comp(prompt_logprobs="2"), 400, "prompt_logprobs"),
    (C, comp(logit_bias={"x": 1.0}), 400, "logit_bias"),
    (C, comp(logit_bias={"5": 101}), 400, "logit_bias"),
    (C, comp(guided_json={"type": "nonsense"}), 400, "guided_json"),
    # chat
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [5]}, 400, "messages.0"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages.0.content.0"),
    # messages as OpenAI checks them: content required but for an assistant that calls tools
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages.0.content"),
    (CHAT, {"messages": [{"role": "system", "content": None}, *USER]}, 400, "messages.0.content"),
    (CHAT, {"messages": [*USER, {"role": "assistant"}]}, 400, "messages.1.content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "input_audio", "input_audio": {}}]}]}, 400,
     "messages.0.content.1"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages.0.content.0"),
    (CHAT, {"messages": [*USER, {"role": "tool", "content": "42"}]}, 400, "messages.1.tool_call_id"),
    (CHAT, {"messages": [*USER, {"role": "assistant", "tool_calls": [{"function": {}}]}]}, 400,
     "messages.1.tool_calls.0"),
    (CHAT, {"messages": [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, 400,
     "messages.1.tool_calls.0.function.arguments"),
    (CHAT, {"messages": [{"role": "user", "content": "hello " * 2000}]}, 400, "messages"),
    (CHAT, chat(model="other"), 404, "model"),
    (CHAT, chat(max_tokens=0), 400, "max_tokens"),
    (CHAT, chat(max_completion_tokens=-1), 400, "max_completion_tokens"),
    (CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    (CHAT, chat(n=100), 400, "n"),
    (CHAT, chat(tools=[{"type": "function"}]), 400, "tools.0"),
    (CHAT, chat(tools={"type": "function"}), 400, "tools"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": ""}}]), 400, "tools.0.function.name"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": 3}}]), 400,
     "tools.0.function.parameters"),
    (CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    (CHAT, chat(tools=[FN], tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    (CHAT, chat(tools=[FN], tool_choice="maybe"), 400, "tool_choice"),
    (CHAT, chat(tools=[FN], tool_choice="required", parallel_tool_calls="yes"), 400, "parallel_tool_calls"),
    (CHAT, chat(tools=[FN], tool_choice="required", response_format={"type": "json_object"}), 400, "tool_choice"),
    (CHAT, chat(response_format={"type": "xml"}), 400, "response_format"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 3}}}), 400,
     "response_format"),
    (CHAT, chat(temperature=[1]), 400, "temperature"),
    # LightLLM routes
    (GEN, b"{", 400, "body"),
    (GEN, {}, 400, "inputs"),
    (GEN, {"inputs": 5}, 400, "inputs"),
    (GEN, {"inputs": ""}, 400, "inputs"),
    (GEN, {"inputs": "hello " * 2000}, 400, "inputs"),
    (GEN, {"inputs": "x", "parameters": "fast"}, 400, "parameters"),
    (GEN, gen(max_new_tokens=-1), 400, "parameters.max_new_tokens"),
    (GEN, gen(max_new_tokens="5"), 400, "parameters.max_new_tokens"),
    (GEN, gen(temperature=-1), 400, "parameters.temperature"),  # validated even when greedy
    (GEN, gen(top_p=0, do_sample=True), 400, "parameters.top_p"),
    (GEN, gen(top_k=-3), 400, "parameters.top_k"),
    (GEN, gen(repetition_penalty=11), 400, "parameters.repetition_penalty"),
    (GEN, gen(stop_sequences=[1]), 400, "parameters.stop_sequences"),
    (GEN, gen(stop_sequences=[""]), 400, "parameters.stop_sequences"),
    (GEN, gen(n=0), 400, "parameters.n"),
    (GEN, gen(best_of=100), 400, "parameters.best_of"),
    (GEN, gen(min_new_tokens=100, max_new_tokens=5), 400, "parameters.min_new_tokens"),
    ("/generate_stream", gen(seed=-5), 400, "parameters.seed"),
    # utility routes
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "user"}], "model": "x"}, 404, "model"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
]


@pytest.mark.parametrize("path, body, status, param", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
async def test_bad_input(engine, tokenizer, path, body, status, param):
    app = make_app(engine, tokenizer, max_body_bytes=BODY_LIMIT)
    async with asgi_client(app) as client:
        if isinstance(body, bytes):
            r = await client.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = await client.post(path, json=body)
        assert r.status_code == status, r.text
        err = r.json()
        if path in ("/generate", "/generate_stream"):
            assert isinstance(err["error"], str) and err["param"] == param, err
        else:
            assert err["error"]["param"] == param, err
            assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
        if status == 404:
            assert err["error"]["code"] == "model_not_found"
        assert engine.calls == []  # nothing reached the engine
        ok = {C: comp(max_tokens=2), CHAT: chat(max_tokens=2), GEN: gen(max_new_tokens=2),
              "/generate_stream": gen(max_new_tokens=2), "/tokenize": {"prompt": "x"}, "/detokenize": {"tokens": [1]}}
        r = await client.post(path, json=ok[path])
        assert r.status_code == 200, r.text


async def test_auto_tool_choice_needs_a_known_call_format(engine, tokenizer):
    """--tool_call_parser auto (the default) finds no call format in a template that is neither ChatML
    nor a known family's: tool_choice "auto" (also the default with tools) is refused, naming the flag."""
    plain = copy.copy(tokenizer)  # the session's tokenizer keeps its own template
    plain.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    async with asgi_client(make_app(engine, plain)) as client:
        for body in (chat(tools=[FN], tool_choice="auto"), chat(tools=[FN])):
            r = await client.post(CHAT, json=body)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "tool_choice" and "--tool_call_parser" in err["message"]
        assert (await client.post(CHAT, json=chat(tools=[FN], tool_choice="required", max_tokens=2))).status_code == 200


async def test_streamed_body_over_the_limit(engine, tokenizer):
    """No Content-Length (chunked upload): the limit is enforced on the bytes as they arrive."""
    async def chunks():
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 1000
        yield b'"}'

    async with asgi_client(make_app(engine, tokenizer, max_body_bytes=4096)) as client:
        r = await client.post(C, content=chunks())
        assert "content-length" not in r.request.headers
        assert r.status_code == 413 and r.json()["error"]["param"] == "body"


async def test_prompt_beyond_any_tokenization_is_refused_untokenized(engine, tokenizer):
    app = make_app(engine, tokenizer, max_body_bytes=64 << 20)
    limit = app.state.front.max_prompt_chars
    async with asgi_client(app) as client:
        r = await client.post(C, json=comp(prompt="a" * (limit + 1)))
        assert r.status_code == 400 and "context" in r.json()["error"]["message"]


async def test_auth(engine, tokenizer):
    async with asgi_client(make_app(engine, tokenizer, api_key="sekrit")) as client:
        assert (await client.get("/health")).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            for method, path in (("GET", "/v1/models"), ("POST", C), ("POST", GEN), ("GET", "/metrics")):
                r = await client.request(method, path, json=comp(), headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
        good = {"Authorization": "Bearer sekrit"}
        assert (await client.get("/v1/models", headers=good)).status_code == 200
        assert (await client.post(C, json=comp(max_tokens=1), headers=good)).status_code == 200
    async with asgi_client(make_app(engine, tokenizer)) as client:  # no key configured: open
        assert (await client.get("/v1/models")).status_code == 200


async def test_unknown_route_and_method(engine, tokenizer):
    async with asgi_client(make_app(engine, tokenizer)) as client:
        r = await client.get("/v1/nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = await client.get(C)
        assert r.status_code == 405 and "error" in r.json()
