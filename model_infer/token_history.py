"""TokenHistory: each request slot's tokens (prompt, then outputs) where the penalties read them.
Owned by rank 0's OutputWriter; process_logits reads it.

The shm pool's token_ids [num_slots, L] int32 is the source of truth. On CPU the history is a
zero-copy view of it. On a GPU it is a device mirror, allocated the first time a penalty asks for
it: a slot's row is uploaded once after the slot gets a new occupant, and every later step appends
the sampled ids on the device (they are there already), so no step copies a whole history.
"""
from __future__ import annotations

import numpy as np
import torch


class TokenHistory:
    def __init__(self, token_ids: np.ndarray, device: torch.device, mirror: bool | None = None):
        """token_ids: the pool's [num_slots, L] int32 array. mirror: keep a device copy (default: on
        any device but the CPU; tests force it to exercise the GPU path)."""
        self.token_ids = token_ids
        self.device = device
        self.mirror = device.type != "cpu" if mirror is None else mirror
        # [num_slots, L] int32: a view of shm, or the mirror (None until first asked for).
        self._tokens: torch.Tensor | None = None if self.mirror else torch.from_numpy(token_ids)
        self._synced = np.zeros(token_ids.shape[0], bool)   # mirror rows that hold the slot's tokens

    def reset(self, slots: np.ndarray) -> None:
        """The slots got new occupants: their mirror rows are stale until the next gather uploads them."""
        self._synced[slots] = False

    def gather(self, slots: np.ndarray, lens: np.ndarray) -> torch.Tensor:
        """[R, max(lens)] int64 on the device: slot slots[r]'s tokens, valid below lens[r] (prompt + outputs
        published so far). Uploads only the rows of slots not seen since their reset."""
        width = int(lens.max())
        if self.mirror:
            if self._tokens is None:
                self._tokens = torch.zeros(self.token_ids.shape, dtype=torch.int32, device=self.device)
            stale = np.unique(slots[~self._synced[slots]])
            if stale.size:
                # Every token published so far; later outputs arrive through append. Columns past a row's own
                # length hold stale values that appends overwrite before they become valid.
                rows = torch.from_numpy(np.ascontiguousarray(self.token_ids[stale, :width]))   # [U, W] host copy
                index = torch.from_numpy(stale.astype(np.int64)).to(self.device, non_blocking=True)
                self._tokens[index, :width] = rows.to(self.device, non_blocking=True)
                self._synced[stale] = True
        index = torch.from_numpy(np.ascontiguousarray(slots, np.int64)).to(self.device, non_blocking=True)
        return self._tokens.index_select(0, index)[:, :width].long()

    def append(self, slots: np.ndarray, positions: np.ndarray, ids: torch.Tensor) -> None:
        """ids [S] (on the device) are the tokens just sampled for slots [S] at positions [S]. A no-op for a
        shm view (rank 0 writes shm itself) and before any penalty asked for the mirror."""
        if self._tokens is None or not self.mirror:
            return
        synced = self._synced[slots]
        if not synced.any():
            return
        sel = torch.from_numpy(np.flatnonzero(synced)).to(self.device, non_blocking=True)
        rows = torch.from_numpy(slots[synced].astype(np.int64)).to(self.device, non_blocking=True)
        cols = torch.from_numpy(positions[synced].astype(np.int64)).to(self.device, non_blocking=True)
        self._tokens[rows, cols] = ids.index_select(0, sel).to(torch.int32)
