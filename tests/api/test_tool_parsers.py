"""The tool-call and reasoning parsers on fixed model outputs, whole and split across stream chunks
at every position, and the grammar that tool_choice "required"/named imposes."""
from __future__ import annotations

import json

import jsonschema
import pytest

from lightserve.chat.output import ChatOutput, ToolMode, plan_tools, with_calls_in_text
from lightserve.chat.reasoning_parsers import REASONING_PARSERS
from lightserve.chat.tool_call import Parsed
from lightserve.chat.tool_parsers import TOOL_PARSERS, ForcedCallParser, choose_tool_parser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

# (parser, model output, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("hermes", ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
     "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("hermes", "Paris is sunny. 1 < 2 and <tool is not a tag.", "Paris is sunny. 1 < 2 and <tool is not a tag.", []),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call> done',
     '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call> done', []),  # bad JSON: text
    ("hermes", 'cut off <tool_call>{"name": "get', 'cut off <tool_call>{"name": "get', []),  # unclosed: text
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", {"city": "Paris"})]),
    ("llama3_json", ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                     '{"name": "get_time", "parameters": {}}'), "",
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("llama3_json", "It is sunny {really}.", "It is sunny {really}.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("mistral", 'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]', "Checking.",
     [("get_weather", {"city": "Rome"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}', "",
     [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    ("mistral", "No [TOOL calls] here.", "No [TOOL calls] here.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]</s>', "", [("get_time", {})]),  # eos text kept
]


def _calls(parsed: Parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


@pytest.mark.parametrize("name, text, content, calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parser_whole_and_split(name, text, content, calls):
    whole = TOOL_PARSERS[name]().parse(text)
    assert (whole.content, _calls(whole)) == (content, calls)
    assert all(c.id.startswith("call_") for c in whole.calls) and len({c.id for c in whole.calls}) == len(calls)
    # Split at every position, and one character at a time: the same message, and no content piece
    # ever holds markup that the whole output did not show as content.
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        parser, got = TOOL_PARSERS[name](), Parsed()
        for piece in pieces:
            step = parser.feed(piece)
            assert step.content in content, (pieces, step.content)
            got.add(step)
        got.add(parser.finish())
        assert (got.content, _calls(got)) == (content, calls), pieces


@pytest.mark.parametrize("name, prompt, text, reasoning, content", [
    ("qwen3", "", "<think>\nThe user wants a city.\n</think>\n\nParis.", "\nThe user wants a city.\n", "Paris."),
    ("qwen3", "", "Paris.", "", "Paris."),                        # thinking off: all answer
    ("qwen3", "<|im_start|>assistant\n<think>\n", "hmm</think>Paris.", "hmm", "Paris."),  # tag in the prompt
    ("qwen3", "", "<think>still thinking", "still thinking", ""),  # cut off inside the reasoning
    ("deepseek_r1", "", "plan: answer</think>\n\nParis.", "plan: answer", "Paris."),
    ("deepseek_r1", "", "<think>plan</think>Paris.", "plan", "Paris."),
])
def test_reasoning_split_whole_and_streamed(name, prompt, text, reasoning, content):
    assert REASONING_PARSERS[name](prompt).parse(text) == (reasoning, content)
    for pieces in [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]:
        parser, got_r, got_c = REASONING_PARSERS[name](prompt), "", ""
        for piece in pieces:
            r, c = parser.feed(piece)
            assert "<" not in c or "<" in content
            got_r, got_c = got_r + r, got_c + c
        r, c = parser.finish()
        assert (got_r + r, got_c + c) == (reasoning, content), pieces


def test_chat_output_reasoning_then_call_streams_as_the_whole():
    text = ('<think>weather question</think>\n\nOne moment.<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>')
    plan = plan_tools([WEATHER], "auto", None, "hermes")
    whole = ChatOutput(plan, "hermes", "qwen3", "")
    whole.feed(text, final=True)
    msg = whole.message()
    assert msg["reasoning_content"] == "weather question" and msg["content"] == "One moment."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == \
        [("get_weather", '{"city": "Paris"}')]
    assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "length"
    stream = ChatOutput(plan, "hermes", "qwen3", "")
    deltas = [stream.feed(ch) for ch in text] + [stream.feed("", final=True)]
    assert "".join(d.get("content", "") for d in deltas) == "One moment."
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "weather question"
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], c["type"], c["function"]["name"]) for c in calls] == [(0, "function", "get_weather")]


def test_required_and_named_grammars_accept_only_calls():
    required = plan_tools([WEATHER, TIME], "required", False, None)
    assert required.mode is ToolMode.REQUIRED and required.prompt_tools == [WEATHER, TIME]
    schema = required.grammar_schema()
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}}], schema)
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "get_weather", "parameters": {}}],
                [{"name": "get_time", "parameters": {}}] * 2):  # parallel_tool_calls false: one call
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None, None)
    assert named.grammar_schema() == WEATHER["function"]["parameters"]
    parsed = ForcedCallParser("get_weather").parse('{"city": "Paris"}')
    assert _calls(parsed) == [("get_weather", {"city": "Paris"})]
    parsed = ForcedCallParser(None).parse('[{"name": "get_time", "parameters": {}}]')
    assert _calls(parsed) == [("get_time", {})]
    assert ForcedCallParser(None).parse('[{"name": "get_ti').content == '[{"name": "get_ti'  # cut off: text
    assert plan_tools([WEATHER], "none", None, None).prompt_tools is None


CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize("setting, template, vocab, arch, parser", [
    ("mistral", CHATML, {}, None, "mistral"),                                      # a named parser as given
    ("auto", "{% if tools %}...<tool_call>{% endif %}<|im_start|>", {}, None, "hermes"),  # Qwen2.5/3, Hermes
    ("auto", "{{ '<|start_header_id|>' }}{% if tools %}<|python_tag|>{% endif %}", {}, None, "llama3_json"),
    ("auto", "[INST]{% if tools %}[TOOL_CALLS]{% endif %}", {}, None, "mistral"),
    ("auto", {"default": "[INST]", "tool_use": "[TOOL_CALLS]"}, {}, None, "mistral"),  # named templates
    ("auto", "[INST]", {"[TOOL_CALLS]": 5}, None, "mistral"),                      # from the vocabulary
    ("auto", "<bos>{{ messages }}", {}, "Qwen3ForCausalLM", "hermes"),             # from the family
    ("auto", CHATML, {}, "LlamaForCausalLM", "hermes"),                            # SmolLM2: lightserve's prompt
    ("auto", CHATML.replace("{% for", "{% if tools %}{{ tools }}{% endif %}{% for"), {}, None, None),  # other tools
    ("auto", "[INST]{{ messages }}", {}, "LlamaForCausalLM", None),                # nothing matches
    ("auto", None, {}, None, None),
])
def test_choose_tool_parser(setting, template, vocab, arch, parser):
    chosen, why = choose_tool_parser(setting, template, vocab, arch)
    assert chosen == parser and why


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_rendered_past_calls_parse_back(name):
    calls = [("get_weather", {"city": "Paris"}), ("get_time", {})]
    parsed = TOOL_PARSERS[name]().parse(TOOL_PARSERS[name].render(calls))
    assert (parsed.content, _calls(parsed)) == ("", calls)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    shown = with_calls_in_text(messages, name)  # for a template that renders no tool_calls
    assert shown[1] == {"role": "assistant", "content": "Checking.\n" + TOOL_PARSERS[name].render(calls[:1])}
    assert shown[0] is messages[0] and shown[2] is messages[2]
