"""A fake streaming LLM server for the benchmark tests: /v1/models, /health, /v1/completions (with
usage), /v1/chat/completions (without usage, so clients must count chunks) and LightLLM's
/generate_stream. Each request gets exactly max_tokens tokens. Used in-process by
test_benchmark_serving.py and as a stand-in server process (`python fake_llm_server.py --port P`)
by test_compare_vllm.py.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import threading
from pathlib import Path

import numpy as np
from aiohttp import web


class FakeServer:
    """aiohttp app on a free loopback port, run on its own event loop in a daemon thread."""

    def __init__(self, delay_s: float = 0.001, fail_every: int = 0, port: int = 0, close_after_stream: bool = False):
        self.port = port
        self.delay_s = delay_s
        self.fail_every = fail_every  # every Nth POST answers 500; 0 = never
        # Close the connection after each /v1/completions stream, its keep-alive notwithstanding (as llama-server does).
        self.close_after_stream = close_after_stream
        self.num_posts = 0
        self.chat_message_counts: list[int] = []
        self.bodies: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/generate_stream", self._lightllm)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def _begin(self, request: web.Request) -> tuple[dict, web.StreamResponse | None]:
        body = await request.json()
        self.bodies.append(body)
        self.num_posts += 1
        if self.fail_every and self.num_posts % self.fail_every == 0:
            return body, None
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        return body, resp

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body, resp = await self._begin(request)
        if resp is None:
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        n = body["max_tokens"]
        prompt = body["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        for i in range(n):
            chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if i == n - 1 else None}],
                     "usage": None}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await asyncio.sleep(self.delay_s)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                              "total_tokens": prompt_tokens + n}}
            await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        if self.close_after_stream and request.transport is not None:
            await asyncio.sleep(0.1)  # the client has taken the connection back into its pool and sent the next request
            request.transport.close()
        return resp

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body, resp = await self._begin(request)
        if resp is None:
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        self.chat_message_counts.append(len(body["messages"]))
        n = body["max_tokens"]
        first = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        await resp.write(b"data: " + json.dumps(first).encode() + b"\n\n")
        for i in range(n):  # no usage chunk: the client must count chunks
            chunk = {"choices": [{"index": 0, "delta": {"content": f" c{i}"},
                                  "finish_reason": "length" if i == n - 1 else None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await asyncio.sleep(self.delay_s)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _lightllm(self, request: web.Request) -> web.StreamResponse:
        body, resp = await self._begin(request)
        if resp is None:
            return web.Response(status=500, text="injected failure")
        n = body["parameters"]["max_new_tokens"]
        text = []
        for i in range(n):
            text.append(f" l{i}")
            last = i == n - 1
            ev = {
                "token": {"id": 100 + i, "text": f" l{i}", "logprob": -0.1, "special": False},
                "generated_text": "".join(text) if last else None,
                "finished": last,
                "finish_reason": "length" if last else None,
                "details": None,
            }
            await resp.write(b"data:" + json.dumps(ev).encode() + b"\n\n")  # LightLLM writes no space
            await asyncio.sleep(self.delay_s)
        await resp.write_eof()
        return resp


def make_tiny_tokenizer(path: Path) -> str:
    """Train a byte-level BPE on made-up words (a fraction of a second) and save it at `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, size=int(rng.integers(2, 7)))) for _ in range(300)]
    corpus = [" ".join(rng.choice(words, size=50)) for _ in range(200)]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False
    )
    tk.train_from_iterator(corpus, trainer)
    tk.save(str(path))
    return str(path)


def main() -> None:
    """Serve until killed (SIGTERM ends the process; the daemon thread goes with it)."""
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--delay-s", type=float, default=0.0)
    args, _ = p.parse_known_args()  # the real servers' other flags are accepted and ignored
    srv = FakeServer(delay_s=args.delay_s, port=args.port).__enter__()
    print(f"fake server on {srv.url}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
