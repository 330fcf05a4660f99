#!/usr/bin/env python3
"""Load generator for an LLM server's HTTP port (lightserve or vLLM's OpenAI server).

Sends seeded workloads (random, shared-prefix, multi-turn, copy-edit) over one of three streaming APIs and
reports TTFT, inter-token latency, TPOT, end-to-end latency and throughput. One process, asyncio +
aiohttp. Used by hand and by scripts/compare_vllm.sh; tests import `main` from
tests/scripts/test_benchmark_serving.py.

This file is longer than 400 lines on purpose: it is a standalone script that others copy to a
machine and run with nothing but aiohttp, numpy and tokenizers, so it is kept in one piece.

Example:
    python scripts/benchmark_serving.py --backend openai --dataset random --num-prompts 128 \
        --input-len-min 128 --input-len-max 512 --output-len 128 --max-concurrency 64
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp
import numpy as np

try:  # orjson parses the many small SSE payloads 3-5x faster; json is the fallback.
    import orjson

    _loads: Callable[[bytes], Any] = orjson.loads
except ImportError:  # pragma: no cover - depends on the environment
    _loads = json.loads

BACKEND_PATHS = {
    "openai": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
    "lightllm": "/generate_stream",
}
PERCENTILES = (50, 90, 99)


def default_model_dir() -> str:
    """Where `python -m lightserve.engine.model_prep` puts the bundled model (`$LIGHTSERVE_CACHE` aware)."""
    root = os.environ.get("LIGHTSERVE_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "lightserve"
    return str(base / "SmolLM2-135M-Instruct")


# ----------------------------------------------------------------------------------------------
# Workload: prompts that re-tokenize to exactly the requested number of tokens
# ----------------------------------------------------------------------------------------------

@dataclass
class Prompt:
    """One request to send. `text` is the prompt (or user message); `token_ids` its exact ids."""

    text: str
    token_ids: list[int]
    output_len: int


@dataclass
class Conversation:
    """A multi-turn chat: user messages sent one after the other, each after the previous answer."""

    turns: list[Prompt]


class PromptMaker:
    """Builds random prompts from a tokenizer's vocabulary that re-encode to exact lengths.

    Ids are drawn from a pool of tokens that are a space plus ASCII letters and encode back to
    themselves alone (" hello" -> [id]). A byte-level BPE splits words at spaces before merging,
    so a run of such tokens re-encodes to the same ids and two runs concatenate without merging
    across the seam (which keeps a shared prefix's tokens identical). Every prompt is still
    re-encoded and checked; a mismatch is repaired by trimming or topping up, then re-checked.
    """

    def __init__(self, tokenizer_path: str, rng: np.random.Generator):
        self.rng = rng
        (self._encode, self._encode_batch, self._decode, self._decode_each, vocab_size,
         special) = _load_tokenizer(tokenizer_path)
        self.pool = self._build_pool(vocab_size, special)

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def make(self, num_tokens: int, prefix: Prompt | None = None) -> tuple[str, list[int]]:
        """Return (text, ids) of `num_tokens` fresh tokens; with `prefix`, prefix.text + text
        must encode to prefix.token_ids + ids."""
        if num_tokens <= 0:
            return "", []
        head_text = prefix.text if prefix else ""
        head_ids = prefix.token_ids if prefix else []
        ids = [int(i) for i in self.rng.choice(self.pool, size=num_tokens)]
        for _ in range(16):
            text = self._decode(ids)
            full = self._encode(head_text + text)
            got = full[len(head_ids):]
            if full[: len(head_ids)] == head_ids and len(got) == num_tokens:
                return text, got
            if full[: len(head_ids)] != head_ids:  # the seam merged: change the first token
                ids[0] = int(self.rng.choice(self.pool))
            elif len(got) > num_tokens:
                ids = got[:num_tokens]
            else:
                ids = got + [int(i) for i in self.rng.choice(self.pool, size=num_tokens - len(got))]
        raise RuntimeError(f"could not build a prompt of exactly {num_tokens} tokens")

    def copy_edit(self, num_tokens: int) -> tuple[str, list[int]]:
        """A prompt of about `num_tokens` tokens that holds a JSON document (records of random words and numbers)
        and asks for it back with one value changed, ending where the copy starts: what a speculative decoder's
        prompt lookup serves (W4). Returns (text, ids); the length is the document's, rounded up to a record."""
        words = [w.strip() for w in self._decode_each([int(i) for i in self.rng.choice(self.pool, size=512)])]
        records: list[str] = []
        doc = ""
        while not records or len(self._encode(doc)) < num_tokens - 40:   # the instruction's ~40 tokens
            i = len(records)
            pick = self.rng.integers(0, len(words), size=3)
            records.append(f'  {{"id": {i}, "name": "{words[pick[0]]}", "tags": ["{words[pick[1]]}", '
                           f'"{words[pick[2]]}"], "score": {self.rng.integers(0, 100) / 100:.2f}}}')
            doc = "[\n" + ",\n".join(records) + "\n]"
        target = int(self.rng.integers(0, len(records)))
        text = (f"Here is a JSON document:\n{doc}\n\nWrite the document out again, unchanged except that the "
                f'record with "id": {target} gets "score": 1.0.\n\nEdited document:\n')
        return text, self._encode(text)

    def _build_pool(self, vocab_size: int, special: set[int]) -> np.ndarray:
        words: list[int] = []
        roundtrip: list[int] = []
        cand = [i for i in range(vocab_size) if i not in special]
        texts = self._decode_each(cand)
        for i, s, enc in zip(cand, texts, self._encode_batch(texts)):
            if not s or enc != [i]:
                continue
            roundtrip.append(i)
            if len(s) > 1 and s[0] == " " and s[1:].isascii() and s[1:].isalpha():
                words.append(i)
        pool = words if len(words) >= 64 else roundtrip
        if not pool:
            raise RuntimeError("tokenizer has no usable tokens for random prompts")
        return np.asarray(pool, dtype=np.int64)


def _load_tokenizer(path: str) -> tuple[Callable, Callable, Callable, Callable, int, set[int]]:
    """(encode, encode_batch, decode, decode_each (one text per id), vocab_size, special ids).
    Uses `tokenizers` on tokenizer.json directly
    (0.5 s) and falls back to transformers' AutoTokenizer (5+ s to import) for other folders."""
    p = Path(path).expanduser()
    tok_file = p / "tokenizer.json" if p.is_dir() else p
    if tok_file.is_file() and tok_file.suffix == ".json":
        from tokenizers import Tokenizer

        tk = Tokenizer.from_file(str(tok_file))
        special = {t.content for t in tk.get_added_tokens_decoder().values() if t.special}
        special_ids = {tk.token_to_id(s) for s in special}
        return (
            lambda text: tk.encode(text, add_special_tokens=False).ids,
            lambda texts: [e.ids for e in tk.encode_batch(texts, add_special_tokens=False)],
            lambda ids: tk.decode(ids, skip_special_tokens=False),
            lambda ids: tk.decode_batch([[i] for i in ids], skip_special_tokens=False),
            tk.get_vocab_size(),
            special_ids,
        )
    from transformers import AutoTokenizer  # slow import; only for folders without tokenizer.json

    hf = AutoTokenizer.from_pretrained(str(p))
    return (
        lambda text: hf.encode(text, add_special_tokens=False),
        lambda texts: [hf.encode(t, add_special_tokens=False) for t in texts],
        lambda ids: hf.decode(ids, skip_special_tokens=False),
        lambda ids: [hf.decode([i], skip_special_tokens=False) for i in ids],
        len(hf),
        set(hf.all_special_ids),
    )


def _lengths(rng: np.random.Generator, n: int, fixed: int | None, lo: int | None, hi: int | None) -> list[int]:
    """n lengths: uniform on [lo, hi] when both are given, else `fixed`."""
    if lo is not None or hi is not None:
        lo = lo if lo is not None else hi
        hi = hi if hi is not None else lo
        if lo > hi:
            raise ValueError(f"min length {lo} > max length {hi}")
        return [int(x) for x in rng.integers(lo, hi + 1, size=n)]
    if fixed is None:
        raise ValueError("a length is missing")
    return [fixed] * n


def build_workload(args: argparse.Namespace, maker: PromptMaker) -> tuple[list[Conversation], list[Conversation]]:
    """(measured, warm-up) conversations; single-turn datasets give one-turn conversations.
    Warm-up prompts are drawn after the measured ones, so --warmup never changes the workload."""
    rng = maker.rng
    if args.dataset == "random":
        n = args.num_prompts + args.warmup
        lens = _lengths(rng, n, args.input_len, args.input_len_min, args.input_len_max)
        convs = []
        for ln in lens:
            text, ids = maker.make(ln)
            convs.append(Conversation([Prompt(text, ids, args.output_len)]))
    elif args.dataset == "shared-prefix":
        # --num-prefixes groups (a system prompt per tenant, say); request i uses prefix i mod k, so
        # groups interleave in arrival order. With k = 1 the draws are those of a single prefix.
        prefixes = [Prompt(*maker.make(args.prefix_len), 0) for _ in range(args.num_prefixes)]
        n = args.num_prompts + args.warmup
        lens = _lengths(rng, n, None, args.suffix_len_min, args.suffix_len_max)
        convs = []
        for i, ln in enumerate(lens):
            prefix = prefixes[i % len(prefixes)]
            text, ids = maker.make(ln, prefix=prefix)
            convs.append(Conversation([Prompt(prefix.text + text, prefix.token_ids + ids, args.output_len)]))
    elif args.dataset == "multi-turn":
        n = args.num_conversations + args.warmup
        convs = []
        for _ in range(n):
            lens = _lengths(rng, args.turns, args.input_len, args.input_len_min, args.input_len_max)
            turns = []
            for ln in lens:
                text, ids = maker.make(ln)
                turns.append(Prompt(text, ids, args.output_len))
            convs.append(Conversation(turns))
    elif args.dataset == "copy-edit":
        n = args.num_prompts + args.warmup
        convs = [Conversation([Prompt(*maker.copy_edit(args.input_len), args.output_len)]) for _ in range(n)]
    else:  # argparse restricts choices
        raise ValueError(args.dataset)
    k = len(convs) - args.warmup
    warm = convs[k:]
    if args.dataset == "multi-turn":  # warm-up: first turns only, as single requests
        warm = [Conversation(c.turns[:1]) for c in warm]
    return convs[:k], warm


# ----------------------------------------------------------------------------------------------
# One streamed request
# ----------------------------------------------------------------------------------------------

@dataclass
class RequestRecord:
    """What one request measured. Times are seconds; `start` is relative to the run's start."""

    conversation: int
    turn: int
    prompt_len: int  # tokens of this request's new text (multi-turn: the new user message only)
    output_len: int  # tokens asked for
    success: bool = False
    error: str | None = None
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    server_prompt_tokens: int | None = None  # the server's count (whole context), when it reports one
    server_cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when reported
    usage_reported: bool = False
    num_chunks: int = 0
    tpot: float | None = None
    finish_reason: str | None = None
    generated_text: str = ""


def _payload(args: argparse.Namespace, model: str | None, prompt: Prompt, messages: list[dict] | None) -> dict:
    if args.backend == "lightllm":
        params = {"max_new_tokens": prompt.output_len, "ignore_eos": args.ignore_eos, "do_sample": False}
        return {"inputs": messages_as_text(messages) if messages else prompt.text, "parameters": params}
    body: dict[str, Any] = {
        "max_tokens": prompt.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": args.ignore_eos,
    }
    if model:
        body["model"] = model
    if args.backend == "openai-chat":
        body["messages"] = messages or [{"role": "user", "content": prompt.text}]
    elif messages:
        body["prompt"] = messages_as_text(messages)
    else:
        body["prompt"] = prompt.token_ids if args.token_ids else prompt.text
    return body


def messages_as_text(messages: list[dict]) -> str:
    """Plain-text transcript for multi-turn runs on the completion (non-chat) backends."""
    return "".join(m["content"] for m in messages)


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict,
    record: RequestRecord,
    backend: str,
    t0: float,
) -> RequestRecord:
    """POST `payload`, read the SSE stream, fill `record`. Never raises (errors land in the record)."""
    pieces: list[str] = []
    start = time.perf_counter()
    record.start = start - t0
    last = None
    done = False
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                record.error = f"HTTP {resp.status}: {body.strip()}"
                return record
            buf = b""
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                buf += data
                while True:
                    nl = buf.find(b"\n")
                    if nl < 0:
                        break
                    line = buf[:nl].strip()
                    buf = buf[nl + 1:]
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments, "event:" lines
                    body = line[5:].strip()
                    if body == b"[DONE]":
                        done = True
                        continue
                    obj = _loads(body)
                    text, ntok, fin = _parse_event(obj, backend, record)
                    if fin:
                        done = True
                    if ntok:
                        record.num_chunks += 1
                        if last is None:
                            record.ttft = now - start
                        else:
                            record.itl.append(now - last)
                        last = now
                        if not record.usage_reported:
                            record.output_tokens += ntok
                    if text:
                        pieces.append(text)
            end = time.perf_counter()
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - a failed request is data, never a crash
        record.error = f"{type(e).__name__}: {e}"[:300]
        return record
    if record.error:
        return record
    if last is None and not done:
        record.error = "stream ended without tokens"
        return record
    record.success = True
    record.e2e = end - start
    record.generated_text = "".join(pieces)
    if record.output_tokens > 1 and record.ttft is not None:
        record.tpot = (record.e2e - record.ttft) / (record.output_tokens - 1)
    return record


def _parse_event(obj: Any, backend: str, record: RequestRecord) -> tuple[str, int, bool]:
    """(text, tokens carried, finished) of one SSE event; usage and errors go into `record`."""
    if not isinstance(obj, dict):
        return "", 0, False
    if "error" in obj and obj["error"]:
        err = obj["error"]
        record.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
        return "", 0, True
    if backend == "lightllm":
        tok = obj.get("token")
        fin = bool(obj.get("finished"))
        if fin:
            record.finish_reason = obj.get("finish_reason")
        if isinstance(tok, dict):
            if tok.get("prompt_tokens") is not None:
                record.server_prompt_tokens = int(tok["prompt_tokens"])
            return tok.get("text") or "", 1, fin
        return "", 0, fin
    usage = obj.get("usage")
    if usage:  # the final chunk with include_usage; overrides the chunk count
        if usage.get("completion_tokens") is not None:
            record.output_tokens = int(usage["completion_tokens"])
            record.usage_reported = True
        if usage.get("prompt_tokens") is not None:
            record.server_prompt_tokens = int(usage["prompt_tokens"])
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is not None:
            record.server_cached_tokens = int(cached)
    choices = obj.get("choices")
    if not choices:
        return "", 0, False
    ch = choices[0]
    if ch.get("finish_reason"):
        record.finish_reason = ch["finish_reason"]
    if backend == "openai-chat":
        text = (ch.get("delta") or {}).get("content") or ""
    else:
        text = ch.get("text") or ""
    ids = ch.get("token_ids")
    ntok = len(ids) if isinstance(ids, list) and ids else (1 if text else 0)
    return text, ntok, False


# ----------------------------------------------------------------------------------------------
# The run: arrivals, concurrency, warm-up
# ----------------------------------------------------------------------------------------------

async def fetch_model(session: aiohttp.ClientSession, base_url: str) -> str | None:
    """First model id from GET /v1/models, or None when the server has no such route."""
    try:
        async with session.get(base_url + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status != 200:
                return None
            data = await resp.json(content_type=None)
            models = data.get("data") or []
            return models[0]["id"] if models else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
        return None


async def run_conversations(
    args: argparse.Namespace,
    session: aiohttp.ClientSession,
    model: str | None,
    convs: list[Conversation],
    arrival_rng: np.random.Generator,
    progress: Any,
) -> tuple[list[RequestRecord], float]:
    """Send every conversation (turns in order), Poisson arrivals, at most --max-concurrency
    requests in flight. Returns (records, duration)."""
    url = args.base_url.rstrip("/") + BACKEND_PATHS[args.backend]
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    records: list[RequestRecord] = []
    multi = args.dataset == "multi-turn"
    t0 = time.perf_counter()

    async def one_conversation(ci: int, conv: Conversation) -> None:
        messages: list[dict] = []
        for ti, prompt in enumerate(conv.turns):
            messages.append({"role": "user", "content": prompt.text})
            rec = RequestRecord(ci, ti, len(prompt.token_ids), prompt.output_len)
            # Several comma-separated names (LoRA adapters): conversation i sends the i-th, in turn.
            names = model.split(",") if model else [None]
            payload = _payload(args, names[ci % len(names)], prompt, list(messages) if multi else None)
            if sem:
                async with sem:
                    await send_request(session, url, payload, rec, args.backend, t0)
            else:
                await send_request(session, url, payload, rec, args.backend, t0)
            records.append(rec)
            if progress is not None:
                progress.update(1)
            if not rec.success:
                break  # the rest of a broken conversation is not sent
            messages.append({"role": "assistant", "content": rec.generated_text})

    tasks = []
    for ci, conv in enumerate(convs):
        tasks.append(asyncio.create_task(one_conversation(ci, conv)))
        if math.isfinite(args.request_rate) and ci + 1 < len(convs):
            await asyncio.sleep(float(arrival_rng.exponential(1.0 / args.request_rate)))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    records.sort(key=lambda r: (r.conversation, r.turn))
    return records, duration


async def run_benchmark(args: argparse.Namespace) -> dict:
    """Build the workload, warm up, run, and return the result dict (config, aggregates, records)."""
    rng = np.random.default_rng(args.seed)
    t_build = time.perf_counter()
    maker = PromptMaker(args.tokenizer, rng)
    convs, warm = build_workload(args, maker)
    build_s = time.perf_counter() - t_build
    arrival_rng = np.random.default_rng([args.seed, 1])

    # --no-keep-alive: a connection per request, closed after it (llama-server closes the connection after a
    # streamed response while its headers announce keep-alive, so a pooled connection fails the next request).
    conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, force_close=args.no_keep_alive)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        model = args.model or await fetch_model(session, args.base_url.rstrip("/"))
        if model is None and args.backend != "lightllm":
            raise SystemExit(f"no --model given and GET {args.base_url}/v1/models gave none")
        if warm:
            wargs = argparse.Namespace(**{**vars(args), "request_rate": math.inf, "dataset": "random"})
            wrecs, _ = await run_conversations(wargs, session, model, warm, arrival_rng, None)
            bad = [r for r in wrecs if not r.success]
            if bad and not args.quiet:
                print(f"warm-up: {len(bad)}/{len(wrecs)} failed ({bad[0].error})", file=sys.stderr)
        total = sum(len(c.turns) for c in convs)
        progress = None
        if not args.no_progress:
            from tqdm import tqdm

            progress = tqdm(total=total, desc=f"{args.backend}/{args.dataset}", unit="req", file=sys.stderr)
        try:
            records, duration = await run_conversations(args, session, model, convs, arrival_rng, progress)
        finally:
            if progress is not None:
                progress.close()

    config = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()}
    config["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    config["model"] = model
    config["prompt_build_s"] = round(build_s, 3)
    return {
        "config": config,
        "client": {"python": platform.python_version(), "host": platform.node()},
        "aggregates": aggregate(records, duration, args.dataset == "multi-turn"),
        "errors": summarize_errors(records),
        "requests": [_record_json(r, args.keep_text) for r in records],
    }


# ----------------------------------------------------------------------------------------------
# Aggregates and output
# ----------------------------------------------------------------------------------------------

def _stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None, **{f"p{p}": None for p in PERCENTILES}}
    a = np.asarray(values, dtype=np.float64) * 1000.0
    out = {"mean": float(a.mean()), "std": float(a.std()), "min": float(a.min()), "max": float(a.max())}
    for p, v in zip(PERCENTILES, np.percentile(a, PERCENTILES)):
        out[f"p{p}"] = float(v)
    return out


def aggregate(records: list[RequestRecord], duration: float, per_turn: bool = False) -> dict:
    ok = [r for r in records if r.success]
    in_tok = sum(r.server_prompt_tokens if r.server_prompt_tokens is not None else r.prompt_len for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    dur = max(duration, 1e-9)
    agg = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / dur,
        "input_throughput": in_tok / dur,
        "output_throughput": out_tok / dur,
        "total_token_throughput": (in_tok + out_tok) / dur,
        "ttft_ms": _stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": _stats_ms([x for r in ok for x in r.itl]),
        "tpot_ms": _stats_ms([r.tpot for r in ok if r.tpot is not None]),
        "e2e_ms": _stats_ms([r.e2e for r in ok if r.e2e is not None]),
        "output_tokens_by_usage": sum(1 for r in ok if r.usage_reported),
        # prompt tokens the server(s) took from a prefix cache; None when no server reported it
        "cached_input_tokens": sum(r.server_cached_tokens for r in ok if r.server_cached_tokens is not None)
        if any(r.server_cached_tokens is not None for r in ok) else None,
    }
    if per_turn:
        turns = sorted({r.turn for r in ok})
        agg["ttft_ms_by_turn"] = {str(t): _stats_ms([r.ttft for r in ok if r.turn == t and r.ttft is not None])
                                  for t in turns}
    return agg


def summarize_errors(records: list[RequestRecord]) -> list[dict]:
    counts = collections.Counter(r.error for r in records if not r.success)
    return [{"error": e, "count": n} for e, n in counts.most_common(20)]


def _record_json(r: RequestRecord, keep_text: bool) -> dict:
    d = asdict(r)
    if not keep_text:
        d.pop("generated_text")
    return d


def format_table(result: dict) -> str:
    agg = result["aggregates"]
    cfg = result["config"]
    w = 52
    lines = [
        f" Serving benchmark: {cfg['backend']} / {cfg['dataset']} ".center(w, "="),
        f"{'Model:':<36}{cfg['model']}",
        f"{'Request rate / max concurrency:':<36}{cfg['request_rate']} / {cfg['max_concurrency'] or 'none'}",
        f"{'Successful requests:':<36}{agg['completed']}",
        f"{'Failed requests:':<36}{agg['failed']}",
        f"{'Benchmark duration (s):':<36}{agg['duration_s']:.2f}",
        f"{'Total input tokens:':<36}{agg['total_input_tokens']}",
        f"{'Total output tokens:':<36}{agg['total_output_tokens']}",
        *([f"{'Cached input tokens (usage):':<36}{agg['cached_input_tokens']}"]
          if agg.get("cached_input_tokens") is not None
          else []),
        f"{'Request throughput (req/s):':<36}{agg['request_throughput']:.2f}",
        f"{'Input token throughput (tok/s):':<36}{agg['input_throughput']:.2f}",
        f"{'Output token throughput (tok/s):':<36}{agg['output_throughput']:.2f}",
        f"{'Total token throughput (tok/s):':<36}{agg['total_token_throughput']:.2f}",
        "-" * w,
        f"{'(ms)':<8}{'mean':>11}{'p50':>11}{'p90':>11}{'p99':>11}",
    ]
    for name in ("ttft", "itl", "tpot", "e2e"):
        s = agg[f"{name}_ms"]
        cells = "".join(f"{s[k]:>11.2f}" if s[k] is not None else f"{'-':>11}" for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{name.upper():<8}{cells}")
    for turn, s in (agg.get("ttft_ms_by_turn") or {}).items():
        cells = "".join(f"{s[k]:>11.2f}" if s[k] is not None else f"{'-':>11}" for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{'TTFT t' + turn:<8}{cells}")
    if result["errors"]:
        lines.append("-" * w)
        lines.append("Errors:")
        for e in result["errors"]:
            lines.append(f"  {e['count']:>5} x {e['error']}")
    lines.append("=" * w)
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", choices=sorted(BACKEND_PATHS), default="openai")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send; default: first id of GET /v1/models; "
                   "several, comma-separated (LoRA adapters), are sent in turn, one per conversation")
    p.add_argument("--tokenizer", default=default_model_dir(), help="tokenizer folder (or tokenizer.json)")
    p.add_argument("--dataset", choices=["random", "shared-prefix", "multi-turn", "copy-edit"], default="random",
                   help="copy-edit: a JSON document of about --input-len tokens to write back with one edit (W4)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (random, multi-turn user messages)")
    p.add_argument("--input-len-min", type=int, default=None, help="with --input-len-max: uniform prompt lengths")
    p.add_argument("--input-len-max", type=int, default=None)
    p.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: tokens of the common prefix")
    p.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct prefixes, used in turn")
    p.add_argument("--suffix-len-min", type=int, default=32, help="shared-prefix: own tokens per request, min")
    p.add_argument("--suffix-len-max", type=int, default=64)
    p.add_argument("--num-conversations", type=int, default=8, help="multi-turn: conversations")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: user messages per conversation")
    p.add_argument("--token-ids", action="store_true", help="openai backend: send prompts as token-id lists")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--warmup", type=int, default=0, help="requests sent first and discarded")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one request may take")
    p.add_argument("--no-keep-alive", action="store_true",
                   help="open a connection per request instead of reusing pooled ones")
    p.add_argument("--output-json", default=None)
    p.add_argument("--keep-text", action="store_true", help="keep generated text in the JSON records")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--quiet", action="store_true", help="print no table")
    args = p.parse_args(argv)
    if args.token_ids and args.backend != "openai":
        p.error("--token-ids works with --backend openai only")
    if args.num_prefixes < 1:
        p.error("--num-prefixes must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run one benchmark; print the table, write --output-json, and return the result dict."""
    args = parse_args(argv)
    result = asyncio.run(run_benchmark(args))
    if not args.quiet:
        print(format_table(result))
    if args.output_json:
        out = Path(args.output_json)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(out)
    return result


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["aggregates"]["completed"] > 0 else 1)
