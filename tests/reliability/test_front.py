"""The HTTP front of a REAL server under bad input, missing credentials and overload: every refusal
names its field, nothing refused disturbs the engine, and overload ends in 503 + Retry-After.

One server for the module: API key on, 64 request slots, a 128-deep queue, a 64 KiB body limit.
The chat-template test starts its own, on a tiny model whose template raises.
"""
from __future__ import annotations

import asyncio
import json
from collections import Counter

import aiohttp
import httpx
import pytest

from tests.reliability.helpers import HTTP_TIMEOUT_S, assert_idle, scrape, start_server
from tests.tp.helpers import make_tiny_llama

API_KEY = "test-key-8f2c"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
POOL, QUEUE, BODY_LIMIT, CONTEXT = 64, 128, 65536, 1024
C, CHAT, GEN, GEN_STREAM = "/v1/completions", "/v1/chat/completions", "/generate", "/generate_stream"
TOO_LONG = "hello " * (CONTEXT + 100)  # ~1100 tokens, under the body limit

# One row per category of bad input: (id, path, body (dict, or raw bytes), status, param named).
BAD_INPUTS = [
    ("malformed_json", C, b'{"prompt": "hi", "max_tokens": ', 400, "body"),
    ("invalid_utf8", C, b'{"prompt": "caf\xe9 \xff\xfe", "max_tokens": 2}', 400, "body"),
    ("not_an_object", C, b'["prompt", "hi"]', 400, "body"),
    ("wrong_type", C, {"prompt": "hi", "max_tokens": "4"}, 400, "max_tokens"),
    ("missing_field", CHAT, {"max_tokens": 4}, 400, "messages"),
    ("missing_inputs", GEN, {"parameters": {"max_new_tokens": 4}}, 400, "inputs"),
    ("negative_max_tokens", C, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("absurd_max_tokens", C, {"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
    ("huge_int_max_new_tokens", GEN, {"inputs": "hi", "parameters": {"max_new_tokens": 2**70}}, 400,
     "parameters.max_new_tokens"),
    ("temperature", C, {"prompt": "hi", "max_tokens": 2, "temperature": -0.5}, 400, "temperature"),
    ("top_p", CHAT, {"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, 400, "top_p"),
    ("top_k", GEN, {"inputs": "hi", "parameters": {"top_k": -7}}, 400, "parameters.top_k"),
    ("penalty", C, {"prompt": "hi", "max_tokens": 2, "frequency_penalty": 9}, 400, "frequency_penalty"),
    ("repetition_penalty", GEN_STREAM, {"inputs": "hi", "parameters": {"repetition_penalty": 0}}, 400,
     "parameters.repetition_penalty"),
    ("empty_prompt", C, {"prompt": "", "max_tokens": 2}, 400, "prompt"),
    ("empty_messages", CHAT, {"messages": []}, 400, "messages"),
    ("bad_role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("prompt_longer_than_context", C, {"prompt": TOO_LONG, "max_tokens": 2}, 400, "prompt"),
    ("inputs_longer_than_context", GEN, {"inputs": TOO_LONG}, 400, "inputs"),
    ("token_id_outside_vocab", C, {"prompt": [1, 2, 10**6], "max_tokens": 2}, 400, "prompt"),
    ("negative_token_id", C, {"prompt": [5, -1], "max_tokens": 2}, 400, "prompt"),
    ("n_above_limit", C, {"prompt": "hi", "max_tokens": 2, "n": 100}, 400, "n"),
    ("unknown_model", CHAT, {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("oversized_body", C, {"prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 2}, 413, "body"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("front"), "--api_key", API_KEY, "--req_pool_size", str(POOL),
                       "--max_queue_size", str(QUEUE), "--max_body_bytes", str(BODY_LIMIT),
                       "--max_total_token_num", "8192", "--max_req_total_len", str(CONTEXT))
    yield srv
    srv.stop()


def _post(url: str, path: str, body, headers: dict | None = None) -> httpx.Response:
    headers = {**AUTH, **(headers or {})}
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, headers={**headers, "Content-Type": "application/json"},
                          timeout=HTTP_TIMEOUT_S)
    return httpx.post(url + path, json=body, headers=headers, timeout=HTTP_TIMEOUT_S)


def _assert_valid_request_succeeds(url: str) -> None:
    r = _post(url, C, {"prompt": "The capital of France is", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path, body, status, param", [row[1:] for row in BAD_INPUTS],
                         ids=[row[0] for row in BAD_INPUTS])
def test_bad_input_is_refused_naming_the_field(server, path, body, status, param):
    r = _post(server.url, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    if path.startswith("/v1/"):  # OpenAI's error shape
        assert set(err) >= {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
        assert err["param"] == param, err
        assert param in err["message"] or param == "body", err
    else:  # LightLLM's: {"error": message, "param": field}
        assert r.json()["param"] == param and param in err, r.json()
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200
    _assert_valid_request_succeeds(server.url)


ENGINE_COUNTERS = ("steps_total", "prompt_tokens_total", "generation_tokens_total")  # the router's


def test_refused_requests_never_reached_the_engine(server):
    """Every bad input of the table once more, on an idle server: the engine ran no step and took no
    prompt or output token for any of them, and they left no request, slot or KV row behind."""
    before = assert_idle(server.url, AUTH)
    statuses = [_post(server.url, path, body).status_code for _, path, body, _, _ in BAD_INPUTS]
    after = assert_idle(server.url, AUTH)
    assert {k: after[k] - before[k] for k in ENGINE_COUNTERS} == dict.fromkeys(ENGINE_COUNTERS, 0)
    assert statuses == [row[3] for row in BAD_INPUTS]
    assert after["req_slots_total"] == after["req_slots_free"] == POOL
    # The counters do count: one valid request moves each of them.
    _assert_valid_request_succeeds(server.url)
    served = assert_idle(server.url, AUTH)
    assert all(served[k] > after[k] for k in ENGINE_COUNTERS), (after, served)


def test_api_key_required_everywhere_but_health(server):
    routes = [("POST", C), ("POST", CHAT), ("POST", GEN), ("POST", GEN_STREAM), ("GET", "/v1/models"),
              ("GET", "/metrics"), ("POST", "/tokenize"), ("GET", "/get_model_name")]
    body = {"prompt": "hi", "inputs": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT_S) as client:
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY}):
                r = client.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.text)
                assert r.headers.get("www-authenticate") == "Bearer"
        assert client.get("/health").status_code == 200
        assert client.get("/v1/models", headers=AUTH).status_code == 200
        r = client.post(GEN, json={"inputs": "hi", "parameters": {"max_new_tokens": 2, "ignore_eos": True}},
                        headers=AUTH)
        assert r.status_code == 200 and r.json()["count_output_tokens"] == 2, r.text


def test_binds_loopback_only(server):
    """Without --host the front listens on 127.0.0.1 alone (never 0.0.0.0 or ::)."""
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, port = local.split(":")
                if state == "0A" and int(port, 16) == server.port:  # 0A = LISTEN
                    listening.append(addr)
    assert listening == ["0100007F"], listening  # 127.0.0.1, little-endian hex


def test_chat_messages_are_data_not_template_code(server):
    """Jinja in a message's content reaches the model as text; it is never evaluated."""
    content = "{{ 7 * 7 }} {% for x in range(3) %}X{% endfor %} {{ ''.__class__.__mro__ }}"
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=HTTP_TIMEOUT_S) as client:
        r = client.post("/tokenize", json={"messages": [{"role": "user", "content": content}]})
        assert r.status_code == 200, r.text
        text = client.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert content in text and "49" not in text.replace(content, "")


# A model's own chat template that refuses system messages (transformers' raise_exception raises
# jinja2.TemplateError) and, for one content, reaches for Python internals (the sandbox raises
# SecurityError, a TemplateError too).
RAISING_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('this template takes no system message') }}{% endif %}"
    "{% if m['content'] == 'escape' %}{{ ''.__class__.__mro__[1].__subclasses__() }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_chat_template_error_is_a_400_naming_messages(tmp_path):
    """A real server whose model's chat template raises: the front answers 400 naming `messages`
    with the template's reason, the engine never sees the request, and valid chats still run."""
    model_dir = make_tiny_llama(tmp_path / "model")
    (model_dir / "chat_template.jinja").write_text(RAISING_TEMPLATE)
    srv = start_server(tmp_path / "server", "--model_dir", str(model_dir), "--max_total_token_num", "1024")
    try:
        cases = [([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                  "this template takes no system message"),
                 ([{"role": "user", "content": "escape"}], "unsafe")]
        for messages, reason in cases:
            r = httpx.post(srv.url + CHAT, json={"messages": messages, "max_tokens": 2}, timeout=HTTP_TIMEOUT_S)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "messages" and reason in err["message"], err
        r = httpx.post(srv.url + CHAT, timeout=HTTP_TIMEOUT_S, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        m = assert_idle(srv.url)
        assert m["prompt_tokens_total"] == r.json()["usage"]["prompt_tokens"]  # the refused never ran
    finally:
        srv.stop()


@pytest.mark.timeout(1800)  # ~7 min on a loaded 2-core machine; a hang still fails
def test_500_concurrent_requests_against_64_slots(server):
    """Each request completes with exactly its tokens or is refused with 503 + Retry-After; none
    hangs; afterwards every request slot and KV row is free."""
    num, max_tokens = 500, 4

    async def one(session: aiohttp.ClientSession, i: int):
        body = {"inputs": f"Number {i}:",  # short: the test is about admission, not prefill
                "parameters": {"max_new_tokens": max_tokens, "ignore_eos": True}}
        async with session.post(server.url + GEN, json=body) as resp:
            return resp.status, resp.headers.get("Retry-After"), json.loads(await resp.read())

    async def run_all():
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=AUTH) as session:
            return await asyncio.gather(*[one(session, i) for i in range(num)])

    results = asyncio.run(run_all())
    statuses = Counter(status for status, _, _ in results)
    for status, retry_after, data in results:
        if status == 200:
            assert data["count_output_tokens"] == max_tokens and data["finish_reason"] == "length", data
        else:
            assert status == 503, (status, data)
            assert retry_after is not None and int(retry_after) >= 1, retry_after
            assert "queued" in data["error"], data
    # 503 comes only once the queue is full, so at least the pool plus the queue got through.
    assert statuses[200] >= POOL + QUEUE, statuses
    assert statuses[503] > 0, f"the queue never filled; the test proved nothing: {statuses}"
    print(f"500 concurrent requests: {dict(statuses)}")
    m = assert_idle(server.url, AUTH)
    assert m["req_slots_free"] == POOL
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200
    _assert_valid_request_succeeds(server.url)
    assert scrape(server.url, AUTH)["requests_in_front"] == 0
