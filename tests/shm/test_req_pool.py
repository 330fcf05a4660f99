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

NUM_TOKENS = 20000


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


def _writer(name: str, slot: int) -> None:
    """Rank 0's role: tokens and logprobs first, then the count, then the finish status."""
    pool = ReqPool.attach(name)
    base = int(pool.prompt_len[slot])
    for i in range(NUM_TOKENS):
        pool.token_ids[slot, base + i] = i + 1000
        pool.logprobs[slot, base + i] = -float(i)
        pool.num_output[slot] = i + 1
    pool.finish[slot] = 2
    pool.close()


def _reader(name: str, slot: int, result) -> None:
    """The detokenizer's role: finish first, then the count; every counted token must be there."""
    pool = ReqPool.attach(name)
    seen_max, bad = 0, 0
    while True:
        finish, n = pool.read_output(slot)
        if n:
            tokens = pool.output_ids(slot, 0, n)
            bad += int((tokens != np.arange(n) + 1000).sum())
            bad += int(pool.output_logprobs(slot, n - 1, n)[0] != -(n - 1))
            seen_max = max(seen_max, n)
        if finish:
            result.put((bad, seen_max, n))
            break
    pool.close()


def test_reader_never_sees_a_count_ahead_of_its_tokens(pool):
    pool.acquire(1, req_id=7)
    pool.write_request(1, [1, 2, 3, 4], SamplingParams(), seed=0)
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    reader = ctx.Process(target=_reader, args=(pool.segment.name, 1, result))
    writer = ctx.Process(target=_writer, args=(pool.segment.name, 1))
    reader.start()
    writer.start()
    writer.join(120)
    bad, seen_max, final_n = result.get(timeout=120)
    reader.join(30)
    assert writer.exitcode == 0 and reader.exitcode == 0
    assert bad == 0
    assert final_n == NUM_TOKENS  # once finish is seen, the count read after it is final


def test_stale_segments_of_dead_launchers_are_removed(tmp_path):
    dead_pid = 2**22 + 12345  # above pid_max on this kernel: never a live process
    live = tmp_path / f"lightserve-{os.getpid()}-aaaaaa-reqs"
    dead = tmp_path / f"lightserve-{dead_pid}-bbbbbb-reqs"
    live.write_bytes(b"x")
    dead.write_bytes(b"x")
    removed = remove_stale_segments("lightserve-", tmp_path)
    assert removed == [dead.name]
    assert live.exists() and not dead.exists()
