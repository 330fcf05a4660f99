"""The Anthropic Messages API against the real server on the real model, through the official
anthropic client, unmodified: plain and streamed messages, a forced tool (whole and streamed), a
multi-turn exchange with tool_use / tool_result, stop sequences, usage with cache reads,
count_tokens, and bad requests (Anthropic's error body, the server healthy after).

The e2e suite's shared server (tests/e2e/conftest.py), started with no tool flags as `make serve` starts it
(`--tool_call_parser auto` reads hermes off SmolLM2's ChatML template; tests/e2e/test_agent_api.py checks the
OpenAI side of that)."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

# Enums keep the grammar-bound input short, so a few tokens finish the call.
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
          "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "Current weather of a city", "input_schema": SCHEMA}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # the 2.x SDK has no temperature parameter: it travels in the body


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]


def test_create_then_cache_reads(client, model):
    messages = [{"role": "user", "content": "Name three colors of the rainbow."}]
    first = client.messages.create(model=model, max_tokens=12, messages=messages, system="Be brief.",
                                   extra_body=GREEDY)
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    [block] = first.content
    assert block.type == "text" and block.text and first.stop_reason in ("end_turn", "max_tokens")
    assert 0 < first.usage.output_tokens <= 12 and first.usage.input_tokens > 10
    again = client.messages.create(model=model, max_tokens=12, messages=messages, system="Be brief.",
                                   extra_body=GREEDY)
    # The radix cache served the prompt: Anthropic counts those tokens apart from input_tokens.
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == \
        first.usage.input_tokens + first.usage.cache_read_input_tokens
    counted = client.messages.count_tokens(model=model, messages=messages, system="Be brief.")
    assert counted.input_tokens == first.usage.input_tokens + first.usage.cache_read_input_tokens


def test_stream_text(client, model):
    with client.messages.stream(model=model, max_tokens=12, messages=ASK, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens > 0


def test_forced_tool_whole_and_streamed(client, model):
    choice = {"type": "tool", "name": "get_weather"}
    done = client.messages.create(model=model, max_tokens=16, messages=ASK, tools=[WEATHER], tool_choice=choice)
    [call] = done.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, SCHEMA)
    assert done.stop_reason == "tool_use"

    with client.messages.stream(model=model, max_tokens=16, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                extra_body=GREEDY) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert deltas == ["input_json_delta"] and final.stop_reason == "tool_use"
    [call] = final.content
    assert call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, SCHEMA)


def test_multi_turn_with_tool_result(client, model):
    history = ASK + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                      "content": json.dumps({"city": "Paris", "sky": "sunny", "celsius": 21})}]}]
    # tool_choice defaults to auto: no --tool_call_parser flag needed.
    done = client.messages.create(model=model, max_tokens=16, messages=history, tools=[WEATHER], extra_body=GREEDY)
    assert done.stop_reason in ("end_turn", "max_tokens", "tool_use") and done.content
    for block in done.content:
        assert block.type in ("text", "tool_use")
        assert block.type != "text" or "<tool_call>" not in block.text


def test_stop_sequences(client, model):
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    free = client.messages.create(model=model, max_tokens=16, messages=messages, extra_body=GREEDY).content[0].text
    words = free.split()
    assert len(words) >= 3, free
    stop = words[2]
    cut = client.messages.create(model=model, max_tokens=16, messages=messages, stop_sequences=[stop, "@@@"],
                                 extra_body=GREEDY)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop), (free, cut)
    assert cut.content[0].text == free[: free.index(stop)]


def test_bad_requests_then_healthy(server, client, model):
    r = httpx.post(f"{server.url}/v1/messages", json={"model": model, "messages": ASK}, timeout=30)
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "max_tokens: Field required"}}
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=model, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "hologram", "data": "x"}]}])
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert bad.value.body["error"]["message"].startswith("messages.0.content.0.type")
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=model, max_tokens=4, messages=[*ASK, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_nobody", "content": "42"}]}])
    assert bad.value.body["error"]["message"].startswith("messages.1.content.0.tool_use_id")
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-elsewhere", max_tokens=4, messages=ASK)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert client.messages.create(model=model, max_tokens=2, messages=ASK).usage.output_tokens > 0
