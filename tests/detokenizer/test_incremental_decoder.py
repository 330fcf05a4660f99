"""IncrementalDecoder against full decode, on byte-level BPE (SmolLM2) and SentencePiece-style
byte fallback: random ids, split multi-byte characters, special tokens, prompt context."""
from __future__ import annotations

import random
import re

import pytest

from lightserve.detokenizer.incremental import REPLACEMENT_CHAR, IncrementalDecoder

ADVERSARIAL_TEXTS = [
    "Hello world 😀 你好",
    "👩‍👩‍👧‍👦 family, 🇯🇵 flag, e\u0301 combining",
    "中文测试：汉字、標點。日本語のテキスト",
    "€100 → ∑ x² ≠ ∞ ✓",
    "code:\n\tdef f(x):\n\t\treturn x  # ünïcödé\n",
    "   leading and trailing spaces   ",
]
SMOL_SPECIAL_IDS = list(range(17))  # <|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>, ...


def decode_incrementally(tokenizer, ids, skip, context=()):
    decoder = IncrementalDecoder(tokenizer, context, skip_special_tokens=skip)
    pieces = decoder.push(ids)
    return pieces, decoder.flush()


def expected_text(tokenizer, ids, skip, context=()):
    context = list(context)[-IncrementalDecoder.CONTEXT_TOKENS:]
    full = tokenizer.decode(context + list(ids), skip_special_tokens=skip)
    head = tokenizer.decode(context, skip_special_tokens=skip) if context else ""
    assert full.startswith(head)
    return full[len(head):]


def check_matches_decode(tokenizer, ids, skip, context=()):
    pieces, tail = decode_incrementally(tokenizer, ids, skip, context)
    want = expected_text(tokenizer, ids, skip, context)
    assert len(pieces) == len(ids)
    assert "".join(pieces) + tail == want
    if REPLACEMENT_CHAR not in want:
        assert not any(REPLACEMENT_CHAR in p for p in pieces) and tail == ""


def check_eager_per_byte(tokenizer, text, byte_ids):
    """One token per UTF-8 byte: each character appears whole with the token that completes it."""
    data = text.encode()
    pieces = IncrementalDecoder(tokenizer, skip_special_tokens=True).push(byte_ids)
    for j in range(len(data)):
        assert "".join(pieces[: j + 1]) == data[: j + 1].decode("utf-8", errors="ignore"), j
    assert not any(REPLACEMENT_CHAR in p for p in pieces)


# ---- byte-level BPE: SmolLM2 -----------------------------------------------------------------------
@pytest.mark.parametrize("skip", [True, False])
def test_smol_random_ids_match_decode(smol_tokenizer, skip):
    rng = random.Random(0)
    vocab = len(smol_tokenizer)
    for _ in range(40):
        ids = [rng.choice(SMOL_SPECIAL_IDS) if rng.random() < 0.1 else rng.randrange(vocab)
               for _ in range(rng.randrange(1, 40))]
        check_matches_decode(smol_tokenizer, ids, skip)


@pytest.mark.parametrize("skip", [True, False])
def test_smol_adversarial_texts_match_decode(smol_tokenizer, skip):
    for text in ADVERSARIAL_TEXTS:
        ids = smol_tokenizer.encode(text, add_special_tokens=False)
        check_matches_decode(smol_tokenizer, ids, skip)
        check_matches_decode(smol_tokenizer, [1] + ids + [2, 0], skip)  # <|im_start|> ... <|im_end|>
        assert "".join(decode_incrementally(smol_tokenizer, ids, skip)[0]) == text  # nothing held at the end


def test_smol_multibyte_split_over_byte_tokens(smol_tokenizer):
    byte_token_ids = _gpt2_byte_token_ids(smol_tokenizer)
    for text in ADVERSARIAL_TEXTS:
        check_eager_per_byte(smol_tokenizer, text, [byte_token_ids[b] for b in text.encode()])


def test_smol_emoji_piece_comes_with_completing_token(smol_tokenizer):
    ids = smol_tokenizer.encode("a 😀", add_special_tokens=False)
    pieces = IncrementalDecoder(smol_tokenizer).push(ids)
    # ' \xf0\x9f' then '\x98\x80': the space waits with the partial emoji (one token's text).
    assert pieces[-2:] == ["", " 😀"] and "".join(pieces) == "a 😀"


def test_smol_special_tokens_skip_on_and_off(smol_tokenizer):
    ids = smol_tokenizer.encode("Hi there", add_special_tokens=False) + [2]
    assert "".join(IncrementalDecoder(smol_tokenizer, skip_special_tokens=True).push(ids)) == "Hi there"
    pieces = IncrementalDecoder(smol_tokenizer, skip_special_tokens=False).push(ids)
    assert pieces[-1] == "<|im_end|>"


def test_smol_with_prompt_context(smol_tokenizer):
    rng = random.Random(1)
    for text in ADVERSARIAL_TEXTS:
        ids = smol_tokenizer.encode(text, add_special_tokens=False)
        k = rng.randrange(1, len(ids))
        if REPLACEMENT_CHAR in smol_tokenizer.decode(ids[:k]):
            continue  # the prompt would end inside a character: not a real prompt
        check_matches_decode(smol_tokenizer, ids[k:], True, context=ids[:k])


def test_decode_window_stays_short(smol_tokenizer):
    calls = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return smol_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = smol_tokenizer.encode("word " * 500, add_special_tokens=False)
    IncrementalDecoder(Counting(), ids[:10]).push(ids)
    assert max(calls) <= IncrementalDecoder.CONTEXT_TOKENS + 2  # O(window), not O(sequence)
    assert len(calls) <= 2 * len(ids) + 1


# ---- SentencePiece-style byte fallback ------------------------------------------------------------
@pytest.mark.parametrize("skip", [True, False])
def test_sp_texts_match_decode(sp_tokenizer, skip):
    for text in ADVERSARIAL_TEXTS + ["Hello world, this is the lazy fox.", "café naïve 你好 世界"]:
        ids = sp_tokenizer.encode(text, add_special_tokens=False).ids
        check_matches_decode(sp_tokenizer, ids, skip)
        check_matches_decode(sp_tokenizer, [1] + ids + [2], skip)


@pytest.mark.parametrize("skip", [True, False])
def test_sp_random_ids(sp_tokenizer, skip):
    """Random byte-fallback runs are often invalid UTF-8. A clean full decode must be matched
    exactly; one with U+FFFD as the stream contract allows (check_invalid_byte_runs)."""
    rng = random.Random(2)
    vocab = sp_tokenizer.get_vocab_size()
    num_invalid = 0
    for _ in range(40):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        pieces, tail = decode_incrementally(sp_tokenizer, ids, skip)
        want = sp_tokenizer.decode(ids, skip_special_tokens=skip)
        assert len(pieces) == len(ids)
        if REPLACEMENT_CHAR in want:
            num_invalid += 1
            check_invalid_byte_runs(sp_tokenizer, ids, pieces, tail, want)
        else:
            assert "".join(pieces) == want and tail == ""
    assert num_invalid >= 10, "too few invalid byte runs to test their handling"


def check_invalid_byte_runs(tokenizer, ids, pieces, tail, want):
    """ByteFallback shows every byte of an invalid run as U+FFFD, including bytes that formed a whole
    character when they arrived; a stream cannot take back a character it has emitted, so it cannot
    equal that decode (IncrementalDecoder.flush). What it must do instead:
    - no piece ends in U+FFFD: a partial character is held, never shown;
    - outside the invalid runs (the U+FFFD stretches of the full decode) the text is exactly the
      full decode's;
    - each invalid run shows at least one U+FFFD (the bad bytes are never dropped silently), and its
      other characters are whole characters made of the run's own bytes: together, in order, a
      subsequence of the bytes of the sequence's byte tokens."""
    assert not any(p.endswith(REPLACEMENT_CHAR) for p in pieces), pieces
    got = "".join(pieces) + tail
    parts = re.split(f"({REPLACEMENT_CHAR}+)", want)
    pattern = "".join(f"(.*?{REPLACEMENT_CHAR}.*?)" if p.startswith(REPLACEMENT_CHAR) else re.escape(p)
                      for p in parts)
    m = re.fullmatch(pattern, got, re.DOTALL)
    assert m, (got, want)
    shown = "".join(m.groups()).replace(REPLACEMENT_CHAR, "").encode()
    byte_values = bytes(int(t[3:5], 16) for t in map(tokenizer.id_to_token, ids) if re.fullmatch(r"<0x[0-9A-F]{2}>", t))
    rest = iter(byte_values)
    assert all(b in rest for b in shown), (shown, byte_values)


def test_sp_random_ids_without_bytes_match_decode(sp_tokenizer):
    rng = random.Random(3)
    words = [i for t, i in sp_tokenizer.get_vocab().items() if not t.startswith("<0x")]
    for _ in range(40):
        ids = [rng.choice(words) for _ in range(rng.randrange(1, 30))]
        check_matches_decode(sp_tokenizer, ids, skip=rng.random() < 0.5)


def test_sp_multibyte_split_over_byte_tokens(sp_tokenizer):
    vocab = sp_tokenizer.get_vocab()
    for text in ["😀你好€", "naïve 👩‍👧 ✓"]:
        check_eager_per_byte(sp_tokenizer, text, [vocab[f"<0x{b:02X}>"] for b in text.encode()])


def test_sp_leading_space_from_context(sp_tokenizer):
    prompt = sp_tokenizer.encode("Hello", add_special_tokens=False).ids
    output = sp_tokenizer.encode("Hello world", add_special_tokens=False).ids[len(prompt):]
    # Decoded alone, SentencePiece strips the first token's space; after the prompt it keeps it.
    assert "".join(IncrementalDecoder(sp_tokenizer).push(output)) == "world"
    assert "".join(IncrementalDecoder(sp_tokenizer, prompt).push(output)) == " world"
    check_matches_decode(sp_tokenizer, output, True, context=prompt)


def test_sp_through_transformers_wrapper(sp_tokenizer):
    # The HF wrapper's decode is bypassed for the Rust one (_decode_fn); the text must not change.
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_object=sp_tokenizer)
    prompt = hf.encode("Hello world", add_special_tokens=False)
    for text in ADVERSARIAL_TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        check_matches_decode(hf, [1] + ids + [2], skip=False)
        check_matches_decode(hf, ids, skip=True, context=prompt)


def _gpt2_byte_token_ids(tokenizer) -> dict[int, int]:
    """Byte value -> id of the single-byte token, via GPT-2's byte-to-unicode table. SmolLM2 lacks
    the bytes UTF-8 never uses (0xC0, 0xC1, 0xF5-0xFF) and a few control characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    vocab = tokenizer.get_vocab()
    return {b: vocab[c] for b, c in chars.items() if c in vocab}
