"""CudaGraphRunner's bookkeeping on CPU, with a stand-in for CUDA graph capture whose replay calls the captured
function again on the static buffers: which size a batch replays, padding reset between replays, the same input
buffers and one shared logits buffer at every replay, the eager fallback, the TP barrier before each capture, and
(tiny Llama, Triton kernels under the interpreter) replayed logits equal to an eager forward."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightserve.config import KernelBackend
from lightserve.messages import BatchPlan
from lightserve.model_infer import model_runner
from lightserve.model_infer.cuda_graph import CudaGraphRunner, capture_sizes
from lightserve.model_infer.forward_batch import make_forward_batch
from lightserve.model_infer.host_staging import HostStaging
from lightserve.model_infer.model_runner import ModelRunner
from lightserve.model_infer.models import read_model_config

from .tiny_models import make_tiny_model

VOCAB = 7


class FakeGraph:
    """A captured 'graph': replay() runs the captured function again (on the same static buffers)."""

    def __init__(self, fn, pool, log: list):
        self.fn, self._pool, self.log = fn, pool if pool is not None else object(), log

    def replay(self) -> None:
        self.log.append(("replay", self))
        self.fn()

    def pool(self):
        return self._pool


class FakeGraphs:
    """CudaGraphs' stand-in: capture runs fn once (as the warm-up and capture do) and records the pool it got."""

    def __init__(self, log: list | None = None):
        self.log = [] if log is None else log

    def capture(self, fn, pool) -> FakeGraph:
        self.log.append(("capture", pool))
        fn()
        return FakeGraph(fn, pool, self.log)

    def synchronize(self) -> None:
        pass

    def free_bytes(self) -> int:
        return 0


class EchoModel:
    """A model whose logits row b shows exactly what the forward read for entry b: input id, position, KV row,
    request row and sequence length."""

    config = SimpleNamespace(vocab_size=VOCAB)

    def __init__(self):
        self.calls = 0

    def forward(self, batch, kv_cache) -> torch.Tensor:
        self.calls += 1
        cols = [batch.input_ids, batch.positions, batch.kv_locs, batch.req_rows, batch.seq_lens, batch.prefix_lens,
                batch.logits_indices]
        return torch.stack([c.float() for c in cols], dim=1)  # [g, VOCAB] float32, a fresh tensor


def _cache(num_req_rows: int = 8, max_len: int = 32):
    return SimpleNamespace(req_to_token=torch.zeros(num_req_rows, max_len, dtype=torch.int32))


def _decode_batch(cache, num_reqs: int, base: int = 0):
    """num_reqs decodes: request b on req row b + 1 at position 3 + b, input id 10 + b, KV row 20 + b (+ base)."""
    i32 = lambda xs: np.array(xs, np.int32)  # noqa: E731
    b = np.arange(num_reqs)
    plan = BatchPlan(step=1, shm_indices=i32(b + 1), req_ids=b.astype(np.int64), prefix_lens=i32(3 + b),
                     extend_lens=i32([1] * num_reqs), sample=np.ones(num_reqs, bool), input_ids=i32(10 + b + base),
                     kv_locs=i32(20 + b + base), num_decode=num_reqs)
    return make_forward_batch(plan, cache.req_to_token, HostStaging(torch.device("cpu")))


def _runner(max_batch: int = 20, log: list | None = None, barrier=None):
    model, cache = EchoModel(), _cache(num_req_rows=max_batch + 2)
    runner = CudaGraphRunner(model, cache, max_batch, max_seq_len=32, pad_kv_loc=99, graphs=FakeGraphs(log),
                             barrier=barrier)
    return runner, model, cache


def test_captures_largest_first_sharing_one_pool_and_one_output_buffer():
    log = []
    runner, model, _ = _runner(20, log)
    assert runner.sizes == capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    captures = [entry for entry in log if entry[0] == "capture"]
    assert len(captures) == len(runner.sizes) and captures[0][1] is None           # the largest makes the pool
    pool = runner.graphs[20].pool()
    assert all(p is pool for _, p in captures[1:])                                   # the rest reuse it
    assert runner.output.shape == (20, VOCAB) and runner.output.dtype == torch.float32
    assert not hasattr(runner, "outputs")                                            # no buffer per size


@pytest.mark.parametrize("num_reqs", range(1, 21))
def test_each_batch_replays_the_smallest_size_that_holds_it(num_reqs):
    log = []
    runner, _, cache = _runner(20, log)
    want = next(s for s in runner.sizes if s >= num_reqs)
    assert runner.size_for(num_reqs) == want
    batch = _decode_batch(cache, num_reqs)
    assert runner.can_run(batch)
    log.clear()
    out = runner.run(batch)
    assert [g for kind, g in log] == [runner.graphs[want]] and log[0][0] == "replay"
    assert out.shape == (num_reqs, VOCAB) and out.data_ptr() == runner.output.data_ptr()
    b = torch.arange(num_reqs, dtype=torch.float32)
    torch.testing.assert_close(out[:, 0], 10 + b)                                    # input ids
    torch.testing.assert_close(out[:, 2], 20 + b)                                    # KV rows
    torch.testing.assert_close(out[:, 4], 4 + b)                                     # seq lens


def test_a_smaller_batch_after_a_larger_one_pads_with_fresh_padding_and_the_same_buffers():
    runner, _, cache = _runner(20)
    ptrs = {name: t.data_ptr() for name, t in vars(runner.inputs).items() if isinstance(t, torch.Tensor)}
    runner.run(_decode_batch(cache, 7))                          # size 8: entries 0..6 real, 7 padding
    small = runner.run(_decode_batch(cache, 3, base=100))        # size 4 over the same buffers: entry 3 padding
    assert {name: t.data_ptr() for name, t in vars(runner.inputs).items() if isinstance(t, torch.Tensor)} == ptrs
    assert small.data_ptr() == runner.output.data_ptr()
    padded = runner.output[:4]                                   # what graph 4 computed, padding row included
    assert padded[3, 2] == 99 and padded[3, 3] == 0 and padded[3, 4] == 1 and padded[3, 5] == 0
    assert padded[:3, 0].tolist() == [110, 111, 112]
    # Entries past size 4 keep the larger step's values: graph 4 reads views of the first 4 only.


def test_extends_prompt_logits_and_batches_past_the_largest_size_run_eagerly():
    runner, _, cache = _runner(4)
    assert runner.can_run(_decode_batch(cache, 4))
    assert not runner.can_run(_decode_batch(cache, 5))                       # past the largest graph
    batch = _decode_batch(cache, 2)
    batch.num_decode = 1                                                     # request 1 extends
    assert not runner.can_run(batch)
    batch = _decode_batch(cache, 2)
    batch.logits_indices = torch.arange(3)                                   # a prompt-logprob row
    assert not runner.can_run(batch)
    batch = _decode_batch(cache, 2)
    batch.max_seq_len = 33                                                   # longer than captured
    assert not runner.can_run(batch)


def test_the_tp_barrier_comes_before_every_capture():
    log = []
    _runner(8, log, barrier=lambda: log.append(("barrier", None)))
    kinds = [kind for kind, _ in log]
    assert kinds == ["barrier", "capture"] * len(capture_sizes(8))


def test_tp_barrier_only_with_tp_above_1(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.distributed, "barrier", lambda **kw: calls.append(kw))
    assert model_runner._tp_barrier(None, 1, torch.device("cpu")) is None
    group = object()
    model_runner._tp_barrier(group, 2, torch.device("cuda", 1))()
    model_runner._tp_barrier(group, 2, torch.device("cpu"))()
    assert calls == [{"group": group, "device_ids": [1]}, {"group": group, "device_ids": None}]


@pytest.fixture(scope="module")
def triton_runner(tmp_path_factory):
    model_dir = make_tiny_model("llama3", tmp_path_factory.mktemp("graphs"))
    return ModelRunner(str(model_dir), read_model_config(model_dir), torch.float32, torch.device("cpu"), 0, 1, None,
                       num_req_rows=6, max_req_total_len=32, kv_size=64, kernel_backend=KernelBackend.TRITON)


def test_replayed_logits_equal_an_eager_forward_and_the_runner_falls_back(triton_runner):
    runner = triton_runner
    log = []
    graphs = CudaGraphRunner(runner.model, runner.kv_cache, 4, runner.max_req_total_len, pad_kv_loc=runner.kv_size,
                             graphs=FakeGraphs(log))
    runner.graph_runner = graphs
    try:
        i32 = lambda xs: np.array(xs, np.int32)  # noqa: E731
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(3, 160, (9,), generator=gen).numpy().astype(np.int32)
        rows = [1, 2, 3]
        # Three 3-token prompts: not a pure decode batch, so eager (no replay).
        log.clear()
        runner.forward(BatchPlan(step=1, shm_indices=i32(rows), req_ids=np.arange(3, dtype=np.int64),
                                 prefix_lens=i32([0] * 3), extend_lens=i32([3] * 3), sample=np.ones(3, bool),
                                 input_ids=prompt, kv_locs=i32(range(1, 10)), num_decode=0))
        assert log == []
        plan = BatchPlan(step=2, shm_indices=i32(rows), req_ids=np.arange(3, dtype=np.int64), prefix_lens=i32([3] * 3),
                         extend_lens=i32([1] * 3), sample=np.ones(3, bool), input_ids=i32([5, 6, 7]),
                         kv_locs=i32([10, 11, 12]), num_decode=3)
        eager = runner.model.forward(make_forward_batch(plan, runner.kv_cache.req_to_token, runner.staging),
                                     runner.kv_cache)                                       # [3, V]
        replayed = runner.forward(plan).clone()                                             # graph of size 4
        assert [kind for kind, _ in log] == ["replay"] and log[0][1] is graphs.graphs[4]
        # The same padded inputs, eagerly: the same kernels on the same shapes, bit for bit.
        padded = runner.model.forward(graphs.inputs.batch(4), runner.kv_cache)
        assert torch.equal(replayed, padded[:3])
        torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)
        # Five decodes: past the largest graph, eager again.
        log.clear()
        five = BatchPlan(step=3, shm_indices=i32([1, 2, 3, 4, 5]), req_ids=np.arange(5, dtype=np.int64),
                         prefix_lens=i32([4, 4, 4, 0, 0]), extend_lens=i32([1] * 5), sample=np.ones(5, bool),
                         input_ids=i32([5] * 5), kv_locs=i32(range(13, 18)), num_decode=5)
        assert runner.forward(five).shape == (5, 160) and log == []
    finally:
        runner.graph_runner = None
