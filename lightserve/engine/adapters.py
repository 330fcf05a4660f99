"""Adapters: the LoRA adapters a server serves, by name, as the HTTP front and the pipeline see them.

Each adapter gets an id (1, 2, ... in --lora_modules order, then each runtime load a new one, never reused, so KV
the radix cache keeps under an unloaded adapter can never match a later one of the same name) that requests carry
in their params (SamplingParams.lora_id) and the router maps to a weight slot (router/lora_slots.py). Owned by the
EngineClient, which tells the router of every change (LoraAdded, LoraRemoved) before any request names it.
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

from lightserve.lora_adapter import LoraAdapter


@dataclass(frozen=True)
class AdapterEntry:
    name: str
    lora_id: int
    adapter: LoraAdapter


class AdapterError(ValueError):
    """A load or unload the server refuses; `status` is the HTTP status it answers with, `param` the request field
    at fault (vLLM's lora_name / lora_path)."""

    def __init__(self, message: str, status: int = 400, param: str = "lora_name"):
        super().__init__(message)
        self.status, self.param = status, param


class Adapters:
    def __init__(self) -> None:
        self._by_name: dict[str, AdapterEntry] = {}
        self._ids = itertools.count(1)
        self.in_flight: Counter[int] = Counter()  # requests running per adapter id (EngineClient.generate)

    def add(self, name: str, adapter: LoraAdapter) -> AdapterEntry:
        """Serve `adapter` as `name` (already read and checked against the base model)."""
        if name in self._by_name:
            raise AdapterError(f"The LoRA adapter {name!r} has already been loaded.")
        entry = AdapterEntry(name, next(self._ids), adapter)
        self._by_name[name] = entry
        return entry

    def remove(self, name: str) -> AdapterEntry:
        entry = self._by_name.get(name)
        if entry is None:
            raise AdapterError(f"The LoRA adapter {name!r} is not loaded.", 404)
        if self.in_flight[entry.lora_id]:
            raise AdapterError(f"The LoRA adapter {name!r} is in use by {self.in_flight[entry.lora_id]} running "
                               "request(s); unload it once they finish.", 409)
        del self._by_name[name]
        self.in_flight.pop(entry.lora_id, None)
        return entry

    def get(self, name: str) -> AdapterEntry | None:
        return self._by_name.get(name)

    def __iter__(self):
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)
