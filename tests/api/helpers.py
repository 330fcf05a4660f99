"""Test helpers for the HTTP front: a scripted FakeEngine with the EngineClient surface the routes use,
the app built around it, an in-process ASGI client and a real uvicorn server on a free port."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from lightserve.config import ServerConfig
from lightserve.engine.client import EngineClient
from lightserve.messages import FinishReason, ReqDelta
from lightserve.sampling import SamplingParams
from lightserve.shm.req_pool import STATS_FIELDS

MODEL_NAME = "smol-test"
CONTEXT = 512
VOCAB = 49152


class FakePool:
    num_slots = 8
    max_top_logprobs = 5  # ServerConfig's default --max_top_logprobs (check_prompt's limit)

    def __init__(self) -> None:
        self.stats = {name: i + 1 for i, name in enumerate(STATS_FIELDS)}

    def num_free_slots(self) -> int:
        return self.num_slots

    def stats_dict(self) -> dict[str, int]:
        return dict(self.stats)


class FakeEngine:
    """Yields `max_new_tokens` tokens (id 100+i, text ' t<i>' or `script[i]`, logprob -0.5) then `finish`,
    `tokens_per_delta` per delta. Records calls and early closes (the real client's abort path)."""

    check_prompt = EngineClient.check_prompt  # the real prompt validation and max_new_tokens cap
    lora_id = EngineClient.lora_id  # no adapters here (adapters None): every name but the model's is unknown

    def __init__(self, max_req_total_len: int = CONTEXT, vocab_size: int = VOCAB):
        self.pool = FakePool()
        self.max_req_total_len = max_req_total_len
        self.vocab_size = vocab_size
        self.started = False
        self.closed = False
        self.calls: list[tuple[list[int], SamplingParams]] = []
        self.delay = 0.0
        self.first_delay = 0.0
        self.tokens_per_delta = 1
        self.finish = FinishReason.LENGTH
        self.empty_final = False  # send the finish in an extra delta without tokens (abort, stop string)
        self.script: list[str] | None = None  # the text of each token instead of " t<i>" (max_new_tokens ignored)
        self.cached_len = 3
        self.fail: Exception | None = None       # raised before the first delta
        self.fail_mid: Exception | None = None   # raised after the first delta
        self.num_pending = 0
        self.num_queued = 0
        self.num_aborted = 0
        self.num_finished = 0
        self.aborted = threading.Event()         # set by an early close (the tests may run uvicorn in a thread)
        self.adapters = None                     # no --enable_lora

    def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[ReqDelta]:
        self.calls.append((list(prompt_ids), params))
        if self.fail is not None:
            raise self.fail
        self.num_pending += 1
        finished = False
        try:
            produced, total = 0, params.max_new_tokens if self.script is None else len(self.script)
            await asyncio.sleep(self.first_delay)
            while produced < total:
                if produced:
                    await asyncio.sleep(self.delay)
                    if self.fail_mid is not None:
                        raise self.fail_mid
                k = min(self.tokens_per_delta, total - produced)
                ids = [100 + produced + j for j in range(k)]
                texts = [f" t{produced + j}" if self.script is None else self.script[produced + j] for j in range(k)]
                produced += k
                finish = self.finish if produced == total and not self.empty_final else FinishReason.NONE
                finished = finish != FinishReason.NONE
                yield ReqDelta(0, 1, "".join(texts), ids, texts, [-0.5] * k, produced, finish, self.cached_len)
            if self.empty_final:
                finished = True
                yield ReqDelta(0, 1, "", [], [], [], produced, self.finish, self.cached_len)
        finally:
            self.num_pending -= 1
            if finished:
                self.num_finished += 1
            else:
                self.num_aborted += 1
                self.aborted.set()


def make_app(engine: FakeEngine, tokenizer: Any, health_reason: str | None = None, **config: Any) -> Any:
    from lightserve.http.app import create_app
    cfg = ServerConfig(instance_id="apitest", **config)
    return create_app(cfg, engine, tokenizer, MODEL_NAME, lambda: health_reason)


@contextlib.asynccontextmanager
async def asgi_client(app: Any, raise_app_exceptions: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    """httpx over ASGITransport with the app's lifespan run around it (httpx does not run it)."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client


@contextlib.contextmanager
def live_server(app: Any) -> Iterator[str]:
    """Run the app under uvicorn (uvloop, as the launcher does) in a thread; yield its base URL."""
    import uvicorn
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, loop="uvloop", log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
