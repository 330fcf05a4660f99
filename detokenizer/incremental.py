"""IncrementalDecoder: turns one request's output tokens into text pieces, one piece per token.

Owned by the detokenizer's ReqStream (one per request). Works for any tokenizer with
`decode(ids, skip_special_tokens=...)`: byte-level BPE (GPT-2, SmolLM2, Llama-3, Qwen) and
SentencePiece with byte fallback (Llama-2, Mistral).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"  # what decode shows for bytes that are not (yet) a whole UTF-8 character


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDecoder:
    """Text pieces for a growing token sequence; the pieces concatenate to the full decode.

    The window technique (prefix_offset/read_offset, as in TGI and vLLM): keep a short window of
    ids whose first part (up to the read offset) is text already emitted. Each new token decodes
    the window once; the piece is what the window's text adds beyond the emitted part. When the
    window's text ends in U+FFFD, the last tokens hold a partial UTF-8 character (split over
    byte-level or byte-fallback tokens), so the piece is "" and the tokens stay in the window
    until a later token completes the character. After each emitted piece the window drops every
    token before the old read offset, so decode cost per token is O(window), not O(sequence).

    Why a window instead of decoding single tokens: SentencePiece decoders strip the leading
    space of the first token of each decode call, and byte-level tokens are not text on their
    own. Starting the window with the prompt's last tokens gives the first output token its
    leading space exactly as `decode(prompt + output)` would.
    """

    CONTEXT_TOKENS = 5  # prompt tokens kept as context: enough for any tokenizer's leading-space rule

    def __init__(self, tokenizer: Tokenizer, context_ids: Iterable[int] = (), skip_special_tokens: bool = True):
        self._decode = _decode_fn(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        context = [int(t) for t in context_ids]
        # The window: _ids[:_read_offset] is text already accounted for (context or emitted
        # pieces), _ids[_read_offset:] are tokens whose text is held back.
        self._ids: list[int] = context[-self.CONTEXT_TOKENS:]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode_window(self._read_offset)  # text of _ids[:_read_offset]

    def push(self, token_ids: Iterable[int]) -> list[str]:
        """One piece per token, in order; "" for a token whose text is not final yet."""
        return [self._step(int(t)) for t in token_ids]

    def flush(self) -> str:
        """At the end of the request: the held text, U+FFFD included if a character never completed.

        The pieces and the flush then concatenate to what `decode(context + output)` adds to
        `decode(context)` (to `decode(output)` without context). Exact for byte-level BPE; for
        byte fallback whenever every run of byte tokens is valid UTF-8 (an invalid run decodes
        as one U+FFFD per byte of the whole run, which no incremental decoder can foresee).
        """
        text = self._decode_window(len(self._ids))
        piece = text[len(self._prefix_text):]
        self._ids, self._read_offset, self._prefix_text = [], 0, ""
        return piece

    # ---- internals ----------------------------------------------------------------------------
    def _step(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._decode_window(len(self._ids))
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing visible yet, or a partial character at the end: hold
        piece = text[len(self._prefix_text):]
        # Slide: the text up to the old read offset is final, so the next window starts there.
        # Its text must be decoded afresh (not sliced from `text`): decoders treat the first token
        # of a call differently (SentencePiece strips its leading space).
        del self._ids[:self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode_window(self._read_offset)
        return piece

    def _decode_window(self, end: int) -> str:
        if end == 0:
            return ""
        return self._decode(self._ids[:end], skip_special_tokens=self._skip_special_tokens)


def _decode_fn(tokenizer: Tokenizer) -> Callable[..., str]:
    """`tokenizer.decode`, or the Rust tokenizer's own decode when the HF wrapper would add nothing
    to it but Python overhead (about 4 us of 5.5 per call; hf_tokenizer.raw_decode_is_exact). A Rust
    tokenizer given as such (the detokenizer's cached one) is its own decode."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return tokenizer.decode
    from lightserve.hf_tokenizer import raw_decode_is_exact

    return tokenizer.backend_tokenizer.decode if raw_decode_is_exact(tokenizer) else tokenizer.decode
