"""OpenAI-compatible generation routes: POST /v1/completions and /v1/chat/completions.

Request schemas and their mapping onto SamplingParams; the response shapes are in openai_output.py and the
SSE chunk stream in openai_stream.py. Several prompts in one completion request run concurrently and come
back as choices with their index.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import Response

from lightserve.chat.output import ToolPlan
from lightserve.http.front import (
    ApiError,
    ApiRouter,
    Front,
    best_of,
    check_model,
    check_n,
    encode_text,
    grammar_of,
    json_response,
    make_checked,
    read_request,
    request_params,
    response_model,
    samples_of,
    stop_list,
)
from lightserve.http.openai_output import chat_logprobs, completion_choice, completion_chunks, token_names, usage
from lightserve.http.openai_stream import open_stream
from lightserve.http.schema import SamplingFields, StrictModel
from lightserve.http.streams import run_all, until_disconnect
from lightserve.messages import FinishReason, ReqDelta
from lightserve.sampling import GrammarKind, SamplingParams

router = ApiRouter(generation=True)

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# SamplingParams field -> request field, for error messages.
_COMPLETION_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "top_logprobs": "logprobs",
                     "grammar": "guided_json"}
_CHAT_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "grammar": "response_format"}
_R = TypeVar("_R", bound="_SamplingRequest")


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
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name each token `token_id:N`


class CompletionRequest(_SamplingRequest):
    prompt: Any  # str | list[str] | list[int] | list[list[int]], checked by _completion_prompts
    logprobs: int | None = None
    echo: bool | None = None           # prepend the prompt (and, with logprobs, its logprobs)
    prompt_logprobs: int | None = None  # vLLM's extension: per prompt token, its logprob and k alternatives
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: Any  # checked by chat.messages.render_chat
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    tools: Any = None        # checked by plan_tools
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    response_format: dict | None = None


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    front, req, n = await _open_request(request, CompletionRequest)
    num_samples = check_n(front, req.best_of, "best_of") if req.best_of is not None else n
    if num_samples < n:
        raise ApiError(400, "must be >= n", "best_of")
    if req.stream and num_samples > n:
        raise ApiError(400, "best_of > n cannot stream", "best_of")
    _refuse(req.suffix, "suffix")
    given = await _completion_prompts(front, req.prompt)
    max_tokens = COMPLETIONS_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    # max_tokens 0 (scoring a prompt: echo + logprobs, or prompt_logprobs) runs one step and shows none.
    score_only = max_tokens == 0 and (bool(req.echo) or req.prompt_logprobs is not None)
    if score_only and req.stream:
        raise ApiError(400, "max_tokens 0 cannot stream", "max_tokens")
    grammar = grammar_of("guided_json", req.guided_json, req.guided_regex, req.guided_grammar)
    if len(given) * num_samples > front.config.req_pool_size:
        raise ApiError(400, f"prompts x n must be <= {front.config.req_pool_size}", "n")
    base = _completion_params(front, req, 1 if score_only else max_tokens, grammar, num_samples > n)
    one = [make_checked(front, ids, base, "prompt", _COMPLETION_NAMES) for ids in given]
    # Choice index = prompt index * n + sample index, as OpenAI orders them.
    params = [s for p in one for s in samples_of(p, num_samples)]
    prompts = [ids for ids in given for _ in range(num_samples)]
    head = _head(front, req.model, "cmpl", "text_completion")
    as_ids = bool(req.return_tokens_as_token_ids)
    if req.stream:
        chunks = completion_chunks(front, prompts, bool(req.echo), req.logprobs, req.prompt_logprobs, as_ids)
        return await open_stream(request, front, prompts, params, head, chunks, _usage_asked(req), None)

    outs = await until_disconnect(request, run_all(front, prompts, params))
    outs = [g for k in range(0, len(outs), num_samples) for g in best_of(outs[k: k + num_samples], n)]
    if score_only:
        for g in outs:
            g.text, g.token_ids, g.token_texts, g.logprobs, g.top_logprobs = "", [], [], [], []
            g.num_output, g.finish = 0, FinishReason.LENGTH
    choices = [completion_choice(front, i, given[i // n], g, bool(req.echo), req.logprobs, req.prompt_logprobs, as_ids)
               for i, g in enumerate(outs)]
    return json_response({**head, "choices": choices, "usage": usage(outs)})


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    front, req, n = await _open_request(request, ChatCompletionRequest)
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
    want_logprobs, as_ids = bool(req.logprobs), bool(req.return_tokens_as_token_ids)
    params = make_checked(front, prompt_ids, _params(front, req, max_tokens, req.top_logprobs or 0, grammar,
                                                     report_logprobs=want_logprobs),
                          "messages", names)
    head = _head(front, req.model, "chatcmpl", "chat.completion.chunk" if req.stream else "chat.completion")

    if req.stream:
        def chunk(i: int, delta: ReqDelta) -> dict | None:
            fields = outputs[i].feed(delta.text, final=delta.finish != FinishReason.NONE)
            if not fields and not delta.finish and not (want_logprobs and delta.token_ids):
                return None
            return {"index": i, "delta": fields,
                    "logprobs": chat_logprobs(front, token_names(delta.token_ids, delta.token_texts, as_ids),
                                              delta.logprobs, delta.top_logprobs, as_ids)
                    if want_logprobs else None,
                    "finish_reason": outputs[i].finish_reason(delta.finish.api_name())}

        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return await open_stream(request, front, [prompt_ids] * n, samples_of(params, n), head, chunk,
                                 _usage_asked(req), role)

    outs = await until_disconnect(request, run_all(front, [prompt_ids] * n, samples_of(params, n)))
    for out, g in zip(outputs, outs):
        out.feed(g.text, final=True)
    choices = [{"index": i, "message": out.message(), "finish_reason": out.finish_reason(g.finish.api_name()),
                "logprobs": chat_logprobs(front, token_names(g.token_ids, g.token_texts, as_ids), g.logprobs,
                                          g.top_logprobs, as_ids) if want_logprobs else None}
               for i, (out, g) in enumerate(zip(outputs, outs))]
    return json_response({**head, "choices": choices, "usage": usage(outs)})


# ---- helpers ------------------------------------------------------------------------------------------
async def _open_request(request: Request, model: type[_R]) -> tuple[Front, _R, int]:
    """What both routes open with: the body as `model`, its model name and n checked. Returns (front, req, n)."""
    front, req = await read_request(request, model)
    check_model(front, req.model)
    return front, req, check_n(front, req.n, "n")


def _head(front: Front, model: str | None, id_prefix: str, kind: str) -> dict:
    """The fields every response and chunk of one request starts with."""
    return {"id": f"{id_prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": response_model(front, model)}


def _completion_params(front: Front, req: CompletionRequest, max_tokens: int, grammar: tuple[GrammarKind, str],
                       rank_samples: bool) -> SamplingParams:
    """The params every prompt of a completion request starts from. Echo with logprobs asks for the prompt's."""
    prompt_k = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_k = max(prompt_k or 0, req.logprobs)
    # best_of ranks its samples by their logprobs (rank_samples), so they count as reported.
    params = _params(front, req, max_tokens, req.logprobs or 0, grammar,
                     report_logprobs=req.logprobs is not None or rank_samples)
    return dataclasses.replace(params, prompt_logprobs=prompt_k)


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
        grammar_kind=grammar[0], grammar=grammar[1], lora_id=check_model(front, req.model))


def _refuse(value: Any, param: str) -> None:
    if value:
        raise ApiError(400, f"{param} is not supported yet", param)


def _usage_asked(req: _SamplingRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)
