"""ModelRunner's limits, on CPU: the GPU KV sizing sets aside what the steps need beside the cache (its arithmetic, and
the forwards that measure it), and no request is planned past the model's context (its rope table), with the last
position matching transformers on both kernel backends."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lightserve.config import KernelBackend
from lightserve.messages import BatchPlan
from lightserve.model_infer import model_runner
from lightserve.model_infer.model_runner import GPU_KV_MEMORY_FRACTION, MIN_KV_TOKENS, ModelRunner, gpu_kv_size
from lightserve.model_infer.models import read_model_config
from lightserve.model_infer.output_writer import PROMPT_LOGPROB_ROWS

from .tiny_models import make_tiny_model

GIB = 2**30
CONTEXT = 24  # the tiny model's max_position_embeddings: its rope table's rows


def test_gpu_kv_size_leaves_the_reservation_free():
    per_token = 128 << 10                      # Llama-3-8B in bf16: 32 layers x 8 KV heads x 128 x 2 x 2 bytes
    free, reserved = 62 * GIB, 12 * GIB        # an H100 after 16 GiB of weights; a step's peak, graphs, sampling
    tokens = gpu_kv_size(free, per_token, reserved)
    assert tokens == int((free - reserved) * GPU_KV_MEMORY_FRACTION // per_token)
    assert tokens * per_token + reserved <= free
    # Every reserved byte comes out of the cache; with nothing reserved the old 0.85 of free would have taken
    # more than what is left once a 12 GiB reservation is made.
    assert gpu_kv_size(free, per_token, reserved + per_token) < tokens
    assert 0.85 * free > free - reserved > tokens * per_token
    with pytest.raises(RuntimeError, match="batch_max_tokens"):
        gpu_kv_size(free, per_token, free - MIN_KV_TOKENS * per_token)     # room for fewer than MIN_KV_TOKENS
    with pytest.raises(RuntimeError):
        gpu_kv_size(free, per_token, free + GIB)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama3", tmp_path_factory.mktemp("limits"), max_position_embeddings=CONTEXT)


def _runner(model_dir, backend: KernelBackend, max_req_total_len: int = 40) -> ModelRunner:
    return ModelRunner(str(model_dir), read_model_config(model_dir), torch.float32, torch.device("cpu"), 0, 1, None,
                       num_req_rows=4, max_req_total_len=max_req_total_len, kv_size=64, kernel_backend=backend)


def test_reserved_bytes_measure_the_largest_step_and_the_largest_graph(model_dir):
    runner = _runner(model_dir, KernelBackend.CPU)
    vocab = runner.model_config.vocab_size
    k_before, table_before = runner.kv_cache.k.clone(), runner.kv_cache.req_to_token.clone()
    shapes = []

    def peak_bytes(fn) -> int:  # on CUDA: the allocator's peak; here the logits' bytes, to see what ran
        logits = fn()
        shapes.append(tuple(logits.shape))
        return logits.numel() * 4

    sizes = runner.reserved_bytes(step_tokens=50, max_sampled=4, graph_batch=3, peak_bytes=peak_bytes)
    # 50 tokens in requests of at most 24 (the capped length): 3 requests, each sampling, every token a logits row.
    assert shapes == [(3 + 50, vocab), (3, vocab)]
    assert sizes == {"largest step": 53 * vocab * 4, "graph pool": 3 * vocab * 4, "graph logits": 3 * vocab * 4,
                     "graph overhead": model_runner.GPU_GRAPH_OVERHEAD,
                     "sampling": (model_runner.GPU_SAMPLING_COPIES * 4
                                  + model_runner.PROMPT_LOGPROB_COPIES * PROMPT_LOGPROB_ROWS) * vocab * 4}
    # The forwards ran on a scratch cache of their own.
    assert torch.equal(runner.kv_cache.k, k_before) and torch.equal(runner.kv_cache.req_to_token, table_before)
    assert "graph pool" not in runner.reserved_bytes(10, 1, 0, peak_bytes=peak_bytes)


def _hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].float()          # [len(ids), V]


@pytest.mark.parametrize("backend", [KernelBackend.CPU, KernelBackend.TRITON])
def test_a_request_reaches_the_last_position_of_the_context_and_no_further(model_dir, backend):
    runner = _runner(model_dir, backend, max_req_total_len=40)
    assert runner.max_req_total_len == CONTEXT == runner.model_config.max_context_len
    assert runner.kv_cache.req_to_token.shape[1] == CONTEXT
    ids = torch.randint(3, 160, (CONTEXT,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = _hf_logits(model_dir, ids)
    i32 = lambda xs: np.array(xs, np.int32)  # noqa: E731

    def plan(step: int, prefix: int, new: list[int], all_logits: bool = False) -> BatchPlan:
        n = len(new)
        return BatchPlan(step=step, shm_indices=i32([1]), req_ids=np.array([7], np.int64), prefix_lens=i32([prefix]),
                         extend_lens=i32([n]), sample=np.array([not all_logits]), input_ids=i32(new),
                         kv_locs=i32(range(1 + prefix, 1 + prefix + n)), num_decode=int(n == 1),
                         prompt_logit_idx=i32(range(n)) if all_logits else i32([]))

    tol = {"atol": 2e-5, "rtol": 1e-5}
    prefill = runner.forward(plan(1, 0, ids[:CONTEXT - 2], all_logits=True))
    torch.testing.assert_close(prefill, expected[:CONTEXT - 2], **tol)
    for pos in (CONTEXT - 2, CONTEXT - 1):                       # the last two positions, as decodes
        torch.testing.assert_close(runner.forward(plan(pos, pos, [ids[pos]]))[0], expected[pos], **tol)
    with pytest.raises(ValueError, match="max_req_total_len 24"):
        runner.forward(plan(CONTEXT, CONTEXT, [5]))              # position 24: past the rope table
