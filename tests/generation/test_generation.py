"""Generation controls over the real server (float32, real SmolLM2): sampling parameters, stopping,
logprobs against transformers, structured output, and the utility routes. One server per module."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.e2e.server import MODEL_DIR, ServerProc

CONTEXT = 512
TIMEOUT = httpx.Timeout(900.0)
REPEAT_PROMPTS = ["1, 2, 1, 2, 1, 2, 1, 2,", "the cat the cat the cat the cat", "Repeat after me: hello hello hello"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = ServerProc("--data_type", "float32", "--max_total_token_num", "8192", "--max_req_total_len", str(CONTEXT),
                     log_path=log).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(MODEL_DIR)


def _post(server: ServerProc, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=TIMEOUT)


def _ids(server: ServerProc, prompt: str, **params) -> list[int]:
    """Output token ids of one /generate request."""
    resp = _post(server, "/generate", {"inputs": prompt, "parameters": {"return_details": True, **params}})
    assert resp.status_code == 200, resp.text
    return [t["id"] for t in resp.json()["tokens"]]


def _many(fn, args_list: list) -> list:
    with ThreadPoolExecutor(len(args_list)) as ex:
        return list(ex.map(lambda a: fn(*a), args_list))


def _repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


# ---- sampling parameters ----------------------------------------------------------------------------
def test_degenerate_sampling_equals_greedy(server):
    prompts = ["The capital of France is", "def add(a, b):"]
    greedy = _many(lambda p: _ids(server, p, max_new_tokens=8), [(p,) for p in prompts])
    for variant in (dict(top_k=1), dict(temperature=1e-5), dict(min_p=1.0)):
        got = _many(lambda p, variant=variant: _ids(server, p, max_new_tokens=8, do_sample=True, seed=3, **variant),
                    [(p,) for p in prompts])
        assert got == greedy, variant


@pytest.mark.parametrize("penalty", [dict(repetition_penalty=1.8), dict(frequency_penalty=1.5),
                                     dict(presence_penalty=1.5)])
def test_penalties_lower_repeats(server, penalty):
    args = dict(max_new_tokens=16, ignore_eos=True)
    plain = _many(lambda p: _ids(server, p, **args), [(p,) for p in REPEAT_PROMPTS])
    penalized = _many(lambda p: _ids(server, p, **args, **penalty), [(p,) for p in REPEAT_PROMPTS])
    assert sum(map(_repeats, penalized)) < sum(map(_repeats, plain)), (plain, penalized)


def test_logit_bias_forces_and_allowed_ids_restrict(server, tokenizer):
    forced = 7052
    ids = _ids(server, "Hello", max_new_tokens=4, ignore_eos=True, logit_bias={str(forced): 100})
    assert ids == [forced] * 4
    allowed = [28, 30, 253]
    ids = _ids(server, "Tell me a story", max_new_tokens=6, ignore_eos=True, do_sample=True, seed=5,
               allowed_token_ids=allowed)
    assert set(ids) <= set(allowed)
    # OpenAI's logit_bias spelling on /v1/completions
    resp = _post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 0,
                                             "logit_bias": {str(forced): 100}, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3
    assert resp.json()["choices"][0]["text"] == tokenizer.decode([forced] * 3)


def test_seeded_request_is_reproducible_alone_and_in_a_batch(server):
    args = dict(max_new_tokens=8, do_sample=True, temperature=1.0, ignore_eos=True)
    alone = _ids(server, "Once upon a time", seed=1234, **args)
    assert alone == _ids(server, "Once upon a time", seed=1234, **args)
    batch = [("Once upon a time", 1234)] + [(f"Story number {i}:", 10 + i) for i in range(16)]
    outs = _many(lambda p, s: _ids(server, p, seed=s, **args), batch)
    assert outs[0] == alone


# ---- stopping ---------------------------------------------------------------------------------------
def _chat_body(content: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, **kw}


def test_stop_string_across_tokens_streaming_and_not(server):
    question = "What is the capital of France?"
    full = _post(server, "/v1/chat/completions", _chat_body(question, max_tokens=12, logprobs=True)).json()
    tokens = [c["token"] for c in full["choices"][0]["logprobs"]["content"]]
    text = full["choices"][0]["message"]["content"]
    # A stop string that starts inside token j and ends inside token j + 1.
    j = next(i for i in range(1, len(tokens) - 1) if len(tokens[i]) >= 2 and len(tokens[i + 1]) >= 2)
    stop = tokens[j][-2:] + tokens[j + 1][:2]
    expected = text[: text.index(stop)]
    body = _chat_body(question, max_tokens=12, stop=[stop])
    out = _post(server, "/v1/chat/completions", body).json()["choices"][0]
    assert (out["message"]["content"], out["finish_reason"]) == (expected, "stop")
    streamed = ""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=TIMEOUT) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                streamed += choice["delta"].get("content", "")
                # Never shown and later cut: the text so far is always a prefix of the final text.
                assert expected.startswith(streamed), (streamed, expected)
    assert streamed == expected


def test_min_new_tokens_masks_eos_and_stop_ids(server, tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say OK."}], tokenize=False,
                                           add_generation_prompt=True)
    short = _ids(server, prompt, max_new_tokens=30, add_special_tokens=False)
    assert short[-1] == tokenizer.eos_token_id and len(short) < 20
    forced = _ids(server, prompt, max_new_tokens=20, min_new_tokens=20, add_special_tokens=False)
    assert len(forced) == 20 and tokenizer.eos_token_id not in forced
    # a stop id is honoured only from min_new_tokens on
    stop_id = short[1]
    out = _ids(server, prompt, max_new_tokens=20, min_new_tokens=3, stop_token_ids=[stop_id], add_special_tokens=False)
    assert len(out) >= 3 and stop_id not in out[:2]


def test_context_caps_max_new_tokens_and_refuses_long_prompts(server):
    resp = _post(server, "/generate", {"inputs": "hi " * (CONTEXT + 10), "parameters": {"max_new_tokens": 4}})
    assert resp.status_code == 400 and "context" in resp.json()["error"], resp.text
    resp = _post(server, "/generate", {"inputs": "hi " * (CONTEXT - 5),
                                       "parameters": {"max_new_tokens": 100, "ignore_eos": True}})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["prompt_tokens"] + out["count_output_tokens"] == CONTEXT and out["finish_reason"] == "length"


# ---- logprobs ---------------------------------------------------------------------------------------
def test_logprobs_match_transformers(server, tokenizer):
    from transformers import AutoModelForCausalLM

    messages = [{"role": "user", "content": "Name a color."}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    out = _post(server, "/generate", {"inputs": prompt, "parameters": {
        "max_new_tokens": 6, "return_details": True, "top_logprobs": 3, "add_special_tokens": False}}).json()
    out_ids = [t["id"] for t in out["tokens"]]
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + out_ids])).logits[0]
    ref = torch.log_softmax(logits[len(prompt_ids) - 1: -1].float(), dim=-1)      # [n, V]
    for j, (tid, token) in enumerate(zip(out_ids, out["tokens"])):
        assert token["logprob"] == pytest.approx(ref[j, tid].item(), abs=2e-3)
        top_vals, _ = ref[j].topk(3)
        assert token["top_logprobs"][0]["id"] == ref[j].argmax().item()
        for alt, v in zip(token["top_logprobs"], top_vals.tolist()):
            assert alt["logprob"] == pytest.approx(v, abs=2e-3)
            assert alt["logprob"] == pytest.approx(ref[j, alt["id"]].item(), abs=2e-3)
    # the chat route renders the same numbers
    data = _post(server, "/v1/chat/completions", _chat_body("Name a color.", max_tokens=6, logprobs=True,
                                                             top_logprobs=3)).json()
    content = data["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx([t["logprob"] for t in out["tokens"]], abs=1e-4)
    assert all(len(c["top_logprobs"]) == 3 for c in content)
    # completions: logprobs=N gives, per token, a dict of its N best alternatives by text; greedy,
    # the best is the token itself
    comp = _post(server, "/v1/completions", {"prompt": "The sky is", "max_tokens": 2, "temperature": 0,
                                             "logprobs": 2}).json()
    lp = comp["choices"][0]["logprobs"]
    assert len(lp["top_logprobs"]) == 2 and all(len(d) == 2 for d in lp["top_logprobs"]), lp
    for text, logprob, alts in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert max(alts, key=alts.get) == text and alts[text] == pytest.approx(logprob, abs=1e-6), lp


def test_echo_and_prompt_logprobs_match_transformers(server, tokenizer):
    from transformers import AutoModelForCausalLM

    prompt = "The quick brown fox jumps over the lazy dog. " * 3 + "Then the fox"
    ids = tokenizer.encode(prompt)
    # Cache the prompt first: a scoring request must still compute (not match) it, or it has no logits.
    assert _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).status_code == 200
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2, "prompt_logprobs": 2}
    data = _post(server, "/v1/completions", body).json()
    choice = data["choices"][0]
    assert choice["text"] == tokenizer.decode(ids) and choice["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 0 and data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)   # [P-1, V]
    want = [ref[j - 1, ids[j]].item() for j in range(1, len(ids))]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=2e-3)
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"][-1] == len(choice["text"]) - len(lp["tokens"][-1])
    for j in range(1, len(ids)):
        assert max(lp["top_logprobs"][j].values()) == pytest.approx(ref[j - 1].max().item(), abs=2e-3)
    # vLLM's prompt_logprobs: the prompt token itself plus the 2 best, keyed by token id
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for j in range(1, len(ids)):
        assert plp[j][str(ids[j])]["logprob"] == pytest.approx(want[j - 1], abs=2e-3)
        ranked = sorted((v["rank"], int(t)) for t, v in plp[j].items() if "rank" in v)
        assert [t for _, t in ranked] == ref[j - 1].topk(2).indices.tolist()
    # echo while generating, streamed: the prompt comes first, then the same tokens as without echo
    plain = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 5,
                                              "temperature": 0}).json()["choices"][0]["text"]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=TIMEOUT,
                      json={"prompt": prompt, "max_tokens": 5, "temperature": 0, "echo": True, "stream": True}) as resp:
        texts = [json.loads(line[6:])["choices"][0]["text"] for line in resp.iter_lines()
                 if line.startswith("data: {")]
    assert texts[0].startswith(tokenizer.decode(ids)) and "".join(texts) == tokenizer.decode(ids) + plain


def test_top_logprobs_above_the_server_limit_is_refused(server):
    resp = _post(server, "/v1/chat/completions", _chat_body("Hi", max_tokens=1, logprobs=True, top_logprobs=6))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "top_logprobs", resp.text


# ---- structured output ------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pets": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                    "maxItems": 3}},
          "required": ["name", "age", "pets"], "additionalProperties": False}


def test_json_schema_outputs_always_validate(server):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}

    def one(seed: int) -> tuple[str, str]:
        body = _chat_body("Describe a person as JSON.", max_tokens=200, temperature=0.9, seed=seed, response_format=fmt)
        resp = _post(server, "/v1/chat/completions", body)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]

    outs = _many(one, [(s,) for s in range(20)])
    for text, reason in outs:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({t for t, _ in outs}) > 1  # sampled, not one canned answer


def test_json_object_regex_and_ebnf(server):
    # Greedy (the chat default samples at temperature 1, which may open objects until max_tokens).
    # (Open-ended greedy JSON from this small model nests forever; this prompt has a short answer.)
    body = _chat_body('Output {"ok": true} as JSON.',
                      max_tokens=100, temperature=0, response_format={"type": "json_object"})
    choice = _post(server, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and isinstance(json.loads(choice["message"]["content"]), dict), choice
    out = _post(server, "/generate", {"inputs": "A phone number:", "parameters": {
        "max_new_tokens": 16, "regular_constraint": r"[0-9]{3}-[0-9]{4}"}}).json()
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out["generated_text"][0]), out
    out = _post(server, "/generate", {"inputs": "Answer yes or no:", "parameters": {
        "max_new_tokens": 8, "guided_grammar": 'root ::= "yes" | "no"'}}).json()
    assert out["generated_text"][0] in ("yes", "no"), out


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"guided_regex": "[a-"}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
def test_bad_grammars_are_openai_errors(server, body, param):
    resp = _post(server, "/v1/chat/completions", _chat_body("Hi", max_tokens=2, **body))
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


# ---- utility routes ---------------------------------------------------------------------------------
def test_tokenize_detokenize_and_model_name(server, tokenizer):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}, timeout=TIMEOUT).json()
    assert ids["tokens"] == tokenizer.encode("Hello world") and ids["count"] == len(ids["tokens"])
    assert ids["max_model_len"] == CONTEXT
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids["tokens"]}, timeout=TIMEOUT).json()
    assert text["prompt"] == "Hello world"
    name = httpx.get(server.url + "/get_model_name", timeout=TIMEOUT).json()["model_name"]
    assert name == httpx.get(server.url + "/v1/models", timeout=TIMEOUT).json()["data"][0]["id"]


# ---- n samples ----------------------------------------------------------------------------------------
def test_n_prefills_the_prompt_once(server, tokenizer):
    words = " ".join(f"w{i}x{(i * 7919) % 1000}" for i in range(40))  # a prompt no earlier test cached
    prompt = f"{words}\nNow write anything you like:"
    prompt_len = len(tokenizer.encode(prompt))
    before = server.metrics()
    resp = _post(server, "/v1/completions", {"prompt": prompt, "n": 4, "max_tokens": 4, "temperature": 1.5,
                                             "seed": 9, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    after = server.metrics()
    assert [c["index"] for c in resp.json()["choices"]] == [0, 1, 2, 3]
    total = after["lightserve_prompt_tokens_total"] - before["lightserve_prompt_tokens_total"]
    cached = after["lightserve_prompt_tokens_cached_total"] - before["lightserve_prompt_tokens_cached_total"]
    assert total == 4 * prompt_len
    assert cached >= 3 * (prompt_len - 1)  # the siblings matched all of the prompt but its last token
    texts = [c["text"] for c in resp.json()["choices"]]
    assert len(set(texts)) > 1, texts  # seeds 9, 10, 11, 12
    out = _post(server, "/generate", {"inputs": prompt, "parameters": {"n": 2, "best_of": 3, "do_sample": True,
                                                                       "max_new_tokens": 3}}).json()
    assert len(out["generated_text"]) == 2
