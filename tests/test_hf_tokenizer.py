"""lightserve/hf_tokenizer.py: load_tokenizer gives the tokenizer AutoTokenizer gives (its class, vocabulary, special
tokens, chat template, encodings and decodings) for folders that name their class and for those that take the
fallback; load_decoder's cached Rust tokenizer decodes (and streams through the detokenizer's IncrementalDecoder)
exactly as that tokenizer does, is keyed by the folder's files, is loaded around when damaged, and is never written
for a tokenizer whose decode transformers changes; in a fresh process both skip what they are there to skip (the
config class; transformers itself)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import tokenizers
from transformers import AutoTokenizer

from lightserve.detokenizer.incremental import IncrementalDecoder
from lightserve.hf_tokenizer import load_decoder, load_tokenizer
from tests.e2e.server import MODEL_DIR

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnew lines", "<|im_start|>user\nWhat is 12 * 7?<|im_end|>",
         "naïve café, 東京, emoji 🚀", "def f(x):\n    return x ** 2"]


def _folder(tmp_path, model_type: str, tokenizer_config: dict):
    out = tmp_path / "model"
    out.mkdir()
    shutil.copy(MODEL_DIR / "tokenizer.json", out / "tokenizer.json")
    base = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    base.pop("tokenizer_class", None)
    (out / "tokenizer_config.json").write_text(json.dumps({**base, **tokenizer_config}))
    (out / "config.json").write_text(json.dumps({"model_type": model_type, "vocab_size": 49152}))
    return out


@pytest.mark.parametrize("model_type,tokenizer_config", [
    ("llama", {"tokenizer_class": "TokenizersBackend"}),
    ("qwen3", {"tokenizer_class": "Qwen2Tokenizer", "clean_up_tokenization_spaces": True}),
    ("mixtral", {}),                                      # no tokenizer_class: AutoTokenizer's own path
], ids=["backend", "qwen-class-cleanup", "no-class"])
def test_same_tokenizer_as_auto_tokenizer(tmp_path, model_type, tokenizer_config):
    folder = _folder(tmp_path, model_type, tokenizer_config)
    ours, ref = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert type(ours) is type(ref)
    assert ours.get_vocab() == ref.get_vocab()
    assert ours.all_special_tokens == ref.all_special_tokens and ours.eos_token == ref.eos_token
    assert ours.chat_template == ref.chat_template
    assert ours.clean_up_tokenization_spaces == ref.clean_up_tokenization_spaces
    for text in TEXTS:
        ids = ref.encode(text)
        assert ours.encode(text) == ids
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenizers"


def _entries(cache) -> list:
    return sorted(cache.glob("*.json")) if cache.exists() else []


def test_cached_decoder_decodes_and_streams_as_the_tokenizer(tmp_path, cache):
    folder = _folder(tmp_path, "llama", {"tokenizer_class": "TokenizersBackend"})
    first = load_decoder(folder)                    # no entry yet: transformers' tokenizer, which writes one
    assert not isinstance(first, tokenizers.Tokenizer) and len(_entries(cache)) == 1
    cached = load_decoder(folder)
    assert isinstance(cached, tokenizers.Tokenizer)
    ref = AutoTokenizer.from_pretrained(folder)
    specials = ref.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    for text in TEXTS:
        ids = ref.encode(text) + specials
        for skip in (False, True):
            assert cached.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
        context, output = ids[:3], ids[3:]
        streams = []
        for tok in (cached, ref):
            dec = IncrementalDecoder(tok, context)
            streams.append(dec.push(output) + [dec.flush()])
        assert streams[0] == streams[1]
        # The pieces add to the context's text what decoding context + output at once adds (byte-level BPE).
        full, head = (ref.decode(seq, skip_special_tokens=True) for seq in (ids, context))
        assert full.startswith(head) and "".join(streams[0]) == full[len(head):]
    # Another tokenizer file is another key: the entry of the old files is not used for it.
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    assert not isinstance(load_decoder(folder), tokenizers.Tokenizer) and len(_entries(cache)) == 2
    # A damaged entry is loaded around, as if there were none.
    for entry in _entries(cache):
        entry.write_text("{not json")
    assert load_decoder(folder).decode(ids) == ref.decode(ids)


@pytest.mark.parametrize("model_type,tokenizer_config", [
    ("llama", {"tokenizer_class": "TokenizersBackend", "clean_up_tokenization_spaces": True}),
    ("codegen", {"tokenizer_class": "CodeGenTokenizer"}),      # a class with a decode of its own
], ids=["cleanup-on", "own-decode"])
def test_no_entry_for_a_tokenizer_whose_decode_transformers_may_change(tmp_path, cache, model_type,
                                                                        tokenizer_config):
    folder = _folder(tmp_path, model_type, tokenizer_config)
    load_tokenizer(folder)
    assert _entries(cache) == []
    decoder = load_decoder(folder)
    assert type(decoder) is type(AutoTokenizer.from_pretrained(folder)) and _entries(cache) == []


def test_fresh_processes_skip_the_config_class_and_transformers(cache):
    """The bundled model's folder: load_tokenizer never imports its LlamaConfig module (it pulls in transformers'
    model loading and torch.distributed, most of the load's time), and once it has run, load_decoder in another
    process imports no transformers (nor torch) at all."""
    code = ("import sys; from lightserve.hf_tokenizer import {fn}; "
            f"tok = {{fn}}({str(MODEL_DIR)!r}); assert tok.decode([42]); "
            "print(sorted(m for m in ('transformers', 'torch', 'transformers.models.llama.configuration_llama') "
            "if m in sys.modules))")
    env = {**os.environ, "LIGHTSERVE_CACHE": str(cache.parent)}

    def run(fn: str) -> str:
        out = subprocess.run([sys.executable, "-c", code.format(fn=fn)], capture_output=True, text=True, timeout=120,
                             check=True, env=env)
        return out.stdout.strip()

    assert run("load_tokenizer") == "['torch', 'transformers']"
    assert len(_entries(cache)) == 1
    assert run("load_decoder") == "[]"
