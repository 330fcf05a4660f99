"""What every HTTP route shares: `Front` (the app's state), the route modules' `ApiRouter` (which
declares their error shape and whether they count as generation routes), and the request helpers
below both the app module and the route modules: body reading, model and prompt checks, and the
mapping of a request onto SamplingParams. Streams and generation live in streams.py.

Error convention: every bad input is 400 (schema and type errors too, never 422), with the field
named in `param`; 401 auth, 404 unknown model or route, 408 timeout, 413 body too large, 503 engine
overloaded (Retry-After: 1) or dead; in an SSE stream that already started, an error event ends it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import APIRouter, Request
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from lightserve.chat.messages import render_chat
from lightserve.chat.output import ChatOutput, ToolPlan, plan_tools
from lightserve.engine.generation import Generation
from lightserve.sampling import GrammarKind, ParamError, SamplingParams

if TYPE_CHECKING:
    from lightserve.config import ServerConfig
    from lightserve.engine.client import EngineClient
    from lightserve.http.drain import Drain
    from lightserve.http.metrics import FrontMetrics

try:
    import orjson

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)

    loads = orjson.loads
except ImportError:  # pragma: no cover - orjson is optional
    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()

    def loads(data: bytes) -> Any:
        return json.loads(data.decode("utf-8"))

INLINE_ENCODE_CHARS = 16384  # longer prompts are tokenized in a thread so the event loop keeps streaming

M = TypeVar("M", bound=BaseModel)


class ErrorStyle(Enum):
    OPENAI = "openai"        # {"error": {"message", "type", "param", "code"}}
    LIGHTLLM = "lightllm"    # {"error": message, "param": field}
    ANTHROPIC = "anthropic"  # {"type": "error", "error": {"type", "message"}}


# Anthropic's error types by HTTP status (its overloaded_error comes with 529; here with 503).
_ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                     404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                     429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


def anthropic_error(status: int, message: str) -> dict:
    """Anthropic's error body for an HTTP status (also the data of a stream's error event)."""
    kind = _ANTHROPIC_ERRORS.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class ApiRouter(APIRouter):
    """A route module's router. `error_style`: the shape of its routes' error bodies; `generation`:
    its routes are generation requests (counted in requests_total, drained on shutdown)."""

    def __init__(self, error_style: ErrorStyle = ErrorStyle.OPENAI, generation: bool = False):
        super().__init__()
        self.error_style = error_style
        self.generation = generation


class ApiError(Exception):
    """A request the front refuses; rendered in the route's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


@dataclass
class Front:
    """Everything a route needs, held on app.state.front (no module globals)."""
    config: ServerConfig
    engine: EngineClient
    tokenizer: Any
    model_name: str
    health: Callable[[], str | None]
    metrics: FrontMetrics
    drain: Drain
    special_ids: frozenset[int] = field(default_factory=frozenset)
    max_prompt_chars: int = 0  # a longer text surely exceeds the context; refused before tokenizing
    model_dir: str = ""
    probe: asyncio.Future | None = None  # the /health_generate probe in progress, shared by concurrent calls
    model_names: tuple[str, ...] = ()  # every name a request may give (--served_model_name aliases)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # from generation_config.json
    tool_parser: str | None = None  # --tool_call_parser, resolved (tool_parsers.choose_tool_parser)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_req_total_len

    def render_chat(self, messages: Any, param: str = "messages", tools: list[dict] | None = None) -> str:
        return render_chat(self.tokenizer, messages, param, tools, self.tool_parser)

    def plan_tools(self, tools: Any, tool_choice: Any, parallel: Any) -> ToolPlan:
        return plan_tools(tools, tool_choice, parallel, self.tool_parser)

    def chat_output(self, plan: ToolPlan, prompt: str) -> ChatOutput:
        """A reader of one choice's output: reasoning, content and the calls `plan` allows."""
        return ChatOutput(plan, self.tool_parser, self.config.reasoning_parser, prompt)

    async def chat_prompt(self, messages: Any, plan: ToolPlan, param: str) -> tuple[str, list[int]]:
        """The chat rendered with the plan's tools, and its token ids (the template has the specials)."""
        prompt = self.render_chat(messages, param, tools=plan.prompt_tools)
        return prompt, await encode_text(self, prompt, param, add_special_tokens=False)


def get_front(request: Request) -> Front:
    return request.app.state.front


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(obj), status_code=status, headers=headers, media_type="application/json")


async def read_json(request: Request) -> dict:
    """The body as a JSON object, refusing bodies over --max_body_bytes (declared or streamed)."""
    limit = get_front(request).config.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise _too_large(limit) if declared.isdigit() else ApiError(400, "bad Content-Length header", "body")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    if size == 0:
        raise ApiError(400, "the request body is empty; expected a JSON object", "body", "invalid_json")
    try:
        data = loads(b"".join(chunks))
    except ValueError as exc:  # includes invalid UTF-8
        raise ApiError(400, f"the body is not valid JSON: {exc}", "body", "invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", "body", "invalid_json")
    return data


async def read_request(request: Request, cls: type[M]) -> tuple[Front, M]:
    """What a generation route opens with: the app's Front and the body parsed as `cls` (a 400 naming the field)."""
    return get_front(request), parse_model(cls, await read_json(request))


def parse_model(cls: type[M], data: dict) -> M:
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = ".".join(str(p) for p in err["loc"]) or "body"
        raise ApiError(400, err["msg"], param) from None


def check_model(front: Front, model: str | None) -> int:
    """The LoRA adapter id `model` names: 0 for the base model (any of its names, or none given), an adapter's id
    under --enable_lora; 404 naming the model otherwise."""
    if model is None or model in front.model_names:
        return 0
    lora_id = front.engine.lora_id(model)
    if lora_id is None:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{front.model_name}`"
                            f"{' and its LoRA adapters' if front.engine.adapters is not None else ''}.",
                       "model", "model_not_found")
    return lora_id


def response_model(front: Front, model: str | None) -> str:
    """The model name a response reports: the adapter the request named, else the base model's first name."""
    return model if model is not None and model not in front.model_names else front.model_name


async def encode_text(front: Front, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    if len(text) > front.max_prompt_chars:
        raise ApiError(400, f"the prompt is longer than this server's context ({front.max_model_len} tokens)", param)
    encode = front.tokenizer.encode
    if len(text) < INLINE_ENCODE_CHARS:
        return encode(text, add_special_tokens=add_special_tokens)
    # Safe off-loop: encoding without truncation/padding never mutates the Rust tokenizer.
    return await asyncio.to_thread(encode, text, add_special_tokens=add_special_tokens)


def request_params(src: Any, defaults: dict[str, Any] | None = None, **given: Any) -> SamplingParams:
    """SamplingParams from an HTTP request model: each field named like a SamplingParams field that
    the client set (not None), then `given`, the fields this API names or converts its own way.
    Unset, a field takes `defaults` (the model's generation_config.json), else temperature is 1
    (both APIs sample unless told otherwise), the rest SamplingParams' defaults."""
    values: dict[str, Any] = {"temperature": 1.0, **(defaults or {})}
    for f in dataclasses.fields(SamplingParams):
        value = getattr(src, f.name, None)
        if value is not None:
            values[f.name] = list(value) if isinstance(value, tuple) else value
    values.update(given)
    return SamplingParams(**values)


def make_checked(front: Front, prompt_ids: list[int], params: SamplingParams, prompt_param: str,
                 names: dict[str, str]) -> SamplingParams:
    """engine.check_prompt (the request's validation, shared with the pipeline), plus the one rule of the HTTP APIs
    alone: a max_new_tokens over the context is refused, not capped. ParamError fields renamed to the API's names."""
    try:
        checked = front.engine.check_prompt(prompt_ids, params, prompt_param)
        if params.max_new_tokens > front.max_model_len:
            raise ParamError("max_new_tokens", f"must be <= {front.max_model_len}, this server's context length")
        return checked
    except ParamError as exc:
        raise ApiError(400, exc.message, names.get(exc.param, exc.param)) from None


def grammar_of(param: str, json_schema: Any = None, regex: Any = None, ebnf: Any = None,
               json_object: bool = False) -> tuple[GrammarKind, str]:
    """The one structured-output constraint of a request, from whichever API field named it."""
    given = [(k, v) for k, v in ((GrammarKind.JSON_SCHEMA, json_schema), (GrammarKind.REGEX, regex),
                                 (GrammarKind.EBNF, ebnf)) if v is not None]
    if json_object:
        given.append((GrammarKind.JSON_OBJECT, ""))
    if len(given) > 1:
        raise ApiError(400, "give at most one of response_format, guided_json, regular_constraint/guided_regex "
                            "and guided_grammar", param)
    if not given:
        return GrammarKind.NONE, ""
    kind, value = given[0]
    if kind is GrammarKind.JSON_SCHEMA and not isinstance(value, str):
        if not isinstance(value, dict):
            raise ApiError(400, "the JSON schema must be an object or a string", param)
        value = json.dumps(value)
    if not isinstance(value, str):
        raise ApiError(400, "must be a string", param)
    return kind, value


def chat_grammar(plan: ToolPlan, param: str, schema: Any = None, json_object: bool = False
                 ) -> tuple[GrammarKind, str]:
    """A chat request's one grammar: its forced tool call's (tool_choice required or named), else
    the structured output that `param` gave (a JSON schema, or any JSON object)."""
    forced = plan.grammar_schema()
    if forced is not None and (schema is not None or json_object):
        raise ApiError(400, f"a forced tool call (tool_choice) cannot be combined with {param}", "tool_choice")
    return grammar_of(param, forced if forced is not None else schema, json_object=json_object)


def stop_list(stop: Any, param: str) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise ApiError(400, "must be a string or a list of strings", param)


def token_text(front: Front, token_id: int) -> str:
    return front.tokenizer.decode([token_id])


def check_n(front: Front, value: int | None, param: str) -> int:
    """The validated n (or best_of); 1 when not given."""
    if value is None:
        return 1
    if value < 1:
        raise ApiError(400, "must be >= 1", param)
    if value > front.config.max_n:
        raise ApiError(400, f"must be <= {front.config.max_n} (--max_n)", param)
    return value


def samples_of(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n copies of one prompt's params sharing a group id, so the router prefills the prompt once and
    the samples diverge after it. A given seed becomes seed + i: the samples must differ."""
    if n == 1:
        return [params]
    group_id = secrets.randbits(62) + 1
    return [dataclasses.replace(params, group_id=group_id, seed=None if params.seed is None else params.seed + i)
            for i in range(n)]


def best_of(outs: list[Generation], n: int) -> list[Generation]:
    """The n generations with the highest cumulative logprob (OpenAI's best_of), in their order."""
    if len(outs) == n:
        return outs
    keep = sorted(range(len(outs)), key=lambda i: -sum(outs[i].logprobs))[:n]
    return [outs[i] for i in sorted(keep)]


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes", "body", "request_too_large")
