"""LoraSlots: which LoRA adapter each of the workers' --max_loras weight slots holds, and the loads to send.

A running request holds its adapter's slot from admission until it finishes or is paused. A request whose adapter
is not resident waits until a slot is free or held by no running request; the least recently used such slot is
reloaded (LoadLora, sent to every rank before the plan that first names the slot). The workers run plans and loads
in the order they were sent, so a step already planned with a slot's old adapter still runs with it. When a request
arrives for an adapter no slot holds, the workers are told at once (PrefetchLora) to read it in the background: the
LoadLora later copies it from their CPU cache (a few ms) instead of stalling a step on the disk. Adapter id 0 is
the base model and needs no slot. Owned by the Scheduler; the router process sends `take_loads()`.
"""
from __future__ import annotations

from lightserve.log import get_logger
from lightserve.messages import LoadLora, PrefetchLora

logger = get_logger(__name__)

BASE = 0


class LoraSlots:
    def __init__(self, num_slots: int, paths: dict[int, str] | None = None) -> None:
        """`paths`: the adapters served from the start (--lora_modules), by id."""
        self.paths: dict[int, str] = dict(paths or {})   # lora_id -> PEFT folder, every adapter the front serves
        self.holder: list[int | None] = [None] * num_slots  # lora_id in each slot
        self.users = [0] * num_slots                       # running requests on each slot
        self._last_used = [0] * num_slots                  # clock tick of the slot's last acquire
        self._clock = 0
        self._loads: list[LoadLora | PrefetchLora] = []
        self._prefetched: set[int] = set()                 # prefetches sent whose adapter has not been loaded since
        self.num_loads = 0

    # ---- the front's adapter list ---------------------------------------------------------------
    def register(self, lora_id: int, path: str) -> None:
        self.paths[lora_id] = path

    def unregister(self, lora_id: int) -> None:
        """The front unloaded the adapter (it refuses while requests use it). Its slot, if any, is free now."""
        self.paths.pop(lora_id, None)
        self._prefetched.discard(lora_id)
        for slot, held in enumerate(self.holder):
            if held == lora_id and self.users[slot] == 0:
                self.holder[slot] = None

    def known(self, lora_id: int) -> bool:
        return lora_id == BASE or lora_id in self.paths

    # ---- requests -------------------------------------------------------------------------------
    def on_arrival(self, lora_id: int) -> None:
        """A request of `lora_id` arrived: unless a slot holds the adapter (or a read was asked for already), ask
        the workers to read it ahead."""
        if lora_id != BASE and lora_id not in self.holder and lora_id not in self._prefetched \
                and lora_id in self.paths:
            self._prefetched.add(lora_id)
            self._loads.append(PrefetchLora(lora_id, self.paths[lora_id]))

    def can_acquire(self, lora_id: int) -> bool:
        """Whether acquire(lora_id) would give a slot now."""
        return lora_id == BASE or lora_id in self.holder or self._victim() is not None

    def acquire(self, lora_id: int) -> int:
        """The slot a request of `lora_id` runs on (-1: the base model), queuing a load if the adapter is not
        resident. Call only where can_acquire says so."""
        if lora_id == BASE:
            return -1
        self._clock += 1
        if lora_id in self.holder:
            slot = self.holder.index(lora_id)
        else:
            slot = self._victim()
            assert slot is not None, "acquire without a free slot"
            self.holder[slot] = lora_id
            self._prefetched.discard(lora_id)
            self._loads.append(LoadLora(lora_id, self.paths[lora_id], slot))
            self.num_loads += 1
        self.users[slot] += 1
        self._last_used[slot] = self._clock
        return slot

    def release(self, slot: int) -> None:
        """A request that held `slot` stopped running (finished, aborted or paused)."""
        if slot < 0:
            return
        assert self.users[slot] > 0, f"release of slot {slot} without a user"
        self.users[slot] -= 1
        if self.users[slot] == 0 and self.holder[slot] not in self.paths:
            self.holder[slot] = None  # unloaded while it ran

    def take_loads(self) -> list[LoadLora | PrefetchLora]:
        """The prefetches and loads queued since the last call, in order, to send before the next plan (the router
        sends prefetches alone when no plan follows)."""
        loads, self._loads = self._loads, []
        return loads

    def _victim(self) -> int | None:
        """A slot to load into: an empty one, else the least recently used one no running request holds."""
        if None in self.holder:
            return self.holder.index(None)
        idle = [s for s, n in enumerate(self.users) if n == 0]
        return min(idle, key=self._last_used.__getitem__) if idle else None
