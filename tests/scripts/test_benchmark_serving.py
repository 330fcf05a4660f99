"""scripts/benchmark_serving.py against a fake streaming server (no model, no GPU, a few seconds)."""
from __future__ import annotations

import importlib.util
import json
import math
import socket
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("tokenizers")

HERE = Path(__file__).resolve().parent
SCRIPT = HERE.parents[1] / "scripts" / "benchmark_serving.py"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


bs = _load("benchmark_serving", SCRIPT)
_fake = _load("fake_llm_server", HERE / "fake_llm_server.py")
FakeServer, make_tiny_tokenizer = _fake.FakeServer, _fake.make_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory) -> str:
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def _check_percentiles(agg: dict) -> None:
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        s = agg[name]
        assert s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"], (name, s)
        assert s["min"] <= s["mean"] <= s["max"], (name, s)
        assert s["min"] >= 0
    # Per request the first token comes before the end.
    assert agg["ttft_ms"]["p50"] <= agg["e2e_ms"]["p50"]


@pytest.mark.parametrize("backend", ["openai", "openai-chat", "lightllm"])
def test_random_each_backend(backend: str, tiny_tokenizer: str, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    num, out_len = 12, 9
    with FakeServer() as srv:
        res = bs.main([
            "--backend", backend, "--base-url", srv.url, "--tokenizer", tiny_tokenizer,
            "--dataset", "random", "--num-prompts", str(num), "--input-len-min", "5", "--input-len-max", "40",
            "--output-len", str(out_len), "--max-concurrency", "4", "--warmup", "2",
            "--output-json", str(out), "--no-progress", "--seed", "3",
        ])
        assert srv.num_posts == num + 2  # warm-up requests went out too
    agg = res["aggregates"]
    assert agg["completed"] == num and agg["failed"] == 0
    assert agg["total_output_tokens"] == num * out_len
    assert agg["output_tokens_by_usage"] == (num if backend == "openai" else 0)
    assert len(res["requests"]) == num
    for r in res["requests"]:
        assert r["success"] and r["output_tokens"] == out_len
        assert len(r["itl"]) == out_len - 1
        assert r["ttft"] <= r["e2e"]
        assert math.isclose(r["tpot"], (r["e2e"] - r["ttft"]) / (out_len - 1))
        assert 5 <= r["prompt_len"] <= 40
    if backend == "openai":  # usage's prompt_tokens = words in the prompt = tokens (word pool)
        assert all(r["server_prompt_tokens"] == r["prompt_len"] for r in res["requests"])
    _check_percentiles(agg)
    assert agg["output_throughput"] > 0 and agg["request_throughput"] > 0
    saved = json.loads(out.read_text())
    assert saved["aggregates"]["completed"] == num
    assert saved["config"]["backend"] == backend and saved["config"]["model"] == "fake-model"
    assert len(saved["requests"]) == num


def test_seeded_workload_is_deterministic(tiny_tokenizer: str) -> None:
    args = bs.parse_args(["--tokenizer", tiny_tokenizer, "--dataset", "random", "--num-prompts", "6",
                          "--input-len-min", "3", "--input-len-max", "30", "--seed", "11"])
    a, _ = bs.build_workload(args, bs.PromptMaker(tiny_tokenizer, np.random.default_rng(11)))
    b, _ = bs.build_workload(args, bs.PromptMaker(tiny_tokenizer, np.random.default_rng(11)))
    assert [c.turns[0].token_ids for c in a] == [c.turns[0].token_ids for c in b]


def test_token_ids_poisson_and_failures(tiny_tokenizer: str, tmp_path: Path) -> None:
    with FakeServer(fail_every=4) as srv:
        res = bs.main([
            "--backend", "openai", "--base-url", srv.url, "--model", "m", "--tokenizer", tiny_tokenizer,
            "--num-prompts", "16", "--input-len", "7", "--output-len", "4", "--token-ids",
            "--request-rate", "400", "--no-progress", "--quiet",
        ])
        assert all(isinstance(b["prompt"], list) and len(b["prompt"]) == 7 for b in srv.bodies)
        assert all(b["model"] == "m" and b["ignore_eos"] is True and b["temperature"] == 0 for b in srv.bodies)
    agg = res["aggregates"]
    assert agg["completed"] == 12 and agg["failed"] == 4
    assert res["errors"] == [{"error": 'HTTP 500: {"error": {"message": "injected failure"}}', "count": 4}]
    assert res["config"]["request_rate"] == 400


def test_unreachable_server_counts_failures(tiny_tokenizer: str) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = bs.main(["--backend", "lightllm", "--base-url", f"http://127.0.0.1:{port}", "--tokenizer", tiny_tokenizer,
                   "--num-prompts", "3", "--input-len", "4", "--output-len", "2", "--no-progress", "--quiet"])
    assert res["aggregates"]["completed"] == 0 and res["aggregates"]["failed"] == 3
    assert res["errors"][0]["count"] == 3 and "Connect" in res["errors"][0]["error"]
    assert res["aggregates"]["ttft_ms"]["p50"] is None


def test_shared_prefix_and_multi_turn(tiny_tokenizer: str, tmp_path: Path) -> None:
    with FakeServer() as srv:
        res = bs.main([
            "--backend", "openai", "--base-url", srv.url, "--tokenizer", tiny_tokenizer,
            "--dataset", "shared-prefix", "--num-prompts", "6", "--prefix-len", "50",
            "--suffix-len-min", "3", "--suffix-len-max", "8", "--output-len", "3", "--no-progress", "--quiet",
        ])
        prompts = [b["prompt"] for b in srv.bodies]
    assert res["aggregates"]["completed"] == 6
    assert all(53 <= r["prompt_len"] <= 58 for r in res["requests"])
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(tiny_tokenizer)
    ids = [tk.encode(p, add_special_tokens=False).ids for p in prompts]
    assert all(x[:50] == ids[0][:50] for x in ids) and len(set(prompts)) == 6
    assert sorted(len(x) for x in ids) == sorted(r["prompt_len"] for r in res["requests"])

    with FakeServer() as srv:
        res = bs.main([
            "--backend", "openai-chat", "--base-url", srv.url, "--tokenizer", tiny_tokenizer,
            "--dataset", "multi-turn", "--num-conversations", "3", "--turns", "3", "--input-len", "6",
            "--output-len", "5", "--max-concurrency", "2", "--no-progress", "--quiet",
            "--output-json", str(tmp_path / "mt.json"),
        ])
        # Each turn carries every earlier user message and answer: 1, 3, 5 messages.
        assert sorted(srv.chat_message_counts) == [1, 1, 1, 3, 3, 3, 5, 5, 5]
        assert any(m["role"] == "assistant" and m["content"] == " c0 c1 c2 c3 c4"
                   for b in srv.bodies for m in b["messages"])
    agg = res["aggregates"]
    assert agg["completed"] == 9 and agg["total_output_tokens"] == 45
    assert set(agg["ttft_ms_by_turn"]) == {"0", "1", "2"}
    assert sorted((r["conversation"], r["turn"]) for r in res["requests"]) == [(c,
                                                                                t) for c in range(3) for t in range(3)]


def test_prompts_retokenize_exactly_with_real_tokenizer() -> None:
    path = Path(bs.default_model_dir())
    if not (path / "tokenizer.json").exists():
        pytest.skip(f"no tokenizer at {path} (run python -m lightserve.engine.model_prep)")
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(path / "tokenizer.json"))
    maker = bs.PromptMaker(str(path), np.random.default_rng(0))
    for n in (1, 2, 17, 128, 256, 511, 1024):
        text, ids = maker.make(n)
        assert tk.encode(text, add_special_tokens=False).ids == ids and len(ids) == n
    args = bs.parse_args(["--tokenizer", str(path), "--dataset", "shared-prefix", "--num-prompts", "8",
                          "--prefix-len", "1024", "--suffix-len-min", "32", "--suffix-len-max", "64"])
    convs, _ = bs.build_workload(args, maker)
    first = convs[0].turns[0].token_ids[:1024]
    for c in convs:
        p = c.turns[0]
        assert tk.encode(p.text, add_special_tokens=False).ids == p.token_ids
        assert p.token_ids[:1024] == first and 1024 + 32 <= len(p.token_ids) <= 1024 + 64


def test_shared_prefix_groups(tiny_tokenizer: str) -> None:
    """--num-prefixes k: request i uses prefix i mod k (the router benchmark's multi-tenant load)."""
    args = bs.parse_args(["--tokenizer", tiny_tokenizer, "--dataset", "shared-prefix", "--num-prompts", "6",
                          "--prefix-len", "20", "--num-prefixes", "3", "--suffix-len-min", "2",
                          "--suffix-len-max", "4"])
    convs, _ = bs.build_workload(args, bs.PromptMaker(tiny_tokenizer, np.random.default_rng(5)))
    heads = [c.turns[0].token_ids[:20] for c in convs]
    assert [heads.index(h) for h in heads] == [0, 1, 2, 0, 1, 2]
    one = bs.parse_args(["--tokenizer", tiny_tokenizer, "--dataset", "shared-prefix", "--num-prompts", "6",
                         "--prefix-len", "20", "--suffix-len-min", "2", "--suffix-len-max", "4"])
    single, _ = bs.build_workload(one, bs.PromptMaker(tiny_tokenizer, np.random.default_rng(5)))
    assert single[0].turns[0].token_ids[:20] == heads[0]  # the first prefix is drawn first either way
    with pytest.raises(SystemExit):
        bs.parse_args(["--num-prefixes", "0"])


def test_copy_edit_prompts_hold_a_document_to_write_back() -> None:
    """W4's prompts (scripts/bench_speculative.py): about --input-len tokens, a JSON document that parses, asked back
    with one edit, seeded."""
    path = Path(bs.default_model_dir())
    if not (path / "tokenizer.json").exists():
        pytest.skip(f"no tokenizer at {path} (run python -m lightserve.engine.model_prep)")
    args = bs.parse_args(["--tokenizer", str(path), "--dataset", "copy-edit", "--num-prompts", "2",
                          "--input-len", "300", "--output-len", "256", "--seed", "5"])
    convs, _ = bs.build_workload(args, bs.PromptMaker(str(path), np.random.default_rng(5)))
    again, _ = bs.build_workload(args, bs.PromptMaker(str(path), np.random.default_rng(5)))
    assert [c.turns[0].token_ids for c in convs] == [c.turns[0].token_ids for c in again]
    for c in convs:
        p = c.turns[0]
        assert 300 <= len(p.token_ids) <= 400 and p.output_len == 256
        doc = p.text[p.text.index("["): p.text.index("]\n\n") + 1]
        records = json.loads(doc)
        assert [r["id"] for r in records] == list(range(len(records)))
        assert p.text.endswith("Edited document:\n")


def test_no_keep_alive_serves_a_server_that_closes_after_each_stream(tiny_tokenizer: str) -> None:
    """A server that closes the connection after each streamed response (llama-server) fails the requests sent on a
    reused pooled connection; with --no-keep-alive each request has its own connection and all complete."""
    args = ["--tokenizer", tiny_tokenizer, "--dataset", "random", "--num-prompts", "8", "--input-len", "8",
            "--output-len", "4", "--max-concurrency", "1", "--no-progress", "--quiet"]
    with FakeServer(close_after_stream=True) as srv:
        pooled = bs.main(["--base-url", srv.url, *args])
        fresh = bs.main(["--base-url", srv.url, *args, "--no-keep-alive"])
    assert pooled["aggregates"]["failed"] > 0
    assert fresh["aggregates"]["failed"] == 0 and fresh["aggregates"]["completed"] == 8
    assert fresh["config"]["no_keep_alive"] is True
