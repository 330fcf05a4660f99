"""OpenAI's Responses API: POST /v1/responses, plain or streamed as Responses events.

A request is turned into a chat (responses_input.py), rendered and generated like a chat
completion, and its output read back by the same ChatOutput as chat completions (reasoning, text,
function calls). `_OutputBuilder` turns ChatOutput's pieces into output items and their stream
events, so the streamed and the plain response are built by one code path. With `store` (OpenAI's
default) the conversation is kept in a bounded in-memory ResponseStore for `previous_response_id`.
"""
from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from starlette.responses import Response

from lightserve.chat.messages import normalize_message
from lightserve.chat.output import ChatOutput, ToolPlan
from lightserve.http.front import (
    ApiError,
    ApiRouter,
    Front,
    chat_grammar,
    check_model,
    json_response,
    make_checked,
    read_request,
    request_params,
    response_model,
)
from lightserve.http.responses_input import (
    ResponseStore,
    chat_tool_choice,
    chat_tools,
    input_messages,
    text_format,
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

router = ApiRouter(generation=True)

STORE_MAX_ITEMS = 1024   # stored conversations; the oldest are dropped first
STORE_TTL_S = 3600.0     # how long a stored conversation can be continued
_NAMES = {"max_new_tokens": "max_output_tokens", "grammar": "text.format"}


class ResponsesRequest(StrictModel):
    model: str | None = None
    input: Any = None            # checked by input_messages
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    text: Any = None
    reasoning: dict | None = None  # effort/summary: accepted; a reasoning model reasons as it does
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict | None = None
    user: str | None = None
    background: bool | None = None


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    front, req = await read_request(request, ResponsesRequest)
    lora_id = check_model(front, req.model)
    if req.background:
        raise ApiError(400, "background responses are not supported", "background")
    if req.input is None:
        raise ApiError(400, "is required", "input")
    store = _store(request)
    history: list[dict] = []
    if req.previous_response_id is not None:
        found = store.get(req.previous_response_id)
        if found is None:
            raise ApiError(400, f"no stored response {req.previous_response_id!r} (unknown, expired, or not "
                                "stored)", "previous_response_id")
        history = found
    messages = history + input_messages(req.input)
    plan = front.plan_tools(chat_tools(req.tools), chat_tool_choice(req.tool_choice), req.parallel_tool_calls)
    kind, grammar = chat_grammar(plan, "text.format", *text_format(req.text))
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    prompt, prompt_ids = await front.chat_prompt(system + messages, plan, "input")
    max_tokens = front.max_model_len if req.max_output_tokens is None else req.max_output_tokens
    params = make_checked(front, prompt_ids, request_params(req, front.sampling_defaults, max_new_tokens=max_tokens,
                                                            grammar_kind=kind, grammar=grammar,
                                                            report_logprobs=False, lora_id=lora_id),
                          "input", _NAMES)
    output = front.chat_output(plan, prompt)
    builder = _OutputBuilder(_skeleton(front, req, plan))
    keep = None if req.store is False else (store, messages)

    if req.stream:
        (timer,), items, (_, first) = await start_stream(request, front, [prompt_ids], [params])

        def events(delta: ReqDelta) -> list[bytes]:
            out = builder.add(output.feed(delta.text, final=delta.finish != FinishReason.NONE))
            if delta.finish != FinishReason.NONE:
                out += builder.finish(delta.finish, _usage(front, len(prompt_ids), delta.num_output, delta.cached_len,
                                                           output.reasoning))
                _keep(keep, builder.head["id"], output)
            return out

        return EventStream(relay(builder.start(), first, items, timer, events, builder.error))

    g = await until_disconnect(request, generate_one(front, prompt_ids, params))
    builder.add(output.feed(g.text, final=True))
    builder.finish(g.finish, _usage(front, len(prompt_ids), g.num_output, g.cached_len, output.reasoning))
    _keep(keep, builder.head["id"], output)
    return json_response(builder.head)


class _OutputBuilder(DeltaBlocks):
    """Output items built from ChatOutput's delta fields, each step also returned as Responses
    stream events. Items open and close in order: reasoning, text, function calls (a text after a
    call opens a new message item)."""

    REASONING, TEXT = "reasoning", "message"

    def __init__(self, head: dict):
        self.head = head           # the response object; head["output"] holds the items
        self._seq = 0
        self._open: dict | None = None

    def start(self) -> list[bytes]:
        return [self._event("response.created", response=self.head),
                self._event("response.in_progress", response=self.head)]

    def finish(self, finish: FinishReason, usage: dict) -> list[bytes]:
        events = self._close()
        incomplete = finish == FinishReason.LENGTH
        self.head.update(status="incomplete" if incomplete else "completed", usage=usage,
                         incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
                         completed_at=None if incomplete else int(time.time()))
        events.append(self._event("response.incomplete" if incomplete else "response.completed", response=self.head))
        return events

    def error(self, code: str, message: str) -> bytes:
        return self._event("error", code=code, message=message, param=None)

    def _text(self, kind: str, delta: str) -> list[bytes]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            events += self._start_item(kind)
        item, index = self._open, len(self.head["output"]) - 1
        item["content"][0]["text"] += delta
        if kind == "message":
            events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=delta, logprobs=[]))
        else:
            events.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=delta))
        return events

    def _start_item(self, kind: str) -> list[bytes]:
        if kind == "message":
            item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        index = len(self.head["output"])
        self.head["output"].append(item)
        self._open = item
        events = [self._event("response.output_item.added", output_index=index, item=item)]
        item["content"].append(part)
        events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))
        return events

    def _close(self) -> list[bytes]:
        item, self._open = self._open, None
        if item is None:
            return []
        index, part = len(self.head["output"]) - 1, item["content"][0]
        item["status"] = "completed"
        if item["type"] == "message":
            done = self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                               text=part["text"], logprobs=[])
        else:
            done = self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=part["text"])
        return [done, self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _call(self, call_id: str, name: str, arguments: str) -> list[bytes]:
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call_id, "name": name,
                "arguments": "", "status": "in_progress"}
        index = len(self.head["output"])
        self.head["output"].append(item)
        events = [self._event("response.output_item.added", output_index=index, item=item),
                  self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                              delta=arguments)]
        item.update(arguments=arguments, status="completed")
        events += [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=name, arguments=arguments),
                   self._event("response.output_item.done", output_index=index, item=item)]
        return events

    def _event(self, kind: str, **fields: Any) -> bytes:
        # Serialized at once: the items keep changing after their "added" event.
        body = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse_event(kind, body)


def _skeleton(front: Front, req: ResponsesRequest, plan: ToolPlan) -> dict:
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if plan.tools else "none")
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": response_model(front, req.model), "output": [],
            "parallel_tool_calls": plan.parallel, "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning or {"effort": None, "summary": None}, "store": req.store is not False,
            "temperature": req.temperature, "top_p": req.top_p, "text": req.text or {"format": {"type": "text"}},
            "tool_choice": choice, "tools": req.tools or [], "truncation": "disabled", "usage": None,
            "metadata": req.metadata or {}, "user": req.user}


def _usage(front: Front, prompt_len: int, num_output: int, cached_len: int, reasoning: str) -> dict:
    # The reasoning's token count, re-encoded from its text (the engine does not tell them apart).
    num_reasoning = len(front.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    return {"input_tokens": prompt_len, "input_tokens_details": {"cached_tokens": cached_len},
            "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": min(num_reasoning, num_output)},
            "total_tokens": prompt_len + num_output}


def _keep(keep: tuple[ResponseStore, list[dict]] | None, response_id: str, output: ChatOutput) -> None:
    if keep is not None:
        store, messages = keep
        store.put(response_id, [*messages, normalize_message(output.message(), "output")])


def _store(request: Request) -> ResponseStore:
    # One per app, made on first use: only this route module knows it exists.
    state = request.app.state
    if getattr(state, "response_store", None) is None:
        state.response_store = ResponseStore(STORE_MAX_ITEMS, STORE_TTL_S)
    return state.response_store
