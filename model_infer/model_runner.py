"""ModelRunner: one rank's model, KV cache and the turn of a BatchPlan into a forward pass.

Owned by the worker process; it knows nothing of sockets or shared memory.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from lightserve.kernels.cpu import memory_bytes
from lightserve.log import get_logger
from lightserve.messages import BatchPlan
from lightserve.model_infer.cuda_graph import CudaGraphRunner, GraphInputs, graph_output_bytes
from lightserve.model_infer.draft_model import DraftModel
from lightserve.model_infer.forward_batch import make_forward_batch
from lightserve.model_infer.host_staging import HostStaging
from lightserve.model_infer.lora import LoraLimits, LoraWeights
from lightserve.model_infer.models import load_model
from lightserve.model_infer.mtp_drafter import MtpDrafter, MtpModel

if TYPE_CHECKING:
    from lightserve.config import KernelBackend
    from lightserve.model_config import ModelConfig

logger = get_logger(__name__)

CPU_KV_MEMORY_FRACTION = 0.35   # of MemAvailable, after the weights are loaded
# A CPU serves few long sequences, and zeroing the cache costs start-up time: at most the bytes of this many tokens in
# the activation dtype, so an 8-bit cache holds about twice the tokens in the same memory.
CPU_KV_DEFAULT_MAX = 65536
# Of the device memory still free once the weights are loaded and what the steps need beside the KV cache
# (`reserved_bytes`) is set aside: the rest of the slack is the allocator's fragmentation, NCCL's and cuBLAS's own.
GPU_KV_MEMORY_FRACTION = 0.9
MIN_KV_TOKENS = 256
DEFAULT_STEP_TOKENS = 8192      # --batch_max_tokens' GPU default, for callers that pass none
# [S, vocab] float32 tensors a sampling step may hold beside its logits: the processed copy (penalties, bias), the
# tempered logits, their softmax and its cumsum, a top-logprobs log_softmax.
GPU_SAMPLING_COPIES = 5
PROMPT_LOGPROB_COPIES = 2       # a prompt-logprob chunk's log_softmax and its top-k (output_writer.PROMPT_LOGPROB_ROWS)
GPU_GRAPH_OVERHEAD = 256 << 20  # the graphs' executable objects and per-size blocks of their pool, a guess


class ModelRunner:
    def __init__(self, model_dir: str, model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 tp_rank: int, tp_size: int, tp_group, num_req_rows: int, max_req_total_len: int,
                 kv_size: int | None, ranks_per_node: int = 1, cuda_graph_max_batch: int = 0,
                 kernel_backend: KernelBackend | None = None, max_step_tokens: int | None = None,
                 kv_dtype: torch.dtype | None = None, int8_activations: bool = False,
                 lora: LoraLimits | None = None, draft: tuple[str, ModelConfig] | None = None, mtp: bool = False):
        """`kernel_backend`: --kernel_backend as resolved (None = by device): TRITON on a CPU device runs the GPU
        code path under Triton's interpreter, with no warm-up or graphs (nothing compiles there).
        `max_req_total_len` is capped at the model's context (its rope table's rows). `max_step_tokens`:
        --batch_max_tokens (None: DEFAULT_STEP_TOKENS); on CUDA the activations of a step that large are set aside
        before the KV cache takes the rest of the device (`reserved_bytes`). `kv_dtype`: --kv_cache_dtype as resolved
        (None = the activation dtype); the cache's size counts bytes, so an 8-bit cache holds about twice the
        tokens. `int8_activations`: --quant_activations int8 (GGML-block weights multiply int8 activations).
        `lora`: --enable_lora's limits (None: no adapters); ValueError naming --enable_lora for a model family that
        takes none. The adapters' slots are allocated before the KV cache is sized. `draft`: --speculative_algorithm
        draft's (model folder, config): a DraftModel whose cache mirrors this one row for row (the two caches share
        the memory budget: the KV size counts both caches' bytes per token). `mtp`: --speculative_algorithm mtp, an
        MtpDrafter of the model's multi-token-prediction layer, its latent cache likewise beside this one (no CUDA
        graphs then: the drafter reads every token's state, which a graph does not return)."""
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.max_req_total_len = _cap_req_len(max_req_total_len, model_config)
        self.model = load_model(model_config, model_dir, dtype=dtype, device=device,
                                tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group, backend=kernel_backend,
                                int8_activations=int8_activations)
        self.lora = None
        if lora is not None:
            self.lora = LoraWeights(model_config, self.model.weights.shards, lora, device)
            self.model.attach_lora(self.lora)
            logger.info("LoRA: %d slots of rank %d over %s, %.1f MiB; CPU cache of %d adapters", lora.max_loras,
                        lora.max_rank, ", ".join(self.lora.targetable), self.lora.nbytes / 2**20,
                        self.lora.max_cpu_loras)
        self.staging = HostStaging(device)
        draft_model = None
        if draft is not None:
            draft_dir, draft_config = draft
            draft_model = load_model(draft_config, draft_dir, dtype=dtype, device=device, tp_rank=tp_rank,
                                     tp_size=tp_size, tp_group=tp_group, backend=kernel_backend)
        elif mtp:
            draft_model = MtpModel.load(model_dir, model_config, dtype, device, tp_rank, tp_size, tp_group,
                                        kernel_backend)
        # The model says which cache its attention reads (K/V per head, or DeepSeek-V3's latent rows) and its size.
        self.kv_dtype = kv_dtype or dtype
        # The served model's cache and a drafter's beside it, row for row: both count in the KV size.
        served = self.model.kv_bytes_per_token(self.kv_dtype)
        per_token = self.kv_bytes_per_token = served + (draft_model.kv_bytes_per_token() if draft_model else 0)
        graph_batch = min(cuda_graph_max_batch, num_req_rows) if device.type == "cuda" else 0
        if kv_size:
            self.kv_size = kv_size
            if device.type == "cpu":
                _check_cpu_kv_fits(kv_size, per_token, ranks_per_node)
        elif device.type == "cuda":
            step_tokens = max_step_tokens or DEFAULT_STEP_TOKENS
            reserved = self.reserved_bytes(step_tokens, min(num_req_rows, step_tokens), graph_batch)
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(device)
            self.kv_size = gpu_kv_size(free, per_token, sum(reserved.values()))
            logger.info("GPU memory: %.0f MiB free after the weights, %.0f MiB reserved beside the KV cache (%s), "
                        "%.0f%% of the rest for KV", free / 2**20, sum(reserved.values()) / 2**20,
                        ", ".join(f"{name} {size / 2**20:.0f} MiB" for name, size in reserved.items()),
                        100 * GPU_KV_MEMORY_FRACTION)
        else:
            self.kv_size = _cpu_kv_size(per_token, ranks_per_node, self.model.kv_bytes_per_token(dtype))
        # One row past the router's range: scratch for padded CUDA-graph entries.
        self.kv_cache = self.model.make_kv_cache(self.kv_size + 1, num_req_rows, self.max_req_total_len, self.kv_dtype)
        self.draft: DraftModel | MtpDrafter | None = None
        if draft_model is not None:
            self.draft = (MtpDrafter if mtp else DraftModel)(draft_model, self.kv_size + 1, num_req_rows,
                                                             self.max_req_total_len)
            logger.info("drafts from %s, its KV cache %.1f MiB", "the multi-token-prediction layer" if mtp else
                        f"the draft model {draft[0]} ({draft[1].num_layers} layers)",
                        self.kv_size * draft_model.kv_bytes_per_token() / 2**20)
        self.tp_barrier = _tp_barrier(tp_group, tp_size, device)
        self.graph_runner = None
        if device.type == "cuda":
            self.warm_up()
            if self.tp_barrier is not None:
                self.tp_barrier()
        if graph_batch > 0 and not mtp:
            self.graph_runner = CudaGraphRunner(self.model, self.kv_cache, graph_batch, self.max_req_total_len,
                                                pad_kv_loc=self.kv_size, barrier=self.tp_barrier)
        logger.info("KV cache: %s of %d tokens, %d bytes per token in %s (%.1f MiB); activations %s on %s, %s kernels",
                    type(self.kv_cache).__name__, self.kv_size, served, str(self.kv_dtype).removeprefix("torch."),
                    self.kv_size * served / 2**20, dtype, device, self.model.backend.value)
        if self.kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scales = getattr(self.model.weights, "kv_scales", None)
            logger.info("fp8 KV cache: %s", "the checkpoint's k_scale / v_scale per layer" if scales else
                        "scale 1.0 (the checkpoint carries no k_scale / v_scale); values beyond the format's range "
                        "saturate")

    @torch.inference_mode()
    def forward(self, plan: BatchPlan, argmax_only: bool = False) -> torch.Tensor:
        """Run one step; returns float32 logits [S + E, vocab]: the S requests with plan.sample, then
        the E tokens of plan.prompt_logit_idx. argmax_only: only each row's argmax will be read
        (ForwardBatch.argmax_only; a bf16 model's logits may then stay bf16 on CPU)."""
        ends = plan.prefix_lens + plan.extend_lens                                # [B] each request's length
        if ends.size and int(ends.max()) > self.max_req_total_len:
            raise ValueError(f"step {plan.step} plans a request of {int(ends.max())} tokens, past "
                             f"max_req_total_len {self.max_req_total_len} (the model's context is "
                             f"{self.model_config.max_context_len})")
        if self.draft is not None:
            self.draft.propose(plan)  # runs the drafter over the step's tokens, fills the speculating rows' drafts
        batch = make_forward_batch(plan, self.kv_cache.req_to_token, self.staging, argmax_only)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.run(batch)
        batch.keep_hidden = self.draft is not None and self.draft.wants_hidden
        logits = self.model.forward(batch, self.kv_cache)
        if batch.keep_hidden:
            self.draft.keep(plan, batch.hidden)
        return logits

    @torch.inference_mode()
    def load_lora(self, lora_id: int, path: str, slot: int) -> None:
        """Put adapter `lora_id` (PEFT folder `path`) into LoRA slot `slot` before the next step that names it
        (the router's LoadLora), from this rank's CPU cache when it holds it. Raises RuntimeError without
        --enable_lora, ValueError for a slot past --max_loras, lora_adapter.LoraAdapterError for an adapter that
        cannot be served (the slot then keeps what it held)."""
        if self.lora is None:
            raise RuntimeError(f"LoadLora for adapter {lora_id} on a worker started without --enable_lora")
        self.lora.load(lora_id, path, slot)

    def prefetch_lora(self, lora_id: int, path: str) -> None:
        """Start reading adapter `lora_id` into this rank's CPU cache in the background (the router's PrefetchLora),
        so its LoadLora copies instead of reading the disk between two steps."""
        if self.lora is not None:
            self.lora.prefetch(lora_id, path)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile every Triton kernel variant an eager step can launch, before the first request pays for it (a
        compile is 1-3 s on a GPU; tests/model/test_launch_keys.py checks that serving launches no other key):
        a decode-only step and a mixed step (a decode and a 2-tile prefill chunk), then the model's
        `warm_up_kernels`: decode attention at every split count (over K/V, or MLA's over latent rows) and the MoE
        blocks' grouped GEMMs at both block sizes. No other batch shape is needed: the step's metadata arrays are
        16-byte aligned whatever the shape (HostStaging, ForwardBatch.extend) and no kernel specializes on a count
        that changes per step. All of it reads and writes only request row 0 and the scratch KV row, which the
        router's plans overwrite before any use. With --enable_lora the two steps run once more with their first
        request on LoRA slot 0 and the second on the base model, every group marked targeted there for the while
        (the slots are still empty: zero deltas), so the LoRA kernels compile too. A draft model warms up the same
        way in its own cache."""
        scratch = self.kv_size                              # the row one past the router's range
        chunk = min(300, self.kv_cache.req_to_token.shape[1] - 1)   # > 2 prefill tiles of 128, ragged
        passes = [False] if self.lora is None else [False, True]
        models = [(self.model, self.kv_cache, passes)]
        if self.draft is not None:  # the draft model's kernels (its own shapes) the same way, without adapters
            models.append((self.draft.model, self.draft.kv_cache, [False]))
        for model, cache, lora_passes in models:
            for with_lora, extend_lens in itertools.product(lora_passes, ([1], [1, chunk])):  # decode, then mixed
                num_reqs, num_tokens = len(extend_lens), sum(extend_lens)
                plan = BatchPlan(step=-1, shm_indices=np.zeros(num_reqs, np.int32),
                                 req_ids=-np.arange(1, num_reqs + 1, dtype=np.int64),
                                 prefix_lens=np.zeros(num_reqs, np.int32),
                                 extend_lens=np.array(extend_lens, np.int32), sample=np.ones(num_reqs, bool),
                                 input_ids=np.zeros(num_tokens, np.int32),
                                 kv_locs=np.full(num_tokens, scratch, np.int32), num_decode=1,
                                 lora_slots=np.array([0, -1][:num_reqs], np.int32) if with_lora else
                                 np.zeros(0, np.int32))
                if with_lora:
                    self.lora.targeted[:, :, 0] = 1
                try:
                    model.forward(make_forward_batch(plan, cache.req_to_token, self.staging), cache)
                finally:
                    if with_lora:
                        self.lora.targeted[:, :, 0] = 0
            one = torch.ones(1, dtype=torch.int32, device=self.device)
            model.warm_up_kernels(cache, one * 0, one)  # request row 0, one token
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def reserved_bytes(self, step_tokens: int, max_sampled: int, graph_batch: int,
                       peak_bytes: Callable[[Callable[[], object]], int] | None = None) -> dict[str, int]:
        """What the device needs beside the weights and the KV cache, by name: the peak of the largest step's forward
        (`step_tokens` new tokens, each a logits row as with prompt logprobs), the sampling of `max_sampled` rows and
        a prompt-logprob chunk, and with `graph_batch` > 0 the graphs: their pool (the peak of the largest graph's
        padded forward), their shared logits buffer and an overhead. The forwards run on a scratch cache of their
        own, freed on return. `peak_bytes(fn)`: what running fn allocates at its peak beyond what was held before
        (default: torch.cuda's peak statistics; a CPU test passes its own)."""
        from lightserve.model_infer.output_writer import PROMPT_LOGPROB_ROWS

        peak_bytes = peak_bytes or (lambda fn: _cuda_peak_bytes(fn, self.device))
        vocab, max_len = self.model_config.vocab_size, self.max_req_total_len
        plan = _largest_step_plan(step_tokens, max_len)
        scratch_row = max(step_tokens, graph_batch)
        cache = self.model.make_kv_cache(scratch_row + 1, plan.shm_indices.size, max_len, self.kv_dtype)
        step = make_forward_batch(plan, cache.req_to_token, self.staging)
        sizes = {"largest step": peak_bytes(lambda: self.model.forward(step, cache))}
        if graph_batch > 0:
            padded = GraphInputs(graph_batch, scratch_row, cache.req_to_token, max_len).batch(graph_batch)
            sizes["graph pool"] = peak_bytes(lambda: self.model.forward(padded, cache))
            sizes["graph logits"] = graph_output_bytes(graph_batch, vocab)
            sizes["graph overhead"] = GPU_GRAPH_OVERHEAD
        sampled_rows = GPU_SAMPLING_COPIES * max_sampled + PROMPT_LOGPROB_COPIES * PROMPT_LOGPROB_ROWS
        sizes["sampling"] = sampled_rows * vocab * 4
        return sizes


def gpu_kv_size(free_bytes: int, bytes_per_token: int, reserved_bytes: int) -> int:
    """KV tokens of a GPU rank: GPU_KV_MEMORY_FRACTION of the bytes free once `reserved_bytes` (what the steps need
    beside the cache, ModelRunner.reserved_bytes) are set aside. RuntimeError where that leaves under MIN_KV_TOKENS."""
    tokens = int(max(0, free_bytes - reserved_bytes) * GPU_KV_MEMORY_FRACTION // bytes_per_token)
    if tokens < MIN_KV_TOKENS:
        raise RuntimeError(f"the GPU has {free_bytes / 2**20:.0f} MiB free after the weights and a step needs "
                           f"{reserved_bytes / 2**20:.0f} MiB beside the KV cache: room for {tokens} KV tokens "
                           f"(< {MIN_KV_TOKENS}); lower --batch_max_tokens or --graph_max_batch_size, or split the "
                           "model over more GPUs (--tp)")
    return tokens


def _cpu_kv_size(bytes_per_token: int, ranks_per_node: int, activation_bytes_per_token: int) -> int:
    """KV tokens of a CPU rank: CPU_KV_MEMORY_FRACTION of the memory available, at most CPU_KV_DEFAULT_MAX tokens'
    bytes in the activation dtype (`activation_bytes_per_token`), in the cache's own `bytes_per_token`."""
    budget = min(memory_bytes() * CPU_KV_MEMORY_FRACTION / ranks_per_node,
                 CPU_KV_DEFAULT_MAX * activation_bytes_per_token)
    return max(int(budget // bytes_per_token), MIN_KV_TOKENS)


def _check_cpu_kv_fits(tokens: int, bytes_per_token: int, ranks_per_node: int) -> None:
    """ValueError naming --max_total_token_num where the node's CPU ranks' KV pools exceed the memory available. The
    pool's pages become resident only as rows are written (kv_cache.lazy_zeros), so a pool too large would start and
    be killed under load: it is refused at start instead."""
    need, available = tokens * bytes_per_token * ranks_per_node, memory_bytes()
    if need > available:
        ranks = f" on each of {ranks_per_node} ranks" if ranks_per_node > 1 else ""
        raise ValueError(f"--max_total_token_num {tokens}: the KV cache needs {need / 2**20:.0f} MiB "
                         f"({bytes_per_token} bytes a token{ranks}), more than the {available / 2**20:.0f} MiB of "
                         "memory available")


def _cuda_peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Bytes fn() allocates at its peak beyond what was allocated before it: run once to compile (and autotune),
    then measured."""
    fn()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def _largest_step_plan(num_tokens: int, max_len: int) -> BatchPlan:
    """A step of num_tokens new prompt tokens, in requests of at most max_len (rows 0.. of a scratch table), every
    token a logits row (prompt logprobs) and every request sampling; KV rows 0 .. num_tokens - 1."""
    full, rest = divmod(num_tokens, max_len)
    extend = np.array([max_len] * full + ([rest] if rest else []), np.int32)
    n = extend.size
    return BatchPlan(step=-1, shm_indices=np.arange(n, dtype=np.int32), req_ids=-1 - np.arange(n, dtype=np.int64),
                     prefix_lens=np.zeros(n, np.int32), extend_lens=extend, sample=np.ones(n, bool),
                     input_ids=np.zeros(num_tokens, np.int32), kv_locs=np.arange(num_tokens, dtype=np.int32),
                     num_decode=0, prompt_logit_idx=np.arange(num_tokens, dtype=np.int32))


def _cap_req_len(max_req_total_len: int, model_config: ModelConfig) -> int:
    """max_req_total_len, at most the model's context: no position past its rope table is ever planned (the launcher
    caps the flag the same way; a caller of the runner alone may not)."""
    context = model_config.max_context_len
    if max_req_total_len > context:
        logger.warning("max_req_total_len %d is past the model's context of %d positions: capped to %d",
                       max_req_total_len, context, context)
        return context
    return max_req_total_len


def _tp_barrier(tp_group, tp_size: int, device: torch.device) -> Callable[[], None] | None:
    """A barrier of the TP group, None with tp 1: every rank waits there after its warm-up and before each graph
    capture, so no rank captures NCCL collectives while a peer still runs eager ones."""
    if tp_size == 1:
        return None
    device_ids = [device.index] if device.type == "cuda" and device.index is not None else None

    def barrier() -> None:
        dist.barrier(group=tp_group, device_ids=device_ids)
    return barrier
