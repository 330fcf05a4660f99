"""scripts/make_bench_gguf.py on a tiny Llama config (a second): the Q4_K_M-style types per tensor, the HF folder
read back from the GGUF (q/k rows in HF order, the safetensors file streamed) equal to the random weights quantized
and dequantized in place, the same random weights on every read, skipping what is there, and --only's check."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import pytest
import safetensors.torch as safetensors_torch
import torch

from lightserve.engine.gguf_export import export_gguf, quantize

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_bench_gguf.py"
TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True, "max_position_embeddings": 256}


@pytest.fixture(scope="module")
def mbg():
    spec = importlib.util.spec_from_file_location("make_bench_gguf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_folder_holds_the_gguf_weights_in_hf_order(mbg, tmp_path: Path) -> None:
    weights = mbg.RandomLlama(TINY)
    assert torch.equal(weights["model.layers.0.mlp.up_proj.weight"], weights["model.layers.0.mlp.up_proj.weight"])
    assert "lm_head.weight" not in weights and torch.equal(weights["model.norm.weight"], torch.ones(256))
    rule = mbg.q4_k_m_rule()
    path = tmp_path / "tiny.gguf"
    mbg.write_file(path, lambda tmp: export_gguf(weights, TINY, tmp, rule), force=False)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["token_embd.weight"] == types["blk.0.attn_v.weight"] == types["blk.0.ffn_down.weight"] == "Q6_K"
    assert types["blk.0.attn_q.weight"] == types["blk.0.attn_output.weight"] == types["blk.0.ffn_up.weight"] == "Q4_K"
    assert types["blk.0.attn_norm.weight"] == "F32" and "output.weight" not in types
    hf = tmp_path / "tiny-hf"
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    mbg.write_folder(hf, lambda tmp: mbg.write_hf_folder(path, TINY, list(weights), tok, tmp), force=False)
    assert {p.name for p in hf.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json"}
    loaded = safetensors_torch.load_file(hf / "model.safetensors")
    assert set(loaded) == set(weights)
    gguf_of = {v: k for k, v in mbg.hf_name_map(TINY, list(weights)).items()}
    for name, got in loaded.items():
        # Quantization works within rows, so quantizing in HF row order gives the same rows as the file's.
        qtype = rule(gguf_of[name], tuple(got.shape))
        want = gguf.quants.dequantize(quantize(weights[name], qtype), qtype)
        assert torch.equal(got, torch.from_numpy(want.reshape(got.shape))), name
    # Both are there now: a second call writes nothing.
    mbg.write_file(path, lambda tmp: pytest.fail("rewrote the file"), force=False)
    mbg.write_folder(hf, lambda tmp: pytest.fail("rewrote the folder"), force=False)


def test_only_names_known_targets(mbg, capsys) -> None:
    with pytest.raises(SystemExit):
        mbg.main(["--only", "llama1b-q4_k_m,llama3-q2_k"])
    assert "unknown ['llama3-q2_k']" in capsys.readouterr().err
