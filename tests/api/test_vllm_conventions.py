"""vLLM's serving conventions: metrics under vLLM's names (scraped with prometheus_client's parser),
/version and /ping, served-model-name aliases, --chat_template and generation_config.json defaults."""
from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lightserve.cli import parse_args
from lightserve.sampling import generation_defaults

from .helpers import MODEL_NAME, asgi_client, make_app

pytestmark = pytest.mark.anyio

VLLM_NAMES = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:time_to_first_token_seconds",
              "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds", "vllm:prefix_cache_queries",
              "vllm:prefix_cache_hits", "vllm:num_preemptions"}


async def test_vllm_metric_names(engine, tokenizer):
    stats = engine.pool.stats
    stats.update(kv_tokens_total=1000, kv_tokens_free=600, kv_tokens_cached=150, requests_running=3,
                 requests_waiting=2, requests_paused=1, prompt_tokens_total=500, prompt_tokens_cached_total=120,
                 generation_tokens_total=77, pauses_total=4)
    engine.num_queued = 5
    async with asgi_client(make_app(engine, tokenizer)) as client:
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200
        text = (await client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert VLLM_NAMES <= set(families)
    value = {name: families[name].samples[0] for name in VLLM_NAMES}
    assert all(s.labels.get("model_name") == MODEL_NAME for s in value.values())
    assert value["vllm:num_requests_running"].value == 3
    assert value["vllm:num_requests_waiting"].value == 2 + 1 + 5
    assert value["vllm:kv_cache_usage_perc"].value == pytest.approx(0.25)
    assert (families["vllm:prompt_tokens"].type, value["vllm:prompt_tokens"].name) == ("counter",
                                                                                       "vllm:prompt_tokens_total")
    assert value["vllm:prompt_tokens"].value == 500 and value["vllm:generation_tokens"].value == 77
    assert value["vllm:prefix_cache_queries"].value == 500 and value["vllm:prefix_cache_hits"].value == 120
    assert value["vllm:num_preemptions"].value == 4
    counts = {s.name: s.value for f in families.values() for s in f.samples if s.name.endswith("_count")}
    assert counts["vllm:time_to_first_token_seconds_count"] == 1
    assert counts["vllm:inter_token_latency_seconds_count"] == 2
    assert counts["vllm:e2e_request_latency_seconds_count"] == 1


async def test_version_ping_and_aliases(engine, tokenizer):
    async with asgi_client(make_app(engine, tokenizer, served_model_name=("first", "second"))) as client:
        assert (await client.get("/version")).json()["version"]
        assert (await client.get("/ping")).json() == {"status": "ok"}
        assert (await client.post("/ping")).status_code == 200
        r = await client.post("/v1/chat/completions", json={"model": "second", "max_tokens": 1,
                                                            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["model"] == MODEL_NAME
    async with asgi_client(make_app(engine, tokenizer, health_reason="router is not running")) as client:
        r = await client.get("/ping")
        assert r.status_code == 503 and r.json()["reason"] == "router is not running"


async def test_generation_config_defaults_under_the_request(engine, tokenizer, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "do_sample": True,
         "eos_token_id": 2}))
    defaults = generation_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1}
    app = make_app(engine, tokenizer)
    app.state.front.sampling_defaults = defaults
    async with asgi_client(app) as client:
        await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        params = engine.calls[-1][1]
        assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.6, 0.95, 20, 1.1)
        await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 1, "temperature": 0, "top_k": 5})
        params = engine.calls[-1][1]
        assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.95, 5)  # the client's values win
        await client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 1}})
        assert engine.calls[-1][1].top_p == 0.95
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "do_sample": False}))
    assert generation_defaults(str(tmp_path)) == {"temperature": 0.0}  # HF: do_sample false is greedy
    assert generation_defaults(str(tmp_path / "none")) == {}


def test_flags(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    config = parse_args(["--served-model-name", "a", "b", "--chat_template", str(template), "--generation_config",
                         "vllm", "--tool_call_parser", "hermes", "--reasoning_parser", "deepseek_r1"])
    assert config.served_model_name == ("a", "b") and config.chat_template == str(template)
    for bad in (["--tool_call_parser", "nope"], ["--reasoning_parser", "nope"], ["--chat_template", "/no/such"],
                ["--generation_config", "/no/such"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
