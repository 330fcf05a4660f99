"""HostStaging: a step's small integer arrays to the device in one transfer. Used by ModelRunner.

On CUDA the arrays are packed into a pinned host buffer and copied with non_blocking=True, so
building a batch never waits for the GPU to finish the previous step. On CPU they are packed into
one fresh tensor (there is nothing to copy).

Every array starts on a 16-byte boundary (segments padded to ALIGN int32s): Triton specializes a kernel on whether
each pointer argument is 16-byte aligned, so an array whose alignment followed the sizes of the arrays before it
would make a new kernel variant (a compile in the serving loop) whenever the batch shape changed it.
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import numpy as np
import torch

_MIN_CAPACITY = 1 << 16   # int32 entries; grows to the largest step seen
ALIGN = 4                 # int32 entries: each array starts at a multiple of 16 bytes


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
        in order; they are views of one device tensor, each starting 16-byte aligned."""
        sizes = [int(a.size) for a in arrays]
        offsets = list(accumulate((-(-n // ALIGN) * ALIGN for n in sizes), initial=0))  # padded segment starts
        total = offsets[-1]
        if self.device.type != "cuda":
            packed = torch.empty(total, dtype=torch.int32)  # torch's CPU allocator aligns to 64 bytes
            _pack(packed.numpy(), arrays, offsets)
            return _segments(packed, offsets, sizes)
        turn, self._turn = self._turn, self._turn ^ 1
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()
        buf = self._buffers[turn]
        if buf is None or buf.numel() < total:
            buf = torch.empty(max(total, _MIN_CAPACITY, 0 if buf is None else 2 * buf.numel()), dtype=torch.int32,
                              pin_memory=True)
            self._buffers[turn] = buf
        _pack(buf.numpy(), arrays, offsets)
        # The caching allocator's blocks start 512-byte aligned, so each segment of the copy is 16-byte aligned.
        dev = buf[:total].to(self.device, non_blocking=True)   # [total] int32
        event = self._copied[turn] or torch.cuda.Event()
        event.record()
        self._copied[turn] = event
        return _segments(dev, offsets, sizes)


def _pack(out: np.ndarray, arrays: Sequence[np.ndarray], offsets: list[int]) -> None:
    for a, offset in zip(arrays, offsets):
        out[offset:offset + a.size] = a.reshape(-1)


def _segments(packed: torch.Tensor, offsets: list[int], sizes: list[int]) -> list[torch.Tensor]:
    return [packed[offset:offset + n] for offset, n in zip(offsets, sizes)]
