"""Against a real uvicorn (uvloop) on a free port: the official openai client, and client disconnects
(mid-stream, while queued, non-stream) reaching the engine's abort path."""
from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from .helpers import MODEL_NAME, live_server, make_app

ABORT_WAIT_S = 5.0


@pytest.fixture
def server(engine, tokenizer):
    with live_server(make_app(engine, tokenizer)) as url:
        yield url


def test_openai_client(server, engine):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL_NAME]
    done = client.completions.create(model=MODEL_NAME, prompt=["a", "b"], max_tokens=3, temperature=0)
    assert [c.text for c in done.choices] == [" t0 t1 t2"] * 2 and done.usage.completion_tokens == 6
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="a", max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == " t0 t1 t2"

    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2, logprobs=True,
                                          top_logprobs=0, seed=7, stop=["zz"], user="me")
    assert chat.choices[0].message.content == " t0 t1" and chat.choices[0].finish_reason == "length"
    assert chat.choices[0].logprobs.content[1].logprob == -0.5
    assert chat.usage.prompt_tokens_details.cached_tokens == 3
    params = engine.calls[-1][1]
    assert (params.seed, params.stop, params.max_new_tokens) == (7, ["zz"], 2)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=3,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " t0 t1 t2"
    assert chunks[-1].usage.completion_tokens == 3 and chunks[-1].choices == []

    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL_NAME, prompt="a", max_tokens=-3)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=messages)
    assert missing.value.code == "model_not_found"


def test_openai_client_auth(engine, tokenizer):
    with live_server(make_app(engine, tokenizer, api_key="k1")) as url:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="k2", max_retries=0).models.list()
        assert openai.OpenAI(base_url=f"{url}/v1", api_key="k1", max_retries=0).models.list().data
        assert httpx.get(f"{url}/health").status_code == 200


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "a", "max_tokens": 400, "stream": True}),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 400, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "stream": True}),
    ("/generate_stream", {"inputs": "a", "parameters": {"max_new_tokens": 400}}),
])
def test_disconnect_mid_stream_aborts(server, engine, path, body):
    engine.delay = 0.02
    with httpx.Client(timeout=10) as client, client.stream("POST", server + path, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first.split(":", 1)[1])
    assert engine.aborted.wait(ABORT_WAIT_S), "closing the stream did not abort the request"
    _wait_for(lambda: engine.num_pending == 0)
    prompt = body.get("prompt")
    assert engine.num_aborted == (len(prompt) if isinstance(prompt, list) else 1)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "a", "max_tokens": 400}),
    ("/generate", {"inputs": "a", "parameters": {"max_new_tokens": 400}}),
    ("/v1/completions", {"prompt": "a", "max_tokens": 400, "stream": True}),  # still waiting for its first token
])
def test_disconnect_before_response_aborts(server, engine, path, body):
    engine.delay = 0.02
    if body.get("stream"):
        engine.first_delay = 30.0
    port = int(server.rsplit(":", 1)[1])
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        _wait_for(lambda: engine.num_pending == 1)
    assert engine.aborted.wait(ABORT_WAIT_S), "the client left but the request kept running"
    _wait_for(lambda: engine.num_pending == 0)


def test_declared_oversized_body_is_refused_before_reading(engine, tokenizer):
    with live_server(make_app(engine, tokenizer, max_body_bytes=1000)) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000000000\r\n\r\n{")
            assert sock.recv(4096).startswith(b"HTTP/1.1 413")


def _wait_for(cond, timeout: float = ABORT_WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)
