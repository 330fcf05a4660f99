"""The decode graph's static inputs and the worker's batch building, on CPU: every tensor a graph reads is a view
of a buffer held for the runner's lifetime, a padded batch computes the real rows exactly as the eager step does
and writes nothing but the scratch row, and ModelRunner's one-copy batch build matches the plan."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lightserve.messages import BatchPlan
from lightserve.model_infer.cuda_graph import GraphInputs, capture_sizes
from lightserve.model_infer.forward_batch import make_forward_batch
from lightserve.model_infer.host_staging import HostStaging
from lightserve.model_infer.latent_kv_cache import LatentKVCache
from lightserve.model_infer.model_runner import ModelRunner
from lightserve.model_infer.models import read_model_config

from .fake_worker import FakeWorker
from .tiny_models import load_model_dir, make_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model("llama3", tmp_path_factory.mktemp("graph"))


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.untyped_storage().data_ptr()
    return start, start + t.untyped_storage().nbytes()


def test_every_graph_input_is_a_view_of_a_held_buffer():
    table = torch.zeros(4, 32, dtype=torch.int32)
    inputs = GraphInputs(16, pad_kv_loc=99, req_to_token=table, max_seq_len=32)
    held = [v for v in vars(inputs).values() if isinstance(v, torch.Tensor)]
    spans = [_storage_span(t) for t in held]
    for g in capture_sizes(16):
        batch = inputs.batch(g)
        for name, value in vars(batch).items():
            if isinstance(value, torch.Tensor):
                ptr = value.data_ptr()
                assert any(lo <= ptr < hi for lo, hi in spans), f"{name} of batch {g} is a temporary"
        # The same addresses at every call: what a captured graph saw is what a replay reads.
        again = inputs.batch(g)
        assert again.logits_indices.data_ptr() == batch.logits_indices.data_ptr()
        assert batch.logits_indices.dtype == torch.long and batch.logits_indices.tolist() == list(range(g))


def test_padded_batch_matches_eager_and_writes_only_the_scratch_row(tiny_dir):
    model = load_model_dir(tiny_dir, dtype=torch.float32)
    worker = FakeWorker(model, num_kv_rows=256, num_req_rows=8, max_len=64)
    gen = torch.Generator().manual_seed(0)
    prompts = {row: torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist()
               for row, n in ((1, 5), (3, 9), (6, 2))}
    worker.step(list(prompts.items()), num_decode=0)
    scratch = 255                                   # never handed out by FakeWorker at these sizes
    eager_batch = worker.make_batch([(row, [7]) for row in prompts], num_decode=3)
    eager = model.forward(eager_batch, worker.kv_cache)              # [3, V]
    kv_before = worker.kv_cache.k.clone()
    inputs = GraphInputs(8, pad_kv_loc=scratch, req_to_token=worker.kv_cache.req_to_token, max_seq_len=64)
    inputs.seq_lens.fill_(50)                       # stale values of an earlier, larger step
    inputs.req_rows.fill_(5)
    inputs.load(eager_batch, 8)
    padded = model.forward(inputs.batch(8), worker.kv_cache)         # [8, V]
    torch.testing.assert_close(padded[:3], eager, atol=1e-5, rtol=1e-5)
    assert inputs.req_rows[3:].tolist() == [0] * 5 and inputs.seq_lens[3:].tolist() == [1] * 5
    # Only this step's rows (rewritten with the same K up to GEMM rounding at M=8 vs M=3) and the scratch row.
    changed = set((worker.kv_cache.k != kv_before).flatten(2).any(-1).any(0).nonzero().flatten().tolist())
    real = eager_batch.kv_locs.tolist()
    assert scratch in changed and changed <= {scratch, *real}
    torch.testing.assert_close(worker.kv_cache.k[:, real], kv_before[:, real], atol=1e-5, rtol=1e-5)


def test_host_staging_packs_every_array_in_order():
    staging = HostStaging(torch.device("cpu"))
    arrays = [np.array([1, 2, 3], np.int32), np.zeros(0, np.int32), np.array([7], np.int64), np.arange(4)]
    out = staging.upload(arrays)
    assert [t.dtype for t in out] == [torch.int32] * 4
    assert [t.tolist() for t in out] == [[1, 2, 3], [], [7], [0, 1, 2, 3]]


def test_model_runner_builds_the_batch_of_a_mixed_plan(tiny_dir):
    cfg = read_model_config(tiny_dir)
    runner = ModelRunner(str(tiny_dir), cfg, torch.float32, torch.device("cpu"), 0, 1, None,
                         num_req_rows=4, max_req_total_len=32, kv_size=64)
    # Slot 2 decodes its 6th token; slot 0 extends 3 tokens after a 4-token cached prefix filled from the plan.
    plan = BatchPlan(step=1, shm_indices=np.array([2, 0], np.int32), req_ids=np.array([5, 6], np.int64),
                     prefix_lens=np.array([5, 4], np.int32), extend_lens=np.array([1, 3], np.int32),
                     sample=np.array([True, True]), input_ids=np.array([11, 12, 13, 14], np.int32),
                     kv_locs=np.array([40, 41, 42, 43], np.int32), num_decode=1,
                     fill_rows=np.zeros(4, np.int32), fill_pos=np.arange(4, dtype=np.int32),
                     fill_locs=np.array([30, 31, 32, 33], np.int32),
                     prompt_logit_idx=np.array([1], np.int32))
    batch = make_forward_batch(plan, runner.kv_cache.req_to_token, runner.staging)
    assert batch.input_ids.tolist() == [11, 12, 13, 14] and batch.input_ids.dtype == torch.long
    assert batch.positions.tolist() == [5, 4, 5, 6]
    assert batch.seq_lens.tolist() == [6, 7] and batch.q_start_locs.tolist() == [0, 1]
    assert batch.logits_indices.tolist() == [0, 3, 1]            # sampled rows, then the prompt-logprob row
    assert batch.max_seq_len == 7 and batch.max_extend_len == 3
    assert runner.kv_cache.req_to_token[0, :7].tolist() == [30, 31, 32, 33, 41, 42, 43]
    assert runner.kv_cache.req_to_token[2, 5] == 40


@pytest.mark.parametrize("kind", ["llama3", "deepseek_v3"])
def test_warm_up_touches_only_request_row_0_and_the_scratch_kv_row(kind, tiny_dir, tmp_path):
    # On CPU the mixed step runs the C kernels and decode attention runs in the Triton interpreter: the
    # same calls a GPU makes at start, checked for what they write. DeepSeek-V3's model makes a latent cache
    # and warms up the MLA decode kernel instead.
    model_dir = tiny_dir if kind == "llama3" else make_tiny_model(kind, tmp_path)
    cfg = read_model_config(model_dir)
    runner = ModelRunner(str(model_dir), cfg, torch.float32, torch.device("cpu"), 0, 1, None,
                         num_req_rows=3, max_req_total_len=40, kv_size=64)
    cache = runner.kv_cache
    rows = cache.latent if isinstance(cache, LatentKVCache) else cache.k  # [layers, KV rows, heads, dim]
    assert isinstance(cache, LatentKVCache) == (kind == "deepseek_v3")
    assert rows.shape[1] == runner.kv_size + 1
    cache.req_to_token[1:].fill_(7)
    runner.warm_up()
    written_kv = set((rows != 0).flatten(2).any(-1).any(0).nonzero().flatten().tolist())
    assert written_kv == {runner.kv_size}                     # the scratch row, one past the router's range
    row0 = cache.req_to_token[0]
    assert row0[0] == runner.kv_size and set(row0.tolist()) <= {0, runner.kv_size}
    assert (cache.req_to_token[1:] == 7).all()
