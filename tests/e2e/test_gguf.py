"""A GGUF checkpoint served by a real server: a tiny random Qwen2 written by lightserve.engine.gguf_export (Q8_0, Q4_0,
Q5_1, Q4_1 across its tensors, an untied output layer) in a folder with its HF config and the bundled model's
tokenizer files (the default model's server reads them from its GGUF metadata; tests/model checks that reading, and
the tensor-parallel shards of packed weights). /v1/completions' greedy text equals transformers' greedy generation
over the same weights dequantized by transformers' own GGUF loader, for concurrent requests; a repeated prefix is
served from the prefix cache; the served name is the file's stem."""
from __future__ import annotations

import asyncio
import json
import shutil

import aiohttp
import pytest
import torch

from lightserve.engine.gguf_export import export_gguf
from tests.e2e.server import MODEL_DIR, ServerProc, bundled_tokenizer
from tests.model.tiny_models import make_tiny_model

TYPES = "attn_q=Q8_0,attn_k=Q4_0,attn_v=Q5_1,ffn=Q4_1,*=Q8_0"
NEW_TOKENS = 12
PROMPTS = ["river stone apple window", "The quick brown fox jumps over", "1 2 3 4 5 6", "quiet seven orange bright"]
TIMEOUT = aiohttp.ClientTimeout(total=600)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, transformers model over the dequantized GGUF)."""
    import transformers
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("gguf")
    hf_dir = make_tiny_model("qwen2", root / "hf", vocab_size=49152)
    folder = root / "model"
    folder.mkdir()
    config = json.loads((hf_dir / "config.json").read_text())
    # No tokenizer.* fields: the server reads the HF files beside the file, and transformers' GGUF reader would take
    # 8 s over a 49k-token vocabulary it does not need for the weights.
    path = export_gguf(load_file(hf_dir / "model.safetensors"), config, folder / "tiny-qwen2.Q8_mix.gguf", TYPES)
    for name in ("config.json", *TOKENIZER_FILES):
        shutil.copy(hf_dir / name if name == "config.json" else MODEL_DIR / name, folder / name)
    shutil.rmtree(hf_dir)
    srv = ServerProc("--model_dir", str(folder), "--data_type", "float32", log_path=root / "server.log")
    try:  # the reference loads while the server starts
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=path.name, dtype=torch.float32).eval()
        yield srv.wait_ready(), hf
    finally:
        srv.stop()


async def _complete(session, url: str, prompt: str) -> dict:
    async with session.post(url + "/v1/completions", json={
            "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}) as resp:
        data = await resp.json()
        assert resp.status == 200, data
        return data


def _run(url: str, prompts: list[str]) -> list[dict]:
    async def go():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            return await asyncio.gather(*[_complete(session, url, p) for p in prompts])
    return asyncio.run(go())


def _hf_greedy_text(hf, prompt: str) -> str:
    tok = bundled_tokenizer()
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:])


def test_concurrent_greedy_completions_match_transformers(served):
    srv, hf = served
    for prompt, out in zip(PROMPTS, _run(srv.url, PROMPTS)):
        assert out["model"] == "tiny-qwen2.Q8_mix"
        assert out["usage"]["completion_tokens"] == NEW_TOKENS
        assert out["choices"][0]["text"] == _hf_greedy_text(hf, prompt), prompt


def test_repeated_prefix_is_served_from_the_cache(served):
    srv, hf = served
    prefix = " ".join(PROMPTS * 3)
    _run(srv.url, [prefix + " garden"])
    out, = _run(srv.url, [prefix + " silver"])
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(bundled_tokenizer().encode(prefix)) - 1
    assert out["choices"][0]["text"] == _hf_greedy_text(hf, prefix + " silver")
