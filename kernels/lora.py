"""LoRA's segmented shrink and expand (S-LoRA/Punica's SGMV): the low-rank products of many adapters in one batch.

A step's tokens are grouped into segments, runs of consecutive tokens under one adapter; tokens under the base model
belong to no segment. Each adapter occupies a slot of stacked, rank-padded weights (model_infer/lora.py loads them):

    shrink:  xa[t, :]                   = x[t, :] @ A[slot]^T                    A: [num_slots, R, K]
    expand:  y[t, n0:n0+nj] += xa[t, r0:r0+rj] @ BT[slot][r0:r0+rj, n0:n0+nj]    BT: [num_slots, R, N]

A fused projection (q/k/v, gate/up) is one shrink over its A's stacked along R and one expand whose slices map each
rank block to its own output columns. The adapter's scaling (alpha/r, rsLoRA's alpha/sqrt(r)) is folded into BT at
load. A and BT are float32 whatever the activation dtype (they are small); xa is float32; y is updated in place.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class LoraSegments:
    """The step's adapter segments: tokens [starts[s], starts[s] + lens[s]) run under slot slots[s]. int32 [S] on
    the weights' device, and the same on the host (`host_*`, numpy) for code that loops without a device sync."""
    starts: Tensor
    lens: Tensor
    slots: Tensor
    host_starts: np.ndarray
    host_lens: np.ndarray
    host_slots: np.ndarray

    @classmethod
    def from_token_slots(cls, token_slots: np.ndarray, device: torch.device | str = "cpu") -> LoraSegments | None:
        """Segments of a [T] int32 array of each token's slot (-1: the base model); None when no token has one."""
        t = token_slots.shape[0]
        if t == 0 or not (token_slots >= 0).any():
            return None
        change = np.flatnonzero(np.diff(token_slots)) + 1                     # where a run starts, past token 0
        starts = np.concatenate([[0], change]).astype(np.int32)               # [runs]
        lens = np.diff(np.concatenate([starts, [t]])).astype(np.int32)        # [runs]
        slots = token_slots[starts].astype(np.int32)                          # [runs]
        keep = slots >= 0
        starts, lens, slots = starts[keep], lens[keep], slots[keep]
        dev = torch.device(device)
        return cls(*(torch.from_numpy(a).to(dev) for a in (starts, lens, slots)), starts, lens, slots)

    @property
    def num_segments(self) -> int:
        return int(self.host_starts.shape[0])


# A slice of an expand: (r0, rj, n0, nj): rank rows [r0, r0 + rj) of BT write output columns [n0, n0 + nj).
Slice = tuple[int, int, int, int]


def lora_shrink_ref(x: Tensor, a: Tensor, segs: LoraSegments) -> Tensor:
    """x [T, K] (model dtype), a [num_slots, R, K] float32 -> xa [T, R] float32; rows outside every segment zero."""
    xa = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for s0, n, slot in zip(segs.host_starts.tolist(), segs.host_lens.tolist(), segs.host_slots.tolist()):
        xa[s0:s0 + n] = x[s0:s0 + n].float() @ a[slot].t()
    return xa


def lora_expand_ref(y: Tensor, xa: Tensor, bt: Tensor, segs: LoraSegments, slices: tuple[Slice, ...]) -> Tensor:
    """y [T, N] (model dtype) += each slice's xa [T, R] block @ bt [num_slots, R, N] block, in float32, rounded once
    to y's dtype; rows outside every segment untouched. Returns y."""
    for s0, n, slot in zip(segs.host_starts.tolist(), segs.host_lens.tolist(), segs.host_slots.tolist()):
        rows = y[s0:s0 + n]
        for r0, rj, n0, nj in slices:
            delta = xa[s0:s0 + n, r0:r0 + rj] @ bt[slot, r0:r0 + rj, n0:n0 + nj]   # [n, nj] float32
            rows[:, n0:n0 + nj] = (rows[:, n0:n0 + nj].float() + delta).to(y.dtype)
    return y


def lora_shrink(x: Tensor, a: Tensor, segs: LoraSegments) -> Tensor:
    """lora_shrink_ref's result by the fastest kernel for x's device and dtype."""
    return lora_shrink_ref(x, a, segs)


def lora_expand(y: Tensor, xa: Tensor, bt: Tensor, segs: LoraSegments, slices: tuple[Slice, ...]) -> Tensor:
    """lora_expand_ref's update of y in place by the fastest kernel for y's device and dtype. Returns y."""
    return lora_expand_ref(y, xa, bt, segs, slices)
