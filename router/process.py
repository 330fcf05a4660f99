"""The router process: receives requests, runs the Scheduler, sends each step's BatchPlan to every
worker rank and takes in rank 0's StepDone.

With tp 1, while steps are short, it plans the next step while the current one runs (the overlap schedule), so the
worker finds its next plan waiting when it finishes a step, instead of idling while its StepDone reaches the router,
the router retires and plans, and the plan comes back. That hides 0.3-0.4 ms a step on a 2-core Zen 5 (bf16 batch-1
decode: 1.0-1.3 -> 0.6-0.8 ms outside the forward). The price is that a request arriving while a step runs joins
one step later, since the step after it is already planned: a few ms after short steps, but a whole prompt chunk or
large CPU batch after long ones, where the hidden time is a fraction of a percent. So the router plans ahead only
after a step shorter than --overlap_max_step_ms. With tp > 1 the other ranks would need rank 0's sampled tokens to
run a step planned before them, so the router plans each step after the one before has finished. With speculative
decoding it also waits while a step with draft tokens runs, or while a request would speculate at its next step
(Scheduler.may_plan_ahead): drafts are looked up from the request's tokens up to its last, and a step's requests
advance by as many tokens as rank 0 accepted, which only its StepDone says."""
from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from multiprocessing.connection import Connection

import zmq

from lightserve.config import ServerConfig
from lightserve.log import get_logger
from lightserve.messages import (
    AbortReq,
    AddReq,
    BatchPlan,
    LoraAdded,
    LoraRemoved,
    ReqReleased,
    Shutdown,
    StepDone,
    decode,
    encode,
)
from lightserve.procutil import child_process, report_ready
from lightserve.router.scheduler import Scheduler, StepRecord
from lightserve.shm.req_pool import ReqPool

logger = get_logger(__name__)

IDLE_POLL_MS = 50
STEP_POLL_MS = 100
STATS_LOG_S = 10.0


def run_router(config: ServerConfig, ready: Connection) -> None:
    """`config`: resolved and started (its kv_size is the workers' agreed KV size)."""
    kv_size = config.kv_size
    with child_process("router", config, ready) as stop:
        pool = ReqPool.attach(config.shm_name)
        ctx = zmq.Context()
        inbox = ctx.socket(zmq.PULL)
        inbox.bind(config.router_addr)
        step_done = ctx.socket(zmq.PULL)
        step_done.bind(config.step_done_addr)
        to_workers = []
        for rank in range(config.tp):
            sock = ctx.socket(zmq.PUSH)
            sock.bind(config.plan_bind_addr(rank))
            to_workers.append(sock)
        to_detok = ctx.socket(zmq.PUSH)
        to_detok.connect(config.detok_addr)
        overlap = config.tp == 1 and not config.disable_overlap_schedule
        router = Router(Scheduler.from_config(config, pool, kv_size), inbox, step_done, to_workers, to_detok,
                        config.overlap_max_step_ms / 1e3 if overlap else 0.0)
        router.scheduler.publish_stats()
        report_ready(ready)
        logger.info("router ready: %d KV tokens, %d request slots, %s%s", kv_size, pool.num_slots,
                    f"plans a step ahead after steps under {config.overlap_max_step_ms:g} ms" if overlap
                    else "plans each step after the one before",
                    f", speculative decoding: {config.speculative_algorithm.value}, up to "
                    f"{config.num_speculative_tokens} draft tokens" if config.speculates else "")
        try:
            router.loop(stop)
        finally:
            for sock in to_workers:
                # Best effort: a dead worker (the usual reason we stop) cannot take it, and zmq.Again
                # here would turn a clean stop into a traceback and leave the sockets open.
                with contextlib.suppress(zmq.Again):
                    sock.send(encode(Shutdown()), zmq.NOBLOCK)
            for sock in (inbox, step_done, to_detok, *to_workers):
                sock.close(linger=100)
            ctx.term()


class Router:
    def __init__(self, scheduler: Scheduler, inbox: zmq.Socket, step_done: zmq.Socket,
                 to_workers: list[zmq.Socket], to_detok: zmq.Socket, ahead_max_step_s: float):
        """`ahead_max_step_s`: plan a step while the one before runs when the last finished step took less (0:
        never)."""
        self.scheduler = scheduler
        self.ahead_max_step_s = ahead_max_step_s
        self.inbox = inbox
        self.step_done = step_done
        self.to_workers = to_workers
        self.to_detok = to_detok
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        self._log_at = time.monotonic() + STATS_LOG_S
        self._window = dict(steps=0, tokens=0, forward_s=0.0, step_s=0.0)

    def loop(self, stop) -> None:
        planned = True
        # Steps sent, oldest first, each with the time the worker could start it: when it was sent if the worker
        # had nothing to do before, else when the step before it ended (so the router's own time between steps,
        # which the overlap schedule hides, counts in the step's time).
        inflight: deque[tuple[StepRecord, float | None]] = deque()
        idle, last_done, last_step_s = True, 0.0, float("inf")
        while not stop.is_set():
            # Steps sent and not yet finished, at most.
            depth = 2 if last_step_s < self.ahead_max_step_s and self.scheduler.may_plan_ahead() else 1
            # Block on the inbox only when no step runs and the last attempt planned nothing: idle, or every
            # request waits for KV that only an abort can free. Never a zero-timeout spin.
            self._drain_inbox(0 if inflight or (planned and self.scheduler.has_work()) else IDLE_POLL_MS)
            record = None
            if len(inflight) < depth:
                record = self.scheduler.plan_step()
                planned = record is not None
            # Adapter prefetches and loads first: the workers apply them between the step before and this one.
            loads = self.scheduler.lora.take_loads() if self.scheduler.lora is not None else []
            for data in [encode(load) for load in loads] + ([encode(record.plan)] if record is not None else []):
                for sock in self.to_workers:
                    sock.send(data, copy=False)
            if record is not None:
                inflight.append((record, time.monotonic() if idle else None))
                idle = False
                if len(inflight) < depth and self.scheduler.may_plan_ahead():
                    continue  # plan the next step while this one runs
            if not inflight:
                idle, last_step_s = True, float("inf")  # the next step starts from idle: its first is planned alone
                self._publish()
                continue
            oldest, start = inflight.popleft()
            done = self._wait_step(oldest, stop)
            if done is None:
                return
            self.scheduler.finish_step(oldest, done.finish, done.num_accepted)
            self._publish()
            last_step_s = done.done_at - (last_done if start is None else start)
            self._account(oldest, done, last_step_s)
            last_done = done.done_at

    def _wait_step(self, record: StepRecord, stop) -> StepDone | None:
        while not stop.is_set():
            if self.step_done.poll(STEP_POLL_MS):
                msg = decode(self.step_done.recv())
                assert isinstance(msg, StepDone) and msg.step == record.plan.step, msg
                return msg
        return None

    def _account(self, record: StepRecord, done: StepDone, step_s: float) -> None:
        """A periodic INFO line: throughput and where a step's time goes; with --log_level debug also a line per
        step (step_line)."""
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s", step_line(record.plan, done.forward_s, step_s))
        w = self._window
        w["steps"] += 1
        w["tokens"] += int(record.plan.input_ids.shape[0])
        w["forward_s"] += done.forward_s
        w["step_s"] += step_s
        now = time.monotonic()
        if now < self._log_at:
            return
        s = self.scheduler
        spec = s.speculation
        logger.info("%.1f steps/s, %d tokens/step, step %.1f ms (forward %.1f ms), running %d, "
                    "waiting %d, KV free %d/%d%s", w["steps"] / (now - self._log_at + STATS_LOG_S),
                    w["tokens"] // w["steps"], 1e3 * w["step_s"] / w["steps"], 1e3 * w["forward_s"] / w["steps"],
                    len(s.running), len(s.waiting), s.allocator.num_free, s.allocator.num_total,
                    ("" if spec is None else f", draft acceptance {100 * spec.acceptance_rate:.1f}% of "
                     f"{spec.counters['spec_draft_tokens_total']} draft tokens")
                    + ("" if s.lora is None else f", LoRA slots hold {s.lora.holder}, {s.lora.num_loads} loads so far"))
        self._window = dict(steps=0, tokens=0, forward_s=0.0, step_s=0.0)
        self._log_at = now + STATS_LOG_S
    def _drain_inbox(self, timeout_ms: int) -> None:
        if not self.poller.poll(timeout_ms):
            return
        while True:
            try:
                msg = decode(self.inbox.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            match msg:
                case AddReq(shm_index=i, req_id=rid):
                    self.scheduler.add_req(i, rid)
                case AbortReq(shm_index=i, req_id=rid, reason=reason):
                    self.scheduler.abort_req(i, rid, reason)
                case LoraAdded(lora_id=lid, path=path) if self.scheduler.lora is not None:
                    self.scheduler.lora.register(lid, path)
                case LoraRemoved(lora_id=lid) if self.scheduler.lora is not None:
                    self.scheduler.lora.unregister(lid)
                case _:
                    logger.error("router: unexpected message %r", type(msg).__name__)

    def _publish(self) -> None:
        for shm_index, req_id, reason in self.scheduler.released:
            self.to_detok.send(encode(ReqReleased(shm_index, req_id, reason)))
        self.scheduler.released.clear()
        self.scheduler.publish_stats()


def step_line(plan: BatchPlan, forward_s: float, step_s: float) -> str:
    """One step for the DEBUG log, which scripts/step_trace.py reads back: its tokens; the requests decoding and the KV
    tokens their attention reads (each one's context and its new token); the prompt chunks, their new tokens and the
    tokens before them in KV (a cached prefix or earlier chunks); the model forward on rank 0, and the whole step from
    when the worker could start it (its plan sent, or the step before it done) to its StepDone: the forward,
    sampling, the shm writes and whatever the worker waited for its plan."""
    nd = plan.num_decode
    return (f"step {plan.step}: tokens {plan.input_ids.shape[0]} decode {nd} kv {int(plan.prefix_lens[:nd].sum()) + nd}"
            f" prefill {plan.extend_lens.shape[0] - nd} new {int(plan.extend_lens[nd:].sum())}"
            f" before {int(plan.prefix_lens[nd:].sum())} forward {1e3 * forward_s:.2f} ms step {1e3 * step_s:.2f} ms")
