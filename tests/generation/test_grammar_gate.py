"""A reasoning model's grammar holds only what follows its reasoning: GrammarSet (rank 0's xgrammar
state) with the real SmolLM2 tokenizer and a real request pool, stepped with scripted logits, so
each step shows which token the model wanted and which one the constraint let through."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lightserve.model_infer.grammar import GrammarSet, Phase
from lightserve.sampling import GrammarKind, SamplingParams
from lightserve.shm.req_pool import ReqPool
from tests.e2e.server import MODEL_DIR

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
SLOT = 3


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture
def pool(make_pool):
    return make_pool(num_slots=4, max_len=256)


def _request(pool: ReqPool, tokenizer, prompt: str) -> None:
    params = SamplingParams(max_new_tokens=64, grammar_kind=GrammarKind.JSON_SCHEMA, grammar=SCHEMA)
    pool.write_request(SLOT, tokenizer.encode(prompt), params, seed=0)


def _step(grammars: GrammarSet, pool: ReqPool, vocab: int, wanted: int) -> int:
    """One greedy step of the slot whose model most wants token `wanted`: the token it gets."""
    logits = torch.zeros(1, vocab)
    logits[0, wanted] = 10.0
    logits[0] += torch.linspace(0, 1, vocab)  # a deterministic runner-up order for masked steps
    slots, rows = np.array([SLOT]), np.array([0])
    grammars.mask(logits, slots, rows, np.array([GrammarKind.JSON_SCHEMA]), pool)
    token = int(logits[0].argmax())
    grammars.accept(slots, np.array([token]))
    return token


def _write(grammars, pool, vocab, ids: list[int]) -> list[int]:
    return [_step(grammars, pool, vocab, t) for t in ids]


def test_without_a_reasoning_parser_the_grammar_holds_the_first_token(pool, tokenizer):
    vocab = len(tokenizer)
    grammars = GrammarSet(str(MODEL_DIR), vocab)
    _request(pool, tokenizer, "Answer:")
    hello = tokenizer.encode("Hello")[0]
    got = _step(grammars, pool, vocab, hello)
    assert got != hello and tokenizer.decode([got]).startswith("{")


def test_output_that_starts_inside_reasoning_is_free_until_the_close_tag(pool, tokenizer):
    vocab = len(tokenizer)
    grammars = GrammarSet(str(MODEL_DIR), vocab, "deepseek_r1")
    _request(pool, tokenizer, "Question?<think>\n")
    thought = tokenizer.encode(" Let me think: yes.")
    assert _write(grammars, pool, vocab, thought) == thought        # reasoning is not held to the schema
    assert grammars.gates[SLOT].phase is Phase.INSIDE
    close = tokenizer.encode("</think>")
    assert _write(grammars, pool, vocab, close) == close
    assert grammars.gates[SLOT].phase is Phase.ACTIVE
    # After the close tag the schema holds: the model wants "Hello" and writes a JSON object.
    hello = tokenizer.encode("Hello")[0]
    answer = [_step(grammars, pool, vocab, hello) for _ in range(6)]
    text = tokenizer.decode(answer)
    assert text.startswith('{"a":'), text


def test_qwen3_output_may_open_reasoning_or_answer_at_once(pool, tokenizer):
    vocab = len(tokenizer)
    open_ids = tokenizer.encode("<think>")
    assert len(open_ids) > 1  # SmolLM2 spells the tag in several tokens: the forced rest is exercised
    # The model opens the tag: its first token is let through, the rest of the tag is forced.
    grammars = GrammarSet(str(MODEL_DIR), vocab, "qwen3")
    _request(pool, tokenizer, "Question?")
    hello = tokenizer.encode("Hello")[0]
    assert _write(grammars, pool, vocab, [open_ids[0]] + [hello] * (len(open_ids) - 1)) == open_ids
    assert grammars.gates[SLOT].phase is Phase.INSIDE
    assert _write(grammars, pool, vocab, [hello]) == [hello]
    _write(grammars, pool, vocab, tokenizer.encode("</think>"))
    assert tokenizer.decode([_step(grammars, pool, vocab, hello)]).startswith("{")
    # The model answers at once: the grammar holds its first token.
    grammars.drop(np.array([SLOT]))
    _request(pool, tokenizer, "Question?")
    assert tokenizer.decode([_step(grammars, pool, vocab, hello)]).startswith("{")
    assert grammars.gates[SLOT].phase is Phase.ACTIVE


def test_qwen3_prompt_that_opens_the_reasoning_starts_inside(pool, tokenizer):
    vocab = len(tokenizer)
    grammars = GrammarSet(str(MODEL_DIR), vocab, "qwen3")
    _request(pool, tokenizer, "Question?<think>\n\n")
    hello = tokenizer.encode("Hello")[0]
    assert _step(grammars, pool, vocab, hello) == hello
    assert grammars.gates[SLOT].phase is Phase.INSIDE
