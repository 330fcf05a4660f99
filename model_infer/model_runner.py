"""ModelRunner: one rank's model, KV cache and the turn of a BatchPlan into a forward pass.

Owned by the worker process; it knows nothing of sockets or shared memory.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from lightserve.log import get_logger
from lightserve.messages import BatchPlan

from lightserve.model_infer.forward_batch import ForwardBatch
from lightserve.model_infer.kv_cache import KVCache
from lightserve.model_infer.llama import LlamaForCausalLM
from lightserve.model_infer.model_config import ModelConfig

logger = get_logger(__name__)

CPU_KV_MEMORY_FRACTION = 0.35   # of MemAvailable, after the weights are loaded
CPU_KV_DEFAULT_MAX = 65536      # tokens; a CPU serves few long sequences, and zeroing the cache costs start-up time
GPU_KV_MEMORY_FRACTION = 0.85   # of free device memory, after the weights are loaded


class ModelRunner:
    def __init__(self, model_dir: str, model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 tp_rank: int, tp_size: int, tp_group, num_req_rows: int, max_req_total_len: int,
                 kv_size: int | None, ranks_per_node: int = 1, cuda_graph_max_batch: int = 0):
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.model = LlamaForCausalLM.load(model_dir, dtype=dtype, device=device,
                                           tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group)
        shards = self.model.weights.shards
        per_token = KVCache.bytes_per_token(model_config, shards.num_kv_heads, dtype)
        self.kv_size = kv_size or _auto_kv_size(per_token, device, ranks_per_node)
        # One row past the router's range: scratch for padded CUDA-graph entries.
        self.kv_cache = KVCache(model_config.num_layers, self.kv_size + 1, shards.num_kv_heads, model_config.head_dim,
                                num_req_rows, max_req_total_len, dtype, device)
        self.graph_runner = None
        if device.type == "cuda" and cuda_graph_max_batch > 0:
            from lightserve.model_infer.cuda_graph import CudaGraphRunner
            self.graph_runner = CudaGraphRunner(self.model, self.kv_cache, min(cuda_graph_max_batch, num_req_rows),
                                                max_req_total_len, pad_kv_loc=self.kv_size)
        logger.info("KV cache: %d tokens (%.1f MiB), %s on %s", self.kv_size,
                    self.kv_size * per_token / 2**20, dtype, device)

    @torch.inference_mode()
    def forward(self, plan: BatchPlan) -> torch.Tensor:
        """Run one step; returns float32 logits [S + E, vocab]: the S requests with plan.sample, then
        the E tokens of plan.prompt_logit_idx."""
        batch = self._make_batch(plan)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.run(batch)
        return self.model.forward(batch, self.kv_cache)

    def _make_batch(self, plan: BatchPlan) -> ForwardBatch:
        dev = self.device
        extend = plan.extend_lens
        num_tokens = int(plan.input_ids.shape[0])
        q_start = np.cumsum(extend, dtype=np.int32) - extend                        # [B]
        # Token t of request b sits at position prefix[b] + (t - q_start[b]).
        positions = np.repeat(plan.prefix_lens - q_start, extend) + np.arange(num_tokens, dtype=np.int32)
        rows = np.repeat(plan.shm_indices, extend)                                 # [T]
        table = self.kv_cache.req_to_token
        if plan.fill_rows.size:
            table[torch.from_numpy(plan.fill_rows).to(dev, torch.long),
                  torch.from_numpy(plan.fill_pos).to(dev, torch.long)] = torch.from_numpy(plan.fill_locs).to(dev)
        kv_locs = torch.from_numpy(plan.kv_locs).to(dev)
        positions_t = torch.from_numpy(positions).to(dev, torch.long)
        table[torch.from_numpy(rows).to(dev, torch.long), positions_t] = kv_locs
        seq_lens = plan.prefix_lens + extend
        # Sampling rows first ([S]), then the prompt-logprob rows ([E]) rank 0 asked for.
        logits_idx = np.concatenate([(q_start + extend - 1)[plan.sample], plan.prompt_logit_idx])
        nd = plan.num_decode
        return ForwardBatch(
            input_ids=torch.from_numpy(plan.input_ids).to(dev, torch.long),
            positions=positions_t,
            kv_locs=kv_locs.long(),
            req_rows=torch.from_numpy(plan.shm_indices).to(dev),
            prefix_lens=torch.from_numpy(plan.prefix_lens).to(dev),
            extend_lens=torch.from_numpy(extend).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            q_start_locs=torch.from_numpy(q_start).to(dev),
            logits_indices=torch.from_numpy(logits_idx).to(dev, torch.long),
            num_decode=nd,
            num_decode_tokens=nd,
            max_seq_len=int(seq_lens.max()),
            max_extend_len=int(extend[nd:].max()) if extend.shape[0] > nd else 0,
            req_to_token=table,
        )


def _auto_kv_size(bytes_per_token: int, device: torch.device, ranks_per_node: int) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * GPU_KV_MEMORY_FRACTION
    else:
        budget = min(_mem_available() * CPU_KV_MEMORY_FRACTION / ranks_per_node,
                     CPU_KV_DEFAULT_MAX * bytes_per_token)
    return max(int(budget // bytes_per_token), 256)


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
