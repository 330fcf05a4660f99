"""The detokenizer process: reads output tokens from the request pool, sends text deltas to the
HTTP front, and tells the router when a stop string ends a request.

Entry: `run_detokenizer`, started by the launcher. `Detokenizer` is its state (one ReqStream per
live request) and maps each incoming message to outgoing ones without touching sockets, so it is
tested and benchmarked in-process.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from multiprocessing.connection import Connection

import zmq

from lightserve.config import ServerConfig
from lightserve.detokenizer.incremental import IncrementalDecoder, Tokenizer
from lightserve.detokenizer.req_stream import ReqStream
from lightserve.log import get_logger
from lightserve.messages import AbortReq, DeltaBatch, FinishReason, ReqDelta, ReqReleased, TokensReady, decode, encode
from lightserve.procutil import child_process, report_ready
from lightserve.shm.req_pool import Owner, ReqPool

logger = get_logger(__name__)

POLL_MS = 100        # the loop wakes this often to check the stop flag
SEND_TIMEOUT_MS = 100  # a blocked send (peer not reading) retries until stop, so SIGTERM still ends us


class Detokenizer:
    """Every live request's ReqStream, keyed by shm_index.

    A request ends here when the pool shows a finish status, a stop string matches, or the router
    releases it (ReqReleased). Ending drops the stream and releases the slot's DETOK ownership
    before the final delta is sent, so the slot is free once the front and router release theirs.
    """

    def __init__(self, tokenizer: Tokenizer, pool: ReqPool):
        self.tokenizer = tokenizer
        self.pool = pool
        self.streams: dict[int, ReqStream] = {}
        # The last ended req_id of each slot: TokensReady can still arrive for it (rank 0 keeps
        # stepping until the router acts on a stop-string abort) and must not start a new stream.
        self._ended: dict[int, int] = {}

    def on_tokens_ready(self, msg: TokensReady) -> tuple[DeltaBatch | None, list[AbortReq]]:
        """One DeltaBatch for every slot in the message (None if no slot had anything new) and the
        AbortReqs for requests a stop string ended. Releases DETOK ownership of ended slots."""
        deltas: list[ReqDelta] = []
        aborts: list[AbortReq] = []
        for shm_index, req_id in zip(msg.shm_indices.tolist(), msg.req_ids.tolist()):
            stream = self._stream(shm_index, req_id)
            if stream is None:
                continue
            finish, num_output = self.pool.read_output(shm_index)
            if num_output == stream.num_read and finish == FinishReason.NONE:
                continue  # a duplicate notification: nothing new
            delta = self._advance(stream, FinishReason(finish), num_output)
            if delta.finish != FinishReason.NONE and finish == FinishReason.NONE:
                # A stop string ended it while rank 0 still runs it: the router must stop it.
                aborts.append(AbortReq(shm_index, req_id, FinishReason.STOP))
            deltas.append(delta)
        return (DeltaBatch(deltas) if deltas else None), aborts

    def on_req_released(self, msg: ReqReleased) -> DeltaBatch | None:
        """The router ended a request: its final delta (tokens published so far included), unless
        it already ended here. Releases DETOK ownership of the slot."""
        seen = msg.shm_index in self.streams
        released_as = msg.reason if msg.reason != FinishReason.NONE else FinishReason.ABORT  # it must end here
        stream = self._stream(msg.shm_index, msg.req_id)
        if stream is None:
            return None
        if not seen:
            # No TokensReady came for it, so rank 0 may never have written this request's outputs
            # and the slot's num_output/finish could be the previous occupant's: read nothing.
            return DeltaBatch([self._advance(stream, released_as, 0)])
        finish, num_output = self.pool.read_output(msg.shm_index)
        # A finish status rank 0 already wrote is the truer reason than the router's abort.
        reason = FinishReason(finish) if finish != FinishReason.NONE else released_as
        return DeltaBatch([self._advance(stream, reason, num_output)])

    # ---- internals ------------------------------------------------------------------------------
    def _stream(self, shm_index: int, req_id: int) -> ReqStream | None:
        """The request's stream, created on first sight; None if it ended or the slot moved on."""
        if int(self.pool.req_id[shm_index]) != req_id or self._ended.get(shm_index) == req_id:
            return None  # stale: the slot holds a newer request, or this one already ended
        stream = self.streams.get(shm_index)
        if stream is not None:
            # A slot is reused only after we released it, i.e. after its old stream ended.
            assert stream.req_id == req_id, (shm_index, stream.req_id, req_id)
            return stream
        pool = self.pool
        prompt_len = int(pool.prompt_len[shm_index])
        context = pool.token_ids[shm_index, max(prompt_len - IncrementalDecoder.CONTEXT_TOKENS, 0):prompt_len]
        stream = ReqStream(shm_index, req_id, self.tokenizer, context.tolist(),
                           skip_special_tokens=bool(pool.params[shm_index]["skip_special_tokens"]),
                           stop=pool.stop_strings(shm_index))
        self.streams[shm_index] = stream
        return stream

    def _advance(self, stream: ReqStream, finish: FinishReason, num_output: int) -> ReqDelta:
        i = stream.shm_index
        ids = self.pool.output_ids(i, stream.num_read, num_output).tolist()
        logprobs = self.pool.output_logprobs(i, stream.num_read, num_output).tolist()
        top = self.pool.output_top_logprobs(i, stream.num_read, num_output)
        delta = stream.advance(ids, logprobs, finish, int(self.pool.cached_len[i]), top)
        if ids and stream.num_read == len(delta.token_ids) and delta.token_ids:
            # The first delta with tokens: the prefill is done, so its prompt logprobs are written.
            prompt = self.pool.prompt_logprobs(i)
            if prompt is not None:
                delta = dataclasses.replace(delta, prompt_logprobs=prompt[0], prompt_top_logprobs=prompt[1])
        if delta.finish != FinishReason.NONE:
            del self.streams[i]
            self._ended[i] = stream.req_id
            self.pool.release(Owner.DETOK, i)
        return delta


def run_detokenizer(config: ServerConfig, ready: Connection) -> None:
    model_dir = config.model_dir
    with child_process("detokenizer", config, ready) as stop:
        from lightserve.hf_tokenizer import load_decoder

        tokenizer = load_decoder(model_dir)  # without importing transformers where the front cached its tokenizer
        pool = ReqPool.attach(config.shm_name)
        ctx = zmq.Context()
        inbox = ctx.socket(zmq.PULL)
        inbox.bind(config.detok_addr)
        to_front = ctx.socket(zmq.PUSH)
        to_router = ctx.socket(zmq.PUSH)
        for sock, addr in ((to_front, config.front_addr), (to_router, config.router_addr)):
            sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
            sock.connect(addr)
        detok = Detokenizer(tokenizer, pool)
        report_ready(ready)
        logger.info("detokenizer ready (%s)", type(tokenizer).__name__)
        try:
            while not stop.is_set():
                if not inbox.poll(POLL_MS):
                    continue
                match decode(inbox.recv(copy=False)):
                    case TokensReady() as msg:
                        batch, aborts = detok.on_tokens_ready(msg)
                        for abort in aborts:
                            _send(to_router, abort, stop)
                        if batch is not None:
                            _send(to_front, batch, stop)
                    case ReqReleased() as msg:
                        batch = detok.on_req_released(msg)
                        if batch is not None:
                            _send(to_front, batch, stop)
                    case other:
                        logger.error("unexpected message %s", type(other).__name__)
        finally:
            for sock in (inbox, to_front, to_router):
                sock.close(linger=0)
            ctx.term()
            _unlink_ipc(config.detok_addr)
            pool.close()


def _send(sock: zmq.Socket, msg: DeltaBatch | AbortReq, stop: threading.Event) -> None:
    # PUSH blocks when the peer's queue is full (it stopped reading): keep trying, but give up
    # once we are told to stop so a stuck peer cannot keep this process from exiting.
    data = encode(msg)
    while not stop.is_set():
        try:
            sock.send(data, copy=False)
            return
        except zmq.Again:
            continue


def _unlink_ipc(addr: str) -> None:
    # libzmq 4.3 leaves the file of a bound ipc:// endpoint behind; whoever binds removes it.
    if addr.startswith("ipc://"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(addr[len("ipc://"):])
