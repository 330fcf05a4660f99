"""The HTTP front's FastAPI app: `create_app`, the one list of route modules, auth and the drain's
count (middleware), error rendering, and the utility routes (metrics, models, tokenize).

The launcher calls `create_app`. Each route module (ROUTE_MODULES) has an `ApiRouter` that declares
its routes' error shape and whether they are generation routes, so adding an endpoint is its route
module plus one line here. Route modules import only front.py / streams.py, never this module.
"""
from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from lightserve.chat.tool_parsers import choose_tool_parser
from lightserve.engine.generation import EngineDead, EngineOverloaded, RequestTimeout, ShuttingDown
from lightserve.http import anthropic_api, lightllm_api, lora_api, openai_api, ops_api, responses_api, vllm_api
from lightserve.http.drain import Drain
from lightserve.http.front import (
    ApiError,
    ApiRouter,
    ClientGone,
    ErrorStyle,
    Front,
    anthropic_error,
    check_model,
    encode_text,
    get_front,
    json_response,
    read_json,
)
from lightserve.http.metrics import FrontMetrics
from lightserve.log import get_logger
from lightserve.sampling import ParamError

if TYPE_CHECKING:
    from lightserve.config import ServerConfig
    from lightserve.engine.client import EngineClient

logger = get_logger(__name__)

router = ApiRouter()  # the utility routes below

# Every route module, in the order their routes are matched.
ROUTE_MODULES = (ops_api, openai_api, lightllm_api, responses_api, anthropic_api, vllm_api, lora_api)
OPEN_PATHS = frozenset({"/health", "/health_generate"})  # reachable without the API key (probes)


@dataclass(frozen=True)
class RouteTable:
    """Per path, what the routers declared: the error shape and whether it is a generation route."""
    styles: dict[str, ErrorStyle]  # paths whose shape is not OpenAI's
    generate_paths: frozenset[str]

    @classmethod
    def of(cls, routers: list[ApiRouter]) -> RouteTable:
        styles = {route.path: r.error_style for r in routers if r.error_style is not ErrorStyle.OPENAI
                  for route in r.routes}
        return cls(styles, frozenset(route.path for r in routers if r.generation for route in r.routes))

    def error_style(self, path: str) -> ErrorStyle:
        return self.styles.get(path, ErrorStyle.OPENAI)


def create_app(config: ServerConfig, engine: EngineClient, tokenizer: Any, model_name: str,
               health: Callable[[], str | None], model_dir: str = "",
               sampling_defaults: dict[str, Any] | None = None) -> FastAPI:
    metrics = FrontMetrics(engine, model_name, config.kv_cache_dtype.value, config.kv_bytes_per_token or 0)
    vocab = tokenizer.get_vocab()
    # Byte-level BPE and SentencePiece vocab strings are at least as long as the text they decode to.
    max_token_chars = max((len(t) for t in vocab), default=1)
    tool_parser, why = choose_tool_parser(config.tool_call_parser, tokenizer.chat_template, vocab,
                                          config.model.architecture if config.model is not None else None)
    logger.info("tool calls (tool_choice auto): %s, since %s", tool_parser or "off", why)
    drain = Drain(engine, config.shutdown_grace_s)
    front = Front(config, engine, tokenizer, model_name, health, metrics, drain,
                  frozenset(getattr(tokenizer, "all_special_ids", ())), max_token_chars * engine.max_req_total_len,
                  model_dir=model_dir,
                  model_names=(model_name, *[n for n in config.served_model_name or () if n != model_name]),
                  sampling_defaults=dict(sampling_defaults or {}), tool_parser=tool_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.close()

    app = FastAPI(title="lightserve", lifespan=lifespan)
    app.state.front = front
    routers = [router, *(module.router for module in ROUTE_MODULES)]
    for r in routers:
        app.include_router(r)
    app.state.routes = routes = RouteTable.of(routers)
    for exc_type, handler in _HANDLERS.items():
        app.add_exception_handler(exc_type, handler)
    app.add_middleware(_FrontMiddleware, api_key=config.api_key, metrics=metrics, drain=drain, routes=routes)
    return app


# ---- utility routes ----------------------------------------------------------------------------------
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
    # Adapters as vLLM lists them: each its own model whose parent is the base.
    cards += [{"id": entry.name, "object": "model", "created": _START_TIME, "owned_by": "lightserve",
               "root": entry.adapter.path, "parent": front.model_name, "max_model_len": front.max_model_len}
              for entry in front.engine.adapters or ()]
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
        text = front.render_chat(body["messages"])
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
def error_response(style: ErrorStyle, status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    if style is ErrorStyle.LIGHTLLM:
        return json_response({"error": message, "param": param}, status, headers)
    if style is ErrorStyle.ANTHROPIC:
        return json_response(anthropic_error(status, message), status, headers)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json_response({"error": {"message": message, "type": kind, "param": param, "code": code}}, status, headers)


def _route_error(request: Request, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> Response:
    style = request.app.state.routes.error_style(request.url.path)
    return error_response(style, status, message, param, code, headers)


def _handler(status: int, code: str, headers: dict[str, str] | None = None) -> Callable:
    async def handle(request: Request, exc: Exception) -> Response:
        return _route_error(request, status, str(exc) or code, None, code, headers)
    return handle


async def _api_error(request: Request, exc: ApiError) -> Response:
    message = exc.message if exc.param in (None, "body") else f"{exc.param}: {exc.message}"
    return _route_error(request, exc.status, message, exc.param, exc.code, exc.headers)


async def _param_error(request: Request, exc: ParamError) -> Response:
    return _route_error(request, 400, str(exc), exc.param)


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
    return _route_error(request, 400, f"{param}: {err.get('msg')}", param)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return _route_error(request, exc.status_code, str(exc.detail), None, code, exc.headers)


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.error("unhandled error on %s", request.url.path, exc_info=exc)
    if request.url.path in request.app.state.routes.generate_paths:
        # sent by ServerErrorMiddleware, outside _FrontMiddleware's count
        get_front(request).metrics.requests.labels("500").inc()
    return _route_error(request, 500, "internal server error", None, "internal_error")


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

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: FrontMetrics, drain: Drain, routes: RouteTable):
        self.app = app
        self.expected = None if api_key is None else api_key.encode()
        self.requests = metrics.requests
        self.drain = drain
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self.expected is not None and path not in OPEN_PATHS and not self._authorized(scope):
            # LightLLM's routes answer this one in OpenAI's shape too: clients read error.code.
            style = ErrorStyle.ANTHROPIC if self.routes.error_style(path) is ErrorStyle.ANTHROPIC else ErrorStyle.OPENAI
            response = error_response(style, 401,
                                      "missing or wrong API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                                      None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        if path not in self.routes.generate_paths:
            return await self.app(scope, receive, send)
        requests = self.requests

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                requests.labels(str(message["status"])).inc()
            await send(message)

        if self.drain.draining:
            response = error_response(self.routes.error_style(path), 503,
                                      "the server is shutting down; retry on another replica", None,
                                      "shutting_down", {"Retry-After": "1"})
            return await response(scope, receive, counting_send)
        self.drain.enter()
        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.drain.leave()

    def _authorized(self, scope: Scope) -> bool:
        """OpenAI's `Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY`: either one right."""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected):
                    return True
            elif name == b"x-api-key" and hmac.compare_digest(value.strip(), self.expected):
                return True
        return False


# ---- private helpers ---------------------------------------------------------------------------------
def _typed(body: dict, name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not kind:
        raise ApiError(400, f"must be a {kind.__name__}", name)
    return value
