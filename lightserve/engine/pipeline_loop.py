"""PipelineLoop: the offline pipeline's loop thread, which alone touches the EngineClient and runs every
request (`run_req`, one `Response`), and the thread that watches the child processes.
`lightserve.pipeline.Pipeline` owns one and submits every coroutine to it.

Threads: the loop thread runs an asyncio loop (uvloop when installed); `submit` hands it a coroutine from
any thread (`run_coroutine_threadsafe`). The watcher thread waits on the children's sentinels and marks the
client dead when one exits. `close` drains like the server, then stops both threads.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import typing
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightserve.config import ServerConfig
from lightserve.engine.generation import Generation, ShuttingDown
from lightserve.log import get_logger
from lightserve.sampling import SamplingParams

if TYPE_CHECKING:
    from lightserve.engine.client import EngineClient
    from lightserve.engine.procs import EngineProcs

logger = get_logger(__name__)

OPEN_TIMEOUT_S = 60.0     # creating the EngineClient on the loop (sockets only)
SHUTDOWN_WAIT_S = 5.0     # after the drain, aborted calls get this long to receive their abort
CLOSED_REASON = "the pipeline was closed before the request finished"


@dataclass
class Response:
    """One prompt's result (`infer`), or one chunk of it (`stream_infer`, `generate`).

    In a chunk, `text`, `token_ids` and `logprobs` are what is new since the prompt's previous
    chunk and `generated_tokens` is the running count; `finish_reason` is None until the last one.
    """
    index: int                        # the prompt's position in the call's list
    text: str
    token_ids: list[int]
    finish_reason: str | None         # "stop", "length", "abort"; None while streaming
    prompt_tokens: int
    generated_tokens: int
    logprobs: list[float] | None = None  # of the chosen tokens; only when asked


class PipelineLoop:
    """The loop thread and the child watcher of one pipeline. Starts both and opens the client; a failure
    on the way stops what started and raises."""

    def __init__(self, procs: EngineProcs, config: ServerConfig):
        self.config = config
        self._procs = procs
        self.engine: EngineClient | None = None  # created on the loop; other threads read only its constants
        self.dead_reason: str | None = None      # set when a child process died; every call then fails
        self.num_in_flight = 0                   # requests in the engine; written on the loop only
        self._tasks: set[asyncio.Task] = set()   # loop-side calls, failed or cancelled at close()
        self._slots: asyncio.Semaphore | None = None  # created on the loop (_open)
        self._stop_watch = threading.Event()
        self._watch_thread: threading.Thread | None = None
        self._loop = _new_event_loop()
        self._loop_thread = threading.Thread(target=self._run_loop, name="lightserve-pipeline-loop", daemon=True)
        try:
            self._loop_thread.start()
            asyncio.run_coroutine_threadsafe(self._open(), self._loop).result(OPEN_TIMEOUT_S)
            self._watch_thread = threading.Thread(target=self._watch_children, name="lightserve-child-watch",
                                                  daemon=True)
            self._watch_thread.start()
        except BaseException:
            self.close()
            raise

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._loop_thread

    def submit(self, coro: typing.Coroutine) -> Future:
        """Run `coro` on the loop; close() waits for it (then aborts it). The caller keeps submissions from
        racing close()."""
        return asyncio.run_coroutine_threadsafe(self._tracked(coro), self._loop)

    async def run_req(self, index: int, prompt_ids: list[int], params: SamplingParams, want_lp: bool,
                      emit: Callable[[Response], None] | None) -> Response:
        """On the loop: one request, once it has a pool slot. With `emit`, every chunk goes to it; else the
        whole result is returned."""
        out = Generation(len(prompt_ids))
        # The client queues callers beyond the pool's slots only up to max_queue_size, then refuses them
        # (HTTP 503). An offline batch should wait instead, so calls queue here first.
        async with self._slots:
            self.num_in_flight += 1
            try:
                async with contextlib.aclosing(self.engine.generate(prompt_ids, params)) as deltas:
                    async for delta in deltas:
                        out.add(delta)
                        if emit is not None and (delta.text or delta.token_ids or delta.finish):
                            emit(Response(index, delta.text, delta.token_ids, delta.finish.api_name(), out.prompt_len,
                                          delta.num_output, delta.logprobs if want_lp else None))
            except ShuttingDown:
                if emit is None:
                    raise
                # close() ended the drain: a stream ends like the server's, with an "abort" chunk.
                emit(Response(index, "", [], "abort", out.prompt_len, out.num_output, [] if want_lp else None))
            finally:
                self.num_in_flight -= 1
        return Response(index, out.text, out.token_ids, out.finish.api_name(), out.prompt_len, out.num_output,
                        out.logprobs if want_lp else None)

    def close(self) -> bool:
        """Drain (calls in flight get shutdown_grace_s, then the client's abort_all ends them), close the
        client and stop both threads. Returns whether a KeyboardInterrupt cut the drain short (the caller
        raises it once the processes are stopped). Not from the loop thread."""
        self._stop_watch.set()
        if self._watch_thread is not None:
            self._watch_thread.join()  # it reads procs.children, which EngineProcs.stop() clears
        loop_alive = self._loop_thread.is_alive()
        interrupted = False
        if self.engine is not None and loop_alive:
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
            try:
                fut.result(self.config.shutdown_grace_s + SHUTDOWN_WAIT_S * 2)
            except KeyboardInterrupt:
                interrupted = True
                self._loop.call_soon_threadsafe(self.engine.abort_all, CLOSED_REASON)
                with contextlib.suppress(Exception):
                    fut.result(SHUTDOWN_WAIT_S * 2)
            except Exception:  # still stop the loop (and the caller the processes)
                logger.exception("pipeline: closing the engine client failed")
        self._loop.call_soon_threadsafe(self._loop.stop)
        if loop_alive:
            self._loop_thread.join(SHUTDOWN_WAIT_S)
        if not self._loop.is_running():
            self._loop.close()
        return interrupted

    # ---- the loop thread ------------------------------------------------------------------------------------
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _open(self) -> None:
        from lightserve.engine.client import EngineClient  # here: importing the pipeline stays free of zmq

        self.engine = EngineClient(self.config, self._procs.pool, self.config.max_req_total_len,
                                   self.config.vocab_size)
        self.engine.start()
        self._slots = asyncio.Semaphore(self._procs.pool.num_slots)

    async def _tracked(self, coro: typing.Coroutine) -> Any:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            return await coro
        finally:
            self._tasks.discard(task)

    async def _shutdown(self) -> None:
        """The drain: calls in flight get shutdown_grace_s, then the rest are aborted."""
        if self._tasks:
            _, late = await asyncio.wait(list(self._tasks), timeout=self.config.shutdown_grace_s)
            if late:
                logger.warning("pipeline: aborting %d calls still running after %g s", len(late),
                               self.config.shutdown_grace_s)
        self.engine.abort_all(CLOSED_REASON)
        if self._tasks:
            _, late = await asyncio.wait(list(self._tasks), timeout=SHUTDOWN_WAIT_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await self.engine.close()

    # ---- the watcher thread ---------------------------------------------------------------------------------
    def _watch_children(self) -> None:
        while not self._stop_watch.is_set():
            child = self._procs.watch(timeout=0.5)
            if child is None or self._stop_watch.is_set():
                continue
            reason = f"{child.name} (pid {child.proc.pid}) exited with code {child.proc.exitcode}"
            logger.error("%s; the pipeline cannot generate any more, close it", reason)
            self.dead_reason = reason
            self.engine.mark_dead_threadsafe(reason)  # in-flight and later calls raise EngineDead
            return


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
