"""The HTTP front's FastAPI app: `create_app`, auth, error handling, the utility routes, and the
request plumbing the generation routes share (body reading, prompt encoding, disconnect watching).

The launcher calls `create_app`; openai_api.py, responses_api.py and lightllm_api.py hold the
generation routes, vllm_api.py vLLM's small utility routes, ops_api.py the probes and the cards routers read.
Error convention: every bad input is 400 (schema and type errors too, never 422), with the field
named in `param`; 401 auth, 404 unknown model or route, 408 timeout, 413 body too large, 503 engine
overloaded (Retry-After: 1) or dead; in an SSE stream that already started, an error event ends it.
NOTE: about 500 lines because it is also the hub both API modules import; moving the plumbing
section into its own module (and dropping the function-level import in create_app) is the next step.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import jinja2
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from lightserve.chat_messages import normalize_messages
from lightserve.chat_output import template_takes_tools, with_tool_prompt
from lightserve.drain import Drain
from lightserve.engine_client import EngineDead, EngineOverloaded, RequestTimeout, ShuttingDown
from lightserve.log import get_logger
from lightserve.messages import FinishReason, ReqDelta
from lightserve.metrics import FrontMetrics, ReqTimer
from lightserve.sampling import GrammarKind, ParamError, SamplingParams

if TYPE_CHECKING:
    from lightserve.config import ServerConfig
    from lightserve.engine_client import EngineClient

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

logger = get_logger(__name__)

LIGHTLLM_PATHS = frozenset({"/generate", "/generate_stream"})  # errors as {"error": msg, "param": field}
# Counted in requests_total.
GENERATE_PATHS = LIGHTLLM_PATHS | {"/v1/completions", "/v1/chat/completions", "/v1/responses"}
OPEN_PATHS = frozenset({"/health", "/health_generate"})  # reachable without the API key (probes)
INLINE_ENCODE_CHARS = 16384  # longer prompts are tokenized in a thread so the event loop keeps streaming
_INT32 = (-(2**31), 2**31 - 1)

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    """A request the front refuses; rendered in the route's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


class StrictModel(BaseModel):
    """Request schemas: JSON types are checked strictly ("16" is not an int); unknown fields are ignored."""
    model_config = ConfigDict(strict=True, extra="ignore")


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

    @property
    def max_model_len(self) -> int:
        return self.engine.max_req_total_len


@dataclass
class Generation:
    """One finished request, accumulated from its deltas."""
    prompt_len: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_output: int = 0
    finish: FinishReason = FinishReason.NONE
    cached_len: int = 0
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None      # prompt tokens 1..prompt_len-1, when asked for
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


def create_app(config: ServerConfig, engine: EngineClient, tokenizer: Any, model_name: str,
               health: Callable[[], str | None], model_dir: str = "",
               sampling_defaults: dict[str, Any] | None = None) -> FastAPI:
    # NOTE: imported here because the route modules import this module's plumbing.
    from lightserve import lightllm_api, openai_api, ops_api, responses_api, vllm_api

    metrics = FrontMetrics(engine, model_name)
    # Byte-level BPE and SentencePiece vocab strings are at least as long as the text they decode to.
    max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1)
    drain = Drain(engine, config.shutdown_grace_s)
    front = Front(config, engine, tokenizer, model_name, health, metrics, drain,
                  frozenset(getattr(tokenizer, "all_special_ids", ())), max_token_chars * engine.max_req_total_len,
                  model_dir=model_dir,
                  model_names=(model_name, *[n for n in config.served_model_name or () if n != model_name]),
                  sampling_defaults=dict(sampling_defaults or {}))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.close()

    app = FastAPI(title="lightserve", lifespan=lifespan)
    app.state.front = front
    app.include_router(router)
    app.include_router(ops_api.router)
    app.include_router(openai_api.router)
    app.include_router(lightllm_api.router)
    app.include_router(responses_api.router)
    app.include_router(vllm_api.router)
    for exc_type, handler in _HANDLERS.items():
        app.add_exception_handler(exc_type, handler)
    app.add_middleware(_FrontMiddleware, api_key=config.api_key, metrics=metrics, drain=drain)
    return app


# ---- shared request plumbing ------------------------------------------------------------------------
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


def parse_model(cls: type[M], data: dict) -> M:
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = ".".join(str(p) for p in err["loc"]) or "body"
        raise ApiError(400, err["msg"], param) from None


def check_model(front: Front, model: str | None) -> None:
    if model is not None and model not in front.model_names:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{front.model_name}`.",
                       "model", "model_not_found")


async def encode_text(front: Front, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    if len(text) > front.max_prompt_chars:
        raise ApiError(400, f"the prompt is longer than this server's context ({front.max_model_len} tokens)", param)
    encode = front.tokenizer.encode
    if len(text) < INLINE_ENCODE_CHARS:
        return encode(text, add_special_tokens=add_special_tokens)
    # Safe off-loop: encoding without truncation/padding never mutates the Rust tokenizer.
    return await asyncio.to_thread(encode, text, add_special_tokens=add_special_tokens)


def render_chat(front: Front, messages: Any, param: str = "messages", tools: list[dict] | None = None) -> str:
    """Messages through the model's chat template (transformers renders it in a sandboxed Jinja env).
    `tools` go to the template's `tools` argument, or into the system message for a template that
    takes none (chat_output.with_tool_prompt)."""
    norm = normalize_messages(messages, param)
    kwargs = {}
    if tools:
        if template_takes_tools(front.tokenizer.chat_template):
            kwargs["tools"] = tools
        else:
            norm = with_tool_prompt(norm, tools, front.config.tool_call_parser)
    try:
        return front.tokenizer.apply_chat_template(norm, tokenize=False, add_generation_prompt=True, **kwargs)
    except (jinja2.TemplateError, TypeError, ValueError) as exc:
        raise ApiError(400, f"the chat template rejected the messages: {exc}", param) from None


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
    """engine.check_prompt plus the edge's own bounds; ParamError fields renamed to the API's names."""
    try:
        for name in ("max_new_tokens", "min_new_tokens", "top_k", "top_logprobs"):
            value = getattr(params, name)
            if isinstance(value, int) and not _INT32[0] <= value <= _INT32[1]:
                raise ParamError(name, "is out of range")
        for name in ("top_logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if isinstance(value, int) and value > front.config.max_top_logprobs:
                raise ParamError(name, f"must be <= {front.config.max_top_logprobs} (--max_top_logprobs)")
        if isinstance(params.max_new_tokens, int) and params.max_new_tokens > front.max_model_len:
            raise ParamError("max_new_tokens", f"must be <= {front.max_model_len}, this server's context length")
        return front.engine.check_prompt(prompt_ids, params, prompt_param)
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


async def generate_one(front: Front, prompt_ids: list[int], params: SamplingParams) -> Generation:
    """Run one request to its end, recording its latency metrics."""
    out = Generation(len(prompt_ids))
    texts: list[str] = []
    timer = front.metrics.timer()
    try:
        async for delta in front.engine.generate(prompt_ids, params):
            if delta.token_ids:
                timer.on_tokens(len(delta.token_ids))
                out.token_ids += delta.token_ids
                out.token_texts += delta.token_texts
                out.logprobs += delta.logprobs
                out.top_logprobs += delta.top_logprobs
            if delta.prompt_logprobs is not None:
                out.prompt_logprobs, out.prompt_top_logprobs = delta.prompt_logprobs, delta.prompt_top_logprobs
            texts.append(delta.text)
            out.num_output, out.finish, out.cached_len = delta.num_output, delta.finish, delta.cached_len
    except asyncio.CancelledError:
        timer.on_finish("disconnect")
        raise
    except Exception:
        timer.on_finish("error")
        raise
    timer.on_finish(out.finish.api_name() or "abort")
    out.text = "".join(texts)
    return out


async def start_generation(request: Request, front: Front, prompt_ids: list[int], params: SamplingParams
                           ) -> tuple[ReqTimer, AsyncIterator[ReqDelta], ReqDelta]:
    """Start one streamed request and wait for its first delta, so engine errors (overload, dead)
    still become HTTP statuses and a client that leaves while queued is noticed.
    Returns (its latency timer, the delta generator, the first delta)."""
    timer = front.metrics.timer()
    gen = front.engine.generate(prompt_ids, params)
    try:
        first = await until_disconnect(request, gen.__anext__())
    except BaseException as exc:
        timer.on_finish("disconnect" if isinstance(exc, (ClientGone, asyncio.CancelledError)) else "error")
        raise
    return timer, gen, first


async def until_disconnect(request: Request, aw: Awaitable[T]) -> T:
    """Await `aw` unless the client disconnects first: then cancel it (an engine generator's finally
    aborts its request) and raise ClientGone. Used for non-streaming work and a stream's first item."""
    work = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we were cancelled (server shutdown): take the work down too
        work.cancel()
        watch.cancel()
        raise
    watch.cancel()
    if work in done:
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    raise ClientGone()


class EventStream(StreamingResponse):
    """SSE response that closes its body iterator however the stream ends. Starlette only cancels
    the sending task on disconnect; closing the iterator aborts the engine request at once rather
    than when the garbage collector finalizes the suspended generator."""
    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


def stop_list(stop: Any, param: str) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise ApiError(400, "must be a string or a list of strings", param)


# ---- utility routes ----------------------------------------------------------------------------------
router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    front_metrics = get_front(request).metrics
    return Response(front_metrics.render(), media_type=front_metrics.content_type)


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    front = get_front(request)
    cards = [{"id": name, "object": "model", "created": _START_TIME, "owned_by": "lightserve",
              "root": front.model_name, "parent": None, "max_model_len": front.max_model_len}
             for name in front.model_names]
    return json_response({"object": "list", "data": cards})


@router.get("/get_model_name")
async def get_model_name(request: Request) -> Response:
    return json_response({"model_name": get_front(request).model_name})


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    front = get_front(request)
    body = await read_json(request)
    check_model(front, _typed(body, "model", str, None))
    if "messages" in body:
        text = render_chat(front, body["messages"])
        tokens = await encode_text(front, text, "messages", add_special_tokens=False)
    else:
        text = _typed(body, "prompt", str, None)
        if text is None:
            raise ApiError(400, "give `prompt` (a string) or `messages`", "prompt")
        tokens = await encode_text(front, text, "prompt", _typed(body, "add_special_tokens", bool, True))
    return json_response({"tokens": tokens, "count": len(tokens), "max_model_len": front.max_model_len})


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    front = get_front(request)
    body = await read_json(request)
    check_model(front, _typed(body, "model", str, None))
    tokens = body.get("tokens")
    vocab = front.engine.vocab_size
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
        raise ApiError(400, f"must be a list of token ids in [0, {vocab})", "tokens")
    return json_response({"prompt": front.tokenizer.decode(tokens)})


_START_TIME = int(time.time())


# ---- errors and middleware -------------------------------------------------------------------------
def error_response(path: str, status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    if path in LIGHTLLM_PATHS:
        return json_response({"error": message, "param": param}, status, headers)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json_response({"error": {"message": message, "type": kind, "param": param, "code": code}}, status, headers)


def _handler(status: int, code: str, headers: dict[str, str] | None = None) -> Callable:
    async def handle(request: Request, exc: Exception) -> Response:
        return error_response(request.url.path, status, str(exc) or code, None, code, headers)
    return handle


async def _api_error(request: Request, exc: ApiError) -> Response:
    message = exc.message if exc.param in (None, "body") else f"{exc.param}: {exc.message}"
    return error_response(request.url.path, exc.status, message, exc.param, exc.code, exc.headers)


async def _param_error(request: Request, exc: ParamError) -> Response:
    return error_response(request.url.path, 400, str(exc), exc.param)


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
    return error_response(request.url.path, 400, f"{param}: {err.get('msg')}", param)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(request.url.path, exc.status_code, str(exc.detail), None, code, exc.headers)


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.error("unhandled error on %s", request.url.path, exc_info=exc)
    if request.url.path in GENERATE_PATHS:  # sent by ServerErrorMiddleware, outside _FrontMiddleware's count
        get_front(request).metrics.requests.labels("500").inc()
    return error_response(request.url.path, 500, "internal server error", None, "internal_error")


_HANDLERS: dict[type[Exception], Callable] = {
    ApiError: _api_error,
    ParamError: _param_error,
    RequestValidationError: _validation_error,
    StarletteHTTPException: _http_error,
    EngineOverloaded: _handler(503, "overloaded", {"Retry-After": "1"}),
    EngineDead: _handler(503, "engine_dead"),
    ShuttingDown: _handler(503, "shutting_down", {"Retry-After": "1"}),
    RequestTimeout: _handler(408, "timeout"),
    ClientGone: _client_gone,
    ClientDisconnect: _client_gone,
    Exception: _internal_error,
}


class _FrontMiddleware:
    """Bearer-key auth on every route but the probes, requests_total for the generation routes, and
    the drain's count of generation requests in flight (503 for new ones while draining).
    Pure ASGI: Starlette's BaseHTTPMiddleware would sit in every streamed chunk's path."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: FrontMetrics, drain: Drain):
        self.app = app
        self.expected = None if api_key is None else api_key.encode()
        self.requests = metrics.requests
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self.expected is not None and path not in OPEN_PATHS and not self._authorized(scope):
            response = error_response("", 401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                                      None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        if path not in GENERATE_PATHS:
            return await self.app(scope, receive, send)
        requests = self.requests

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                requests.labels(str(message["status"])).inc()
            await send(message)

        if self.drain.draining:
            response = error_response(path, 503, "the server is shutting down; retry on another replica", None,
                                      "shutting_down", {"Retry-After": "1"})
            return await response(scope, receive, counting_send)
        self.drain.enter()
        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.drain.leave()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)
        return False


# ---- private helpers ---------------------------------------------------------------------------------
def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes", "body", "request_too_large")


def _typed(body: dict, name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not kind:
        raise ApiError(400, f"must be a {kind.__name__}", name)
    return value


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
