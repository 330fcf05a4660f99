"""The Anthropic Messages API's request side, in chat terms: `system` + `messages` (text, tool_use,
tool_result and thinking blocks) -> chat messages, `tools` / `tool_choice` -> the chat forms that
chat.output.plan_tools reads, `thinking` and `output_config`. Used by lightserve/http/anthropic_api.py.
Raises ParamError naming the field.
"""
from __future__ import annotations

from typing import Any

from lightserve.chat.messages import function_tools
from lightserve.sampling import ParamError

# Block types that carry media or documents: refused by name, since this server serves text models.
_MEDIA_BLOCKS = ("image", "document", "search_result", "container_upload")
# Blocks of Anthropic's own server tools (web search, code execution, ...): nothing here runs them.
_SERVER_BLOCKS = ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
                  "bash_code_execution_tool_result", "text_editor_code_execution_tool_result",
                  "tool_search_tool_result", "mcp_tool_use", "mcp_tool_result")
_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_THINKING = ("enabled", "adaptive", "between_tools", "disabled")
_OUTPUT_CONFIG = ("format", "effort")  # effort: accepted; the model thinks as it does


def chat_messages(system: Any, messages: Any) -> list[dict]:
    """`system` and `messages` as chat messages, normalized as chat.messages.normalize_messages makes
    them (content strings, tool_calls arguments as objects). A user turn's tool_result blocks become
    tool messages (in block order, its text between them user messages); an assistant turn's text and
    tool_use blocks one assistant message with tool_calls; thinking blocks are dropped, since chat
    templates do not show past reasoning. Each tool_result must answer an earlier tool_use."""
    out = [{"role": "system", "content": text} for text in [_system_text(system)] if text]
    if not isinstance(messages, list) or not messages:
        raise ParamError("messages", "must be a non-empty list of messages")
    call_ids: set[str] = set()
    for i, msg in enumerate(messages):
        where = f"messages.{i}"
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in _BLOCKS:
            raise ParamError(f"{where}.role", "must be 'user' or 'assistant'")
        content = msg.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ParamError(f"{where}.content", "must be a string or a list of content blocks")
        if role == "user":
            out += _user_turn(content, f"{where}.content", call_ids)
        else:
            out.append(_assistant_turn(content, f"{where}.content", call_ids))
    return out


def chat_tools(tools: Any) -> list[dict] | None:
    """Anthropic's client tools ({"name", "description", "input_schema"}) in the chat form."""
    return function_tools(tools, "tools", _client_tool)


def chat_tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """(the chat tool_choice, parallel_tool_calls) of Anthropic's `tool_choice`: auto, any (at least
    one call: "required"), tool (that one, named), none; `disable_parallel_tool_use` allows one call."""
    if choice is None:
        return None, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise ParamError("tool_choice.name", "is required with type 'tool'")
        chat_choice = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in _TOOL_CHOICES:
        chat_choice = _TOOL_CHOICES[kind]
    else:
        raise ParamError("tool_choice.type", "must be auto, any, tool or none")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise ParamError("tool_choice.disable_parallel_tool_use", "must be a boolean")
    return chat_choice, None if disable is None else not disable


def wants_thinking(thinking: Any) -> bool:
    """Whether the answer shows the reasoning as thinking blocks (with --reasoning_parser): when the
    client turned thinking on and did not ask for it omitted. budget_tokens is accepted, not enforced:
    the reasoning takes what it takes within max_tokens."""
    if thinking is None:
        return False
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in _THINKING:
        raise ParamError("thinking.type", f"must be one of {', '.join(_THINKING)}")
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and (type(budget) is not int or budget < 1):
        raise ParamError("thinking.budget_tokens", "must be a positive integer with type 'enabled'")
    return kind != "disabled" and thinking.get("display") != "omitted"


def output_schema(config: Any) -> dict | None:
    """The JSON schema of `output_config.format` (type json_schema), or None for free text."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ParamError("output_config", "must be an object")
    for key in config:
        if key not in _OUTPUT_CONFIG:
            raise ParamError(f"output_config.{key}", "is not a known field")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise ParamError("output_config.format.type", "must be 'json_schema'")
    if not isinstance(fmt.get("schema"), dict):
        raise ParamError("output_config.format.schema", "must be a JSON schema object")
    return fmt["schema"]


# ---- helpers ----------------------------------------------------------------------------------------
def _system_text(system: Any) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    if isinstance(system, list):
        return "\n".join(_text(block, f"system.{i}") for i, block in enumerate(system))
    raise ParamError("system", "must be a string or a list of text blocks")


def _text(block: Any, where: str, allowed: tuple[str, ...] = ("text",)) -> str:
    """A text block's text; any other block is refused, naming the `allowed` ones."""
    kind = _kind(block, where)
    if kind != "text":
        raise _unsupported(kind, where, allowed)
    if not isinstance(block.get("text"), str):
        raise ParamError(f"{where}.text", "must be a string")
    return block["text"]


def _client_tool(tool: Any, where: str) -> dict:
    if not isinstance(tool, dict):
        raise ParamError(where, "must be an object with name and input_schema")
    if tool.get("type") not in (None, "custom"):
        raise ParamError(f"{where}.type", f"{tool['type']!r} is one of Anthropic's server tools; only "
                                          "client tools (name, description, input_schema) are supported")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise ParamError(f"{where}.name", "must be a non-empty string")
    if not isinstance(tool.get("input_schema"), dict):
        raise ParamError(f"{where}.input_schema", "is required: the JSON schema of the tool's input")
    fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if isinstance(tool.get("description"), str):
        fn["description"] = tool["description"]
    return fn


def _user_turn(blocks: list, where: str, call_ids: set[str]) -> list[dict]:
    out: list[dict] = []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = _kind(block, at)
        if kind == "tool_result":
            out.append(_tool_result(block, at, call_ids))
        elif out and out[-1]["role"] == "user":
            out[-1]["content"] += "\n" + _text(block, at, _BLOCKS["user"])
        else:
            out.append({"role": "user", "content": _text(block, at, _BLOCKS["user"])})
    return out or [{"role": "user", "content": ""}]


def _assistant_turn(blocks: list, where: str, call_ids: set[str]) -> dict:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = _kind(block, at)
        if kind == "tool_use":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, dict):
                raise ParamError(at, "a tool_use block needs id and name strings and an input object")
            call_ids.add(call_id)
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
        elif kind not in ("thinking", "redacted_thinking"):
            texts.append(_text(block, at, _BLOCKS["assistant"]))
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tool_result(block: dict, where: str, call_ids: set[str]) -> dict:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or call_id not in call_ids:
        raise ParamError(f"{where}.tool_use_id", f"{call_id!r} answers no tool_use block of an earlier "
                                                 "assistant message")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_text(part, f"{where}.content.{k}") for k, part in enumerate(content))
    elif not isinstance(content, str):
        raise ParamError(f"{where}.content", "must be a string or a list of text blocks")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise ParamError(f"{where}.is_error", "must be a boolean")
    # Chat templates have no error flag: the model reads it in the text.
    return {"role": "tool", "tool_call_id": call_id, "content": f"Error: {content}" if is_error else content}


def _kind(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise ParamError(f"{where}.type", "each content block needs a type")
    return kind


def _unsupported(kind: str, where: str, allowed: tuple[str, ...]) -> ParamError:
    if kind in _MEDIA_BLOCKS:
        return ParamError(where, f"{kind} blocks are not supported: this server serves text-only models")
    if kind in _SERVER_BLOCKS:
        return ParamError(f"{where}.type", f"{kind} blocks belong to Anthropic's server tools, not served here")
    return ParamError(f"{where}.type", f"unknown or misplaced block type {kind!r}: here the blocks are "
                                       f"{', '.join(allowed)}")
