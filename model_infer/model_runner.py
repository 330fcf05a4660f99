"""ModelRunner: one rank's model, KV cache and the turn of a BatchPlan into a forward pass.

Owned by the worker process; it knows nothing of sockets or shared memory.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from lightserve.kernels.decode_attention import warm_up_decode_attention
from lightserve.log import get_logger
from lightserve.messages import BatchPlan
from lightserve.model_infer.forward_batch import ForwardBatch
from lightserve.model_infer.host_staging import HostStaging
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
        self.staging = HostStaging(device)
        self.graph_runner = None
        if device.type == "cuda":
            self.warm_up()
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

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile every Triton kernel an eager step can launch, before the first request pays for it:
        one mixed step (a decode and a 2-tile prefill chunk) and decode attention at every split count.
        All of it reads and writes only request row 0 and the scratch KV row, which the router's plans
        overwrite before any use."""
        scratch = self.kv_size                              # the row one past the router's range
        chunk = min(300, self.kv_cache.req_to_token.shape[1] - 1)   # > 2 prefill tiles of 128, ragged
        plan = BatchPlan(step=-1, shm_indices=np.zeros(2, np.int32), req_ids=np.array([-1, -2], np.int64),
                         prefix_lens=np.zeros(2, np.int32), extend_lens=np.array([1, chunk], np.int32),
                         sample=np.ones(2, bool), input_ids=np.zeros(1 + chunk, np.int32),
                         kv_locs=np.full(1 + chunk, scratch, np.int32), num_decode=1)
        self.model.forward(self._make_batch(plan), self.kv_cache)
        shards = self.model.weights.shards
        hq, hk, d = shards.num_heads, shards.num_kv_heads, self.model_config.head_dim
        # q as the model passes it: a [1, Hq, D] view of the fused qkv output (its row stride matters to
        # Triton's specialization).
        qkv = torch.zeros(1, (hq + 2 * hk) * d, dtype=self.dtype, device=self.device)
        q = qkv[:, :hq * d].view(1, hq, d)
        one = torch.ones(1, dtype=torch.int32, device=self.device)
        warm_up_decode_attention(q, self.kv_cache.k_caches[0], self.kv_cache.v_caches[0],
                                 self.kv_cache.req_to_token, one * 0, one)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _make_batch(self, plan: BatchPlan) -> ForwardBatch:
        extend = plan.extend_lens
        num_tokens = int(plan.input_ids.shape[0])
        q_start = np.cumsum(extend, dtype=np.int32) - extend                        # [B]
        # Token t of request b sits at position prefix[b] + (t - q_start[b]).
        positions = np.repeat(plan.prefix_lens - q_start, extend) + np.arange(num_tokens, dtype=np.int32)
        rows = np.repeat(plan.shm_indices, extend)                                 # [T]
        seq_lens = plan.prefix_lens + extend                                       # [B]
        # Sampling rows first ([S]), then the prompt-logprob rows ([E]) rank 0 asked for.
        logits_idx = np.concatenate([(q_start + extend - 1)[plan.sample], plan.prompt_logit_idx])
        # Every integer array of the step in one host-to-device copy (pinned and asynchronous on CUDA).
        (input_ids, positions_t, kv_locs, rows_t, req_rows, prefix_lens, extend_t, seq_lens_t, q_start_t,
         logits_idx_t, fill_rows, fill_pos, fill_locs) = self.staging.upload(
            [plan.input_ids, positions, plan.kv_locs, rows, plan.shm_indices, plan.prefix_lens, extend, seq_lens,
             q_start, logits_idx, plan.fill_rows, plan.fill_pos, plan.fill_locs])
        table = self.kv_cache.req_to_token
        if plan.fill_rows.size:
            table[fill_rows.long(), fill_pos.long()] = fill_locs
        positions_t = positions_t.long()
        table[rows_t.long(), positions_t] = kv_locs
        nd = plan.num_decode
        return ForwardBatch(
            input_ids=input_ids.long(),
            positions=positions_t,
            kv_locs=kv_locs.long(),
            req_rows=req_rows,
            prefix_lens=prefix_lens,
            extend_lens=extend_t,
            seq_lens=seq_lens_t,
            q_start_locs=q_start_t,
            logits_indices=logits_idx_t.long(),
            num_decode=nd,
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
