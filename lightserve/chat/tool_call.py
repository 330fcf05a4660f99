"""A tool call (`ToolCall`), what a parser's step yields (`Parsed`), and `ToolParser`, the base every tool-call
format's parser extends (tool_parsers.py): incremental, with whitespace beside calls held back. `partial_suffix`
is the text helper the tool and reasoning parsers share.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it: a string
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Parsed:
    """What one feed or finish adds: content text and whole tool calls."""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, other: Parsed) -> None:
        self.content += other.content
        self.calls += other.calls


class ToolParser:
    """Base: subclasses turn text into Parsed pieces. Whitespace next to tool calls is not content
    (templates put newlines between calls), so trailing whitespace is held until it is followed by
    more content, and dropped at the end once a call was made."""
    name: ClassVar[str] = ""
    # The text that starts a call; the fallback system prompt shows it (output.with_tool_prompt).
    example: ClassVar[str] = ""

    def __init__(self) -> None:
        self._buf = ""
        self._pending_space = ""
        self.num_calls = 0

    def feed(self, delta: str) -> Parsed:
        self._buf += delta
        return self._step(final=False)

    def finish(self) -> Parsed:
        out = self._step(final=True)
        if self._pending_space and not self.num_calls:
            out.content += self._pending_space
        self._pending_space = ""
        return out

    def parse(self, text: str) -> Parsed:
        out = self.feed(text)
        out.add(self.finish())
        return out

    @classmethod
    def render(cls, calls: list[tuple[str, dict]]) -> str:
        """(name, arguments) calls written as the model writes them: a past assistant turn shown to
        a template that takes no tool_calls. `parse` reads the text back."""
        raise NotImplementedError

    def _step(self, final: bool) -> Parsed:
        raise NotImplementedError

    def _content(self, text: str, out: Parsed) -> None:
        """Show `text` as content, holding its trailing whitespace back."""
        body = text.rstrip()
        if body:
            out.content += self._pending_space + body
            self._pending_space = ""
        self._pending_space += text[len(body):]

    def _calls(self, calls: list[ToolCall], out: Parsed) -> None:
        self._pending_space = ""
        self.num_calls += len(calls)
        out.calls += calls

    def _release(self, calls: list[ToolCall] | None, out: Parsed) -> None:
        """Empty the held text: as `calls` if it parsed into some, else as content."""
        if calls is None:
            self._content(self._buf, out)
        else:
            self._calls(calls, out)
        self._buf = ""


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (it may become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
