"""LoraWeights: one rank's resident LoRA adapters, stacked per layer in the slots the kernels index
(kernels/lora.py), with a CPU cache of adapters already sharded and scaled. ModelRunner builds it when --enable_lora
is set and loads adapters into slots on the router's LoadLora; the model (models/base.py) adds each step's deltas.

Per layer and projection group (a fused projection is one group), in --lora_dtype (LoraLimits.dtype: float32,
bfloat16 or float16; the kernels widen to float32) on the model's device, R = max rank:
    qkv      A [slots, 3R, hidden]   BT [slots, 3R, q_out + 2 * kv_out]   rank blocks q | k | v
    o        A [slots, R, q_out]     BT [slots, R, hidden]
    gate_up  A [slots, 2R, hidden]   BT [slots, 2R, 2 * I_local]          rank blocks gate | up
    down     A [slots, R, I_local]   BT [slots, R, hidden]
(q_out, kv_out, I_local: this rank's shard.) An adapter of rank r < R fills rows [0, r) of each rank block; a
projection it does not target stays zero. BT = (scaling * B)^T, so the expand needs no scaling; the scaling is
folded in float32 and the product rounded once to the stacks' dtype.

Tensor parallelism: the column-parallel groups (qkv, gate_up) keep B's rows of this rank's shard and all of A; the
row-parallel ones (o, down) keep A's columns of this rank's shard and all of B. Each rank's delta of a row-parallel
projection is then its partial sum, added before the all-reduce: exact by linearity, with no extra communication.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

import numpy as np
import torch

from lightserve.kernels.lora import LoraSegments, Slice, lora_apply
from lightserve.log import get_logger
from lightserve.lora_adapter import load_lora_tensors, lora_target_modules, read_lora_adapter

if TYPE_CHECKING:
    from lightserve.config import KernelBackend
    from lightserve.model_config import ModelConfig
    from lightserve.model_infer.weights import TPShards

logger = get_logger(__name__)


class LoraGroup(IntEnum):
    """The projection groups of a decoder layer, as the forward runs them."""
    QKV_PROJ = 0
    O_PROJ = 1
    GATE_UP_PROJ = 2
    DOWN_PROJ = 3


# Each PEFT module: (its group, its rank block in the group).
_MODULE_GROUP = {
    "q_proj": (LoraGroup.QKV_PROJ, 0), "k_proj": (LoraGroup.QKV_PROJ, 1), "v_proj": (LoraGroup.QKV_PROJ, 2),
    "o_proj": (LoraGroup.O_PROJ, 0),
    "gate_proj": (LoraGroup.GATE_UP_PROJ, 0), "up_proj": (LoraGroup.GATE_UP_PROJ, 1),
    "down_proj": (LoraGroup.DOWN_PROJ, 0),
}


# The dtypes the stacks may be stored in (the kernels widen each to float32).
LORA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class LoraLimits:
    """--max_loras, --max_lora_rank and --max_cpu_loras (None = max_loras), what the store is sized by, and
    --lora_dtype as resolved (the stacks' dtype). ValueError naming --lora_dtype for a dtype not in LORA_DTYPES."""
    max_loras: int
    max_rank: int
    max_cpu_loras: int | None = None
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.dtype not in LORA_DTYPES:
            raise ValueError(f"--lora_dtype must be float32, bfloat16 or float16, got {self.dtype}")


@dataclass(frozen=True)
class GroupBuffers:
    """One layer's stacked weights of one group: a [slots, blocks * R, K], bt [slots, blocks * R, N] in the limits'
    dtype, and the expand's slices (rank block j writes its own output columns)."""
    a: torch.Tensor
    bt: torch.Tensor
    slices: tuple[Slice, ...]


@dataclass(frozen=True)
class CachedAdapter:
    """An adapter as this rank keeps it in CPU memory: per (layer, module), this rank's shard of A [r, K] and of
    (scaling * B)^T [r, N], in the stacks' dtype (rounded once, at the read: half the cache's memory in bf16, and a
    slot's fill a plain copy)."""
    lora_id: int
    path: str
    rank: int
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class LoraWeights:
    def __init__(self, model: ModelConfig, shards: TPShards, limits: LoraLimits, device: torch.device | str) -> None:
        """Zeroed slots for `limits.max_loras` adapters of rank up to `limits.max_rank` over `model`'s layers as
        this rank (`shards`) holds them. ValueError naming --enable_lora for a family that takes no adapters."""
        self.targetable = lora_target_modules(model)
        self.model, self.shards, self.limits = model, shards, limits
        self.num_slots, r = limits.max_loras, limits.max_rank
        self.max_cpu_loras = limits.max_cpu_loras or limits.max_loras
        d, sh = model.head_dim, shards
        q_out, kv_out, inter, hidden = sh.num_heads * d, sh.num_kv_heads * d, sh.inter_size, model.hidden_size
        # Per group: (rank blocks, K, each block's output width); blocks write consecutive output columns.
        shapes = {LoraGroup.QKV_PROJ: (hidden, (q_out, kv_out, kv_out)), LoraGroup.O_PROJ: (q_out, (hidden,))}
        if "gate_proj" in self.targetable:
            shapes |= {LoraGroup.GATE_UP_PROJ: (hidden, (inter, inter)), LoraGroup.DOWN_PROJ: (inter, (hidden,))}
        self.layers: list[dict[LoraGroup, GroupBuffers]] = []
        for _ in range(model.num_layers):
            groups = {}
            for group, (k, widths) in shapes.items():
                starts = np.cumsum((0, *widths[:-1]))
                slices = tuple((j * r, r, int(n0), n) for j, (n0, n) in enumerate(zip(starts, widths)))
                groups[group] = GroupBuffers(
                    a=torch.zeros(self.num_slots, len(widths) * r, k, dtype=limits.dtype, device=device),
                    bt=torch.zeros(self.num_slots, len(widths) * r, sum(widths), dtype=limits.dtype, device=device),
                    slices=slices)
            self.layers.append(groups)
        # [layer, group, slot]: 1 where the slot's adapter targets the group there; the forward skips a group none
        # of a step's slots targets (host numpy, read without a device sync). uint8 and never reallocated: the CPU
        # one-call driver reads it through a pointer (kernels/decoder_layers.py, bind_lora).
        self.targeted = np.zeros((model.num_layers, len(LoraGroup), self.num_slots), dtype=np.uint8)
        self.slot_ids: list[int | None] = [None] * self.num_slots   # the lora_id each slot holds
        self.cache: OrderedDict[int, CachedAdapter] = OrderedDict()  # lora_id -> adapter, least recently used first
        # Reads the router asked for ahead of their load (prefetch): lora_id -> (path, the read), oldest first.
        self._reading: dict[int, tuple[str, Future[CachedAdapter]]] = {}
        self._reader: ThreadPoolExecutor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the stacked device buffers (the CPU cache not counted)."""
        return sum(b.a.nbytes + b.bt.nbytes for groups in self.layers for b in groups.values())

    def prefetch(self, lora_id: int, path: str) -> None:
        """Start reading adapter `lora_id` from `path` in a background thread (the router's PrefetchLora: a request
        waits for it), unless the CPU cache holds it or it is being read; `load` then takes the read, waiting only
        for what is left of it. Reads release the GIL for most of their time (file reads, torch ops), so the steps
        meanwhile run on. At most max_cpu_loras reads are kept (the oldest dropped: a request that never ran)."""
        cached = self.cache.get(lora_id)
        if (cached is not None and cached.path == path) or self._reading.get(lora_id, ("",))[0] == path:
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-read")
        while len(self._reading) >= self.max_cpu_loras:
            del self._reading[next(iter(self._reading))]
        self._reading[lora_id] = (path, self._reader.submit(self._read, lora_id, path))

    def load(self, lora_id: int, path: str, slot: int) -> None:
        """Put adapter `lora_id` (PEFT folder `path`) into `slot`, replacing what the slot held: from the CPU cache
        when it holds lora_id with the same path, else read from disk (then cached, the least recently used adapter
        dropped past max_cpu_loras). Raises ValueError for a slot out of range, LoraAdapterError for an adapter that
        read_lora_adapter refuses or that cannot be read; the slot is left as it was then."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"LoRA slot {slot} is out of range: --max_loras is {self.num_slots}")
        start = time.perf_counter()
        reading = self._reading.pop(lora_id, None)
        if reading is not None and reading[0] == str(path) and reading[1].exception() is None:
            self.cache[lora_id] = reading[1].result()  # a failed read is read again below, to raise here
        cached = self.cache.get(lora_id)
        hit = cached is not None and cached.path == str(path)
        if hit:
            self.cache.move_to_end(lora_id)
        else:
            cached = self._read(lora_id, str(path))
            self.cache[lora_id] = cached
            self.cache.move_to_end(lora_id)
        while len(self.cache) > self.max_cpu_loras:
            self.cache.popitem(last=False)
        self._fill_slot(slot, cached)
        self.slot_ids[slot] = lora_id
        logger.info("LoRA %d (rank %d, %s) in slot %d from %s in %.2fs", lora_id, cached.rank, path, slot,
                    "the CPU cache" if hit else "disk", time.perf_counter() - start)

    def stacks(self) -> list[list[tuple[torch.Tensor, torch.Tensor, tuple[Slice, ...]] | None]]:
        """Per layer, per LoraGroup: the group's (a, bt, slices), None where no adapter can target it (the MLP of a
        family whose adapters target attention only). What the CPU one-call driver binds."""
        return [[(b.a, b.bt, b.slices) if (b := groups.get(g)) is not None else None for g in LoraGroup]
                for groups in self.layers]

    def apply(self, layer: int, group: LoraGroup, x: torch.Tensor, y: torch.Tensor, segs: LoraSegments,
              backend: KernelBackend | None = None) -> None:
        """y [T, N] += each segment's delta of layer `layer`'s `group` for its input x [T, K]; rows outside every
        segment untouched. Skipped when no slot of the step targets the group in this layer. `backend`: the
        model's (--kernel_backend; None: by the device)."""
        if not self.targeted[layer, group, segs.host_slots].any():
            return
        buffers = self.layers[layer][group]
        lora_apply(y, x, buffers.a, buffers.bt, segs, buffers.slices, backend)  # shrink and expand in one call

    def _read(self, lora_id: int, path: str) -> CachedAdapter:
        """The adapter from disk: checked, this rank's shard cut, scaling folded into B in float32, both then
        rounded to the stacks' dtype."""
        adapter = read_lora_adapter(path, self.model, self.limits.max_rank)
        modules = {}
        for (layer, module), (a, b) in load_lora_tensors(adapter).items():
            a, b = self._shard(module, a, b)
            dtype = self.limits.dtype
            modules[layer, module] = (a.to(dtype).contiguous(),                       # [r, K]
                                      (adapter.scaling * b).t().to(dtype).contiguous())  # [r, N]
        return CachedAdapter(lora_id, path, adapter.rank, modules)

    def _shard(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of A [r, K] and B [N, r]: B's rows of a column-parallel projection, A's columns of a
        row-parallel one (the same ranges as models/llama.py reads of the base weights)."""
        sh, d = self.shards, self.model.head_dim
        q = (sh.q_head_start * d, (sh.q_head_start + sh.num_heads) * d)
        kv = (sh.kv_head_start * d, (sh.kv_head_start + sh.num_kv_heads) * d)
        inter = (sh.inter_start, sh.inter_start + sh.inter_size)
        rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": inter, "up_proj": inter}.get(module)
        if rows is not None:
            return a, b[rows[0]:rows[1]]
        cols = q if module == "o_proj" else inter
        return a[:, cols[0]:cols[1]], b

    def _fill_slot(self, slot: int, adapter: CachedAdapter) -> None:
        r = self.limits.max_rank
        self.targeted[:, :, slot] = 0
        for groups in self.layers:
            for buffers in groups.values():
                buffers.a[slot].zero_()
                buffers.bt[slot].zero_()
        for (layer, module), (a, bt) in adapter.modules.items():
            group, block = _MODULE_GROUP[module]
            buffers = self.layers[layer][group]
            r0, _, n0, n = buffers.slices[block]
            rank = a.shape[0]
            buffers.a[slot, r0:r0 + rank].copy_(a)                      # [r, K]
            buffers.bt[slot, r0:r0 + rank, n0:n0 + n].copy_(bt)         # [r, N_block]
            assert rank <= r
            self.targeted[layer, group, slot] = 1

