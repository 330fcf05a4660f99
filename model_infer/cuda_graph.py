"""CudaGraphRunner: decode steps replayed from CUDA graphs captured at start-up (CUDA only).

A pure-decode batch of B requests is padded to the next captured size G and replayed. The graphs
read static input buffers (`GraphInputs`, device-agnostic so its padding is tested on CPU); a
replay copies the step's inputs into them (device to device, no allocation per step). Padding
entries point at a scratch KV row (`pad_kv_loc`, one past the router's range) and at request row 0
with length 1, so they compute garbage that is never read. Every graph copies its logits into one
shared [max_batch, vocab] float32 buffer (`CudaGraphRunner.output`), so the per-graph logits are
temporaries of the shared memory pool. How a graph is captured (`CudaGraphs`) is an argument, so a
test runs the runner's bookkeeping on CPU with a stand-in.
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from lightserve.log import get_logger
from lightserve.model_infer.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from lightserve.model_infer.kv_cache import KVCache
    from lightserve.model_infer.latent_kv_cache import LatentKVCache

logger = get_logger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """Small sizes one by one's powers of two, then every 16: padding waste stays under ~15%."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch] + list(range(16, max_batch + 1, 16))
    return sizes if sizes[-1] == max_batch else sizes + [max_batch]


class GraphInputs:
    """Every tensor a captured decode graph reads, allocated once at the largest size.

    NOTE: a captured graph keeps the addresses it saw at capture. Each tensor of `batch(g)` is
    therefore a view of a buffer held here for the runner's lifetime; a temporary (e.g. a `.long()`
    of a buffer) would be freed after capture and its memory reused by later steps' tensors.
    """

    def __init__(self, max_batch: int, pad_kv_loc: int, req_to_token: torch.Tensor, max_seq_len: int):
        n, dev = max_batch, req_to_token.device
        self.pad_kv_loc = pad_kv_loc
        self.req_to_token = req_to_token    # [num_rows, max_req_total_len] int32, the KV cache's table
        self.max_seq_len = max_seq_len      # attention is captured for the longest allowed sequence
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)                 # [n]
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)                 # [n]
        self.kv_locs = torch.full((n,), pad_kv_loc, dtype=torch.long, device=dev)     # [n]
        self.req_rows = torch.zeros(n, dtype=torch.int32, device=dev)                 # [n]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)                  # [n]
        self.prefix_lens = torch.zeros(n, dtype=torch.int32, device=dev)              # [n]
        self.extend_lens = torch.ones(n, dtype=torch.int32, device=dev)               # [n], all decodes
        self.q_start_locs = torch.arange(n, dtype=torch.int32, device=dev)            # [n], token b is request b
        self.logits_indices = torch.arange(n, dtype=torch.long, device=dev)           # [n]

    def batch(self, g: int) -> ForwardBatch:
        """The ForwardBatch a graph of size g is captured with: views of the buffers above."""
        return ForwardBatch(
            input_ids=self.input_ids[:g], positions=self.positions[:g], kv_locs=self.kv_locs[:g],
            req_rows=self.req_rows[:g], prefix_lens=self.prefix_lens[:g], extend_lens=self.extend_lens[:g],
            seq_lens=self.seq_lens[:g], q_start_locs=self.q_start_locs[:g], logits_indices=self.logits_indices[:g],
            num_decode=g, max_seq_len=self.max_seq_len, max_extend_len=0,
            req_to_token=self.req_to_token)

    def load(self, batch: ForwardBatch, g: int) -> None:
        """Copy a pure-decode batch of B <= g requests into entries [0, B) and reset [B, g) to padding
        (they may hold a previous step's values). Device-to-device copies only: no host sync."""
        b = batch.num_reqs
        self.input_ids[:b].copy_(batch.input_ids)
        self.positions[:b].copy_(batch.positions)
        self.kv_locs[:b].copy_(batch.kv_locs)
        self.req_rows[:b].copy_(batch.req_rows)
        self.seq_lens[:b].copy_(batch.seq_lens)
        self.prefix_lens[:b].copy_(batch.prefix_lens)
        self.kv_locs[b:g].fill_(self.pad_kv_loc)
        self.req_rows[b:g].zero_()
        self.seq_lens[b:g].fill_(1)
        self.prefix_lens[b:g].zero_()


class CudaGraphs:
    """How CudaGraphRunner captures: torch.cuda.CUDAGraph under torch.cuda.graph, after two warm-up runs on the
    capture's side stream (Triton compiles and autotunes outside the capture). A stand-in for tests has the same
    three methods; its graphs need only `replay()` and `pool()`."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()

    def capture(self, fn: Callable[[], None], pool) -> torch.cuda.CUDAGraph:
        """A graph of fn(); its memory comes from `pool` (None: a new one, which `graph.pool()` then shares)."""
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=self.stream):
            fn()
        return graph

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info()[0]


class CudaGraphRunner:
    def __init__(self, model, kv_cache: KVCache | LatentKVCache, max_batch: int, max_seq_len: int, pad_kv_loc: int,
                 graphs: CudaGraphs | None = None, barrier: Callable[[], None] | None = None):
        """`graphs`: how to capture (default CudaGraphs: real CUDA graphs); `barrier`: called before each capture
        (ModelRunner passes a barrier of the TP group with tp > 1, so no rank captures its NCCL collectives while a
        peer still runs a warm-up or an earlier capture)."""
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = capture_sizes(max_batch)
        self.inputs = GraphInputs(self.sizes[-1], pad_kv_loc, kv_cache.req_to_token, max_seq_len)
        # [max_batch, vocab] float32, allocated outside the graphs' pool: every graph's logits land here.
        self.output = torch.empty(self.sizes[-1], model.config.vocab_size, dtype=torch.float32,
                                  device=kv_cache.req_to_token.device)
        self.capturer = graphs or CudaGraphs()
        self.barrier = barrier
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0
        self.capture_bytes = 0
        self._capture_all()

    @property
    def max_seq_len(self) -> int:
        return self.inputs.max_seq_len

    def can_run(self, batch: ForwardBatch) -> bool:
        """A pure-decode batch that fits a captured size; a step with LoRA segments runs eagerly (the graphs were
        captured without adapters, and the segments change every step)."""
        return (batch.num_decode == batch.num_reqs and 0 < batch.num_reqs <= self.sizes[-1]
                and batch.logits_indices.shape[0] == batch.num_reqs and batch.max_seq_len <= self.max_seq_len
                and batch.lora is None)

    def size_for(self, num_reqs: int) -> int:
        """The captured size a batch of num_reqs requests replays: the smallest at least as large."""
        return self.sizes[bisect.bisect_left(self.sizes, num_reqs)]

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, vocab] float32 of a pure-decode batch (every request samples): a view of the shared output
        buffer, valid until the next replay."""
        g = self.size_for(batch.num_reqs)
        self.inputs.load(batch, g)
        self.graphs[g].replay()
        return self.output[:batch.num_reqs]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        free_before = self.capturer.free_bytes()
        pool = None
        # Largest first, so the smaller graphs reuse the largest one's memory pool.
        for g in reversed(self.sizes):
            if self.barrier is not None:
                self.barrier()
            graph = self.capturer.capture(self._step_fn(g), pool)
            pool = graph.pool()
            self.graphs[g] = graph
        self.capturer.synchronize()
        self.capture_s = time.perf_counter() - t0
        self.capture_bytes = max(0, free_before - self.capturer.free_bytes())
        logger.info("captured %d decode CUDA graphs (batch sizes up to %d) in %.1f s, %.0f MiB, writing one "
                    "%.0f MiB logits buffer", len(self.graphs), self.sizes[-1], self.capture_s,
                    self.capture_bytes / 2**20, self.output.nbytes / 2**20)

    def _step_fn(self, g: int) -> Callable[[], None]:
        """What graph g runs: the forward of the size-g static batch, its logits (a temporary of the pool, free
        again for the next graph's capture) copied into the shared output."""
        batch = self.inputs.batch(g)

        def step() -> None:
            self.output[:g].copy_(self.model.forward(batch, self.kv_cache))
        return step


def graph_output_bytes(max_batch: int, vocab_size: int) -> int:
    """Bytes of CudaGraphRunner.output for graphs up to max_batch (ModelRunner reserves them before sizing KV)."""
    return max_batch * vocab_size * 4
