"""Reasoning parsers: split a reasoning model's output into `reasoning_content` and `content`.

Chosen once by `--reasoning_parser` from `REASONING_PARSERS`; one instance per generated choice,
fed incrementally like the tool parsers (lightserve/chat/tool_parsers.py), so a stream never shows a
partial `<think>` tag and the streamed pieces concatenate to the non-streamed message.
"""
from __future__ import annotations

from typing import ClassVar

from lightserve.chat.tool_call import partial_suffix


class ThinkParser:
    """`<think>reasoning</think>answer`. Qwen3 writes the opening tag itself (unless its template
    already put it at the end of the prompt); DeepSeek-R1's template always ends the prompt with
    `<think>`, so its output starts inside the reasoning."""
    name: ClassVar[str] = "qwen3"
    always_starts_inside: ClassVar[bool] = False
    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, prompt: str) -> None:
        # Where the output starts when it does not open with <think> itself.
        self._starts_inside = self.always_starts_inside or prompt.rstrip().endswith(self.OPEN)
        self._inside: bool | None = None  # None: not yet known whether the output opens with <think>
        self._buf = ""
        self._skip_newlines = False  # templates put "\n\n" after </think>: not part of the answer

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) that `delta` completes."""
        self._buf += delta
        return self._step(final=False)

    def finish(self) -> tuple[str, str]:
        return self._step(final=True)

    def parse(self, text: str) -> tuple[str, str]:
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return r1 + r2, c1 + c2

    def _step(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self._inside is None:
            head = self._buf.lstrip()
            if head.startswith(self.OPEN):
                self._buf, self._inside = head[len(self.OPEN):], True
            elif final or not self.OPEN.startswith(head):
                self._inside = self._starts_inside
            else:
                return "", ""
        if self._inside:
            end = self._buf.find(self.CLOSE)
            if end < 0:
                keep = 0 if final else partial_suffix(self._buf, self.CLOSE)
                reasoning, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return reasoning, ""
            reasoning, self._buf = self._buf[:end], self._buf[end + len(self.CLOSE):]
            self._inside, self._skip_newlines = False, True
        if self._skip_newlines:
            self._buf = self._buf.lstrip("\n")
            if not self._buf and not final:
                return reasoning, ""
            self._skip_newlines = False
        content, self._buf = self._buf, ""
        return reasoning, content


class DeepSeekR1Parser(ThinkParser):
    name = "deepseek_r1"
    always_starts_inside = True


REASONING_PARSERS: dict[str, type[ThinkParser]] = {p.name: p for p in (ThinkParser, DeepSeekR1Parser)}
