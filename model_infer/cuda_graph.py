"""CudaGraphRunner: decode steps replayed from CUDA graphs captured at start-up (CUDA only).

A pure-decode batch of B requests is padded to the next captured size G and replayed. The graphs
read static input buffers owned here; a replay copies the step's inputs into them (no allocation
per step). Padding entries point at a scratch KV row (`pad_kv_loc`, one past the router's range)
and at request row 0 with length 1, so they compute garbage that is never read.
"""
from __future__ import annotations

import bisect

import torch

from lightserve.log import get_logger

from lightserve.model_infer.forward_batch import ForwardBatch
from lightserve.model_infer.kv_cache import KVCache

logger = get_logger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """Small sizes one by one's powers of two, then every 16: padding waste stays under ~15%."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch] + list(range(16, max_batch + 1, 16))
    return sizes if sizes[-1] == max_batch else sizes + [max_batch]


class CudaGraphRunner:
    def __init__(self, model, kv_cache: KVCache, max_batch: int, max_seq_len: int, pad_kv_loc: int):
        self.model = model
        self.kv_cache = kv_cache
        self.max_seq_len = max_seq_len   # attention is captured for the longest allowed sequence
        self.sizes = capture_sizes(max_batch)
        dev = kv_cache.req_to_token.device
        n = self.sizes[-1]
        # Static inputs: replays read these; `run` overwrites their first B entries.
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.kv_locs = torch.full((n,), pad_kv_loc, dtype=torch.long, device=dev)
        self.req_rows = torch.zeros(n, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.prefix_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.ones = torch.ones(n, dtype=torch.int32, device=dev)
        self.arange = torch.arange(n, dtype=torch.int32, device=dev)
        self.pad_kv_loc = pad_kv_loc
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture_all()

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.num_decode == batch.num_reqs and 0 < batch.num_reqs <= self.sizes[-1]
                and batch.logits_indices.shape[0] == batch.num_reqs and batch.max_seq_len <= self.max_seq_len)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, vocab] float32 of a pure-decode batch (every request samples)."""
        b = batch.num_reqs
        g = self.sizes[bisect.bisect_left(self.sizes, b)]
        self.input_ids[:b].copy_(batch.input_ids)
        self.positions[:b].copy_(batch.positions)
        self.kv_locs[:b].copy_(batch.kv_locs)
        self.req_rows[:b].copy_(batch.req_rows)
        self.seq_lens[:b].copy_(batch.seq_lens)
        self.prefix_lens[:b].copy_(batch.prefix_lens)
        # Entries [b, g) may hold a previous step's values: reset them to the harmless padding.
        self.kv_locs[b:g].fill_(self.pad_kv_loc)
        self.req_rows[b:g].zero_()
        self.seq_lens[b:g].fill_(1)
        self.prefix_lens[b:g].zero_()
        self.graphs[g].replay()
        return self.outputs[g][:b]

    def _batch(self, g: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:g], positions=self.positions[:g], kv_locs=self.kv_locs[:g],
            req_rows=self.req_rows[:g], prefix_lens=self.prefix_lens[:g], extend_lens=self.ones[:g],
            seq_lens=self.seq_lens[:g], q_start_locs=self.arange[:g], logits_indices=self.arange[:g].long(),
            num_decode=g, num_decode_tokens=g, max_seq_len=self.max_seq_len, max_extend_len=0,
            req_to_token=self.kv_cache.req_to_token)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        stream = torch.cuda.Stream()
        # Largest first, so the smaller graphs reuse the largest one's memory pool.
        for g in reversed(self.sizes):
            batch = self._batch(g)
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton compiles and autotunes outside the capture
                    self.model.forward(batch, self.kv_cache)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[g] = self.model.forward(batch, self.kv_cache)
            pool = graph.pool()
            self.graphs[g] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes up to %d)", len(self.graphs), self.sizes[-1])
