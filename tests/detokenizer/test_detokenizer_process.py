"""The real detokenizer process: the test plays rank 0 (writes outputs into the pool, sends
TokensReady), the router (ReqReleased in, AbortReq out) and the HTTP front (DeltaBatch in)."""
from __future__ import annotations

import glob
import multiprocessing
import tempfile
from pathlib import Path

import numpy as np
import pytest
import zmq

from lightserve.config import SHM_PREFIX, ServerConfig
from lightserve.detokenizer.process import Detokenizer, run_detokenizer
from lightserve.messages import AbortReq, DeltaBatch, FinishReason, ReqReleased, TokensReady, decode, encode
from lightserve.sampling import SamplingParams
from lightserve.shm.req_pool import Owner, ReqPool
from lightserve.shm.segment import SHM_DIR
from tests.shm.helpers import is_released, list_segments

READY_TIMEOUT_S = 120  # spawn + importing transformers + loading the tokenizer, on a busy 2-core box
RECV_TIMEOUT_S = 20


class FakeEngine:
    """The pool writes of the front (request fields) and rank 0 (outputs, in the documented order)."""

    def __init__(self, pool: ReqPool, tokenizer):
        self.pool = pool
        self.tokenizer = tokenizer

    def add(self, shm_index: int, req_id: int, prompt: str, **params) -> None:
        pool = self.pool
        pool.acquire(shm_index, req_id)
        pool.write_request(shm_index, self.tokenizer.encode(prompt), SamplingParams(**params).validate(), seed=0)
        pool.num_output[shm_index] = 0  # outputs of the slot's previous occupant
        pool.finish[shm_index] = FinishReason.NONE

    def publish(self, shm_index: int, token_ids: list[int], finish: FinishReason = FinishReason.NONE) -> None:
        pool, n = self.pool, int(self.pool.num_output[shm_index])
        start = int(pool.prompt_len[shm_index]) + n
        pool.token_ids[shm_index, start:start + len(token_ids)] = token_ids
        pool.logprobs[shm_index, start:start + len(token_ids)] = -0.25
        pool.num_output[shm_index] = n + len(token_ids)  # publishes the tokens above
        if finish != FinishReason.NONE:
            pool.finish[shm_index] = finish


def recv(sock: zmq.Socket):
    assert sock.poll(RECV_TIMEOUT_S * 1000), "timed out waiting for the detokenizer"
    return decode(sock.recv())


def tokens_ready(slots: list[int], req_ids: list[int]) -> bytes:
    return encode(TokensReady(np.array(slots, np.int32), np.array(req_ids, np.int64)))


def test_detokenizer_state_without_sockets(smol_tokenizer):
    pool = ReqPool.create(ServerConfig().shm_name, num_slots=2, max_len=64)
    try:
        engine, detok = FakeEngine(pool, smol_tokenizer), Detokenizer(smol_tokenizer, pool)
        engine.add(0, 1, "Hi", stop=["!"])
        engine.add(1, 2, "Hi")
        engine.publish(0, smol_tokenizer.encode("Done! yes"), FinishReason.LENGTH)
        engine.publish(1, smol_tokenizer.encode(" a"))
        batch, aborts = detok.on_tokens_ready(decode(tokens_ready([0, 1], [1, 2])))
        # Rank 0 had already finished request 1, so the router needs no abort for its stop string.
        assert aborts == [] and [(d.text, d.finish) for d in batch.deltas] == [
            ("Done", FinishReason.STOP), (" a", FinishReason.NONE)]
        assert detok.on_tokens_ready(decode(tokens_ready([0, 1], [1, 2]))) == (None, [])  # nothing new
        assert list(detok.streams) == [1]
    finally:
        pool.close()
        pool.segment.unlink()


@pytest.mark.timeout(300)
def test_detokenizer_process(smol_dir, smol_tokenizer):
    config = ServerConfig(log_level="warning", model_dir=str(smol_dir))
    pool = ReqPool.create(config.shm_name, num_slots=4, max_len=128)
    ctx = zmq.Context()
    front, router, rank0 = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    front.bind(config.front_addr)
    router.bind(config.router_addr)
    rank0.connect(config.detok_addr)
    ours = _instance_files(config)  # the test's: the pool segment, the front's and the router's socket files
    assert len(ours) == 3, ours
    mp = multiprocessing.get_context("spawn")
    ready_recv, ready_send = mp.Pipe(duplex=False)
    proc = mp.Process(target=run_detokenizer, args=(config, ready_send), daemon=True)
    proc.start()
    try:
        assert ready_recv.poll(READY_TIMEOUT_S), "detokenizer did not report ready"
        assert ready_recv.recv()[0] == "ready"
        assert _instance_files(config) == sorted([*ours, config.detok_addr.removeprefix("ipc://")])
        _exercise(FakeEngine(pool, smol_tokenizer), smol_tokenizer, front, router, rank0)
    finally:
        proc.terminate()  # SIGTERM: the process's clean stop
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        left_by_detok = _instance_files(config)  # before the test removes its own files
        for sock in (front, router, rank0):
            sock.close(linger=0)
        ctx.term()
        for addr in (config.front_addr, config.router_addr):  # ours: the test bound them
            Path(addr.removeprefix("ipc://")).unlink(missing_ok=True)
        pool.close()
        pool.segment.unlink()
    assert proc.exitcode == 0
    # The detokenizer removed the socket file it bound, and nothing of the test's (the pool is the launcher's).
    assert left_by_detok == ours
    assert _instance_files(config) == []


def _instance_files(config: ServerConfig) -> list[str]:
    """The shm segments and ipc socket files of `config`'s instance."""
    prefix = f"{SHM_PREFIX}{config.instance_id}-"
    return sorted([str(SHM_DIR / name) for name in list_segments(prefix)]
                  + glob.glob(f"{tempfile.gettempdir()}/{prefix}*"))


def _exercise(engine: FakeEngine, tok, front, router, rank0) -> None:
    pool = engine.pool
    plain, stopped, aborted, unseen = 0, 1, 2, 3  # slots
    engine.add(plain, 101, "Say hi", max_new_tokens=64)
    engine.add(stopped, 102, "Greet the world", stop=[" world"])
    engine.add(aborted, 103, "Count")
    engine.add(unseen, 104, "Never scheduled")
    pool.cached_len[plain] = 2
    outputs = {  # plain runs longest, so every step has at least one delta
        plain: tok.encode("Hello world 😀 你好! How are you?", add_special_tokens=False),
        stopped: tok.encode(" Hello world again", add_special_tokens=False),
        aborted: tok.encode(" one two", add_special_tokens=False),
    }
    texts = {slot: "" for slot in outputs}
    finishes: dict[int, FinishReason] = {}
    for step in range(len(outputs[plain])):
        live = [s for s in outputs if step < len(outputs[s])]
        for s in live:
            last = s == plain and step == len(outputs[s]) - 1
            engine.publish(s, [outputs[s][step]], FinishReason.LENGTH if last else FinishReason.NONE)
        rank0.send(tokens_ready(live, [int(pool.req_id[s]) for s in live]))
        batch = recv(front)
        assert isinstance(batch, DeltaBatch)
        # One batch per TokensReady with every live slot; the stopped request is ignored once ended.
        assert sorted(d.shm_index for d in batch.deltas) == [s for s in live if s not in finishes]
        for d in batch.deltas:
            assert len(d.token_ids) == len(d.token_texts) == len(d.logprobs) == 1
            assert "".join(d.token_texts) == d.text and d.logprobs == [-0.25]
            assert d.cached_len == (2 if d.shm_index == plain else 0)
            texts[d.shm_index] += d.text
            if d.finish != FinishReason.NONE:
                finishes[d.shm_index] = d.finish
                assert is_released(pool, Owner.DETOK, d.shm_index)  # released before the final delta

    assert texts[plain] == "Hello world 😀 你好! How are you?" and finishes[plain] == FinishReason.LENGTH
    assert texts[stopped] == " Hello" and finishes[stopped] == FinishReason.STOP
    assert recv(router) == AbortReq(stopped, 102, FinishReason.STOP)
    assert texts[aborted] == " one two" and not is_released(pool, Owner.DETOK, aborted)

    # The router aborts a running request: tokens published without a TokensReady still come.
    engine.publish(aborted, tok.encode(" three", add_special_tokens=False))
    rank0.send(encode(ReqReleased(aborted, 103, FinishReason.ABORT)))
    (final,) = recv(front).deltas
    assert (final.text, final.num_output, final.finish) == (" three", 3, FinishReason.ABORT)
    # ... and one that never produced a token.
    rank0.send(encode(ReqReleased(unseen, 104, FinishReason.ABORT)))
    (final,) = recv(front).deltas
    assert (final.shm_index, final.text, final.num_output, final.finish) == (unseen, "", 0, FinishReason.ABORT)
    assert is_released(pool, Owner.DETOK, aborted) and is_released(pool, Owner.DETOK, unseen)

    # Slot reuse: late TokensReady for ended requests are ignored; the new occupant starts fresh.
    for owner in (Owner.FRONT, Owner.ROUTER):
        pool.release(owner, plain)
    engine.add(plain, 105, "Again", skip_special_tokens=False)
    reply = tok.encode("<|im_start|>ok", add_special_tokens=False) + [2]
    engine.publish(plain, reply, FinishReason.STOP)
    rank0.send(tokens_ready([plain, stopped], [101, 102]))  # stale: 101 left the slot, 102 ended
    rank0.send(tokens_ready([plain], [105]))
    (d,) = recv(front).deltas
    assert (d.req_id, d.text, d.finish, d.num_output) == (105, "<|im_start|>ok<|im_end|>", FinishReason.STOP,
                                                          len(reply))
    assert front.poll(300) == 0 and router.poll(0) == 0  # nothing else was sent
