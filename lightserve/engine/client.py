"""EngineClient: the HTTP front's (and the offline pipeline's) handle on the engine processes.

It takes a request slot in the shared-memory pool, writes the prompt and sampling params there,
tells the router (AddReq), and yields the detokenizer's text deltas until the request finishes.
Leaving the iterator early (client disconnect, timeout, cancellation) aborts the request.
All methods run on one asyncio event loop; nothing here is thread-safe by itself.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import AsyncIterator

import zmq
import zmq.asyncio

from lightserve.config import ServerConfig
from lightserve.engine.adapters import AdapterError, Adapters
from lightserve.engine.generation import EngineDead, EngineOverloaded, RequestTimeout, ShuttingDown
from lightserve.log import get_logger
from lightserve.lora_adapter import LoraAdapter, LoraAdapterError, load_lora_tensors, read_lora_adapter
from lightserve.messages import (
    AbortReq,
    AddReq,
    DeltaBatch,
    FinishReason,
    LoraAdded,
    LoraRemoved,
    ReqDelta,
    decode,
    encode,
)
from lightserve.sampling import ParamError, SamplingParams
from lightserve.shm.req_pool import Owner, ReqPool

logger = get_logger(__name__)

SLOT_RECHECK_S = 0.01  # a waiter re-checks the pool this often: router releases arrive without a message


@dataclass
class _Pending:
    req_id: int
    queue: asyncio.Queue
    arrival: float
    first_token_at: float | None = None
    finished: bool = False


class EngineClient:
    def __init__(self, config: ServerConfig, pool: ReqPool, max_req_total_len: int, vocab_size: int):
        self.config = config
        self.pool = pool
        self.max_req_total_len = max_req_total_len
        self.vocab_size = vocab_size
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}          # shm_index -> request on it
        self._slot_waiters: deque[asyncio.Future] = deque()
        self._slot_poller: asyncio.Task | None = None
        self._dead_reason: str | None = None
        self._shutdown_reason: str | None = None
        self._progress_waiters: list[asyncio.Future] = []  # woken by the next delta that carries tokens
        self._ctx = zmq.asyncio.Context()
        self._to_router = self._ctx.socket(zmq.PUSH)
        self._to_router.connect(config.router_addr)
        self._from_detok = self._ctx.socket(zmq.PULL)
        self._from_detok.bind(config.front_addr)
        self._recv_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # --enable_lora: the adapters served, those of --lora_modules first (ids 1, 2, ..., as the router numbers
        # them); their files were read and checked against the model at start (resolve_config).
        self.adapters = Adapters() if config.enable_lora else None
        for name, path in config.lora_items:
            self.adapters.add(name, read_lora_adapter(path, config.model_config, config.max_lora_rank))

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the receive loop on the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._recv_task = self._loop.create_task(self._recv_loop())

    async def close(self) -> None:
        for task in (self._recv_task, self._slot_poller):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._to_router.close(linger=0)
        self._from_detok.close(linger=0)
        self._ctx.term()

    def mark_dead(self, reason: str) -> None:
        """Called by the launcher's monitor when a process died: fail every request now."""
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        self._fail_all(EngineDead, reason)

    def abort_all(self, reason: str) -> None:
        """End of a drain: every request still running or queued for a slot fails with ShuttingDown
        (its generator's finally sends AbortReq, so the router frees its KV), and so does every later
        generate() call."""
        if self._shutdown_reason is not None:
            return
        self._shutdown_reason = reason
        self._fail_all(ShuttingDown, reason)

    def _fail_all(self, kind: type[Exception], reason: str) -> None:
        for pending in self._pending.values():
            pending.queue.put_nowait(kind(reason))
        while self._slot_waiters:
            fut = self._slot_waiters.popleft()
            if not fut.done():
                fut.set_exception(kind(reason))

    def mark_dead_threadsafe(self, reason: str) -> None:
        """mark_dead from another thread (the launcher's child watcher)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.mark_dead, reason)
        else:
            self._dead_reason = reason

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_queued(self) -> int:
        return len(self._slot_waiters)

    # ---- LoRA adapters ------------------------------------------------------------------------------
    def lora_id(self, name: str) -> int | None:
        """The id of the adapter served as `name`, or None."""
        entry = self.adapters.get(name) if self.adapters is not None else None
        return None if entry is None else entry.lora_id

    async def load_lora(self, name: str, path: str) -> int:
        """Serve the PEFT adapter in `path` as `name` from now on; returns its id. The whole file is read here (in a
        thread) and checked against the model, so the workers' later load cannot fail. AdapterError (400) when the
        name is taken or the adapter does not fit the model."""
        if self.adapters.get(name) is not None:  # before reading anything
            raise AdapterError(f"The LoRA adapter {name!r} has already been loaded.")
        try:
            adapter = await asyncio.to_thread(_read_whole_adapter, path, self.config)
        except LoraAdapterError as exc:
            raise AdapterError(str(exc), param="lora_path") from None
        entry = self.adapters.add(name, adapter)
        self._to_router.send(encode(LoraAdded(entry.lora_id, adapter.path)), copy=False)
        logger.info("LoRA adapter %r loaded from %s (id %d, rank %d)", name, adapter.path, entry.lora_id,
                    adapter.rank)
        return entry.lora_id

    def unload_lora(self, name: str) -> None:
        """Stop serving `name`. AdapterError: 404 unknown, 409 while requests of it run or wait."""
        entry = self.adapters.remove(name)
        self._to_router.send(encode(LoraRemoved(entry.lora_id)), copy=False)
        logger.info("LoRA adapter %r unloaded (id %d)", name, entry.lora_id)

    # ---- requests ---------------------------------------------------------------------------------
    def check_prompt(self, prompt_ids: list[int], params: SamplingParams, field_name: str = "prompt") -> SamplingParams:
        """Validate a tokenized prompt and its params against this server (the one validation of a request, for the
        HTTP front and the pipeline alike): returns the params to run, max_new_tokens capped by the context left
        after the prompt. `params` is not modified (a capped request gets a copy).

        Raises ParamError naming `field_name` for an empty or too-long prompt or a bad token id, and naming the
        field for bad params (SamplingParams.validate, with this model's vocabulary and the pool's
        --max_top_logprobs).
        """
        if len(prompt_ids) == 0:
            raise ParamError(field_name, "the prompt is empty")
        if len(prompt_ids) >= self.max_req_total_len:
            raise ParamError(field_name, f"the prompt has {len(prompt_ids)} tokens; this server's context "
                                         f"is {self.max_req_total_len} tokens (prompt + output)")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise ParamError(field_name, f"token ids must be in [0, {self.vocab_size})")
        params.validate(self.vocab_size, self.pool.max_top_logprobs)
        room = self.max_req_total_len - len(prompt_ids)
        if params.max_new_tokens > room:
            return replace(params, max_new_tokens=room, min_new_tokens=min(params.min_new_tokens, room))
        return params

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[ReqDelta]:
        """Yield deltas until one carries a finish reason. Call check_prompt first (and for an adapter's request,
        take params.lora_id from lora_id())."""
        if self._dead_reason is not None:
            raise EngineDead(self._dead_reason)
        if self._shutdown_reason is not None:
            raise ShuttingDown(self._shutdown_reason)
        if params.lora_id:  # counted from now, so an unload cannot pull the adapter from under a queued request
            self.adapters.in_flight[params.lora_id] += 1
        try:
            # aclosing: a client gone closes _run at once, whose finally tells the router to abort.
            async with contextlib.aclosing(self._run(prompt_ids, params)) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            if params.lora_id:
                self.adapters.in_flight[params.lora_id] -= 1

    async def _run(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[ReqDelta]:
        arrival = time.monotonic()
        timeout_s = self.config.request_timeout_s
        try:
            # The timeout covers the wait for a slot too: a request queued behind a stuck pool ends.
            shm_index = await asyncio.wait_for(self._acquire_slot(), timeout_s)
        except TimeoutError:
            raise RequestTimeout(f"request waited {timeout_s} s for a request slot") from None
        req_id = next(self._ids)
        pending = _Pending(req_id, asyncio.Queue(), arrival)
        self.pool.acquire(shm_index, req_id)
        seed = params.seed if params.seed is not None else secrets.randbits(62)
        self.pool.write_request(shm_index, prompt_ids, params, seed)
        self._pending[shm_index] = pending
        self._to_router.send(encode(AddReq(shm_index, req_id)), copy=False)
        deadline = None if timeout_s is None else arrival + timeout_s
        try:
            while True:
                timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                try:
                    item = await asyncio.wait_for(pending.queue.get(), timeout)
                except asyncio.TimeoutError:
                    raise RequestTimeout(f"request ran past {timeout_s} s") from None
                if isinstance(item, Exception):
                    raise item
                if pending.first_token_at is None:
                    pending.first_token_at = time.monotonic()
                if item.finish != FinishReason.NONE:
                    pending.finished = True
                yield item
                if pending.finished:
                    return
        finally:
            self._pending.pop(shm_index, None)
            if not pending.finished and self._dead_reason is None:
                # Client gone, timeout or cancellation: the router frees the KV and tells the detokenizer.
                self._to_router.send(encode(AbortReq(shm_index, req_id)), copy=False)
            self.pool.release(Owner.FRONT, shm_index)
            self._wake_slot_waiter()

    async def probe(self, prompt_ids: list[int], timeout_s: float) -> str | None:
        """One greedy token through the whole chain (slot, router, worker, detokenizer, back here).
        Returns None when the engine moved within `timeout_s`, else why not.

        The engine also counts as moving when any other request receives a token meanwhile: under
        load the probe may wait behind a long queue, and a wedged engine produces no tokens at all.
        The probe request is aborted when it is not needed any more.
        """
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        deadline = time.monotonic() + timeout_s
        work = asyncio.ensure_future(_run_to_end(self.generate(prompt_ids, self.check_prompt(prompt_ids, params))))
        progress = asyncio.get_running_loop().create_future()
        self._progress_waiters.append(progress)
        waiting = {work, progress}
        try:
            while waiting:
                done, waiting = await asyncio.wait(waiting, timeout=max(deadline - time.monotonic(), 0),
                                                   return_when=asyncio.FIRST_COMPLETED)
                if not done or progress in done:
                    break
                exc = work.exception()
                if exc is None:
                    return None
                if not isinstance(exc, EngineOverloaded):  # a full queue is busy, not wedged: keep watching
                    return f"the probe request failed: {exc}"
        finally:
            work.cancel()
            progress.cancel()
            if progress in self._progress_waiters:
                self._progress_waiters.remove(progress)
            await asyncio.gather(work, return_exceptions=True)
        if progress.done() and not progress.cancelled():
            return None
        return f"no output token within {timeout_s:g} s"

    # ---- internals ---------------------------------------------------------------------------------
    async def _acquire_slot(self) -> int:
        free = self._free_slots()
        if free and not self._slot_waiters:
            return free[0]
        if len(self._slot_waiters) >= self.config.max_queue_size:
            raise EngineOverloaded(f"{self.pool.num_slots} requests in flight and {len(self._slot_waiters)} queued")
        fut = asyncio.get_running_loop().create_future()
        self._slot_waiters.append(fut)
        if self._slot_poller is None or self._slot_poller.done():
            self._slot_poller = asyncio.get_running_loop().create_task(self._poll_slots())
        try:
            return await fut
        except BaseException:
            if fut in self._slot_waiters:
                self._slot_waiters.remove(fut)
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._pending.pop(fut.result(), None)  # we were handed a slot we no longer need
                self._wake_slot_waiter()
            raise

    async def _poll_slots(self) -> None:
        # NOTE: one poller for all waiters, not a timer each: with 128 queued, per-waiter timers
        # woke the front's event loop 12,800 times a second (a quarter of a core); this is ~3%.
        while self._slot_waiters:
            await asyncio.sleep(SLOT_RECHECK_S)
            self._wake_slot_waiter()

    def _free_slots(self) -> list[int]:
        # A slot still in _pending is ours even if every owner released it (between acquire and write).
        return [i for i in self.pool.free_slots().tolist() if i not in self._pending]

    def _wake_slot_waiter(self) -> None:
        while self._slot_waiters and self._slot_waiters[0].done():
            self._slot_waiters.popleft()
        if not self._slot_waiters:
            return
        free = self._free_slots()
        taken = set()
        while self._slot_waiters and free:
            fut = self._slot_waiters.popleft()
            if fut.done():
                continue
            slot = free.pop(0)
            taken.add(slot)
            # Reserve it in _pending at once so no other caller takes it before the waiter runs.
            self._pending[slot] = _Pending(-1, asyncio.Queue(), time.monotonic())
            fut.set_result(slot)

    async def _recv_loop(self) -> None:
        while True:
            msg = decode(await self._from_detok.recv(copy=False))
            match msg:
                case DeltaBatch(deltas=deltas):
                    if self._progress_waiters and any(d.token_ids for d in deltas):
                        for fut in self._progress_waiters:
                            if not fut.done():
                                fut.set_result(None)
                        self._progress_waiters.clear()
                    for delta in deltas:
                        pending = self._pending.get(delta.shm_index)
                        # Slot ownership: a delta reaches only the request that owns the slot now.
                        if pending is not None and pending.req_id == delta.req_id:
                            pending.queue.put_nowait(delta)
                    if self._slot_waiters:
                        self._wake_slot_waiter()
                case _:
                    logger.error("front: unexpected message %r", type(msg).__name__)


async def _run_to_end(deltas: AsyncIterator[ReqDelta]) -> None:
    async for _ in deltas:
        pass


def _read_whole_adapter(path: str, config: ServerConfig) -> LoraAdapter:
    """The adapter in `path` checked against the model, its tensors read once (a truncated or corrupt file fails
    here, not in a worker)."""
    adapter = read_lora_adapter(path, config.model_config, config.max_lora_rank)
    load_lora_tensors(adapter)
    return adapter
