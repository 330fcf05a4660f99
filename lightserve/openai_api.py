"""OpenAI-compatible generation routes: POST /v1/completions and /v1/chat/completions.

Request schemas, their mapping onto SamplingParams, and the response / SSE chunk shapes. Several
prompts in one completion request run concurrently and come back as choices with their index.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from starlette.responses import Response

from lightserve.api_schema import SamplingFields, StrictModel
from lightserve.chat_output import ToolPlan
from lightserve.engine_client import EngineDead, RequestTimeout, ShuttingDown
from lightserve.front import (
    ApiError,
    ApiRouter,
    Front,
    best_of,
    check_model,
    check_n,
    dumps,
    encode_text,
    get_front,
    grammar_of,
    json_response,
    make_checked,
    parse_model,
    read_json,
    request_params,
    samples_of,
    stop_list,
)
from lightserve.front_streams import (
    EventStream,
    Item,
    run_all,
    start_stream,
    until_disconnect,
)
from lightserve.log import get_logger
from lightserve.messages import FinishReason, ReqDelta
from lightserve.metrics import ReqTimer
from lightserve.openai_output import (
    chat_logprobs,
    completion_logprobs,
    usage,
    usage_dict,
    vllm_prompt_logprobs,
    with_echo,
)
from lightserve.sampling import GrammarKind, SamplingParams

logger = get_logger(__name__)

router = ApiRouter(generation=True)

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# SamplingParams field -> request field, for error messages.
_COMPLETION_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "top_logprobs": "logprobs",
                     "grammar": "guided_json"}
_CHAT_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "grammar": "response_format"}
_DONE = b"data: [DONE]\n\n"


class StreamOptions(StrictModel):
    include_usage: bool | None = None


class _SamplingRequest(SamplingFields):
    """Fields both endpoints share; SamplingFields has the sampling ones."""
    model: str | None = None
    max_tokens: int | None = None
    stop: Any = None  # str | list[str]; checked by stop_list
    min_tokens: int | None = None
    user: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    guided_regex: str | None = None  # vLLM's extension: a regular expression


class CompletionRequest(_SamplingRequest):
    prompt: Any  # str | list[str] | list[int] | list[list[int]], checked by _completion_prompts
    logprobs: int | None = None
    echo: bool | None = None           # prepend the prompt (and, with logprobs, its logprobs)
    prompt_logprobs: int | None = None  # vLLM's extension: per prompt token, its logprob and k alternatives
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: Any  # checked by chat_messages.render_chat
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    tools: Any = None        # checked by plan_tools
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    response_format: dict | None = None


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    front = get_front(request)
    req = parse_model(CompletionRequest, await read_json(request))
    check_model(front, req.model)
    n = check_n(front, req.n, "n")
    num_samples = check_n(front, req.best_of, "best_of") if req.best_of is not None else n
    if num_samples < n:
        raise ApiError(400, "must be >= n", "best_of")
    if req.stream and num_samples > n:
        raise ApiError(400, "best_of > n cannot stream", "best_of")
    _refuse(req.suffix, "suffix")
    echo = bool(req.echo)
    prompts = await _completion_prompts(front, req.prompt)
    max_tokens = COMPLETIONS_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    # max_tokens 0 (scoring a prompt: echo + logprobs, or prompt_logprobs) runs one step and shows none.
    score_only = max_tokens == 0 and (echo or req.prompt_logprobs is not None)
    if score_only and req.stream:
        raise ApiError(400, "max_tokens 0 cannot stream", "max_tokens")
    grammar = grammar_of("guided_json", req.guided_json, req.guided_regex, req.guided_grammar)
    if len(prompts) * num_samples > front.config.req_pool_size:
        raise ApiError(400, f"prompts x n must be <= {front.config.req_pool_size}", "n")
    want_logprobs = req.logprobs is not None
    prompt_k = req.prompt_logprobs
    if echo and want_logprobs:
        prompt_k = max(prompt_k or 0, req.logprobs)
    # best_of ranks its samples by their logprobs, so they count as reported.
    base = dataclasses.replace(_params(front, req, 1 if score_only else max_tokens, req.logprobs or 0, grammar,
                                       report_logprobs=want_logprobs or num_samples > n),
                               prompt_logprobs=prompt_k)
    one = [make_checked(front, ids, base, "prompt", _COMPLETION_NAMES) for ids in prompts]
    # Choice index = prompt index * n + sample index, as OpenAI orders them.
    params = [s for p in one for s in samples_of(p, num_samples)]
    given, prompts = prompts, [ids for ids in prompts for _ in range(num_samples)]
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": front.model_name}

    if req.stream:
        offsets = [0] * len(prompts)
        echoed = [not echo] * len(prompts)

        def chunk(i: int, delta: ReqDelta) -> dict | None:
            text, logprobs = delta.text, None
            if want_logprobs:
                logprobs, offsets[i] = completion_logprobs(front, delta.token_texts, delta.logprobs,
                                                            delta.top_logprobs, offsets[i])
            if not echoed[i]:
                echoed[i] = True
                text, logprobs, offsets[i] = with_echo(front, prompts[i], delta.prompt_logprobs,
                                                        delta.prompt_top_logprobs, text, logprobs, want_logprobs)
            if not text and not delta.finish and not (want_logprobs and delta.token_ids):
                return None
            body = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": delta.finish.api_name()}
            if delta.prompt_logprobs is not None and req.prompt_logprobs is not None:
                body["prompt_logprobs"] = vllm_prompt_logprobs(front, prompts[i], delta.prompt_logprobs,
                                                                delta.prompt_top_logprobs)
            return body

        return await _open_stream(request, front, prompts, params, head, chunk, req.stream_options, None)

    outs = await until_disconnect(request, run_all(front, prompts, params))
    outs = [g for k in range(0, len(outs), num_samples) for g in best_of(outs[k: k + num_samples], n)]
    if score_only:
        for g in outs:
            g.text, g.token_ids, g.token_texts, g.logprobs, g.top_logprobs = "", [], [], [], []
            g.num_output, g.finish = 0, FinishReason.LENGTH
    choices = []
    for i, g in enumerate(outs):
        ids = given[i // n]
        text = g.text
        logprobs = completion_logprobs(front, g.token_texts, g.logprobs, g.top_logprobs, 0)[0] \
            if want_logprobs else None
        if echo:
            text, logprobs, _ = with_echo(front, ids, g.prompt_logprobs, g.prompt_top_logprobs, text, logprobs,
                                           want_logprobs)
        choice = {"index": i, "text": text, "finish_reason": g.finish.api_name(), "logprobs": logprobs}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(front, ids, g.prompt_logprobs, g.prompt_top_logprobs)
        choices.append(choice)
    return json_response({**head, "choices": choices, "usage": usage(outs)})


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    front = get_front(request)
    req = parse_model(ChatCompletionRequest, await read_json(request))
    check_model(front, req.model)
    n = check_n(front, req.n, "n")
    plan = front.plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    grammar = _chat_grammar(req, plan)
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    prompt, prompt_ids = await front.chat_prompt(req.messages, plan, "messages")
    outputs = [front.chat_output(plan, prompt) for _ in range(n)]
    names = dict(_CHAT_NAMES)
    max_tokens = req.max_tokens
    if req.max_completion_tokens is not None:
        max_tokens, names["max_new_tokens"] = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens = front.max_model_len  # "up to the context": check_prompt caps it to the room left
    want_logprobs = bool(req.logprobs)
    params = make_checked(front, prompt_ids, _params(front, req, max_tokens, req.top_logprobs or 0, grammar,
                                                     report_logprobs=want_logprobs),
                          "messages", names)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "object": "chat.completion.chunk" if req.stream else "chat.completion",
            "created": created, "model": front.model_name}

    if req.stream:
        def chunk(i: int, delta: ReqDelta) -> dict | None:
            fields = outputs[i].feed(delta.text, final=delta.finish != FinishReason.NONE)
            if not fields and not delta.finish and not (want_logprobs and delta.token_ids):
                return None
            return {"index": i, "delta": fields,
                    "logprobs": chat_logprobs(front, delta.token_texts, delta.logprobs, delta.top_logprobs)
                    if want_logprobs else None,
                    "finish_reason": outputs[i].finish_reason(delta.finish.api_name())}

        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return await _open_stream(request, front, [prompt_ids] * n, samples_of(params, n), head, chunk,
                                  req.stream_options, role)

    outs = await until_disconnect(request, run_all(front, [prompt_ids] * n, samples_of(params, n)))
    for out, g in zip(outputs, outs):
        out.feed(g.text, final=True)
    choices = [{"index": i, "message": out.message(), "finish_reason": out.finish_reason(g.finish.api_name()),
                "logprobs": chat_logprobs(front, g.token_texts, g.logprobs, g.top_logprobs) if want_logprobs else None}
               for i, (out, g) in enumerate(zip(outputs, outs))]
    return json_response({**head, "choices": choices, "usage": usage(outs)})


# ---- streaming ----------------------------------------------------------------------------------------
class _Choice:
    """Per-prompt bookkeeping of a stream, for usage and metrics."""
    __slots__ = ("cached_len", "done", "num_output", "prompt_len", "timer")

    def __init__(self, timer: ReqTimer, prompt_len: int):
        self.timer, self.prompt_len, self.num_output, self.cached_len, self.done = timer, prompt_len, 0, 0, False


async def _open_stream(request: Request, front: Front, prompts: list[list[int]], params: list[SamplingParams],
                       head: dict, chunk: Callable[[int, ReqDelta], dict | None],
                       stream_options: StreamOptions | None, role_choice: dict | None) -> Response:
    """Start the requests (the first delta is awaited, front_streams.start_stream), then stream SSE."""
    timers, items, first = await start_stream(request, front, prompts, params)
    choices = [_Choice(timer, len(ids)) for timer, ids in zip(timers, prompts)]
    include_usage = bool(stream_options and stream_options.include_usage)
    return EventStream(_sse(first, items, choices, head, chunk, include_usage, role_choice))


async def _sse(first: Item, items: AsyncIterator[Item], choices: list[_Choice],
               head: dict, chunk: Callable[[int, ReqDelta], dict | None], include_usage: bool,
               role_choice: dict | None) -> AsyncIterator[bytes]:
    # Every chunk is `head` plus one choice: serialize the head once, splice each choice in.
    prefix = b"data: " + dumps(head)[:-1] + b',"choices":['
    suffix = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"
    item: Item | None = first

    def usage_chunk() -> bytes:
        usage = usage_dict(sum(c.prompt_len for c in choices), sum(c.num_output for c in choices),
                            sum(c.cached_len for c in choices))
        return b"data: " + dumps({**head, "choices": [], "usage": usage}) + b"\n\n"

    try:
        if role_choice is not None:
            yield prefix + dumps(role_choice) + suffix
        while item is not None:
            i, delta = item
            c = choices[i]
            if delta.token_ids:
                c.timer.on_tokens(len(delta.token_ids))
            c.num_output, c.cached_len = delta.num_output, delta.cached_len
            if delta.finish != FinishReason.NONE:
                c.done = True
                c.timer.on_finish(delta.finish.api_name())
            body = chunk(i, delta)
            if body is not None:
                yield prefix + dumps(body) + suffix
            item = await anext(items, None)
        if include_usage:
            yield usage_chunk()
    except ShuttingDown:
        # The drain's grace period ended: each unfinished choice ends like any finished one, with
        # finish_reason "abort", so a client can tell the cut answer from a complete one.
        for i, c in enumerate(choices):
            if not c.done:
                c.done = True
                c.timer.on_finish("abort")
                abort = ReqDelta(-1, -1, "", [], [], [], c.num_output, FinishReason.ABORT, c.cached_len)
                yield prefix + dumps(chunk(i, abort)) + suffix
        if include_usage:
            yield usage_chunk()
    except (RequestTimeout, EngineDead) as exc:
        _finish_open(choices, "error")
        code, kind = ("timeout", "timeout") if isinstance(exc, RequestTimeout) else ("engine_dead", "server_error")
        yield b"data: " + dumps({"error": {"message": str(exc), "type": kind, "param": None, "code": code}}) + b"\n\n"
    except Exception:
        logger.exception("stream failed")
        _finish_open(choices, "error")
        yield b"data: " + dumps({"error": {"message": "internal server error", "type": "server_error",
                                           "param": None, "code": "internal_error"}}) + b"\n\n"
    finally:
        _finish_open(choices, "disconnect")
        await items.aclose()
    yield _DONE


# ---- helpers ------------------------------------------------------------------------------------------
async def _completion_prompts(front: Front, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [await encode_text(front, prompt, "prompt")]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            prompts = [await encode_text(front, p, "prompt") for p in prompt]
        elif all(type(t) is int for t in prompt):
            prompts = [prompt]
        elif all(isinstance(p, list) and all(type(t) is int for t in p) for p in prompt):
            prompts = prompt
        else:
            prompts = []
        if len(prompts) > front.config.req_pool_size:
            raise ApiError(400, f"at most {front.config.req_pool_size} prompts per request", "prompt")
        if prompts:
            return prompts
    raise ApiError(400, "must be a non-empty string, list of strings, list of token ids, or list of token-id lists",
                   "prompt")


def _chat_grammar(req: ChatCompletionRequest, plan: ToolPlan) -> tuple[GrammarKind, str]:
    fmt = req.response_format
    json_schema, json_object = plan.grammar_schema(), False
    if json_schema is not None and ((fmt or {}).get("type", "text") != "text" or req.guided_json is not None
                                    or req.guided_regex is not None or req.guided_grammar is not None):
        raise ApiError(400, 'tool_choice "required" or a named function cannot be combined with '
                            "response_format or guided_*", "tool_choice")
    if fmt is not None:
        kind = fmt.get("type", "text")
        if kind == "json_object":
            json_object = True
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise ApiError(400, 'json_schema needs {"name": ..., "schema": {...}}', "response_format")
            json_schema = spec["schema"]
        elif kind != "text":
            raise ApiError(400, f"unknown response_format type {kind!r}", "response_format")
    if req.guided_json is not None:
        if json_schema is not None or json_object:
            raise ApiError(400, "give response_format or guided_json, not both", "guided_json")
        json_schema = req.guided_json
    return grammar_of("response_format", json_schema, req.guided_regex, req.guided_grammar, json_object)


def _params(front: Front, req: _SamplingRequest, max_tokens: int, top_logprobs: int,
            grammar: tuple[GrammarKind, str] = (GrammarKind.NONE, ""), report_logprobs: bool = True) -> SamplingParams:
    return request_params(
        req, front.sampling_defaults, max_new_tokens=max_tokens,
        min_new_tokens=req.min_tokens if req.min_tokens is not None else 0,
        stop=stop_list(req.stop, "stop"), top_logprobs=top_logprobs, report_logprobs=report_logprobs,
        grammar_kind=grammar[0], grammar=grammar[1])


def _refuse(value: Any, param: str) -> None:
    if value:
        raise ApiError(400, f"{param} is not supported yet", param)


def _finish_open(choices: list[_Choice], reason: str) -> None:
    for c in choices:
        if not c.done:
            c.done = True
            c.timer.on_finish(reason)

