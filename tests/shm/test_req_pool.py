"""The shared-memory request pool: layout, slot ownership and the write order, across real processes."""
from __future__ import annotations

import multiprocessing as mp
import os
import secrets

import numpy as np
import pytest

from lightserve.sampling import SamplingParams
from lightserve.shm.req_pool import Owner, ReqPool
from lightserve.shm.segment import SHM_DIR, remove_stale_segments

NUM_TOKENS = 2000
VOCAB = 1200
TOKEN_BASE = 100


@pytest.fixture
def pool():
    name = f"lightserve-{os.getpid()}-{secrets.token_hex(3)}-test"
    p = ReqPool.create(name, num_slots=8, max_len=NUM_TOKENS + 16)
    yield p
    p.close()
    p.segment.unlink()
    assert not (SHM_DIR / name).exists()


def test_request_fields_round_trip(pool):
    pool.acquire(3, req_id=42)
    params = SamplingParams(max_new_tokens=7, temperature=0.5, top_k=4, stop=["END", "ÿ"], stop_token_ids=[5, 6])
    pool.write_request(3, [9, 8, 7], params, seed=123)
    other = ReqPool.attach(pool.segment.name)
    try:
        assert other.req_id[3] == 42 and other.prompt_len[3] == 3
        assert other.token_ids[3, :3].tolist() == [9, 8, 7]
        rec = other.params[3]
        assert rec["max_new_tokens"] == 7 and rec["top_k"] == 4 and rec["seed"] == 123
        assert np.isclose(rec["temperature"], 0.5)
        assert rec["num_stop_token_ids"] == 2 and rec["stop_token_ids"][:2].tolist() == [5, 6]
        assert other.stop_strings(3) == ["END", "ÿ"]
    finally:
        other.close()


def test_slot_is_free_only_after_all_three_owners_release(pool):
    assert pool.num_free_slots() == 8
    pool.acquire(0, req_id=1)
    assert 0 not in pool.free_slots()
    pool.release(Owner.FRONT, 0)
    pool.release(Owner.DETOK, 0)
    assert 0 not in pool.free_slots()
    pool.release(Owner.ROUTER, 0)
    assert 0 in pool.free_slots()
    # Reuse: a new generation needs three fresh releases.
    pool.acquire(0, req_id=2)
    pool.release(Owner.ROUTER, 0)
    assert 0 not in pool.free_slots()
    with pytest.raises(AssertionError):
        pool.acquire(0, req_id=3)


class _NoSocket:
    """Stands in for the writer's zmq sockets to the router and the detokenizer."""

    def send(self, *_args, **_kw) -> None:
        pass

    def close(self, **_kw) -> None:
        pass


def _token(i: int) -> int:
    return TOKEN_BASE + i % 1000


def _writer(name: str, slot: int, req_id: int, ready) -> None:
    """Rank 0's real write path: model_infer's OutputWriter, one decode step per token, with logits
    that make token _token(i) the greedy choice at step i (its runner-up 1 logit below)."""
    from types import SimpleNamespace

    import torch

    from lightserve.messages import BatchPlan
    from lightserve.model_infer.output_writer import OutputWriter

    pool = ReqPool.attach(name)
    writer = OutputWriter(pool, SimpleNamespace(eos_token_ids=(), vocab_size=VOCAB), "", _NoSocket(), _NoSocket())
    prompt_len = int(pool.prompt_len[slot])
    ready.set()  # imports done: the reader starts polling now rather than spin through them
    one = lambda v: np.array([v], np.int32)  # noqa: E731
    for i in range(NUM_TOKENS):
        logits = torch.zeros(1, VOCAB)
        logits[0, _token(i)], logits[0, _token(i + 1)] = 2.0, 1.0
        plan = BatchPlan(step=i, shm_indices=one(slot), req_ids=np.array([req_id], np.int64),
                         prefix_lens=one(prompt_len + i - 1), extend_lens=one(1), sample=np.array([True]),
                         input_ids=one(_token(i - 1)), kv_locs=one(0), num_decode=1)
        writer.write(plan, logits, 0.0)
    pool.close()


def _reader(name: str, slot: int, want_logprob: float, ready, result) -> None:
    """The detokenizer's role: finish first, then the count; every counted token must be there,
    with its logprob and its top alternative."""
    pool = ReqPool.attach(name)
    seen_max, bad = 0, 0
    expected = np.array([_token(i) for i in range(NUM_TOKENS)], np.int32)
    assert ready.wait(120), "the writer never started"
    while True:
        finish, n = pool.read_output(slot)
        if n:
            bad += int((pool.output_ids(slot, 0, n) != expected[:n]).sum())
            bad += int(abs(pool.output_logprobs(slot, n - 1, n)[0] - want_logprob) > 1e-5)
            bad += int(pool.output_top_logprobs(slot, n - 1, n)[0][0][0] != expected[n - 1])
            seen_max = max(seen_max, n)
        if finish:
            result.put((bad, seen_max, n, finish))
            break
    pool.close()


def test_reader_never_sees_a_count_ahead_of_its_tokens(pool):
    """The worker's OutputWriter publishes while a reader in another process polls: a count the
    reader sees always has its tokens, logprobs and top alternatives written, and the count read
    after the finish status is final."""
    import torch

    from lightserve.messages import FinishReason

    pool.acquire(1, req_id=7)
    pool.write_request(1, [1, 2, 3, 4], SamplingParams(max_new_tokens=NUM_TOKENS, temperature=0, top_logprobs=2,
                                                       ignore_eos=True), seed=0)
    logits = torch.tensor([2.0, 1.0] + [0.0] * (VOCAB - 2))
    want_logprob = float(torch.log_softmax(logits, -1)[0])
    ctx = mp.get_context("spawn")
    result, ready = ctx.Queue(), ctx.Event()
    reader = ctx.Process(target=_reader, args=(pool.segment.name, 1, want_logprob, ready, result))
    writer = ctx.Process(target=_writer, args=(pool.segment.name, 1, 7, ready))
    reader.start()
    writer.start()
    writer.join(120)
    bad, seen_max, final_n, finish = result.get(timeout=120)
    reader.join(30)
    assert writer.exitcode == 0 and reader.exitcode == 0
    assert bad == 0
    assert 0 < seen_max <= final_n == NUM_TOKENS  # once finish is seen, the count read after it is final
    assert finish == FinishReason.LENGTH


def test_stale_segments_of_dead_launchers_are_removed(tmp_path):
    dead_pid = 2**22 + 12345  # above pid_max on this kernel: never a live process
    live = tmp_path / f"lightserve-{os.getpid()}-aaaaaa-reqs"
    dead = tmp_path / f"lightserve-{dead_pid}-bbbbbb-reqs"
    live.write_bytes(b"x")
    dead.write_bytes(b"x")
    removed = remove_stale_segments("lightserve-", tmp_path)
    assert removed == [dead.name]
    assert live.exists() and not dead.exists()
