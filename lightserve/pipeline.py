"""The offline pipeline: `pipeline(**server_args)` starts the engine processes (EngineProcs) without the
HTTP front, and its `Pipeline` generates from Python, from any number of threads and event loops.

Threads: the pipeline owns a `PipelineLoop` (engine/pipeline_loop.py): one loop thread running an asyncio
loop that alone touches the EngineClient, and one thread that watches the child processes. Public methods
run in the caller's thread: they tokenize and validate there, submit one coroutine to the loop, and
receive results through a thread-safe queue (`stream_infer`), the caller's own loop (`generate`) or the
coroutine's future (`infer`). Request ids come from the EngineClient's counter, which only the loop thread
advances, so no caller can pick or share one.
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
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from lightserve.chat.messages import render_chat
from lightserve.cli import make_config
from lightserve.config import ServerConfig
from lightserve.engine.generation import gather_all
from lightserve.engine.pipeline_loop import PipelineLoop, Response
from lightserve.sampling import ParamError, SamplingParams

if TYPE_CHECKING:
    from lightserve.engine.procs import EngineProcs

GenerationConfig = SamplingParams  # one definition for the HTTP API and the pipeline
"""Alias of `SamplingParams`: max_new_tokens, temperature (0 = greedy, the default), top_p, top_k,
ignore_eos, stop, seed, ... Each call works on its own copy, so one config may be reused freely."""

Chat = list[dict[str, Any]]
Prompt = str | Chat
Adapter = str | Sequence[str | None] | None  # a LoRA adapter's name for every prompt, or one per prompt
_DONE = object()          # end of a stream, after its last chunk


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


class Pipeline:
    """Offline generation on the engine processes of one launch. Every public method may be
    called from any thread at the same time; `close()` (or a `with` block, or interpreter exit)
    stops the processes and frees their shared memory."""

    def __init__(self, config: ServerConfig):
        from lightserve.engine.procs import EngineProcs
        from lightserve.hf_tokenizer import load_tokenizer
        from lightserve.resolve_config import resolve_config

        self._lock = threading.Lock()       # guards _closed against submissions racing close()
        self._closed = False
        self._procs: EngineProcs | None = None
        self._loop: PipelineLoop | None = None
        atexit.register(self.close)  # before start(): a failed or interrupted start still cleans up
        try:
            self._procs = EngineProcs(resolve_config(config))
            self.config: ServerConfig = self._procs.start()
            self.model_dir = model_dir = self.config.model_dir
            self.tokenizer = load_tokenizer(model_dir)
            # NOTE: the first encode resets any truncation/padding stored in tokenizer.json (a write
            # to the Rust tokenizer); doing it here, on one thread, leaves later encodes read-only.
            self.tokenizer.encode("warm up")
            self._loop = PipelineLoop(self._procs, self.config)
        except BaseException:
            self.close()
            raise

    # ---- public API ---------------------------------------------------------------------------------
    def infer(self, prompts: Prompt | Sequence[Prompt], gen_config: SamplingParams | None = None, *,
              logprobs: bool = False, adapter: Adapter = None) -> Response | list[Response]:
        """Generate to the end. A single prompt (a str or one chat) returns one Response, a list
        returns one per prompt, in order. `adapter`: the LoRA adapter (a --lora_modules name) every prompt runs
        under, or one per prompt (None: the base model). Raises ParamError (a ValueError) naming the bad field."""
        items, single = self._prepare(prompts, gen_config, adapter)
        want_lp = logprobs or _asks_logprobs(gen_config)
        coros = [self._loop.run_req(i, ids, params, want_lp, None) for i, (ids, params) in enumerate(items)]
        fut = self._submit(gather_all(coros))
        try:
            outs = fut.result()
        except BaseException:
            fut.cancel()  # Ctrl-C in the caller: abort the requests
            raise
        return outs[0] if single else outs

    def stream_infer(self, prompts: Prompt | Sequence[Prompt], gen_config: SamplingParams | None = None, *,
                     logprobs: bool = False, adapter: Adapter = None) -> Iterator[Response]:
        """Yield chunks as tokens arrive, from every prompt interleaved; `index` says whose.
        Validation errors raise here, before iteration. Leaving the loop early (break, close(),
        garbage collection) aborts the requests still running. `adapter`: as infer's."""
        items, _ = self._prepare(prompts, gen_config, adapter)
        return self._stream(items, logprobs or _asks_logprobs(gen_config))

    async def generate(self, prompt: Prompt, gen_config: SamplingParams | None = None, *,
                       logprobs: bool = False, adapter: str | None = None) -> AsyncIterator[Response]:
        """Async generator of one prompt's chunks, for use on the caller's own event loop (any
        loop but the pipeline's). Leaving the `async for` early aborts the request. `adapter`: the LoRA adapter
        it runs under (None: the base model)."""
        items, single = self._prepare(prompt, gen_config, adapter)
        if not single:
            raise TypeError("generate() takes one prompt (a str or a chat); use stream_infer() for a list")
        user_loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()

        def put(item: object) -> None:  # runs on the pipeline's loop
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody listens
                user_loop.call_soon_threadsafe(chunks.put_nowait, item)

        ids, params = items[0]
        fut = self._submit(self._loop.run_req(0, ids, params, logprobs or _asks_logprobs(gen_config), put))
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
        if self._closed or pool is None or self._loop is None:
            raise RuntimeError("the pipeline is closed")
        return {**pool.stats_dict(), "requests_in_flight": self._loop.num_in_flight}

    @property
    def dead_reason(self) -> str | None:
        """Why the pipeline cannot generate any more (a child process died), or None."""
        return None if self._loop is None else self._loop.dead_reason

    def close(self) -> None:
        """Drain, then stop every process and unlink the shared memory. Idempotent; also runs at
        interpreter exit.

        New calls are refused at once. Calls in flight run on for up to `shutdown_grace_s` (a
        setting, 30 s by default); those still running then are aborted: a stream's last chunk has
        finish_reason "abort", and `infer` raises ShuttingDown. Ctrl-C during the wait aborts them
        at once (the stop still completes, then the KeyboardInterrupt goes on).
        """
        if self._loop is not None and self._loop.on_loop_thread():
            raise RuntimeError("close() called from the pipeline's own loop")
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        interrupted = self._loop is not None and self._loop.close()
        if self._procs is not None:
            self._procs.stop()
        if interrupted:
            raise KeyboardInterrupt

    def __enter__(self) -> Pipeline:  # noqa: PYI034 - typing.Self needs 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- caller's thread ---------------------------------------------------------------------------------
    def _prepare(self, prompts: Prompt | Sequence[Prompt], gen_config: SamplingParams | None, adapter: Adapter = None,
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
        lora_ids = self._lora_ids(adapter, len(batch))
        items = []
        for i, prompt in enumerate(batch):
            name = "prompt" if single else f"prompts[{i}]"
            if isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt)
            else:
                ids = self.tokenizer.encode(render_chat(self.tokenizer, prompt, name), add_special_tokens=False)
            one = replace(params, lora_id=lora_ids[i]) if lora_ids[i] else params
            items.append((ids, self._loop.engine.check_prompt(ids, one, name)))
        return items, single

    def _lora_ids(self, adapter: Adapter, num_prompts: int) -> list[int]:
        """Each prompt's adapter id (0: the base model). ParamError naming `adapter` for a name not served."""
        names = [adapter] * num_prompts if adapter is None or isinstance(adapter, str) else list(adapter)
        if len(names) != num_prompts:
            raise ParamError("adapter", f"gives {len(names)} adapters for {num_prompts} prompts")
        engine = self._loop.engine
        ids = []
        for name in names:
            lora_id = 0 if name is None else engine.lora_id(name)
            if lora_id is None:
                served = ", ".join(sorted(e.name for e in engine.adapters or ()))
                hint = f"served: {served}" if served else "start it with enable_lora=True, lora_modules=['NAME=PATH']"
                raise ParamError("adapter", f"{name!r} is not a LoRA adapter of this pipeline ({hint})")
            ids.append(lora_id)
        return ids

    def _submit(self, coro: typing.Coroutine) -> Future:
        # Under the lock: once close() has begun, no coroutine reaches a loop that may be stopping
        # (its future would never complete).
        with self._lock:
            if self._closed:
                coro.close()
                raise RuntimeError("the pipeline is closed")
            return self._loop.submit(coro)

    def _stream(self, items: list[tuple[list[int], SamplingParams]], want_lp: bool) -> Iterator[Response]:
        # A generator: nothing is submitted until the first next(), so an iterator that is never
        # used never starts requests that nobody would abort.
        chunks: queue.SimpleQueue = queue.SimpleQueue()
        fut = self._submit(gather_all([self._loop.run_req(i, ids, params, want_lp, chunks.put)
                                        for i, (ids, params) in enumerate(items)]))
        fut.add_done_callback(lambda f: chunks.put(_outcome(f)))
        try:
            while (item := chunks.get()) is not _DONE:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            fut.cancel()  # early exit: cancels the coroutine on the loop, which aborts the requests


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
