"""The offline pipeline: `pipeline(**server_args)` starts the engine processes (EngineProcs) without the
HTTP front, and its `Pipeline` generates from Python, from any number of threads and event loops.

Threads: the pipeline owns one loop thread running an asyncio loop (uvloop when installed) that
alone touches the EngineClient, and one thread that watches the child processes. Public methods
run in the caller's thread: they tokenize and validate there, submit one coroutine to the loop
(`run_coroutine_threadsafe`), and receive results through a thread-safe queue (`stream_infer`), the
caller's own loop (`generate`) or the coroutine's future (`infer`). Request ids come from the
EngineClient's counter, which only the loop thread advances, so no caller can pick or share one.
NOTE: a little over 400 lines: one noun, but three thread contexts, each commented where it runs.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import multiprocessing
import os
import queue
import threading
import typing
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import TYPE_CHECKING, Any

from lightserve.chat_messages import render_chat
from lightserve.config import ServerConfig
from lightserve.generation import Generation, gather_all
from lightserve.log import get_logger
from lightserve.sampling import SamplingParams

if TYPE_CHECKING:
    from lightserve.engine_client import EngineClient
    from lightserve.engine_procs import EngineProcs

logger = get_logger(__name__)

GenerationConfig = SamplingParams  # one definition for the HTTP API and the pipeline
"""Alias of `SamplingParams`: max_new_tokens, temperature (0 = greedy, the default), top_p, top_k,
ignore_eos, stop, seed, ... Each call works on its own copy, so one config may be reused freely."""

Chat = list[dict[str, Any]]
Prompt = str | Chat
OPEN_TIMEOUT_S = 60.0     # creating the EngineClient on the loop (sockets only)
SHUTDOWN_WAIT_S = 5.0     # after the drain, aborted calls get this long to receive their abort
CLOSED_REASON = "the pipeline was closed before the request finished"
_DONE = object()          # end of a stream, after its last chunk


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


def pipeline(model_dir: str | os.PathLike | None = None, **server_args: Any) -> Pipeline:
    """Start the engine (router, worker ranks, detokenizer) and return a Pipeline.

    `server_args` are ServerConfig fields, the same settings as the server's CLI flags
    (`device="cpu"`, `tp=2`, `data_type="float32"`, `max_total_token_num=16384`, ...); enum fields
    accept their strings. `log_level` defaults to "warning" here, so the children stay quiet.
    Raises TypeError for an unknown setting, ValueError for a bad value, StartError when a process
    fails to start.
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # NOTE: engine processes start with "spawn", which re-imports the caller's main module in
        # each child; a script that calls pipeline() at top level would start engines recursively.
        raise RuntimeError("lightserve.pipeline() was called while a child process imported your main module; "
                           "put the code that creates the pipeline under `if __name__ == '__main__':`")
    return Pipeline(make_config(model_dir, **server_args))


def make_config(model_dir: str | os.PathLike | None = None, **server_args: Any) -> ServerConfig:
    """pipeline()'s settings as a ServerConfig: enum strings converted, unknown names refused."""
    hints = typing.get_type_hints(ServerConfig)
    names = [f.name for f in fields(ServerConfig) if f.name != "model_dir" and f.metadata.get("cli", True)]
    server_args.setdefault("log_level", "warning")
    for key, value in list(server_args.items()):
        if key not in names:
            raise TypeError(f"pipeline() got an unknown setting {key!r}; the settings are: {', '.join(names)}")
        enum_type = _enum_of(hints[key])
        if enum_type is not None and not isinstance(value, enum_type):
            try:
                server_args[key] = enum_type(value.lower() if isinstance(value, str) else value)
            except ValueError:
                raise ValueError(f"{key}: must be one of {[e.value for e in enum_type]}, got {value!r}") from None
    return ServerConfig(model_dir=None if model_dir is None else os.fspath(model_dir), **server_args)


class Pipeline:
    """Offline generation on the engine processes of one launch. Every public method may be
    called from any thread at the same time; `close()` (or a `with` block, or interpreter exit)
    stops the processes and frees their shared memory."""

    def __init__(self, config: ServerConfig):
        from transformers import AutoTokenizer

        from lightserve.engine_procs import EngineProcs, resolve_config

        self._lock = threading.Lock()       # guards _closed against submissions racing close()
        self._closed = False
        self._procs: EngineProcs | None = None
        self._engine: EngineClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._watch_thread: threading.Thread | None = None
        self._stop_watch = threading.Event()
        self.dead_reason: str | None = None  # set when a child process died; every call then fails
        self._num_in_flight = 0             # requests in the engine; written on the loop only
        self._tasks: set[asyncio.Task] = set()  # loop-side calls, failed or cancelled at close()
        self._slots: asyncio.Semaphore | None = None  # created on the loop (_open)
        atexit.register(self.close)  # before start(): a failed or interrupted start still cleans up
        try:
            self._procs = EngineProcs(resolve_config(config))
            self.config: ServerConfig = self._procs.start()
            self.model_dir = model_dir = self.config.model_dir
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
            # NOTE: the first encode resets any truncation/padding stored in tokenizer.json (a write
            # to the Rust tokenizer); doing it here, on one thread, leaves later encodes read-only.
            self.tokenizer.encode("warm up")
            vocab_size = self.config.vocab_size
            self._loop = _new_event_loop()
            self._loop_thread = threading.Thread(target=self._run_loop, name="lightserve-pipeline-loop", daemon=True)
            self._loop_thread.start()
            asyncio.run_coroutine_threadsafe(self._open(vocab_size), self._loop).result(OPEN_TIMEOUT_S)
            self._watch_thread = threading.Thread(target=self._watch_children, name="lightserve-child-watch",
                                                  daemon=True)
            self._watch_thread.start()
        except BaseException:
            self.close()
            raise

    # ---- public API ---------------------------------------------------------------------------------
    def infer(self, prompts: Prompt | Sequence[Prompt], gen_config: SamplingParams | None = None, *,
              logprobs: bool = False) -> Response | list[Response]:
        """Generate to the end. A single prompt (a str or one chat) returns one Response, a list
        returns one per prompt, in order. Raises ParamError (a ValueError) naming the bad field."""
        items, single = self._prepare(prompts, gen_config)
        want_lp = logprobs or _asks_logprobs(gen_config)
        coros = [self._run_req(i, ids, params, want_lp, None) for i, (ids, params) in enumerate(items)]
        fut = self._submit(gather_all(coros))
        try:
            outs = fut.result()
        except BaseException:
            fut.cancel()  # Ctrl-C in the caller: abort the requests
            raise
        return outs[0] if single else outs

    def stream_infer(self, prompts: Prompt | Sequence[Prompt], gen_config: SamplingParams | None = None, *,
                     logprobs: bool = False) -> Iterator[Response]:
        """Yield chunks as tokens arrive, from every prompt interleaved; `index` says whose.
        Validation errors raise here, before iteration. Leaving the loop early (break, close(),
        garbage collection) aborts the requests still running."""
        items, _ = self._prepare(prompts, gen_config)
        return self._stream(items, logprobs or _asks_logprobs(gen_config))

    async def generate(self, prompt: Prompt, gen_config: SamplingParams | None = None, *,
                       logprobs: bool = False) -> AsyncIterator[Response]:
        """Async generator of one prompt's chunks, for use on the caller's own event loop (any
        loop but the pipeline's). Leaving the `async for` early aborts the request."""
        items, single = self._prepare(prompt, gen_config)
        if not single:
            raise TypeError("generate() takes one prompt (a str or a chat); use stream_infer() for a list")
        user_loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()

        def put(item: object) -> None:  # runs on the pipeline's loop
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody listens
                user_loop.call_soon_threadsafe(chunks.put_nowait, item)

        ids, params = items[0]
        fut = self._submit(self._run_req(0, ids, params, logprobs or _asks_logprobs(gen_config), put))
        fut.add_done_callback(lambda f: put(_outcome(f)))
        try:
            while (item := await chunks.get()) is not _DONE:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            fut.cancel()

    def stats(self) -> dict[str, int]:
        """The router's counters (`max_batch_size`, `steps_total`, `requests_running`, ...; see
        shm/req_pool.py STATS_FIELDS) plus `requests_in_flight`, this pipeline's unfinished requests."""
        procs = self._procs
        pool = None if procs is None else procs.pool
        if self._closed or pool is None:
            raise RuntimeError("the pipeline is closed")
        return {**pool.stats_dict(), "requests_in_flight": self._num_in_flight}

    def close(self) -> None:
        """Drain, then stop every process and unlink the shared memory. Idempotent; also runs at
        interpreter exit.

        New calls are refused at once. Calls in flight run on for up to `shutdown_grace_s` (a
        setting, 30 s by default); those still running then are aborted: a stream's last chunk has
        finish_reason "abort", and `infer` raises ShuttingDown. Ctrl-C during the wait aborts them
        at once (the stop still completes, then the KeyboardInterrupt goes on).
        """
        if self._loop_thread is not None and threading.current_thread() is self._loop_thread:
            raise RuntimeError("close() called from the pipeline's own loop")
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        self._stop_watch.set()
        if self._watch_thread is not None:
            self._watch_thread.join()  # it reads procs.children, which stop() clears
        loop_alive = self._loop_thread is not None and self._loop_thread.is_alive()
        interrupted = False
        if self._loop is not None:
            if self._engine is not None and loop_alive:
                fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
                wait_s = self.config.shutdown_grace_s + SHUTDOWN_WAIT_S * 2
                try:
                    fut.result(wait_s)
                except KeyboardInterrupt:
                    interrupted = True
                    self._loop.call_soon_threadsafe(self._engine.abort_all, CLOSED_REASON)
                    with contextlib.suppress(Exception):
                        fut.result(SHUTDOWN_WAIT_S * 2)
                except Exception:  # still stop the loop and the processes below
                    logger.exception("pipeline: closing the engine client failed")
            self._loop.call_soon_threadsafe(self._loop.stop)
            if loop_alive:
                self._loop_thread.join(SHUTDOWN_WAIT_S)
            if not self._loop.is_running():
                self._loop.close()
        if self._procs is not None:
            self._procs.stop()
        if interrupted:
            raise KeyboardInterrupt

    def __enter__(self) -> Pipeline:  # noqa: PYI034 - typing.Self needs 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- caller's thread ---------------------------------------------------------------------------------
    def _prepare(self, prompts: Prompt | Sequence[Prompt], gen_config: SamplingParams | None,
                 ) -> tuple[list[tuple[list[int], SamplingParams]], bool]:
        """Tokenize and validate every prompt in the calling thread. Returns ([(ids, params)], single).

        NOTE: tokenizing here keeps the loop free to stream other requests' tokens. It is safe from
        many threads: a HF fast tokenizer's encode without truncation/padding never mutates the Rust
        tokenizer, and apply_chat_template only renders a compiled Jinja template. check_prompt is
        safe here too: it reads only the client's constants and modifies nothing.
        """
        if self._closed:
            raise RuntimeError("the pipeline is closed")
        batch, single = _split_prompts(prompts)
        if gen_config is not None and not isinstance(gen_config, SamplingParams):
            raise TypeError(f"gen_config must be a GenerationConfig, got {type(gen_config).__name__}")
        # A Response carries logprobs only where the config asks for alternatives.
        params = replace(gen_config if gen_config is not None else GenerationConfig(),
                         report_logprobs=_asks_logprobs(gen_config))
        items = []
        for i, prompt in enumerate(batch):
            name = "prompt" if single else f"prompts[{i}]"
            if isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt)
            else:
                ids = self.tokenizer.encode(render_chat(self.tokenizer, prompt, name), add_special_tokens=False)
            items.append((ids, self._engine.check_prompt(ids, params, name)))
        return items, single

    def _submit(self, coro: typing.Coroutine) -> Future:
        # Under the lock: once close() has begun, no coroutine reaches a loop that may be stopping
        # (its future would never complete).
        with self._lock:
            if self._closed:
                coro.close()
                raise RuntimeError("the pipeline is closed")
            return asyncio.run_coroutine_threadsafe(self._tracked(coro), self._loop)

    def _stream(self, items: list[tuple[list[int], SamplingParams]], want_lp: bool) -> Iterator[Response]:
        # A generator: nothing is submitted until the first next(), so an iterator that is never
        # used never starts requests that nobody would abort.
        chunks: queue.SimpleQueue = queue.SimpleQueue()
        fut = self._submit(gather_all([self._run_req(i, ids, params, want_lp, chunks.put)
                                        for i, (ids, params) in enumerate(items)]))
        fut.add_done_callback(lambda f: chunks.put(_outcome(f)))
        try:
            while (item := chunks.get()) is not _DONE:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            fut.cancel()  # early exit: cancels the coroutine on the loop, which aborts the requests

    # ---- the pipeline's loop thread -----------------------------------------------------------------
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _open(self, vocab_size: int) -> None:
        from lightserve.engine_client import EngineClient

        self._engine = EngineClient(self.config, self._procs.pool, self.config.max_req_total_len, vocab_size)
        self._engine.start()
        # The client queues callers beyond the pool's slots only up to max_queue_size, then refuses
        # them (HTTP 503). An offline batch should wait instead, so calls queue here first.
        self._slots = asyncio.Semaphore(self._procs.pool.num_slots)

    async def _tracked(self, coro: typing.Coroutine) -> Any:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            return await coro
        finally:
            self._tasks.discard(task)

    async def _run_req(self, index: int, prompt_ids: list[int], params: SamplingParams, want_lp: bool,
                       emit: Callable[[Response], None] | None) -> Response:
        """One request. With `emit`, every chunk goes to it; else the whole result is returned."""
        from lightserve.engine_client import (
            ShuttingDown,  # here: importing the pipeline stays free of zmq
        )
        out = Generation(len(prompt_ids))
        async with self._slots:
            self._num_in_flight += 1
            try:
                async with contextlib.aclosing(self._engine.generate(prompt_ids, params)) as deltas:
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
                self._num_in_flight -= 1
        return Response(index, out.text, out.token_ids, out.finish.api_name(), out.prompt_len, out.num_output,
                        out.logprobs if want_lp else None)

    async def _shutdown(self) -> None:
        """The drain: calls in flight get shutdown_grace_s, then the rest are aborted."""
        if self._tasks:
            _, late = await asyncio.wait(list(self._tasks), timeout=self.config.shutdown_grace_s)
            if late:
                logger.warning("pipeline: aborting %d calls still running after %g s", len(late),
                               self.config.shutdown_grace_s)
        self._engine.abort_all(CLOSED_REASON)
        if self._tasks:
            _, late = await asyncio.wait(list(self._tasks), timeout=SHUTDOWN_WAIT_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await self._engine.close()

    # ---- the watcher thread -----------------------------------------------------------------------------
    def _watch_children(self) -> None:
        while not self._stop_watch.is_set():
            child = self._procs.watch(timeout=0.5)
            if child is None or self._stop_watch.is_set():
                continue
            reason = f"{child.name} (pid {child.proc.pid}) exited with code {child.proc.exitcode}"
            logger.error("%s; the pipeline cannot generate any more, close it", reason)
            self.dead_reason = reason
            self._engine.mark_dead_threadsafe(reason)  # in-flight and later calls raise EngineDead
            return


# ---- helpers ---------------------------------------------------------------------------------------
def _split_prompts(prompts: Any) -> tuple[list[Prompt], bool]:
    """([prompt, ...], single). A chat is a non-empty list of dicts; a batch is a list whose items
    are each a str or a chat. Anything else (a mixed list, token ids, an empty chat) is refused."""
    if isinstance(prompts, str):
        return [prompts], True
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(p, dict) for p in prompts):
            return [list(prompts)], True
        if all(isinstance(p, str) or _is_chat(p) for p in prompts):
            return [p if isinstance(p, str) else list(p) for p in prompts], False
    raise TypeError("prompts must be a str, a chat (a list of {'role': ..., 'content': ...} dicts), "
                    f"or a list of those; got {_describe(prompts)}")


def _is_chat(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(m, dict) for m in value)


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a {type(value).__name__} of {', '.join(kinds)}" if kinds else f"an empty {type(value).__name__}"
    return type(value).__name__


def _asks_logprobs(gen_config: SamplingParams | None) -> bool:
    return gen_config is not None and gen_config.top_logprobs > 0


def _outcome(fut: Future) -> object:
    """The item that ends a stream: _DONE, or the error the caller should see."""
    if fut.cancelled():
        return RuntimeError("the request was cancelled")
    return fut.exception() or _DONE


def _enum_of(annotation: Any) -> type[Enum] | None:
    for arg in typing.get_args(annotation) or (annotation,):
        if isinstance(arg, type) and issubclass(arg, Enum):
            return arg
    return None


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()

