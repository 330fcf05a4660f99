"""What tests read of a request pool and of /dev/shm that the server itself never asks."""
from __future__ import annotations

from lightserve.shm.req_pool import Owner, ReqPool
from lightserve.shm.segment import SHM_DIR


def is_released(pool: ReqPool, owner: Owner, shm_index: int) -> bool:
    """Whether `owner` has released the slot's current request (its released_gen caught up with slot_gen)."""
    return bool(pool.released_gen[owner, shm_index] == pool.slot_gen[shm_index])


def list_segments(prefix: str) -> list[str]:
    """The shared-memory segments in /dev/shm whose names start with `prefix`."""
    return sorted(p.name for p in SHM_DIR.glob(f"{prefix}*"))
