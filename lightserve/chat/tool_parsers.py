"""Tool-call parsers: the model's text -> plain content plus OpenAI-style tool calls.

One small class per output format, chosen once by `--tool_call_parser` from `TOOL_PARSERS` (or, with
`auto`, the default, by `choose_tool_parser` from the chat template and the model family). Each
parser is incremental: `feed(delta)` returns what can be shown so far and `finish()` the rest, so a
stream never shows half-parsed markup as content. `parse(text)` is defined as feed + finish, which
makes the streamed pieces concatenate to exactly the non-streamed message (the contract: tool_call.py).
Used by lightserve/chat/output.py, one parser per generated choice.
"""
from __future__ import annotations

import json
from collections.abc import Container
from typing import Any

from lightserve.chat.tool_call import Parsed, ToolCall, ToolParser, partial_suffix


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, between text
    (Hermes 2 Pro, Qwen2.5, Qwen3). Each call is sent as soon as its closing tag arrives."""
    name = "hermes"
    example = '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>'
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    @classmethod
    def render(cls, calls: list[tuple[str, dict]]) -> str:
        return "\n".join(f"{cls.OPEN}\n{_dumps({'name': n, 'arguments': a})}\n{cls.CLOSE}" for n, a in calls)

    def _step(self, final: bool) -> Parsed:
        out = Parsed()
        while self._buf:
            start = self._buf.find(self.OPEN)
            if start < 0:
                keep = 0 if final else partial_suffix(self._buf, self.OPEN)
                self._content(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
                break
            self._content(self._buf[:start], out)
            self._buf = self._buf[start:]
            end = self._buf.find(self.CLOSE)
            if end < 0:
                if final:  # an unclosed call is not a call: the client sees the text
                    self._content(self._buf, out)
                    self._buf = ""
                break
            markup = self._buf[: end + len(self.CLOSE)]
            self._buf = self._buf[end + len(self.CLOSE):]
            call = _call_from(_loads(markup[len(self.OPEN): -len(self.CLOSE)]), "arguments")
            if call is None:
                self._content(markup, out)
            else:
                self._calls([call], out)
        return out


class Llama3JsonParser(ToolParser):
    """Llama 3.1-3.3's JSON calls: the whole output is `{"name": ..., "parameters": {...}}`, several
    separated by `;`, optionally after `<|python_tag|>`. Output that starts otherwise is content;
    output that starts like a call is held to the end and shown as content if it does not parse."""
    name = "llama3_json"
    example = '{"name": "<function name>", "parameters": {<arguments as JSON>}}'
    TAG = "<|python_tag|>"

    @classmethod
    def render(cls, calls: list[tuple[str, dict]]) -> str:
        return "; ".join(_dumps({"name": n, "parameters": a}) for n, a in calls)

    def __init__(self) -> None:
        super().__init__()
        self._mode: str | None = None  # None: undecided; "text"; "call"

    def _step(self, final: bool) -> Parsed:
        out = Parsed()
        if self._mode is None:
            head = self._buf.lstrip()
            if head.startswith(("{", self.TAG)):
                self._mode = "call"
            elif head and not (self.TAG.startswith(head) and not final):
                self._mode = "text"
            elif not final:
                return out
        if self._mode != "call":
            self._content(self._buf, out)
            self._buf = ""
            return out
        if final:
            self._release(_json_calls(self._buf.strip().removeprefix(self.TAG), ";", "parameters"), out)
        return out


class MistralParser(ToolParser):
    """Mistral's `[TOOL_CALLS]` followed by a JSON list of {"name", "arguments"} (v0.3 tokenizers) or
    by `name[ARGS]{...}` (v11+ tokenizers). Text before the marker is content; the calls are held
    to the end. NOTE: `[TOOL_CALLS]` is a special token: serve with skip_special_tokens false."""
    name = "mistral"
    example = '[TOOL_CALLS][{"name": "<function name>", "arguments": {<arguments as JSON>}}]'
    TAG = "[TOOL_CALLS]"

    @classmethod
    def render(cls, calls: list[tuple[str, dict]]) -> str:
        return cls.TAG + _dumps([{"name": n, "arguments": a} for n, a in calls])

    def __init__(self) -> None:
        super().__init__()
        self._in_calls = False

    def _step(self, final: bool) -> Parsed:
        out = Parsed()
        if not self._in_calls:
            start = self._buf.find(self.TAG)
            if start < 0:
                keep = 0 if final else partial_suffix(self._buf, self.TAG)
                self._content(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            self._content(self._buf[:start], out)
            self._buf = self._buf[start:]
            self._in_calls = True
        if final:
            self._release(_mistral_calls(self._buf), out)
        return out


class ForcedCallParser(ToolParser):
    """The output of tool_choice "required" (a JSON list of {"name", "parameters"}) or of a named
    choice (the arguments object of `function`), both produced under a JSON-schema grammar. Held to
    the end; a cut-off output (max_tokens) is shown as content."""
    name = "forced"

    def __init__(self, function: str | None) -> None:
        super().__init__()
        self._function = function

    def _step(self, final: bool) -> Parsed:
        out = Parsed()
        if not final:
            return out
        value = _loads(self._buf)
        if self._function is not None:
            calls = [ToolCall(self._function, json.dumps(value, ensure_ascii=False))] \
                if isinstance(value, dict) else None
        else:
            calls = [_call_from(v, "parameters") for v in value] if isinstance(value, list) and value else None
            if calls is not None and None in calls:
                calls = None
        self._release(calls, out)
        return out


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}
AUTO = "auto"  # --tool_call_parser's default: choose_tool_parser reads the format off the model

# What names a format, first match wins: text in the chat template, a token of the vocabulary, the
# architecture. Qwen's and Hermes' templates write <tool_call>; Llama 3.1+ templates <|python_tag|>
# (Llama 3.0's only the header tokens: its calls are read as 3.1's); Mistral's [TOOL_CALLS].
_TEMPLATE_MARKS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"),
                   ("<|start_header_id|>", "llama3_json"))
_VOCAB_MARKS = (("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"))
_FAMILIES = {"Qwen2ForCausalLM": "hermes", "Qwen3ForCausalLM": "hermes", "Qwen3MoeForCausalLM": "hermes",
             "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mistral"}


def choose_tool_parser(setting: str | None, template: Any, vocab: Container[str],
                       architecture: str | None) -> tuple[str | None, str]:
    """(parser name, why) for `--tool_call_parser`: a named parser as given; for `auto`, the format
    the chat template, the vocabulary or the model family speaks. A ChatML template with no tool
    section (SmolLM2's) gets hermes, which the tool prompt of output.with_tool_prompt then
    describes. None when nothing matches: tool_choice "auto" is refused (400 naming the flag)."""
    if setting != AUTO:
        return setting, "--tool_call_parser"
    source = "\n".join(template.values()) if isinstance(template, dict) else template or ""
    for mark, name in _TEMPLATE_MARKS:
        if mark in source:
            return name, f"the chat template writes {mark}"
    for token, name in _VOCAB_MARKS:
        if token in vocab:
            return name, f"the vocabulary has {token}"
    if architecture in _FAMILIES:
        return _FAMILIES[architecture], f"the model family {architecture}"
    if "<|im_start|>" in source and "tools" not in source:
        return "hermes", "the ChatML template has no tool section (lightserve's tool prompt asks for hermes calls)"
    return None, "no known tool-call format in the chat template, vocabulary or model family"


# ---- helpers ----------------------------------------------------------------------------------------
def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _json_prefix(text: str) -> Any:
    """The JSON value that opens `text`, ignoring what follows (an end-of-turn token's text)."""
    try:
        return json.JSONDecoder().raw_decode(text)[0]
    except ValueError:
        return None


def _call_from(obj: Any, args_key: str) -> ToolCall | None:
    """A ToolCall from {"name": str, args_key (or "arguments"): object}; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = _loads(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_calls(text: str, separator: str, args_key: str) -> list[ToolCall] | None:
    """Calls written as JSON objects one after another, separated by `separator` and whitespace."""
    decoder, pos, calls = json.JSONDecoder(), 0, []
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == separator):
            pos += 1
        if pos == len(text):
            return calls or None
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        call = _call_from(obj, args_key)
        if call is None:
            return None
        calls.append(call)


def _mistral_calls(text: str) -> list[ToolCall] | None:
    calls: list[ToolCall] = []
    for piece in text.split(MistralParser.TAG)[1:]:
        piece = piece.strip()
        if piece.startswith("["):
            value = _json_prefix(piece)
            found = [_call_from(v, "arguments") for v in value] if isinstance(value, list) else [None]
        else:
            name, sep, args = piece.partition("[ARGS]")
            found = [_call_from({"name": name.strip(), "arguments": _json_prefix(args.strip())}, "arguments")] \
                if sep else [None]
        if not found or None in found:
            return None
        calls += found
    return calls or None
