"""Running requests for the HTTP routes: to their end (`generate_one`, `run_all`), or as a stream of
(request index, delta) whose first delta is awaited before the response starts (`start_stream`);
`until_disconnect` ties either to the client's connection, `relay` turns one request's deltas into
an API's stream events, and `EventStream` is the SSE response.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Send

from lightserve.engine.generation import EngineDead, Generation, RequestTimeout, ShuttingDown, gather_all
from lightserve.http.front import ClientGone, Front, dumps
from lightserve.log import get_logger
from lightserve.messages import FinishReason, ReqDelta
from lightserve.sampling import SamplingParams

if TYPE_CHECKING:
    from lightserve.http.metrics import ReqTimer

logger = get_logger(__name__)

T = TypeVar("T")
Item = tuple[int, ReqDelta]  # (index of the request in the call's list, its delta)


async def generate_one(front: Front, prompt_ids: list[int], params: SamplingParams) -> Generation:
    """Run one request to its end, recording its latency metrics."""
    out = Generation(len(prompt_ids))
    timer = front.metrics.timer()
    try:
        async for delta in front.engine.generate(prompt_ids, params):
            if delta.token_ids:
                timer.on_tokens(len(delta.token_ids))
            out.add(delta)
    except asyncio.CancelledError:
        timer.on_finish("disconnect")
        raise
    except Exception:
        timer.on_finish("error")
        raise
    timer.on_finish(out.finish.api_name() or "abort")
    return out


async def run_all(front: Front, prompts: list[list[int]], params: list[SamplingParams]) -> list[Generation]:
    """Every request to its end, concurrently; one failing (or our cancellation) aborts the rest."""
    return await gather_all([generate_one(front, ids, p) for ids, p in zip(prompts, params)])


async def start_stream(request: Request, front: Front, prompts: list[list[int]], params: list[SamplingParams]
                       ) -> tuple[list[ReqTimer], AsyncIterator[Item], Item]:
    """Start the requests and wait for the first delta, so engine errors (overload, dead) still become
    HTTP statuses and a client that leaves while queued is noticed. Returns (a latency timer per
    request, the rest of the deltas, the first one)."""
    timers = [front.metrics.timer() for _ in prompts]
    items = merged(front, prompts, params)
    try:
        first = await until_disconnect(request, _first(items))
    except BaseException as exc:
        reason = "disconnect" if isinstance(exc, (ClientGone, asyncio.CancelledError)) else "error"
        for timer in timers:
            timer.on_finish(reason)
        raise
    return timers, items, first


async def merged(front: Front, prompts: list[list[int]], params: list[SamplingParams]) -> AsyncIterator[Item]:
    """Several requests' deltas in arrival order. Each runs in its own task; closing this generator
    cancels the tasks, which aborts the unfinished requests."""
    if len(prompts) == 1:  # no task needed
        gen = front.engine.generate(prompts[0], params[0])
        try:
            async for delta in gen:
                yield 0, delta
        finally:
            await gen.aclose()  # abort now even if we are closed while suspended at our yield
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for delta in front.engine.generate(prompts[i], params[i]):
                queue.put_nowait((i, delta))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(prompts))]
    try:
        left = len(prompts)
        while left:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item.finish != FinishReason.NONE:
                left -= 1
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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


async def relay(start: list[bytes], first: ReqDelta, items: AsyncIterator[Item], timer: ReqTimer,
                events: Callable[[ReqDelta], list[bytes]], error: Callable[[str, str], bytes]
                ) -> AsyncIterator[bytes]:
    """One request's SSE body in an API's event shape: `start`, then `events(delta)` for each delta
    (the final one last: its finish is set), each delta's events sent together. A failure mid-stream
    (timeout, engine dead, drain ended, a bug) ends it with `error(code, message)`. Records the
    request's latency metrics on `timer`."""
    delta: ReqDelta | None = first
    ended = False
    try:
        yield b"".join(start)
        while delta is not None:
            if delta.token_ids:
                timer.on_tokens(len(delta.token_ids))
            out = events(delta)
            if delta.finish != FinishReason.NONE:
                ended = True
                timer.on_finish(delta.finish.api_name())
            if out:
                yield b"".join(out)
            item = None if ended else await anext(items, None)
            delta = None if item is None else item[1]
    except Exception as exc:  # noqa: BLE001 - the response has started: an error event is all we can send
        ended = True
        timer.on_finish("error")
        yield error(*stream_error(exc))
    finally:
        if not ended:
            timer.on_finish("disconnect")
        await items.aclose()


def sse_event(kind: str, body: dict) -> bytes:
    """A named server-sent event, as the Responses and Anthropic streams send them."""
    return b"event: " + kind.encode() + b"\ndata: " + dumps(body) + b"\n\n"


def stream_error(exc: Exception) -> tuple[str, str]:
    """(code, message) of a failure in a stream that already started; unexpected ones are logged."""
    for kind, code in ((RequestTimeout, "timeout"), (EngineDead, "engine_dead"), (ShuttingDown, "shutting_down")):
        if isinstance(exc, kind):
            return code, str(exc)
    logger.error("stream failed", exc_info=exc)
    return "internal_error", "internal server error"


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


async def _first(items: AsyncIterator[Item]) -> Item:
    return await items.__anext__()


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class DeltaBlocks:
    """The order a streamed chat answer's parts open in, for the APIs that stream them as typed blocks (Anthropic's
    content blocks, the Responses API's output items): ChatOutput's delta fields -> the reasoning block (where
    `show_reasoning`), the text block, then a block per tool call, each call closing the block before it. Subclasses
    name the two text kinds and build the events: `_text(kind, delta)`, `_call(call_id, name, arguments)`,
    `_close()`, each returning the stream events (bytes) of that step."""

    REASONING = TEXT = ""
    show_reasoning = True

    def add(self, fields: dict) -> list[bytes]:
        events = []
        if fields.get("reasoning_content") and self.show_reasoning:
            events += self._text(self.REASONING, fields["reasoning_content"])
        if fields.get("content"):
            events += self._text(self.TEXT, fields["content"])
        for call in fields.get("tool_calls", ()):
            events += self._close()
            events += self._call(call["id"], call["function"]["name"], call["function"]["arguments"])
        return events

    def _text(self, kind: str, delta: str) -> list[bytes]:
        raise NotImplementedError

    def _call(self, call_id: str, name: str, arguments: str) -> list[bytes]:
        raise NotImplementedError

    def _close(self) -> list[bytes]:
        raise NotImplementedError
