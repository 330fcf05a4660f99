"""The offline pipeline on the real model (float32), one pipeline for the module: threads, lists,
asyncio, chats, early exits and validation."""
from __future__ import annotations

import asyncio
import threading

import pytest

from lightserve import GenerationConfig, pipeline
from lightserve.sampling import ParamError, SamplingParams
from tests.greedy_check import greedy_mismatch
from tests.pipeline.helpers import SETTINGS, assert_greedy, hf_model, wait_until

TOPICS = ["the ocean", "a red bicycle", "volcanoes", "chess openings", "the moon", "bread baking",
          "a lost key", "jazz music", "winter in Oslo", "prime numbers", "honey bees", "old maps"]
THREADS, CALLS, NEW_TOKENS = 5, 4, 32   # 20 streams of 32 tokens, 5 at a time
ASYNC_NEW_TOKENS = 32
ABANDONED_MAX_NEW = 4000  # what an abandoned stream asks for: none may run to it
PROMPTS8 = ["What is the capital of France?", "def fibonacci(n):", "1, 1, 2, 3, 5, 8,",
            "Write a haiku about rain.", "The quick brown fox", "Q: What is 12 times 7?\nA:",
            "Once upon a time, in a small village,", "import numpy as np\n"]


@pytest.fixture(scope="module")
def pipe():
    with pipeline(**SETTINGS) as p:
        yield p


def _check_greedy(pipe, prompt: str, got_ids: list[int], what: str) -> None:
    assert_greedy(pipe.model_dir, pipe.tokenizer.encode(prompt), got_ids, what)


def _joined(chunks):
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids]


def test_threads_each_get_exactly_their_own_stream_and_batch(pipe):
    """5 threads x 4 sequential stream_infer calls, all prompts distinct: every stream equals the
    greedy infer() of its own prompt, and the router ran them in batches larger than one."""
    cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = {(t, c): f"Thread {t}, call {c}: a short story about {TOPICS[(t * CALLS + c) % len(TOPICS)]}."
               for t in range(THREADS) for c in range(CALLS)}
    streams, errors = {}, []
    start = threading.Barrier(THREADS)
    running_seen = []
    done = threading.Event()

    def worker(t: int) -> None:
        try:
            start.wait()
            for c in range(CALLS):
                streams[t, c] = list(pipe.stream_infer(prompts[t, c], cfg))
        except Exception as exc:  # noqa: BLE001 - reported below, with the thread
            errors.append((t, exc))

    def monitor() -> None:  # requests the router runs at once while the threads stream
        while not done.wait(0.05):
            running_seen.append(pipe.stats()["requests_running"])

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    watcher = threading.Thread(target=monitor)
    for th in threads + [watcher]:
        th.start()
    try:
        for th in threads:
            th.join(600)
    finally:
        done.set()
        watcher.join()
    assert not errors, errors
    assert max(running_seen) > 1 and pipe.stats()["max_batch_size"] > 1

    # Each stream must be transformers' greedy continuation of its own prompt (teacher-forced,
    # tests/greedy_check.py): tokens of another thread's request, or a dropped or repeated token,
    # cannot pass. Its text must be the decode of exactly those tokens.
    hf = hf_model(pipe.model_dir)
    for (t, c), prompt in sorted(prompts.items()):
        chunks = streams[t, c]
        assert all(ch.index == 0 for ch in chunks)
        assert [ch.finish_reason for ch in chunks][-1] == "length"
        assert all(ch.finish_reason is None for ch in chunks[:-1])
        counts = [ch.generated_tokens for ch in chunks]
        assert counts == [sum(len(ch.token_ids) for ch in chunks[: i + 1]) for i in range(len(chunks))]
        text, ids = _joined(chunks)
        assert len(ids) == NEW_TOKENS
        problem = greedy_mismatch(hf, pipe.tokenizer.encode(prompt), ids)
        assert problem is None, f"thread {t} call {c}: {problem}"
        assert text == pipe.tokenizer.decode(ids, skip_special_tokens=True), f"thread {t} call {c}"


def test_stream_list_chunks_carry_their_index(pipe):
    cfg = GenerationConfig(max_new_tokens=32)
    refs = pipe.infer(PROMPTS8, cfg)
    assert [r.index for r in refs] == list(range(8))
    per_index: dict[int, list] = {i: [] for i in range(8)}
    for chunk in pipe.stream_infer(PROMPTS8, cfg):
        assert not per_index[chunk.index] or per_index[chunk.index][-1].finish_reason is None, "chunk after finish"
        per_index[chunk.index].append(chunk)
    for i, ref in enumerate(refs):
        chunks = per_index[i]
        assert chunks[-1].finish_reason in ("stop", "length") and chunks[-1].prompt_tokens == ref.prompt_tokens
        text, ids = _joined(chunks)
        assert chunks[-1].generated_tokens == len(ids)
        assert text == pipe.tokenizer.decode(ids, skip_special_tokens=True), f"prompt {i}"
        _check_greedy(pipe, PROMPTS8[i], ids, f"stream of prompt {i}")
        _check_greedy(pipe, PROMPTS8[i], ref.token_ids, f"infer of prompt {i}")


def test_asyncio_and_threads_at_the_same_time(pipe):
    cfg = GenerationConfig(max_new_tokens=ASYNC_NEW_TOKENS, ignore_eos=True)
    async_prompts = [f"Async task {i} writes about {TOPICS[i]}:" for i in range(3)]
    thread_prompts = [f"Worker thread {i} writes about {TOPICS[-1 - i]}:" for i in range(3)]
    thread_out: list = []

    def in_thread() -> None:
        thread_out.extend(pipe.infer(thread_prompts, cfg))

    async def one(prompt: str) -> tuple[str, list[int]]:
        text, ids = "", []
        async for chunk in pipe.generate(prompt, cfg):
            assert chunk.index == 0
            text += chunk.text
            ids += chunk.token_ids
        return text, ids

    async def main() -> list:
        th = threading.Thread(target=in_thread)
        th.start()
        outs = await asyncio.gather(*[one(p) for p in async_prompts])
        await asyncio.to_thread(th.join, 300)
        return outs

    async_out = asyncio.run(main())
    assert len(thread_out) == 3
    for (text, ids), prompt in zip(async_out, async_prompts):
        assert len(ids) == ASYNC_NEW_TOKENS and text == pipe.tokenizer.decode(ids, skip_special_tokens=True)
        _check_greedy(pipe, prompt, ids, prompt)
    for response, prompt in zip(thread_out, thread_prompts):
        assert len(response.token_ids) == ASYNC_NEW_TOKENS
        _check_greedy(pipe, prompt, response.token_ids, prompt)


def _idle(pipe) -> bool:
    s = pipe.stats()
    return s["requests_in_flight"] == 0 and s["requests_running"] == 0 and s["requests_waiting"] == 0


def test_abandoned_streams_abort_their_requests(pipe):
    """A stream closed after its first chunk, and an `async for` left early, end their requests: the
    engine goes idle having generated fewer tokens, all requests together, than one of them asked for.
    With ignore_eos only the length could end one, so none ran to its end: they were aborted."""
    cfg = GenerationConfig(max_new_tokens=ABANDONED_MAX_NEW, ignore_eos=True)  # minutes of work if not aborted
    generated = pipe.stats()["generation_tokens_total"]
    gen = pipe.stream_infer(["Count to a million:", "Name every star:"], cfg)
    next(gen)
    gen.close()
    assert wait_until(lambda: _idle(pipe), 15)
    assert pipe.stats()["generation_tokens_total"] - generated < cfg.max_new_tokens

    async def leave_early() -> None:
        async for _ in pipe.generate("Tell me everything:", cfg):
            break

    generated = pipe.stats()["generation_tokens_total"]
    asyncio.run(leave_early())
    assert wait_until(lambda: _idle(pipe), 15)
    assert pipe.stats()["generation_tokens_total"] - generated < cfg.max_new_tokens


def test_chat_prompts(pipe):
    cfg = GenerationConfig(max_new_tokens=24)
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    chat2 = [{"role": "user", "content": "Say hello."}]
    rendered = pipe.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    rendered2 = pipe.tokenizer.apply_chat_template(chat2, tokenize=False, add_generation_prompt=True)
    chat_ids = [pipe.tokenizer.encode(r, add_special_tokens=False) for r in (rendered, rendered2)]
    one = pipe.infer(chat, cfg)                    # a single chat -> one Response
    many = pipe.infer([chat, chat2, "Plain text"], cfg)  # a list of chats (and a str) -> a list
    assert not isinstance(one, list) and len(many) == 3
    # A chat is its rendered template: the prompt's length, and transformers' greedy answer to it.
    assert one.prompt_tokens == many[0].prompt_tokens == len(chat_ids[0])
    assert many[1].prompt_tokens == len(chat_ids[1])
    assert_greedy(pipe.model_dir, chat_ids[0], one.token_ids, "a single chat")
    assert_greedy(pipe.model_dir, chat_ids[0], many[0].token_ids, "chat 0 of a list")
    assert_greedy(pipe.model_dir, chat_ids[1], many[1].token_ids, "chat 1 of a list")
    _check_greedy(pipe, "Plain text", many[2].token_ids, "the plain text of a list")
    as_text = pipe.infer(rendered, cfg)  # the rendered chat passed as a plain string
    assert as_text.prompt_tokens == len(chat_ids[0])
    assert_greedy(pipe.model_dir, chat_ids[0], as_text.token_ids, "a chat rendered by hand")
    streamed = list(pipe.stream_infer([chat2], cfg))
    text, ids = _joined(streamed)
    assert {c.index for c in streamed} == {0} and text == pipe.tokenizer.decode(ids, skip_special_tokens=True)
    assert_greedy(pipe.model_dir, chat_ids[1], ids, "a streamed chat")
    for bad in ([], [{"role": "user", "content": "x"}, "y"], [1, 2], {"role": "user", "content": "x"}):
        if bad == []:
            assert pipe.infer(bad) == []
            continue
        with pytest.raises(TypeError, match="prompts must be"):
            pipe.infer(bad)
    with pytest.raises(ValueError, match=r"prompt\.0\.content"):
        pipe.infer([{"role": "user"}])


def test_bad_config_names_the_field(pipe):
    cases = [({"temperature": -1}, "temperature"), ({"top_p": 0.0}, "top_p"),
             ({"max_new_tokens": 0}, "max_new_tokens"), ({"stop": [""]}, "stop"), ({"seed": -3}, "seed")]
    for kwargs, name in cases:
        with pytest.raises(ValueError, match=f"^{name}:") as info:
            pipe.infer("Hello", GenerationConfig(**kwargs))
        assert isinstance(info.value, ParamError) and info.value.param == name
        with pytest.raises(ValueError, match=f"^{name}:"):
            pipe.stream_infer(["a", "b"], GenerationConfig(**kwargs))  # raises before iteration
    with pytest.raises(ValueError, match=r"^prompts\[1\]: the prompt is empty"):
        pipe.infer(["ok", ""])
    with pytest.raises(TypeError, match="GenerationConfig"):
        pipe.infer("Hello", {"temperature": 0})

    async def bad_async() -> None:
        async for _ in pipe.generate("Hello", GenerationConfig(top_k=-5)):
            pass

    with pytest.raises(ValueError, match="^top_k:"):
        asyncio.run(bad_async())


def test_each_call_copies_the_config(pipe):
    cfg = GenerationConfig(max_new_tokens=10**6, temperature=0.0)
    out = pipe.infer("Hi", GenerationConfig(max_new_tokens=4, ignore_eos=True))
    assert out.generated_tokens == 4 and out.finish_reason == "length" and out.logprobs is None
    gen = pipe.stream_infer("Hi", cfg)  # check_prompt caps max_new_tokens on the call's copy
    next(gen)
    gen.close()
    assert cfg.max_new_tokens == 10**6 and GenerationConfig is SamplingParams
    lp = pipe.infer("Hi", GenerationConfig(max_new_tokens=4, ignore_eos=True), logprobs=True)
    assert len(lp.logprobs) == 4 and all(x <= 0 for x in lp.logprobs)
