"""Agent-client features against the real server on the real model, through the official openai
client: tool calls (grammar-bound required/named choices, auto, a full round trip, stream vs
whole), /v1/responses, and vLLM's conventions (metric names, /version, /ping, name aliases).
One server for the module, with a tool-capable chat template (SmolLM2's own takes no tools) and no
--tool_call_parser: the default, auto, reads hermes off the template."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server import ServerProc

TEMPLATE = Path(__file__).with_name("tools_template.jinja")
# Enums keep the grammar-bound arguments short, so a few tokens finish the call.
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
          "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                             "parameters": PARAMS}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _asked_and_called(city: str, i: int, sky: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": json.dumps({"city": city, "sky": sky})}]


# Two questions the assistant answered with calls, then a third: greedy, the model calls again, given one
# nudge: "response" banned, which it would write after "<tool_" (echoing the <tool_response> turns).
CALLS_BEFORE = [*_asked_and_called("London", 1, "rain"), *_asked_and_called("Tokyo", 2, "sun"), *ASK]
NO_TOOL_RESPONSE = {"7639": -100}  # SmolLM2's token "response"


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("agent") / "server.log"
    srv = ServerProc("--data_type", "float32", "--max_total_token_num", "4096", "--chat_template", str(TEMPLATE),
                     "--served_model_name", "smol-agent", "smol", log_path=log).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(agent_server):
    return openai.OpenAI(base_url=f"{agent_server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, PARAMS)
    return args


def test_required_and_named_calls_always_parse(client):
    done = client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER], tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=48, temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    _check_call(choice.message.tool_calls[0])
    # Sampled: the grammar still holds the sample to the schema.
    done = client.chat.completions.create(model="smol-agent", messages=ASK, tools=[WEATHER], tool_choice=NAMED,
                                          max_tokens=32, temperature=1.0, seed=3)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    _check_call(choice.message.tool_calls[0])


def test_named_call_streamed_equals_whole_then_round_trip(client):
    whole = client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER], tool_choice=NAMED,
                                           max_tokens=32, temperature=0)
    [call] = whole.choices[0].message.tool_calls
    args = _check_call(call)
    pieces = []
    for chunk in client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER], tool_choice=NAMED,
                                                max_tokens=32, temperature=0, stream=True):
        for c in chunk.choices:
            assert not c.delta.content
            pieces += c.delta.tool_calls or []
            finish = c.finish_reason or None
    assert finish == "tool_calls" and {p.index for p in pieces} == {0}
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    assert "".join(p.function.name or "" for p in pieces) == "get_weather"

    # The tool's result goes back; the model answers (in text, or with another call: both are valid).
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({**args, "sky": "sunny"})}]
    final = client.chat.completions.create(model="smol", messages=history, tools=[WEATHER], max_tokens=24,
                                           temperature=0)
    choice = final.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    for c in choice.message.tool_calls or []:
        _check_call(c)
    assert final.usage.prompt_tokens > whole.usage.prompt_tokens + 20  # the call and its result are in the prompt


def test_auto_gives_text_or_calls(agent_server, client):
    """tool_choice auto leaves the choice to the model, and each answer comes back as what it is: a question
    the model answers in words is text, no call; one it answers with a call (greedy, after a history of
    calls) is that call, parsed by the parser --tool_call_parser auto chose, no <tool_call> text left over."""
    assert "tool calls (tool_choice auto): hermes" in agent_server.log_path.read_text()
    text = client.chat.completions.create(model="smol", tools=[WEATHER], tool_choice="auto", max_tokens=24,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}],
                                          temperature=0).choices[0]
    assert (text.finish_reason, text.message.content) == ("stop", "The capital of France is Paris."), text
    assert not text.message.tool_calls, text
    called = client.chat.completions.create(model="smol", messages=CALLS_BEFORE, tools=[WEATHER], tool_choice="auto",
                                            max_tokens=40, temperature=0, logit_bias=NO_TOOL_RESPONSE).choices[0]
    assert called.finish_reason == "tool_calls" and not called.message.content, called
    [call] = called.message.tool_calls
    assert _check_call(call) == {"city": "Paris"}


def test_responses_create_and_stream(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
              "required": ["city"]}
    r = client.responses.create(model="smol", input="Which city is the capital of France?",
                                instructions="Answer in JSON.", max_output_tokens=24, temperature=0,
                                text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    assert r.status == "completed" and r.usage.output_tokens > 0
    jsonschema.validate(json.loads(r.output_text), schema)

    tool = {"type": "function", "name": "get_weather", "parameters": PARAMS}
    with client.responses.stream(model="smol", input="Weather in Tokyo?", tools=[tool], max_output_tokens=32,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    [item] = final.output
    assert item.type == "function_call" and item.name == "get_weather"
    jsonschema.validate(json.loads(item.arguments), PARAMS)


def test_vllm_metrics_version_ping(agent_server, client):
    assert [m.id for m in client.models.list()] == ["smol-agent", "smol"]
    assert httpx.get(agent_server.url + "/version", timeout=10).json()["version"]
    assert httpx.get(agent_server.url + "/ping", timeout=10).status_code == 200
    text = httpx.get(agent_server.url + "/metrics", timeout=10).text
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count"):
        assert name in samples, name
        assert samples[name].labels == {"model_name": "smol-agent"}, samples[name]
    assert samples["vllm:prompt_tokens_total"].value > 0 and samples["vllm:generation_tokens_total"].value > 0
    assert samples["vllm:num_requests_running"].value == 0 and 0 <= samples["vllm:kv_cache_usage_perc"].value <= 1
