"""ModelRunner: one rank's model, KV cache and the turn of a BatchPlan into a forward pass.

Owned by the worker process; it knows nothing of sockets or shared memory.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from lightserve.kernels.cpu import memory_bytes
from lightserve.log import get_logger
from lightserve.messages import BatchPlan
from lightserve.model_infer.forward_batch import make_forward_batch
from lightserve.model_infer.host_staging import HostStaging
from lightserve.model_infer.models import load_model

if TYPE_CHECKING:
    from lightserve.config import KernelBackend
    from lightserve.model_config import ModelConfig

logger = get_logger(__name__)

CPU_KV_MEMORY_FRACTION = 0.35   # of MemAvailable, after the weights are loaded
CPU_KV_DEFAULT_MAX = 65536      # tokens; a CPU serves few long sequences, and zeroing the cache costs start-up time
GPU_KV_MEMORY_FRACTION = 0.85   # of free device memory, after the weights are loaded


class ModelRunner:
    def __init__(self, model_dir: str, model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 tp_rank: int, tp_size: int, tp_group, num_req_rows: int, max_req_total_len: int,
                 kv_size: int | None, ranks_per_node: int = 1, cuda_graph_max_batch: int = 0,
                 kernel_backend: KernelBackend | None = None):
        """`kernel_backend`: --kernel_backend as resolved (None = by device): TRITON on a CPU device runs the GPU
        code path under Triton's interpreter, with no warm-up or graphs (nothing compiles there)."""
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.model = load_model(model_config, model_dir, dtype=dtype, device=device,
                                tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group, backend=kernel_backend)
        # The model says which cache its attention reads (K/V per head, or DeepSeek-V3's latent rows) and its size.
        per_token = self.model.kv_bytes_per_token()
        self.kv_size = kv_size or _auto_kv_size(per_token, device, ranks_per_node)
        # One row past the router's range: scratch for padded CUDA-graph entries.
        self.kv_cache = self.model.make_kv_cache(self.kv_size + 1, num_req_rows, max_req_total_len)
        self.staging = HostStaging(device)
        self.graph_runner = None
        if device.type == "cuda":
            self.warm_up()
        if device.type == "cuda" and cuda_graph_max_batch > 0:
            from lightserve.model_infer.cuda_graph import CudaGraphRunner
            self.graph_runner = CudaGraphRunner(self.model, self.kv_cache, min(cuda_graph_max_batch, num_req_rows),
                                                max_req_total_len, pad_kv_loc=self.kv_size)
        logger.info("KV cache: %s of %d tokens, %d bytes per token (%.1f MiB), %s on %s, %s kernels",
                    type(self.kv_cache).__name__, self.kv_size, per_token, self.kv_size * per_token / 2**20, dtype,
                    device, self.model.backend.value)

    @torch.inference_mode()
    def forward(self, plan: BatchPlan, argmax_only: bool = False) -> torch.Tensor:
        """Run one step; returns float32 logits [S + E, vocab]: the S requests with plan.sample, then
        the E tokens of plan.prompt_logit_idx. argmax_only: only each row's argmax will be read
        (ForwardBatch.argmax_only)."""
        batch = make_forward_batch(plan, self.kv_cache.req_to_token, self.staging, argmax_only)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.run(batch)
        return self.model.forward(batch, self.kv_cache)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile every Triton kernel an eager step can launch, before the first request pays for it:
        one mixed step (a decode and a 2-tile prefill chunk) and the model's decode attention at every split
        count (`warm_up_attention`: over K/V, or MLA's over latent rows).
        All of it reads and writes only request row 0 and the scratch KV row, which the router's plans
        overwrite before any use."""
        scratch = self.kv_size                              # the row one past the router's range
        chunk = min(300, self.kv_cache.req_to_token.shape[1] - 1)   # > 2 prefill tiles of 128, ragged
        plan = BatchPlan(step=-1, shm_indices=np.zeros(2, np.int32), req_ids=np.array([-1, -2], np.int64),
                         prefix_lens=np.zeros(2, np.int32), extend_lens=np.array([1, chunk], np.int32),
                         sample=np.ones(2, bool), input_ids=np.zeros(1 + chunk, np.int32),
                         kv_locs=np.full(1 + chunk, scratch, np.int32), num_decode=1)
        self.model.forward(make_forward_batch(plan, self.kv_cache.req_to_token, self.staging), self.kv_cache)
        one = torch.ones(1, dtype=torch.int32, device=self.device)
        self.model.warm_up_attention(self.kv_cache, one * 0, one)  # request row 0, one token
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _auto_kv_size(bytes_per_token: int, device: torch.device, ranks_per_node: int) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * GPU_KV_MEMORY_FRACTION
    else:
        budget = min(memory_bytes() * CPU_KV_MEMORY_FRACTION / ranks_per_node,
                     CPU_KV_DEFAULT_MAX * bytes_per_token)
    return max(int(budget // bytes_per_token), 256)
