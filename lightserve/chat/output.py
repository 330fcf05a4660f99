"""What a chat request's tools ask of the model, and how its output is read back.

`plan_tools` checks `tools`/`tool_choice`/`parallel_tool_calls` and decides the prompt's tool list
and, for tool_choice "required" or a named function, the JSON schema the output is held to (so the
call always parses). `ChatOutput` splits one choice's text, incrementally, into reasoning, content
and tool calls. Used by openai_api.py (chat completions) and responses_api.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from lightserve.chat.reasoning_parsers import REASONING_PARSERS
from lightserve.chat.tool_call import Parsed, ToolParser
from lightserve.chat.tool_parsers import TOOL_PARSERS, ForcedCallParser
from lightserve.sampling import ParamError


class ToolMode(Enum):
    NONE = "none"          # no tools given, or tool_choice "none": the model answers in text
    AUTO = "auto"          # the model may call; the tool parser reads the calls out of its text
    REQUIRED = "required"  # grammar: a JSON list of {"name", "parameters"}, at least one
    NAMED = "named"        # grammar: the arguments object of one function


@dataclass(frozen=True)
class ToolPlan:
    mode: ToolMode = ToolMode.NONE
    tools: list[dict] = field(default_factory=list)  # OpenAI's {"type": "function", "function": {...}}
    function: str | None = None                      # the named choice
    parallel: bool = True

    @property
    def prompt_tools(self) -> list[dict] | None:
        """The tools the chat template is given (none under tool_choice "none", as vLLM does)."""
        return self.tools if self.mode is not ToolMode.NONE else None

    def grammar_schema(self) -> dict | None:
        """The JSON schema that forces the call, or None when the model writes freely."""
        params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}
        if self.mode is ToolMode.NAMED:
            return params[self.function]
        if self.mode is not ToolMode.REQUIRED:
            return None
        items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                  "required": ["name", "parameters"]} for name, schema in params.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema


def plan_tools(tools: Any, tool_choice: Any, parallel: Any, parser_name: str | None) -> ToolPlan:
    """The request's tool settings, checked (ParamError names the field)."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise ParamError("tool_choice", "needs tools")
        return ToolPlan()
    if not isinstance(tools, list):
        raise ParamError("tools", "must be a list of function tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ParamError(f"tools.{i}", "must be {'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ParamError(f"tools.{i}.function.name", "must be a non-empty string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ParamError(f"tools.{i}.function.parameters", "must be a JSON schema object")
    if parallel is not None and not isinstance(parallel, bool):
        raise ParamError("parallel_tool_calls", "must be a boolean")
    parallel = parallel is not False
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan(ToolMode.NONE, tools, None, parallel)
    if choice == "auto":
        if parser_name is None:
            raise ParamError("tool_choice", '"auto" needs the server started with --tool_call_parser: this '
                                            "model's chat template and family name no tool-call format")
        return ToolPlan(ToolMode.AUTO, tools, None, parallel)
    if choice == "required":
        return ToolPlan(ToolMode.REQUIRED, tools, None, parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise ParamError("tool_choice", 'must be "none", "auto", "required" or '
                                        '{"type": "function", "function": {"name": ...}}')
    if name not in {t["function"]["name"] for t in tools}:
        raise ParamError("tool_choice", f"names {name!r}, which is not in tools")
    return ToolPlan(ToolMode.NAMED, tools, name, parallel)


def template_takes_tools(template: Any) -> bool:
    """Whether the chat template renders a `tools` argument (HF templates for tool-use models do)."""
    if isinstance(template, dict):  # named templates: {"default": ..., "tool_use": ...}
        return "tool_use" in template or any(template_takes_tools(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


def with_calls_in_text(messages: list[dict], parser_name: str | None) -> list[dict]:
    """For templates without tool support: past assistant tool_calls written into the message's
    content in the parser's format (hermes' without a parser), so the model sees the calls that its
    tool messages answer. Normalized messages in (arguments as objects), template-ready ones out."""
    parser = TOOL_PARSERS[parser_name or "hermes"]
    out = []
    for msg in messages:
        if msg.get("tool_calls"):
            calls = parser.render([(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]])
            msg = {k: v for k, v in msg.items() if k != "tool_calls"}
            msg["content"] = f"{msg['content']}\n{calls}" if msg["content"] else calls
        out.append(msg)
    return out


def with_tool_prompt(messages: list[dict], tools: list[dict], parser_name: str | None) -> list[dict]:
    """For templates without tool support: the tools described in the system message.
    The calling format shown is the parser's, so the model's calls can be read back."""
    example = TOOL_PARSERS[parser_name].example if parser_name else TOOL_PARSERS["hermes"].example
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    text = (f"You can call the following functions:\n{listing}\n\nTo call a function, reply with exactly\n"
            f"{example}\nonce per call, and nothing else.")
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


class ChatOutput:
    """One choice's text -> reasoning, content and tool calls, incrementally. `feed` returns OpenAI
    delta fields ({"reasoning_content", "content", "tool_calls"}, each only when non-empty);
    `message` is everything seen, as a non-streamed message."""

    def __init__(self, plan: ToolPlan, tool_parser: str | None, reasoning_parser: str | None, prompt: str):
        self._reasoning = REASONING_PARSERS[reasoning_parser](prompt) if reasoning_parser else None
        self._tools: ToolParser | None = None
        if plan.mode in (ToolMode.REQUIRED, ToolMode.NAMED):
            self._tools = ForcedCallParser(plan.function)
        elif plan.mode is ToolMode.AUTO and tool_parser is not None:
            self._tools = TOOL_PARSERS[tool_parser]()
        self._parallel = plan.parallel
        self.reasoning, self.content, self.calls = "", "", []

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the model stopped after calling, else the engine's reason."""
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason

    def feed(self, text: str, final: bool = False) -> dict:
        """The delta fields `text` completes; with `final`, also everything still held back."""
        return self._split(text, final)

    def message(self) -> dict:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or (None if self.calls else "")}
        if self._reasoning is not None:
            msg["reasoning_content"] = self.reasoning or None
        if self._tools is not None:
            msg["tool_calls"] = [c.as_openai() for c in self.calls]
        return msg

    def _split(self, text: str, final: bool) -> dict:
        reasoning, content = "", text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text)
            if final:
                more = self._reasoning.finish()
                reasoning, content = reasoning + more[0], content + more[1]
        parsed = Parsed(content)
        if self._tools is not None:
            parsed = self._tools.feed(content)
            if final:
                parsed.add(self._tools.finish())
        if not self._parallel:  # the parser may read several; the client asked for at most one
            parsed.calls = parsed.calls[: max(0, 1 - len(self.calls))]
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
            self.reasoning += reasoning
        if parsed.content:
            delta["content"] = parsed.content
            self.content += parsed.content
        if parsed.calls:
            delta["tool_calls"] = [{"index": len(self.calls) + i, **c.as_openai()} for i, c in enumerate(parsed.calls)]
            self.calls += parsed.calls
        return delta
