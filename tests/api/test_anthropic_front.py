"""POST /v1/messages and /v1/messages/count_tokens through the official anthropic client against a
real uvicorn, with a FakeEngine that plays fixed model outputs token by token: content blocks
(thinking, text, tool_use), the stream's events adding up to the whole message, the tool plan and
grammar, usage with cache reads, stop sequences, auth, and Anthropic's error bodies."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from lightserve.messages import FinishReason
from lightserve.sampling import GrammarKind

from .helpers import CONTEXT, MODEL_NAME, FakeEngine, live_server, make_app

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# A reasoning model's answer with a call, cut into tokens the way a tokenizer might cut it.
OUTPUT = ["<th", "ink>", "The user", " wants weather.", "</th", "ink>\n\n", "Let me check.", "\n<tool", "_call>",
          '\n{"name": "get_weather", ', '"arguments": {"city": ', '"Paris"}}', "\n</tool_call>"]
KEY = "sekrit"
EPHEMERAL = {"type": "ephemeral"}  # cache_control: accepted; the radix cache reuses prefixes anyway


@pytest.fixture(scope="module")
def served(tokenizer):
    """(client, engine, url): one app for the module; each test sets the engine's script."""
    engine = FakeEngine()
    app = make_app(engine, tokenizer, reasoning_parser="qwen3", api_key=KEY)
    with live_server(app) as url:
        yield anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0), engine, url


@pytest.fixture
def client(served):
    client, engine, _ = served
    engine.script, engine.finish, engine.calls[:] = None, FinishReason.STOP, []
    return client


@pytest.fixture
def engine(served):
    return served[1]


def _blocks(message) -> list[tuple]:
    return [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None) or (b.name, b.input))
            for b in message.content]


def test_blocks_whole_and_streamed_agree(client, engine, tokenizer):
    engine.script = OUTPUT
    thinking = {"type": "enabled", "budget_tokens": 1024}
    whole = client.messages.create(model=MODEL_NAME, max_tokens=64, messages=ASK, tools=[WEATHER], thinking=thinking)
    assert _blocks(whole) == [("thinking", "The user wants weather."), ("text", "Let me check."),
                              ("tool_use", ("get_weather", {"city": "Paris"}))]
    assert whole.stop_reason == "tool_use" and whole.stop_sequence is None and whole.id.startswith("msg_")
    assert whole.content[2].id.startswith("toolu_") and whole.model == MODEL_NAME and whole.role == "assistant"
    prompt_len = len(engine.calls[-1][0])
    assert (whole.usage.input_tokens, whole.usage.cache_read_input_tokens, whole.usage.output_tokens) == \
        (prompt_len - engine.cached_len, engine.cached_len, len(OUTPUT))
    assert engine.calls[-1][1].grammar_kind == GrammarKind.NONE  # auto: the model writes freely
    assert "get_weather" in tokenizer.decode(engine.calls[-1][0])  # lightserve's tool prompt (SmolLM2's template)

    with client.messages.stream(model=MODEL_NAME, max_tokens=64, messages=ASK, tools=[WEATHER],
                                thinking=thinking) as stream:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(whole) and final.stop_reason == "tool_use"
    assert final.usage.output_tokens == len(OUTPUT) and final.usage.cache_read_input_tokens == engine.cached_len
    assert kinds[0] == ("message_start", None) and kinds[-1] == ("message_stop", None)
    assert ("content_block_delta", "thinking_delta") in kinds and ("content_block_delta", "input_json_delta") in kinds
    assert [k for k, _ in kinds].count("content_block_start") == [k for k, _ in kinds].count("content_block_stop") == 3

    # Without `thinking` the reasoning is parsed away but not shown (as Anthropic shows none).
    plain = client.messages.create(model=MODEL_NAME, max_tokens=64, messages=ASK, tools=[WEATHER])
    assert _blocks(plain) == _blocks(whole)[1:]


def test_raw_event_sequence(served, client, engine):
    _, _, url = served
    engine.script = ["Hi", " there"]
    body = {"model": MODEL_NAME, "max_tokens": 8, "messages": ASK, "stream": True}
    with httpx.stream("POST", f"{url}/v1/messages", json=body, headers={"x-api-key": KEY,
                                                                         "anthropic-version": "2023-06-01"}) as r:
        events = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert events == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
                      "content_block_stop", "message_delta", "message_stop"]


def test_forced_tool_calls_are_grammar_bound(client, engine):
    engine.script = ['[{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}]']
    done = client.messages.create(model=MODEL_NAME, max_tokens=32, messages=ASK, tools=[WEATHER],
                                  tool_choice={"type": "any", "disable_parallel_tool_use": True})
    params = engine.calls[-1][1]
    assert params.grammar_kind == GrammarKind.JSON_SCHEMA and json.loads(params.grammar)["maxItems"] == 1
    assert _blocks(done) == [("tool_use", ("get_weather", {"city": "Oslo"}))] and done.stop_reason == "tool_use"

    engine.script = ['{"city": ', '"Rome"}']
    with client.messages.stream(model=MODEL_NAME, max_tokens=32, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    assert json.loads(engine.calls[-1][1].grammar) == WEATHER["input_schema"]
    assert _blocks(final) == [("tool_use", ("get_weather", {"city": "Rome"}))] and final.stop_reason == "tool_use"

    engine.script = ['{"city": "Rome"}']  # output_config.format: the same grammar engine
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    done = client.messages.create(model=MODEL_NAME, max_tokens=32, messages=ASK,
                                  extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert json.loads(engine.calls[-1][1].grammar) == schema and done.content[0].text == '{"city": "Rome"}'


def test_multi_turn_with_tool_results(client, engine, tokenizer):
    engine.script = ["It is ", "sunny."]
    history = ASK + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hidden thought.", "signature": "s"},
                                          {"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": [{"type": "text", "text": "service down"}],
                                      "cache_control": EPHEMERAL},
                                     {"type": "text", "text": "Try again?"}]}]
    done = client.messages.create(model=MODEL_NAME, max_tokens=16, messages=history, tools=[WEATHER],
                                  system=[{"type": "text", "text": "Be brief.", "cache_control": EPHEMERAL}],
                                  metadata={"user_id": "u1"}, extra_body={"temperature": 0.5, "top_k": 7})
    assert _blocks(done) == [("text", "It is sunny.")] and done.stop_reason == "end_turn"
    prompt = tokenizer.decode(engine.calls[-1][0])
    for piece in ("Be brief.", "Checking.\n<tool_call>", '"arguments": {"city": "Paris"}', "Error: service down",
                  "Try again?"):
        assert piece in prompt, piece
    assert "Hidden thought." not in prompt  # past thinking is not shown to the model
    params = engine.calls[-1][1]
    assert (params.temperature, params.top_k) == (0.5, 7)


def test_stop_reasons_and_stop_sequence(client, engine):
    # The FakeEngine's tokens are ids 100, 101, ... whose text in SmolLM2's vocabulary is "t", "u", "v", ...
    done = client.messages.create(model=MODEL_NAME, max_tokens=3, messages=ASK, stop_sequences=["zz", "v"])
    assert (done.stop_reason, done.stop_sequence) == ("stop_sequence", "v")
    assert engine.calls[-1][1].stop == ["zz", "v"]
    done = client.messages.create(model=MODEL_NAME, max_tokens=3, messages=ASK, stop_sequences=["zz"])
    assert (done.stop_reason, done.stop_sequence) == ("end_turn", None)
    engine.finish = FinishReason.LENGTH
    done = client.messages.create(model=MODEL_NAME, max_tokens=3, messages=ASK)
    assert done.stop_reason == "max_tokens" and done.usage.output_tokens == 3
    # An agent's max_tokens beyond the context is capped to the room the prompt leaves.
    with client.messages.stream(model=MODEL_NAME, max_tokens=32000, messages=ASK) as stream:
        done = stream.get_final_message()
    room = CONTEXT - len(engine.calls[-1][0])
    assert engine.calls[-1][1].max_new_tokens == room
    assert done.stop_reason == "model_context_window_exceeded" and done.usage.output_tokens == room


def test_count_tokens(client, engine):
    counted = client.messages.count_tokens(model=MODEL_NAME, messages=ASK)
    client.messages.create(model=MODEL_NAME, max_tokens=1, messages=ASK)
    assert counted.input_tokens == len(engine.calls[-1][0])
    assert client.messages.count_tokens(model=MODEL_NAME, messages=ASK, tools=[WEATHER]).input_tokens > \
        counted.input_tokens + 10


def test_auth_headers(served, client):
    _, _, url = served
    body = {"model": MODEL_NAME, "max_tokens": 1, "messages": ASK}
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
        assert httpx.post(f"{url}/v1/messages", json=body, headers=headers).status_code == 200
    for headers in ({}, {"x-api-key": "wrong"}):
        r = httpx.post(f"{url}/v1/messages", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL_NAME, max_tokens=1, messages=ASK)


USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]}
BAD = [
    ({"messages": ASK}, 400, "max_tokens"),
    ({"max_tokens": 4}, 400, "messages"),
    ({"max_tokens": "4", "messages": ASK}, 400, "max_tokens"),
    ({"max_tokens": 4, "messages": ASK, "frequency": 1}, 400, "frequency"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "poem", "text": "x"}]}]}, 400,
     "messages.0.content.0.type"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "messages.0.content.0: image"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400, "messages.0.role"),
    ({"max_tokens": 4, "messages": [*ASK, USE, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]}, 400, "messages.2.content.0.tool_use_id"),
    ({"max_tokens": 4, "messages": ASK, "tool_choice": {"type": "any"}}, 400, "tool_choice"),
    ({"max_tokens": 4, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "x"}}, 400,
     "tool_choice"),
    ({"max_tokens": 4, "messages": ASK, "tools": [{"name": "f"}]}, 400, "tools.0.input_schema"),
    ({"max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "tools.0.type"),
    ({"max_tokens": 4, "messages": ASK, "thinking": {"type": "enabled"}}, 400, "thinking.budget_tokens"),
    ({"max_tokens": 4, "messages": ASK, "output_config": {"format": {"type": "xml"}}}, 400,
     "output_config.format.type"),
    ({"max_tokens": 4, "messages": ASK, "output_config": {"verbosity": 1}}, 400, "output_config.verbosity"),
    ({"max_tokens": 4, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": {}}}}, 400, "tool_choice"),
    ({"max_tokens": 0, "messages": ASK}, 400, "max_tokens"),
    ({"max_tokens": 4, "messages": ASK, "temperature": -1}, 400, "temperature"),
    ({"max_tokens": 4, "messages": ASK, "stop_sequences": "x"}, 400, "stop_sequences"),
    ({"max_tokens": 4, "messages": ASK, "model": "claude-nope"}, 404, "model"),
]


@pytest.mark.parametrize("body, status, named", BAD, ids=[b[2] for b in BAD])
def test_bad_requests_get_anthropic_errors(served, client, engine, body, status, named):
    _, _, url = served
    r = httpx.post(f"{url}/v1/messages", json={"model": MODEL_NAME, **body}, headers={"x-api-key": KEY})
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["message"].startswith(named), err
    assert err["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert engine.calls == []
    assert client.messages.create(model=MODEL_NAME, max_tokens=1, messages=ASK).content  # still serving
