"""/v1/responses through the official openai client (responses.create and responses.stream) against
a real uvicorn, with a FakeEngine playing fixed model outputs."""
from __future__ import annotations

import json

import openai
import pytest

from lightserve.messages import FinishReason
from lightserve.sampling import GrammarKind

from .helpers import MODEL_NAME, live_server, make_app

TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
THINK_AND_CALL = ["<think>", "Need", " weather.", "</think>", "\n\n", "On it.", "<tool_call>",
                  '{"name": "get_weather", "arguments": {"city": "Paris"}}', "</tool_call>"]


@pytest.fixture
def client(engine, tokenizer):
    engine.finish = FinishReason.STOP
    app = make_app(engine, tokenizer, tool_call_parser="hermes", reasoning_parser="qwen3")
    with live_server(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _summary(response) -> list[tuple]:
    out = []
    for item in response.output:
        if item.type == "message":
            out.append(("message", "".join(c.text for c in item.content)))
        elif item.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in item.content)))
        else:
            out.append((item.type, item.name, json.loads(item.arguments)))
    return out


def test_create_text_and_parameters(client, engine, tokenizer):
    engine.script = ["Bonjour", " !"]
    r = client.responses.create(model=MODEL_NAME, input="Say hello in French.", instructions="Be brief.",
                                max_output_tokens=5, temperature=0.5, top_p=0.9)
    assert r.status == "completed" and r.output_text == "Bonjour !" and r.model == MODEL_NAME
    assert r.usage.output_tokens == 2 and r.usage.input_tokens == len(engine.calls[-1][0])
    prompt, params = engine.calls[-1]
    assert (params.max_new_tokens, params.temperature, params.top_p) == (5, 0.5, 0.9)
    text = tokenizer.decode(prompt)
    assert "Be brief." in text and "Say hello in French." in text

    engine.finish = FinishReason.LENGTH
    cut = client.responses.create(model=MODEL_NAME, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Hi"}]}], max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_reasoning_and_function_call_streamed_equals_whole(client, engine):
    engine.script = THINK_AND_CALL
    whole = client.responses.create(model=MODEL_NAME, input="Weather in Paris?", tools=[TOOL])
    expected = [("reasoning", "Need weather."), ("message", "On it."), ("function_call", "get_weather",
                                                                        {"city": "Paris"})]
    assert _summary(whole) == expected
    assert whole.output[2].call_id.startswith("call_") and whole.usage.output_tokens_details.reasoning_tokens > 0

    with client.responses.stream(model=MODEL_NAME, input="Weather in Paris?", tools=[TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert _summary(final) == expected
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    for kind in ("response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                 "response.output_text.delta", "response.output_text.done", "response.function_call_arguments.done",
                 "response.output_item.done"):
        assert kind in kinds, kind
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "On it."


def test_function_call_round_trip_and_previous_response(client, engine, tokenizer):
    engine.script = ['{"city": ', '"Oslo"}']
    first = client.responses.create(model=MODEL_NAME, input="Weather in Oslo?", tools=[TOOL],
                                    tool_choice={"type": "function", "name": "get_weather"})
    assert engine.calls[-1][1].grammar_kind == GrammarKind.JSON_SCHEMA
    [call] = first.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Oslo"})

    engine.script = ["Cold."]
    second = client.responses.create(model=MODEL_NAME, previous_response_id=first.id, tools=[TOOL], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": -3}'}])
    assert second.output_text == "Cold."
    prompt = tokenizer.decode(engine.calls[-1][0])
    assert "Weather in Oslo?" in prompt and '{"temp": -3}' in prompt and "get_weather" in prompt

    # The same conversation sent as items, without the store.
    third = client.responses.create(model=MODEL_NAME, store=False, tools=[TOOL], input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": -3}'}])
    assert third.output_text == "Cold." and tokenizer.decode(engine.calls[-1][0]) == prompt
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=MODEL_NAME, previous_response_id=third.id, input="and tomorrow?")
    assert bad.value.body["param"] == "previous_response_id"


def test_text_format_json_schema(client, engine):
    engine.script = ['{"answer": ', "42}"]
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    r = client.responses.create(model=MODEL_NAME, input="6 x 7?", text={"format": {
        "type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    assert json.loads(r.output_text) == {"answer": 42}
    params = engine.calls[-1][1]
    assert params.grammar_kind == GrammarKind.JSON_SCHEMA and json.loads(params.grammar) == schema


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"type": "message", "role": "user"}]}, "input.0.content"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "computer_call"}]}, "input.0.type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input.0.arguments"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
])
def test_bad_requests_name_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as bad:
        client.post("/responses", body={"model": MODEL_NAME, **body}, cast_to=object)
    assert bad.value.body["param"] == param
