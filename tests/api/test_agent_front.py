"""Tool calls and reasoning through the official openai client against a real uvicorn, with a
FakeEngine that plays fixed model outputs token by token: the streamed pieces must add up to the
non-streamed message, and no markup may leak into content."""
from __future__ import annotations

import json

import openai
import pytest

from lightserve.messages import FinishReason
from lightserve.sampling import GrammarKind

from .helpers import MODEL_NAME, live_server, make_app

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# A reasoning model's answer with a call, cut into tokens the way a tokenizer might cut it.
OUTPUT = ["<th", "ink>", "The user", " wants weather.", "</th", "ink>\n\n", "Let me check.", "\n<tool", "_call>",
          '\n{"name": "get_weather", ', '"arguments": {"city": ', '"Paris"}}', "\n</tool_call>"]


@pytest.fixture
def client(engine, tokenizer):
    engine.finish = FinishReason.STOP
    app = make_app(engine, tokenizer, tool_call_parser="hermes", reasoning_parser="qwen3",
                   served_model_name=(MODEL_NAME, "alias-b"))
    with live_server(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _assemble(chunks) -> tuple[str, str, list[tuple[str, str, str]], str]:
    """content, reasoning, [(id, name, arguments)], finish_reason from stream chunks."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            assert "<tool_call>" not in (delta.content or "") and "think>" not in (delta.content or "")
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", "", ""])
                entry[0] += call.id or ""
                entry[1] += call.function.name or ""
                entry[2] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, reasoning, [tuple(calls[i]) for i in sorted(calls)], finish


def test_auto_call_with_reasoning_streamed_equals_whole(client, engine):
    engine.script = OUTPUT
    done = client.chat.completions.create(model="alias-b", messages=ASK, tools=[WEATHER])
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and done.model == MODEL_NAME
    assert choice.message.content == "Let me check."
    assert choice.message.reasoning_content == "The user wants weather."
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert engine.calls[-1][1].grammar_kind == GrammarKind.NONE  # auto: the model writes freely

    content, reasoning, calls, finish = _assemble(client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER], stream=True))
    assert (content, reasoning, finish) == ("Let me check.", "The user wants weather.", "tool_calls")
    assert [(name, json.loads(args)) for _, name, args in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0][0].startswith("call_")


def test_round_trip_with_tool_result(client, engine, tokenizer):
    """The call, the tool's answer and the final reply: tool messages and assistant tool_calls are
    accepted, and the prompt carries them."""
    engine.script = ["It is ", "sunny."]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'}]
    done = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=[WEATHER])
    msg = done.choices[0].message
    assert (msg.content, msg.tool_calls, done.choices[0].finish_reason) == ("It is sunny.", [], "stop")
    prompt = tokenizer.decode(engine.calls[-1][0])
    assert "get_weather" in prompt and '{"sky": "sunny"}' in prompt
    assert "You can call the following functions" in prompt  # the fallback system prompt


def test_required_and_named_choices_are_grammar_bound(client, engine):
    engine.script = ['[{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}]']
    done = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER], tool_choice="required",
                                          parallel_tool_calls=False)
    params = engine.calls[-1][1]
    assert params.grammar_kind == GrammarKind.JSON_SCHEMA and json.loads(params.grammar)["maxItems"] == 1
    [call] = done.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
    assert done.choices[0].finish_reason == "tool_calls" and done.choices[0].message.content is None

    engine.script = ['{"city": ', '"Rome"}']
    named = {"type": "function", "function": {"name": "get_weather"}}
    content, _, calls, finish = _assemble(client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER], tool_choice=named, stream=True))
    assert json.loads(engine.calls[-1][1].grammar) == WEATHER["function"]["parameters"]
    assert (content, finish) == ("", "tool_calls") and [c[1:] for c in calls] == [("get_weather", '{"city": "Rome"}')]


def test_tool_choice_none_and_plain_text(client, engine, tokenizer):
    engine.script = ["Just ", "text <tool", " maybe."]
    done = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER], tool_choice="none")
    assert done.choices[0].message.content == "Just text <tool maybe."
    assert "get_weather" not in tokenizer.decode(engine.calls[-1][0])  # no tools in the prompt
    content, reasoning, calls, finish = _assemble(client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, stream=True))
    assert (content, reasoning, calls, finish) == ("Just text <tool maybe.", "", [], "stop")


def test_content_parts_and_aliases(client, engine):
    engine.script = ["ok"]
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    assert client.chat.completions.create(model="alias-b", messages=parts).choices[0].message.content == "ok"
    assert [m.id for m in client.models.list()] == [MODEL_NAME, "alias-b"]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert bad.value.body["param"] == "messages.0.content.0" and "image" in bad.value.body["message"]
