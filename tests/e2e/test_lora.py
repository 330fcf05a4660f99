"""LoRA adapters served by a real server: a tiny random Llama with the bundled tokenizer, three random PEFT adapters
(made by peft here: different ranks and targets, one rsLoRA), two from --lora_modules and one loaded at run time,
over --max_loras 2 slots. The official openai client's greedy completions, read back as token ids
(return_tokens_as_token_ids), equal transformers + peft with each adapter merged, for concurrent requests mixing
the adapters and the base; the prefix cache never hands one adapter's KV to another; bad adapters and names are
refused with the field named while the server keeps serving."""
from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import openai
import pytest
import torch

from tests.e2e.server import MODEL_DIR, ServerProc, bundled_tokenizer, files_left, lightserve_files
from tests.model.tiny_models import make_tiny_model

NEW_TOKENS = 8
LONG_CONTEXT = 4096
PROMPTS = ["river stone apple window", "The quick brown fox jumps over"]
# name -> (rank, alpha, targets, rsLoRA)
ADAPTERS = {"alpha": (8, 16, ["q_proj", "v_proj", "down_proj"], False),
            "beta": (16, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
            "gamma": (4, 4, ["o_proj", "gate_proj", "up_proj"], False)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _make_adapter(base_dir, out_dir, rank, alpha, targets, rslora, seed):
    import peft
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                          init_lora_weights=False)
    peft.get_peft_model(base, cfg).save_pretrained(out_dir)
    return out_dir


def _greedy_ids(base_dir, adapter_dir, prompt: str) -> list[int]:
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    ids = torch.tensor([bundled_tokenizer().encode(prompt)])
    with torch.no_grad():
        out = model.eval().generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    """(server, {name or None: adapter folder}, {(name, prompt): expected ids})."""
    root = tmp_path_factory.mktemp("lora")
    # A context of 4096 (rope scaling is set by the 64-position original length): a long request stays in flight
    # for seconds even on this tiny model.
    base = make_tiny_model("llama3", root / "base", vocab_size=49152, max_position_embeddings=LONG_CONTEXT)
    for name in TOKENIZER_FILES:
        shutil.copy(MODEL_DIR / name, base / name)
    dirs = {name: _make_adapter(base, root / name, *spec, seed=i) for i, (name, spec) in enumerate(ADAPTERS.items())}
    expected = {(name, p): _greedy_ids(base, dirs.get(name), p) for name in (None, *ADAPTERS) for p in PROMPTS}
    # A bad adapter of each kind, for the refusals.
    _make_adapter(base, root / "rank32", 32, 32, ["q_proj"], False, seed=9)
    corrupt = shutil.copytree(dirs["alpha"], root / "corrupt")
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])  # the header promises data that is not there
    srv = ServerProc("--model_dir", str(base), "--data_type", "float32", "--enable_lora", "--lora_modules",
                     f"alpha={dirs['alpha']}", f"beta={dirs['beta']}", "--max_loras", "2",
                     "--allow_runtime_lora_updating", log_path=root / "server.log").wait_ready()
    yield srv, dirs, expected, root
    srv.stop()


def _client(srv) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)


async def _complete_ids(client, model: str, prompt: str) -> tuple[list[int], dict]:
    out = await client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                          logprobs=1, extra_body={"ignore_eos": True,
                                                                  "return_tokens_as_token_ids": True})
    tokens = out.choices[0].logprobs.tokens
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.split(":", 1)[1]) for t in tokens], out.model_dump()


def test_models_lists_the_adapters_with_the_base_as_parent(lora_server):
    srv, dirs, _, _ = lora_server
    cards = {c["id"]: c for c in httpx.get(srv.url + "/v1/models").json()["data"]}
    base = next(name for name, c in cards.items() if c["parent"] is None)
    assert cards["alpha"]["parent"] == base and cards["beta"]["parent"] == base
    assert cards["alpha"]["root"] == str(dirs["alpha"])
    metrics = httpx.get(srv.url + "/metrics").text
    assert 'lightserve_lora_requests{adapter="alpha"} 0.0' in metrics
    assert 'lightserve_lora_requests{adapter="beta"} 0.0' in metrics


def test_mixed_adapters_and_base_greedy_equal_peft_merged(lora_server):
    """gamma is loaded at run time; with 2 slots for 3 adapters, requests wait for a slot and slots are reloaded."""
    srv, dirs, expected, _ = lora_server
    r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": str(dirs["gamma"])})
    assert r.status_code == 200, r.text

    async def go():
        client = _client(srv)
        jobs = [(name, p) for p in PROMPTS for name in (None, *ADAPTERS)] * 2
        base = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        outs = await asyncio.gather(*[_complete_ids(client, name or base, p) for name, p in jobs])
        await client.close()
        return jobs, outs

    jobs, outs = asyncio.run(go())
    for (name, prompt), (ids, body) in zip(jobs, outs):
        assert ids == expected[(name, prompt)], (name, prompt)
        if name is not None:
            assert body["model"] == name
    # The adapters change the output: otherwise this test could not tell them apart.
    assert len({tuple(expected[(n, PROMPTS[1])]) for n in (None, *ADAPTERS)}) >= 3


def test_chat_logprobs_name_token_ids(lora_server):
    srv, _, _, _ = lora_server
    r = httpx.post(srv.url + "/v1/chat/completions", json={
        "model": "beta", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
        "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}, timeout=120)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert content and all(c["token"].startswith("token_id:") for c in content)
    assert all(a["token"].startswith("token_id:") for c in content for a in c["top_logprobs"])


def test_prefix_cache_keeps_each_adapters_kv_apart(lora_server):
    srv, _, expected, _ = lora_server
    prompt = PROMPTS[0]

    async def go():
        client = _client(srv)
        first = await _complete_ids(client, "alpha", prompt)
        base = await _complete_ids(client, httpx.get(srv.url + "/v1/models").json()["data"][0]["id"], prompt)
        again = await _complete_ids(client, "alpha", prompt)
        await client.close()
        return first, base, again

    first, base, again = asyncio.run(go())
    assert first[0] == again[0] == expected[("alpha", prompt)]
    assert base[0] == expected[(None, prompt)]
    assert again[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_bad_names_and_adapters_are_refused_and_the_server_keeps_serving(lora_server):
    srv, dirs, expected, root = lora_server

    def post(path, **body):
        return httpx.post(srv.url + path, json=body, timeout=60)

    r = post("/v1/completions", model="nope", prompt="x", max_tokens=1)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model" and "nope" in r.json()["error"]["message"]
    r = post("/v1/load_lora_adapter", lora_name="big", lora_path=str(root / "rank32"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert "max_lora_rank" in r.json()["error"]["message"]
    r = post("/v1/load_lora_adapter", lora_name="bad", lora_path=str(root / "corrupt"))
    assert r.status_code == 400 and "adapter_model.safetensors" in r.json()["error"]["message"], r.text
    r = post("/v1/load_lora_adapter", lora_name="missing", lora_path=str(root / "no-such-folder"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = post("/v1/load_lora_adapter", lora_name="alpha", lora_path=str(dirs["alpha"]))
    assert r.status_code == 400 and "already" in r.json()["error"]["message"]
    r = post("/v1/load_lora_adapter", lora_name="x")
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = post("/v1/unload_lora_adapter", lora_name="nope")
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"

    async def unload_while_running():
        client = _client(srv)
        stream = await client.completions.create(model="beta", prompt=PROMPTS[0], max_tokens=LONG_CONTEXT - 64,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:  # the request runs: its adapter is in use
            in_use = post("/v1/unload_lora_adapter", lora_name="beta")
            assert 'lightserve_lora_requests{adapter="beta"} 1.0' in httpx.get(srv.url + "/metrics").text
            break
        await stream.close()
        await client.close()
        return in_use

    in_use = asyncio.run(unload_while_running())
    assert in_use.status_code == 409 and "in use" in in_use.json()["error"]["message"]
    assert wait_unloaded(post)
    r = post("/v1/completions", model="beta", prompt="x", max_tokens=1)
    assert r.status_code == 404
    assert "beta" not in {c["id"] for c in httpx.get(srv.url + "/v1/models").json()["data"]}
    # Loaded again under the same name: served with its weights once more.
    assert post("/v1/load_lora_adapter", lora_name="beta", lora_path=str(dirs["beta"])).status_code == 200

    async def after():
        client = _client(srv)
        outs = await asyncio.gather(_complete_ids(client, "beta", PROMPTS[1]),
                                    _complete_ids(client, "alpha", PROMPTS[1]))
        await client.close()
        return outs

    (beta, _), (alpha, _) = asyncio.run(after())
    assert beta == expected[("beta", PROMPTS[1])] and alpha == expected[("alpha", PROMPTS[1])]
    assert httpx.get(srv.url + "/health").status_code == 200


def wait_unloaded(post, timeout_s: float = 30.0) -> bool:
    """Unload beta once the aborted stream's request has left the engine (its count drops as it ends)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = post("/v1/unload_lora_adapter", lora_name="beta")
        if r.status_code == 200:
            return True
        assert r.status_code == 409, r.text
        time.sleep(0.1)
    return False


def test_a_bad_lora_module_stops_the_start_naming_it(tmp_path):
    base = make_tiny_model("llama3", tmp_path / "base", vocab_size=49152)
    for name in TOKENIZER_FILES:
        shutil.copy(MODEL_DIR / name, base / name)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}))
    before = lightserve_files()
    srv = ServerProc("--model_dir", str(base), "--enable_lora", "--lora_modules", f"broken={bad}",
                     log_path=tmp_path / "server.log")
    assert srv.proc.wait(timeout=120) != 0
    log = srv.log_tail()
    assert "--lora_modules broken=" in log and "adapter_model.safetensors" in log, log
    assert not files_left(before, [srv.pid])


def test_pipeline_runs_each_prompt_under_its_adapter(lora_server):
    from lightserve.pipeline import GenerationConfig, pipeline

    _, dirs, expected, root = lora_server
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    with pipeline(str(root / "base"), data_type="float32", enable_lora=True, max_loras=2,
                  lora_modules=[f"alpha={dirs['alpha']}", f"gamma={dirs['gamma']}"]) as pipe:
        names = ["alpha", None, "gamma", "alpha"]
        outs = pipe.infer([PROMPTS[1], PROMPTS[1], PROMPTS[0], PROMPTS[0]], config, adapter=names)
        assert [o.token_ids for o in outs] == [expected[("alpha", PROMPTS[1])], expected[(None, PROMPTS[1])],
                                               expected[("gamma", PROMPTS[0])], expected[("alpha", PROMPTS[0])]]
        assert pipe.infer(PROMPTS[1], config, adapter="gamma").token_ids == expected[("gamma", PROMPTS[1])]
        with pytest.raises(ValueError, match="adapter.*'beta'.*served: alpha, gamma"):
            pipe.infer(PROMPTS[0], config, adapter="beta")
        with pytest.raises(ValueError, match="adapter.*2 adapters for 1 prompts"):
            pipe.infer([PROMPTS[0]], config, adapter=["alpha", "gamma"])
