"""TokenHistory's device mirror (forced on CPU here): a slot's row is uploaded once after a reset, later tokens
arrive only through append, and what the penalties read equals the shm rows step after step."""
from __future__ import annotations

import numpy as np
import torch

from lightserve.model_infer.token_history import TokenHistory

CPU = torch.device("cpu")


def test_mirror_uploads_once_then_appends():
    table = np.zeros((4, 16), np.int32)
    table[1, :3] = [5, 6, 7]                      # slot 1: a 3-token prompt
    table[3, :2] = [9, 8]                         # slot 3: a 2-token prompt
    mirror = TokenHistory(table, CPU, mirror=True)
    view = TokenHistory(table, CPU)               # the CPU path: a view of the table itself
    slots, lens = np.array([3, 1]), np.array([2, 3])
    assert mirror.gather(slots, lens).tolist() == view.gather(slots, lens).tolist() == [[9, 8, 0], [5, 6, 7]]
    for step in range(4):                          # rank 0 samples a token per slot and publishes it in shm
        pos = lens.copy()
        ids = torch.tensor([20 + step, 30 + step])
        mirror.append(slots, pos, ids)
        table[slots, pos] = ids.numpy()
        lens = lens + 1
        assert mirror.gather(slots, lens).tolist() == view.gather(slots, lens).tolist()
    # No second upload: a change in shm the mirror was not told about stays invisible ...
    table[1, 0] = 99
    assert mirror.gather(np.array([1]), np.array([3]))[0, 0] == 5
    # ... until the slot gets a new occupant, whose row is uploaded afresh.
    table[1, :2] = [40, 41]
    mirror.reset(np.array([1]))
    assert mirror.gather(np.array([1]), np.array([2])).tolist() == [[40, 41]]


def test_append_before_any_gather_is_a_no_op():
    table = np.zeros((2, 8), np.int32)
    mirror = TokenHistory(table, CPU, mirror=True)
    mirror.append(np.array([0]), np.array([0]), torch.tensor([4]))   # no penalty has asked yet: nothing held
    table[0, :2] = [4, 5]
    assert mirror.gather(np.array([0]), np.array([2])).tolist() == [[4, 5]]
