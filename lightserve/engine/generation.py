"""A request's run as its caller sees it: the result accumulated from its deltas (`Generation`), the ways
`EngineClient.generate` fails (`EngineOverloaded`, `EngineDead`, `RequestTimeout`, `ShuttingDown`), and
`gather_all`, which runs several requests together and ends the others when one fails. Shared by the HTTP
front and the offline pipeline; no HTTP here, and light to import (no zmq).
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from lightserve.messages import FinishReason, ReqDelta


class EngineOverloaded(Exception):
    """The request pool and its waiting queue are full (HTTP 503 with Retry-After)."""


class EngineDead(Exception):
    """An engine process died; no request can complete (HTTP 503)."""


class RequestTimeout(Exception):
    """The request ran past --request_timeout_s and was aborted."""


class ShuttingDown(Exception):
    """The server is shutting down: a new request is refused, or one still running at the end of the
    drain's grace period is aborted (HTTP 503 with Retry-After; in a stream, a last "abort" chunk)."""


@dataclass
class Generation:
    """One request's output so far: `add` each delta in arrival order."""
    prompt_len: int
    token_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_output: int = 0
    finish: FinishReason = FinishReason.NONE
    cached_len: int = 0
    prompt_logprobs: list[float] | None = None      # prompt tokens 1..prompt_len-1, when asked for
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    text_parts: list[str] = field(default_factory=list)  # joined on read: one join, not one copy per delta

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @text.setter
    def text(self, value: str) -> None:
        self.text_parts = [value]

    def add(self, delta: ReqDelta) -> None:
        if delta.text:
            self.text_parts.append(delta.text)
        if delta.token_ids:
            self.token_ids += delta.token_ids
            self.token_texts += delta.token_texts
            self.logprobs += delta.logprobs
            self.top_logprobs += delta.top_logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_logprobs = delta.prompt_logprobs, delta.prompt_top_logprobs
        self.num_output, self.finish, self.cached_len = delta.num_output, delta.finish, delta.cached_len


async def gather_all(aws: list[Awaitable[Any]]) -> list[Any]:
    """asyncio.gather, but the first failure (or our own cancellation) cancels the others, so no
    request keeps running for a caller that already has its error (an engine generator's finally
    aborts its request)."""
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
