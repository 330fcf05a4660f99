"""HostStaging: a step's small integer arrays to the device in one transfer. Used by ModelRunner.

On CUDA the arrays are packed into a pinned host buffer and copied with non_blocking=True, so
building a batch never waits for the GPU to finish the previous step. On CPU they are packed into
one fresh tensor (there is nothing to copy).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_MIN_CAPACITY = 1 << 16   # int32 entries; grows to the largest step seen


class HostStaging:
    """NOTE: two pinned buffers alternate. A buffer is rewritten only after the copy that last read it has
    completed (its event), so the host may run one step ahead of the GPU without corrupting a copy in flight;
    on a rank that never reads results back (tp_rank > 0) that wait is what bounds the lead."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def upload(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """int32 device tensors with the arrays' contents (any integer dtype whose values fit int32),
        in order; they are views of one device tensor."""
        sizes = [int(a.size) for a in arrays]
        total = sum(sizes)
        if self.device.type != "cuda":
            packed = np.empty(total, np.int32)
            _pack(packed, arrays)
            return list(torch.from_numpy(packed).split(sizes))
        turn, self._turn = self._turn, self._turn ^ 1
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()
        buf = self._buffers[turn]
        if buf is None or buf.numel() < total:
            buf = torch.empty(max(total, _MIN_CAPACITY, 0 if buf is None else 2 * buf.numel()), dtype=torch.int32,
                              pin_memory=True)
            self._buffers[turn] = buf
        _pack(buf.numpy(), arrays)
        dev = buf[:total].to(self.device, non_blocking=True)   # [total] int32
        event = self._copied[turn] or torch.cuda.Event()
        event.record()
        self._copied[turn] = event
        return list(dev.split(sizes))


def _pack(out: np.ndarray, arrays: Sequence[np.ndarray]) -> None:
    offset = 0
    for a in arrays:
        out[offset:offset + a.size] = a.reshape(-1)
        offset += a.size
