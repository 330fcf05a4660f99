"""Chat messages checked as OpenAI checks them, normalized and rendered by the model's chat template.

`render_chat` is the one way a chat becomes a prompt: the HTTP front (/v1/chat/completions,
/v1/responses, /tokenize) and the offline pipeline call it. Raises ParamError naming the field,
which the front renders as a 400.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from lightserve.chat.output import template_takes_tools, with_calls_in_text, with_tool_prompt
from lightserve.sampling import ParamError

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Part types that carry media: refused by name, since this server serves text models only.
_MEDIA_PARTS = {"image_url": "image", "input_image": "image", "input_audio": "audio", "audio": "audio",
                "file": "file", "input_file": "file", "video_url": "video"}
_TEXT_PARTS = ("text", "input_text", "output_text")


def render_chat(tokenizer: Any, messages: Any, param: str = "messages", tools: list[dict] | None = None,
                tool_call_parser: str | None = None) -> str:
    """Messages through the model's chat template (transformers renders it in a sandboxed Jinja env),
    ending with the assistant's turn. `tools` go to the template's `tools` argument, or into the
    system message for a template that takes none (output.with_tool_prompt), which then sees
    past tool calls in the assistant's text (output.with_calls_in_text)."""
    import jinja2  # only where chats are rendered

    norm = normalize_messages(messages, param)
    kwargs = {}
    if template_takes_tools(tokenizer.chat_template):
        if tools:
            kwargs["tools"] = tools
    else:
        norm = with_calls_in_text(norm, tool_call_parser)
        if tools:
            norm = with_tool_prompt(norm, tools, tool_call_parser)
    try:
        return tokenizer.apply_chat_template(norm, tokenize=False, add_generation_prompt=True, **kwargs)
    except (jinja2.TemplateError, TypeError, ValueError) as exc:
        raise ParamError(param, f"the chat template rejected the messages: {exc}") from None


def normalize_messages(messages: Any, param: str = "messages") -> list[dict]:
    """The messages as template-ready dicts: content a string; assistant `tool_calls` with their
    arguments decoded to objects (HF templates render `arguments | tojson`); tool results with their
    `tool_call_id`. Raises ParamError for anything OpenAI would refuse."""
    if not isinstance(messages, list) or not messages:
        raise ParamError(param, "must be a non-empty list of messages")
    return [normalize_message(msg, f"{param}.{i}") for i, msg in enumerate(messages)]


def function_tools(tools: Any, what: str, function_of: Callable[[Any, str], dict]) -> list[dict] | None:
    """An API's `tools` in the chat form that chat.output.plan_tools reads ({"type": "function", "function": ...}),
    each tool's function read by `function_of(tool, "tools.<i>")`; None when not given. `what` names the list's items
    in the error for a `tools` that is not a list. Raises ParamError naming the field."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ParamError("tools", f"must be a list of {what}")
    return [{"type": "function", "function": function_of(tool, f"tools.{i}")} for i, tool in enumerate(tools)]


def normalize_message(msg: Any, where: str) -> dict:
    """One message of normalize_messages; `where` names it in errors."""
    if not isinstance(msg, dict):
        raise ParamError(where, "each message must be an object with role and content")
    role = msg.get("role")
    if role not in CHAT_ROLES:
        raise ParamError(f"{where}.role", f"must be one of {list(CHAT_ROLES)}")
    content = msg.get("content")
    if role == "assistant":
        out: dict = {"role": role, "content": "" if content is None else _content_text(content, f"{where}.content")}
        calls = msg.get("tool_calls")
        if calls is not None:
            out["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        elif content is None:
            raise ParamError(f"{where}.content", "is required unless the assistant message has tool_calls")
        return out
    if content is None:
        raise ParamError(f"{where}.content", f"is required in a {role} message")
    out = {"role": role, "content": _content_text(content, f"{where}.content")}
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ParamError(f"{where}.tool_call_id", "is required in a tool message (the id of the call it answers)")
        out["tool_call_id"] = call_id
    name = msg.get("name")
    if isinstance(name, str):
        out["name"] = name
    return out


def _content_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _MEDIA_PARTS:
                raise ParamError(f"{param}.{i}", f"{_MEDIA_PARTS[kind]} content is not supported: this server "
                                                 "serves text-only models")
            if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                raise ParamError(f"{param}.{i}", "content parts must be {'type': 'text', 'text': ...}")
            parts.append(part["text"])
        return "\n".join(parts)
    raise ParamError(param, "must be a string or a list of text parts")


def _tool_calls(calls: Any, param: str) -> list[dict]:
    if not isinstance(calls, list):
        raise ParamError(param, "must be a list of tool calls")
    out = []
    for i, call in enumerate(calls):
        where = f"{param}.{i}"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ParamError(where, "must be {'id': ..., 'type': 'function', "
                                    "'function': {'name': ..., 'arguments': ...}}")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise ParamError(f"{where}.function.arguments", "must be a JSON string") from None
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out
