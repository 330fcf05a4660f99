"""Every family the registry added beyond Llama, served by a real server on a tiny random checkpoint
(tests/model/tiny_models.py: sliding-window layers of 8-16 tokens beside global ones, soft-capping, longrope;
Mixtral and Qwen3-MoE with 4 experts, top-2, one dense Qwen3-MoE layer; DeepSeek-V3's latent attention over its
latent KV cache, grouped sigmoid routing and a shared expert), greedy outputs checked against transformers' float32
logits by teacher forcing: each chosen token's logit is within 1e-3 of its row's maximum. Prompts run past the
window; the KV cache is small enough that a batch pauses and resumes; a follow-up prompt hits the prefix cache
past the window. The start-up log gives the KV bytes per token of the family's cache. One server per family;
DeepSeek-V3's speculates with its multi-token-prediction layer."""
from __future__ import annotations

import asyncio
import re
import shutil

import aiohttp
import pytest
import torch

from tests.e2e.server import MODEL_DIR, ServerProc, wait_until
from tests.model.tiny_models import make_mtp_checkpoint, make_tiny_model

# Mistral's window runs the same windowed Llama forward as Phi-3 here; tests/model checks it against transformers.
FAMILIES = ["gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe", "deepseek_v3"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
LOGIT_GAP = 1e-3
NEW_TOKENS = 40
# KV rows for ~5 of the 8 requests below at full length, while admission expects 70% of their outputs:
# the batch must pause some and resume them.
KV_TOKENS = 300
TIMEOUT = aiohttp.ClientTimeout(total=600)
FLOAT32_BYTES = 4
WORDS = ("river stone apple window quiet seven orange bright table music cloud paper garden silver "
         "engine forest candle winter yellow bridge").split()


def _prompt(i: int, num_words: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(num_words)) + f" {i}"


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(server, transformers model, tokenizer) of one family; SmolLM2's tokenizer, so its vocabulary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp(request.param) / "model"
    # DeepSeek-V3's checkpoint holds an MTP layer, and its server speculates with it (--speculative_algorithm mtp):
    # the same checks hold with drafts accepted and rejected under pauses, resumes and prefix-cache hits.
    mtp = request.param == "deepseek_v3"
    model_dir = make_mtp_checkpoint(folder, vocab_size=49152) if mtp else \
        make_tiny_model(request.param, folder, vocab_size=49152)
    for name in TOKENIZER_FILES:
        if (MODEL_DIR / name).exists():
            shutil.copy(MODEL_DIR / name, model_dir / name)
    log = model_dir.parent / "server.log"
    srv = ServerProc("--model_dir", str(model_dir), "--data_type", "float32", "--max_total_token_num",
                     str(KV_TOKENS), "--chunked_prefill_size", "24",
                     *(("--speculative_algorithm", "mtp", "--num_speculative_tokens", "3") if mtp else ()),
                     log_path=log)
    try:
        # The reference loads while the server starts (a start leaves this process's core partly idle).
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        srv.wait_ready()
        yield srv, hf, tokenizer
    finally:
        srv.stop()


async def _generate(session, url: str, prompt: str) -> dict:
    async with session.post(url + "/generate", json={"inputs": prompt, "parameters": {
            "max_new_tokens": NEW_TOKENS, "ignore_eos": True, "return_details": True}}) as resp:
        data = await resp.json()
        assert resp.status == 200, data
        return data


def _run(url: str, prompts: list[str]) -> list[dict]:
    async def go():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            return await asyncio.gather(*[_generate(session, url, p) for p in prompts])
    return asyncio.run(go())


def _logit_gap_problem(hf, prompt_ids: list[int], got: list[int]) -> str | None:
    """None when each of our tokens' logit, in transformers' teacher-forced float32 logits, is within
    LOGIT_GAP of its row's maximum."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + got])).logits[0, len(prompt_ids) - 1: -1].float()  # [n, V]
    gaps = logits.max(-1).values - logits.gather(1, torch.tensor(got)[:, None])[:, 0]  # [n]
    worst = int(gaps.argmax())
    if gaps[worst] > LOGIT_GAP:
        return f"token {worst}: got {got[worst]}, {float(gaps[worst]):.3g} below transformers' maximum"
    return None


def _check(hf, tokenizer, prompt: str, result: dict) -> None:
    got = [t["id"] for t in result["tokens"]]
    assert len(got) == NEW_TOKENS
    prompt_ids = tokenizer(prompt)["input_ids"]
    problem = _logit_gap_problem(hf, prompt_ids, got)
    assert problem is None, f"{problem}\nprompt of {len(prompt_ids)} tokens {prompt!r}"


@pytest.mark.timeout(900)
def test_greedy_past_the_window_with_pauses_matches_transformers(family):
    srv, hf, tokenizer = family
    prompts = [_prompt(i, 10 + 3 * i) for i in range(8)]  # 11 to 32 tokens: all past the window
    before = srv.metrics()
    results = _run(srv.url, prompts)
    after = srv.metrics()
    assert after["lightserve_pauses_total"] > before["lightserve_pauses_total"]
    assert after["lightserve_resumes_total"] > before["lightserve_resumes_total"]
    for prompt, result in zip(prompts, results):
        _check(hf, tokenizer, prompt, result)
    assert wait_until(lambda: srv.metrics()["lightserve_requests_running"] == 0, 30)
    if hf.config.model_type == "deepseek_v3":  # the MTP layer proposed drafts
        assert srv.metrics()["lightserve_spec_draft_tokens_total"] > 0


@pytest.mark.timeout(600)
def test_prefix_cache_hit_past_the_window_matches_transformers(family):
    srv, hf, tokenizer = family
    shared = _prompt(100, 40)
    first, = _run(srv.url, [shared])
    _check(hf, tokenizer, shared, first)
    follow = shared + " " + _prompt(101, 6)
    second, = _run(srv.url, [follow])
    assert second["prompt_cache_len"] >= 32  # the shared prompt's KV, past every window, came from the cache
    _check(hf, tokenizer, follow, second)


def _kv_bytes_per_token(config) -> int:
    """What one token's KV takes over all layers, from transformers' config of the model (float32)."""
    if config.model_type == "deepseek_v3":  # one latent row per layer: normalized latents + roped key dims
        return (config.kv_lora_rank + config.qk_rope_head_dim) * FLOAT32_BYTES * config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_key_value_heads * head_dim * FLOAT32_BYTES * config.num_hidden_layers  # K and V


def test_start_up_log_gives_the_kv_bytes_per_token(family):
    srv, hf, _ = family
    logged = re.search(r"KV cache: (\w+) of (\d+) tokens, (\d+) bytes per token", srv.log_path.read_text())
    assert logged is not None, srv.log_tail()
    cache, tokens, per_token = logged.group(1), int(logged.group(2)), int(logged.group(3))
    assert cache == ("LatentKVCache" if hf.config.model_type == "deepseek_v3" else "KVCache")
    assert tokens == KV_TOKENS and per_token == _kv_bytes_per_token(hf.config)
