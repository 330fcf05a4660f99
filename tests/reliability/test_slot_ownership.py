"""No request can read another's output: the front hands a delta only to the request that owns the
slot now (same req_id), so a late delta of a slot's earlier occupant, or one forged for it, is
dropped. One process, fake neighbours: a real EngineClient and request pool, zmq sockets standing
in for the router and the detokenizer."""
from __future__ import annotations

import asyncio
import os
import secrets

import zmq
import zmq.asyncio

from lightserve.config import ServerConfig
from lightserve.engine.client import EngineClient
from lightserve.messages import (
    AddReq,
    DeltaBatch,
    FinishReason,
    ReqDelta,
    decode,
    encode,
)
from lightserve.procutil import remove_instance_files
from lightserve.sampling import SamplingParams
from lightserve.shm.req_pool import ReqPool

RECV_TIMEOUT_S = 30


def _delta(shm_index: int, req_id: int, text: str) -> ReqDelta:
    return ReqDelta(shm_index, req_id, text, [7], [text], [-0.1], 1, FinishReason.LENGTH)


async def _scenario(config: ServerConfig, pool: ReqPool) -> list[str]:
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.PULL)
    router.bind(config.router_addr)
    engine = EngineClient(config, pool, pool.max_len, 1000)
    engine.start()
    detok = ctx.socket(zmq.PUSH)
    detok.connect(config.front_addr)
    gens = [engine.generate([1, 2, 3], SamplingParams(max_new_tokens=1)) for _ in range(2)]
    try:
        firsts = [asyncio.ensure_future(anext(g)) for g in gens]
        adds = [decode(await asyncio.wait_for(router.recv(), RECV_TIMEOUT_S)) for _ in gens]
        assert all(isinstance(a, AddReq) for a in adds) and adds[0].shm_index != adds[1].shm_index
        a, b = adds
        # zmq keeps the order of one PUSH socket: the bad deltas arrive first and must be dropped.
        detok.send(encode(DeltaBatch([_delta(a.shm_index, a.req_id - 1, "stale occupant"),
                                      _delta(a.shm_index, b.req_id, "b's text on a's slot"),
                                      _delta(b.shm_index, a.req_id, "a's text on b's slot")])))
        detok.send(encode(DeltaBatch([_delta(a.shm_index, a.req_id, "a"), _delta(b.shm_index, b.req_id, "b")])))
        return [d.text for d in await asyncio.wait_for(asyncio.gather(*firsts), RECV_TIMEOUT_S)]
    finally:
        for g in gens:
            await g.aclose()
        await engine.close()
        router.close(linger=0)
        detok.close(linger=0)
        ctx.term()


def test_deltas_reach_only_the_request_that_owns_the_slot():
    config = ServerConfig(instance_id=f"{os.getpid()}-{secrets.token_hex(3)}")
    pool = ReqPool.create(config.shm_name, 4, 64)
    try:
        assert asyncio.run(_scenario(config, pool)) == ["a", "b"]
    finally:
        pool.close()
        remove_instance_files(config)
