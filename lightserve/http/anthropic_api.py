"""Anthropic's Messages API: POST /v1/messages (plain, or streamed as Anthropic's events) and
POST /v1/messages/count_tokens, with Anthropic's error bodies.

A request becomes a chat (anthropic_input.py) and runs as a chat completion does: the same chat
template, tool plan and grammar (tool_choice any/tool, output_config.format), read back by the same
ChatOutput (reasoning, text, tool calls), here rendered as content blocks. `_MessageBuilder` builds
the blocks and their stream events in one code path, so the streamed and the plain message agree.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import ConfigDict
from starlette.responses import Response

from lightserve.chat.output import ChatOutput, ToolPlan
from lightserve.http.anthropic_input import chat_messages, chat_tool_choice, chat_tools, output_schema, wants_thinking
from lightserve.http.front import (
    ApiRouter,
    ErrorStyle,
    Front,
    anthropic_error,
    chat_grammar,
    check_model,
    json_response,
    make_checked,
    read_request,
    request_params,
    response_model,
    stop_list,
)
from lightserve.http.schema import StrictModel
from lightserve.http.streams import (
    DeltaBlocks,
    EventStream,
    generate_one,
    relay,
    sse_event,
    start_stream,
    until_disconnect,
)
from lightserve.messages import FinishReason, ReqDelta
from lightserve.sampling import GrammarKind

router = ApiRouter(ErrorStyle.ANTHROPIC, generation=True)

# SamplingParams field -> request field, for error messages.
_NAMES = {"max_new_tokens": "max_tokens", "stop": "stop_sequences", "grammar": "output_config.format"}
# A failure after the stream started, as the HTTP status its error event names (streams.stream_error).
_STREAM_STATUS = {"timeout": 408, "engine_dead": 503, "shutting_down": 503}
_PING = sse_event("ping", {"type": "ping"})


class CountTokensRequest(StrictModel):
    """The fields that shape the prompt. Any other field is a 400 naming it."""
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str
    messages: Any  # checked by anthropic_input.chat_messages
    system: Any = None
    tools: Any = None
    tool_choice: Any = None
    thinking: Any = None
    output_config: Any = None
    # Accepted, changing nothing here: the radix cache reuses every prefix without breakpoints.
    cache_control: Any = None
    speed: str | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    # Fields of older SDKs, and extra_body of the current one (2.x has no parameters for them).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    # Accepted, changing nothing here.
    metadata: dict | None = None
    service_tier: str | None = None
    inference_geo: str | None = None


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    front, req = await read_request(request, MessagesRequest)
    chat = await _chat(front, req)
    kind, grammar = chat.grammar
    # Agents ask for more than a small model's context holds (Claude Code: 32000): max_tokens is capped
    # to the room the prompt leaves, and a cut there is stop_reason model_context_window_exceeded.
    params = make_checked(front, chat.prompt_ids, request_params(
        req, front.sampling_defaults, max_new_tokens=min(req.max_tokens, front.max_model_len),
        stop=stop_list(req.stop_sequences, "stop_sequences"), grammar_kind=kind, grammar=grammar,
        report_logprobs=False, lora_id=check_model(front, req.model)), "messages", _NAMES)
    output = front.chat_output(chat.plan, chat.prompt)
    builder = _MessageBuilder(response_model(front, req.model), len(chat.prompt_ids), wants_thinking(req.thinking),
                              params.max_new_tokens < req.max_tokens)

    if req.stream:
        (timer,), items, (_, first) = await start_stream(request, front, [chat.prompt_ids], [params])
        output_ids: list[int] = []

        def events(delta: ReqDelta) -> list[bytes]:
            output_ids.extend(delta.token_ids)
            done = delta.finish != FinishReason.NONE
            out = builder.add(output.feed(delta.text, final=done))
            if done:
                out += builder.finish(output, delta.finish, _matched_stop(front, output_ids, params.stop, delta.finish),
                                      delta.num_output, delta.cached_len)
            return out

        def error(code: str, message: str) -> bytes:
            return sse_event("error", anthropic_error(_STREAM_STATUS.get(code, 500), message))

        return EventStream(relay(builder.start(first.cached_len), first, items, timer, events, error))

    g = await until_disconnect(request, generate_one(front, chat.prompt_ids, params))
    builder.add(output.feed(g.text, final=True))
    builder.finish(output, g.finish, _matched_stop(front, g.token_ids, params.stop, g.finish), g.num_output,
                   g.cached_len)
    return json_response(builder.message)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    front, req = await read_request(request, CountTokensRequest)
    chat = await _chat(front, req)
    return json_response({"input_tokens": len(chat.prompt_ids)})


@dataclass
class _Chat:
    plan: ToolPlan
    prompt: str
    prompt_ids: list[int]
    grammar: tuple[GrammarKind, str]


async def _chat(front: Front, req: CountTokensRequest) -> _Chat:
    """The request checked and rendered as a chat prompt, with its tool plan and grammar."""
    check_model(front, req.model)
    messages = chat_messages(req.system, req.messages)
    choice, parallel = chat_tool_choice(req.tool_choice)
    plan = front.plan_tools(chat_tools(req.tools), choice, parallel)
    grammar = chat_grammar(plan, "output_config.format", output_schema(req.output_config))
    wants_thinking(req.thinking)  # checked here, so count_tokens refuses what messages would
    prompt, prompt_ids = await front.chat_prompt(messages, plan, "messages")
    return _Chat(plan, prompt, prompt_ids, grammar)


class _MessageBuilder(DeltaBlocks):
    """Content blocks built from ChatOutput's delta fields, each step also returned as Anthropic
    stream events. Blocks open and close in order: thinking (only when the client asked for it),
    text, tool_use (a text after a call opens a new text block)."""

    REASONING, TEXT = "thinking", "text"

    def __init__(self, model_name: str, prompt_len: int, thinking: bool, capped: bool):
        self.message: dict[str, Any] = {
            "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model_name,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": _usage(prompt_len, 0, 0)}
        self._prompt_len = prompt_len
        self.show_reasoning = thinking
        self._capped = capped  # max_tokens was cut to the context: a length stop is the context's
        self._open: dict | None = None

    def start(self, cached_len: int) -> list[bytes]:
        self.message["usage"] = _usage(self._prompt_len, cached_len, 0)
        return [self._event("message_start", message=self.message), _PING]

    def finish(self, output: ChatOutput, finish: FinishReason, stop_sequence: str | None, num_output: int,
               cached_len: int) -> list[bytes]:
        events = self._close()
        if finish == FinishReason.LENGTH:
            reason = "model_context_window_exceeded" if self._capped else "max_tokens"
        elif output.calls:
            reason = "tool_use"
        else:
            reason = "end_turn" if stop_sequence is None else "stop_sequence"
        usage = _usage(self._prompt_len, cached_len, num_output)
        self.message.update(stop_reason=reason, stop_sequence=stop_sequence, usage=usage)
        return [*events, self._event("message_delta", delta={"stop_reason": reason, "stop_sequence": stop_sequence},
                                     usage=usage),
                self._event("message_stop")]

    def _text(self, kind: str, delta: str) -> list[bytes]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            events += self._start_block({"type": "thinking", "thinking": "", "signature": ""}
                                        if kind == "thinking" else {"type": "text", "text": ""})
        self._open[kind] += delta  # the block's "text" or "thinking"
        events.append(self._event("content_block_delta", index=len(self.message["content"]) - 1,
                                  delta={"type": f"{kind}_delta", kind: delta}))
        return events

    def _call(self, call_id: str, name: str, arguments: str) -> list[bytes]:
        # The call's id in Anthropic's spelling: toolu_ for call_; a client sends it back as is.
        block = {"type": "tool_use", "id": "toolu_" + call_id.removeprefix("call_"), "name": name, "input": {}}
        events = self._start_block(block)
        block["input"] = json.loads(arguments)  # ChatOutput's calls hold a JSON object, always
        events.append(self._event("content_block_delta", index=len(self.message["content"]) - 1,
                                  delta={"type": "input_json_delta", "partial_json": arguments}))
        return events + self._close()

    def _start_block(self, block: dict) -> list[bytes]:
        self.message["content"].append(block)
        self._open = block
        return [self._event("content_block_start", index=len(self.message["content"]) - 1, content_block=block)]

    def _close(self) -> list[bytes]:
        block, self._open = self._open, None
        if block is None:
            return []
        return [self._event("content_block_stop", index=len(self.message["content"]) - 1)]

    def _event(self, kind: str, **fields: Any) -> bytes:
        # Serialized at once: the message and its blocks keep changing after their start events.
        return sse_event(kind, {"type": kind, **fields})


def _usage(prompt_len: int, cached_len: int, num_output: int) -> dict:
    # Anthropic counts the cached prompt tokens apart: input = input_tokens + cache reads + cache writes.
    return {"input_tokens": prompt_len - cached_len, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_len, "output_tokens": num_output}


def _matched_stop(front: Front, output_ids: list[int], stops: list[str], finish: FinishReason) -> str | None:
    """Which stop sequence ended the output, if one did. The engine reports only STOP (eos, a stop
    token or a stop string) and the text it shows ends before the match; the decoded tokens hold it.
    The match that completes first is the one that stopped the request."""
    if finish != FinishReason.STOP or not stops:
        return None
    text = front.tokenizer.decode(output_ids, skip_special_tokens=True)
    found = [(at + len(s), s) for s in stops if (at := text.find(s)) >= 0]
    return min(found)[1] if found else None
