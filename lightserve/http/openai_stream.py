"""OpenAI's stream of chunks for /v1/completions and /v1/chat/completions: every chunk is the response's head
plus one choice, then the usage chunk when asked, then `[DONE]`; a drain's end, a timeout or a dead engine
ends it as OpenAI clients expect. Called by openai_api.py.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from fastapi import Request
from starlette.responses import Response

from lightserve.engine.generation import EngineDead, RequestTimeout, ShuttingDown
from lightserve.http.front import Front, dumps
from lightserve.http.metrics import ReqTimer
from lightserve.http.openai_output import usage_dict
from lightserve.http.streams import EventStream, Item, start_stream
from lightserve.log import get_logger
from lightserve.messages import FinishReason, ReqDelta
from lightserve.sampling import SamplingParams

logger = get_logger(__name__)

_DONE = b"data: [DONE]\n\n"


class _Choice:
    """Per-prompt bookkeeping of a stream, for usage and metrics."""
    __slots__ = ("cached_len", "done", "num_output", "prompt_len", "timer")

    def __init__(self, timer: ReqTimer, prompt_len: int):
        self.timer, self.prompt_len, self.num_output, self.cached_len, self.done = timer, prompt_len, 0, 0, False


async def open_stream(request: Request, front: Front, prompts: list[list[int]], params: list[SamplingParams],
                      head: dict, chunk: Callable[[int, ReqDelta], dict | None], include_usage: bool,
                      role_choice: dict | None) -> Response:
    """Start the requests (the first delta is awaited, streams.start_stream), then stream SSE: `head` plus
    `chunk(i, delta)` as each choice's delta, `role_choice` first when given, the usage chunk last when asked."""
    timers, items, first = await start_stream(request, front, prompts, params)
    choices = [_Choice(timer, len(ids)) for timer, ids in zip(timers, prompts)]
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


def _finish_open(choices: list[_Choice], reason: str) -> None:
    for c in choices:
        if not c.done:
            c.done = True
            c.timer.on_finish(reason)

