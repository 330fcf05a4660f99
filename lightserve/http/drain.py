"""Drain: the HTTP front's graceful shutdown, started by the launcher on SIGTERM or Ctrl-C.

While draining, new generation requests get 503 with Retry-After and /health answers 503
"draining" (so load balancers and Kubernetes stop sending), and the requests in flight run on for
up to --shutdown_grace_s. Those still running then, or when a second signal cuts the wait short,
are aborted visibly: `EngineClient.abort_all` fails them with `ShuttingDown`, which a stream turns
into a last chunk with finish_reason "abort" and a non-streaming request into a 503 JSON error.
The counting is done by `app._FrontMiddleware`, which wraps every generation request from
its first byte to the end of its response body. `DrainingServer` is the uvicorn server the launcher
runs: its signal handler starts the drain instead of uvicorn's immediate shutdown.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import uvicorn

from lightserve.log import get_logger

if TYPE_CHECKING:
    from lightserve.engine.client import EngineClient

logger = get_logger(__name__)

# After the abort, how long the aborted requests get to send their last chunk or 503. They need one
# event-loop turn each; this only bounds a client that does not read.
FLUSH_S = 5.0
SHUTDOWN_REASON = "the server is shutting down"


class Drain:
    """Shutdown state of one HTTP front. Every method runs on the front's event loop."""

    def __init__(self, engine: EngineClient, grace_s: float):
        self.engine = engine
        self.grace_s = grace_s
        self.draining = False
        self.in_flight = 0              # generation requests whose response has not ended yet
        self._idle = asyncio.Event()    # set while draining with nothing in flight
        self._cut = asyncio.Event()     # a second signal: abort now

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        if self.draining and self.in_flight == 0:
            self._idle.set()

    def cut(self) -> None:
        """Stop waiting for the grace period (a second SIGTERM or Ctrl-C)."""
        self._cut.set()

    async def run(self) -> None:
        """Refuse new requests, wait for those in flight (at most grace_s, or until cut()), abort
        the rest and let their last chunks go out. Returns when the front may close its sockets."""
        self.draining = True
        t0 = time.monotonic()
        if self.in_flight == 0:
            self._idle.set()
        logger.info("draining: %d requests in flight get up to %g s (a second signal aborts them now)",
                    self.in_flight, self.grace_s)
        idle, cut = asyncio.ensure_future(self._idle.wait()), asyncio.ensure_future(self._cut.wait())
        try:
            await asyncio.wait((idle, cut), timeout=self.grace_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
            cut.cancel()
        left = self.in_flight
        # Also when nothing is left: a request that got past the middleware just before the drain
        # began (still reading its body, say) is refused by the engine from here on.
        self.engine.abort_all(SHUTDOWN_REASON)
        if left:
            logger.warning("aborting %d requests still running after %.1f s of draining", left, time.monotonic() - t0)
            try:
                await asyncio.wait_for(self._idle.wait(), FLUSH_S)
            except TimeoutError:
                logger.warning("%d aborted requests did not end in %g s; closing their connections", self.in_flight,
                               FLUSH_S)
        else:
            logger.info("drained in %.1f s", time.monotonic() - t0)


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM and SIGINT start the drain instead of closing the sockets: the
    port stays open, so a new request hears 503 rather than a refused connection. A second signal
    cuts the drain short; uvicorn's own shutdown (close the sockets, wait for the connections,
    lifespan shutdown) runs once the drain is over.

    The signal handler only counts: it may run between any two bytecodes of the event loop's thread,
    so the drain starts on the loop at uvicorn's next tick (every 0.1 s).
    """

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        self.num_signals = 0
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: object) -> None:
        # NOTE: replaces uvicorn's handler, which would shut down at once and re-raise the signal
        # when done; the launcher's own stop follows run() instead.
        self.num_signals += 1

    async def on_tick(self, counter: int) -> bool:
        if self.num_signals and self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain_then_exit())
        if self.num_signals > 1:
            self.drain.cut()
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain.run()
        finally:
            self.should_exit = True
