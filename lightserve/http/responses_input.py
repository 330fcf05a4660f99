"""The Responses API's request side, in chat terms: input items -> chat messages, function tools
and tool_choice -> the chat forms chat.output.plan_tools reads, text.format -> a grammar; and
`ResponseStore`, the bounded in-memory store behind `store` / `previous_response_id`.
Used by lightserve/http/responses_api.py. Raises ParamError naming the field.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from lightserve.chat.messages import function_tools, normalize_message
from lightserve.sampling import ParamError

_ROLES = ("system", "developer", "user", "assistant")


def input_messages(value: Any) -> list[dict]:
    """`input` (a string or a list of items) as normalized chat messages. Consecutive function_call
    items become one assistant message with several tool_calls; reasoning items are dropped, since
    chat templates do not show past reasoning to the model."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ParamError("input", "must be a string or a non-empty list of input items")
    out: list[dict] = []
    for i, item in enumerate(value):
        where = f"input.{i}"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in _ROLES:
            out.append(normalize_message(item, where))
        elif kind == "message":
            raise ParamError(f"{where}.role", f"must be one of {list(_ROLES)}")
        elif kind == "function_call":
            call = _function_call(item, where)
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, (str, list)):
                raise ParamError(where, "a function_call_output needs call_id and output strings")
            out.append(normalize_message({"role": "tool", "tool_call_id": call_id, "content": output}, where))
        elif kind == "reasoning":
            continue
        else:
            raise ParamError(f"{where}.type", "must be message, function_call, function_call_output or reasoning")
    return out


def chat_tools(tools: Any) -> list[dict] | None:
    """Responses' flat {"type": "function", "name", "parameters", ...} tools in the chat form."""
    return function_tools(tools, "function tools", _function_tool)


def chat_tool_choice(choice: Any) -> Any:
    """{"type": "function", "name": ...} in the chat form; "none"/"auto"/"required" unchanged."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def text_format(text: Any) -> tuple[dict | None, bool]:
    """(JSON schema, json_object) of `text.format`; (None, False) for plain text."""
    fmt = text.get("format") if isinstance(text, dict) else None
    if text is not None and not isinstance(text, dict):
        raise ParamError("text", "must be an object like {'format': {'type': 'text'}}")
    if fmt is None:
        return None, False
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None, False
    if kind == "json_object":
        return None, True
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ParamError("text.format.schema", "must be a JSON schema object")
        return fmt["schema"], False
    raise ParamError("text.format.type", "must be text, json_object or json_schema")


@dataclass
class _Stored:
    messages: list[dict]  # the conversation up to and including this response's output
    expires: float


class ResponseStore:
    """The conversations of recent responses, for `previous_response_id`: at most `max_items`,
    each kept `ttl_s` seconds; the oldest go first. Only the HTTP front's event loop touches it."""

    def __init__(self, max_items: int, ttl_s: float):
        self._items: OrderedDict[str, _Stored] = OrderedDict()
        self.max_items, self.ttl_s = max_items, ttl_s

    def put(self, response_id: str, messages: list[dict]) -> None:
        self._expire()
        self._items[response_id] = _Stored(messages, time.monotonic() + self.ttl_s)
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict] | None:
        self._expire()
        item = self._items.get(response_id)
        return None if item is None else item.messages

    def _expire(self) -> None:
        now = time.monotonic()
        while self._items and next(iter(self._items.values())).expires <= now:
            self._items.popitem(last=False)


def _function_tool(tool: Any, where: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ParamError(f"{where}.type", "only function tools are supported (no built-in tools here)")
    return {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}


def _function_call(item: dict, where: str) -> dict:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, str):
        raise ParamError(where, "a function_call needs call_id, name and arguments strings")
    try:
        message = normalize_message({"role": "assistant", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}, where)
    except ParamError:
        raise ParamError(f"{where}.arguments", "must be a JSON string") from None
    return message["tool_calls"][0]
