"""KVAllocator: free-pool accounting, refusal when short, no row handed out twice."""
from __future__ import annotations

import numpy as np
import pytest

from lightserve.router.kv_allocator import KVAllocator


def test_alloc_and_free_accounting():
    alloc = KVAllocator(10)
    assert (alloc.num_free, alloc.num_total) == (10, 10)
    a = alloc.alloc(3)
    assert a.dtype == np.int32 and a.tolist() == [0, 1, 2]
    b = alloc.alloc(7)
    assert alloc.num_free == 0
    assert sorted(np.concatenate([a, b]).tolist()) == list(range(10))
    alloc.free(a)
    assert alloc.num_free == 3
    assert sorted(alloc.alloc(3).tolist()) == [0, 1, 2]


def test_alloc_returns_none_when_short_and_takes_nothing():
    alloc = KVAllocator(4)
    assert alloc.alloc(3) is not None
    assert alloc.alloc(2) is None
    assert alloc.num_free == 1
    assert alloc.alloc(1) is not None
    assert alloc.alloc(0).shape == (0,)


def test_free_copies_the_callers_array():
    alloc = KVAllocator(4)
    locs = alloc.alloc(4)
    alloc.free(locs)
    locs[:] = -1   # the caller reuses its buffer; the pool must not see it
    assert sorted(alloc.alloc(4).tolist()) == [0, 1, 2, 3]


def test_no_duplicates_under_random_alloc_free():
    rng = np.random.default_rng(0)
    alloc = KVAllocator(256, check_double_free=True)
    held: list[np.ndarray] = []
    for _ in range(500):
        if held and rng.random() < 0.45:
            alloc.free(held.pop(int(rng.integers(len(held)))))
        else:
            locs = alloc.alloc(int(rng.integers(0, 40)))
            if locs is not None:
                held.append(locs)
        owned = np.concatenate(held) if held else np.zeros(0, np.int32)
        assert len(np.unique(owned)) == len(owned)
        assert alloc.num_free + len(owned) == alloc.num_total
    rest = alloc.alloc(alloc.num_free)
    assert sorted(np.concatenate([rest, *held]).tolist()) == list(range(256))


def test_double_free_is_caught():
    alloc = KVAllocator(8, check_double_free=True)
    locs = alloc.alloc(2)
    alloc.alloc(2)
    alloc.free(locs)
    with pytest.raises(AssertionError, match="double free"):
        alloc.free(locs[:1])
    with pytest.raises(AssertionError, match="double free"):
        KVAllocator(2).free(np.arange(3, dtype=np.int32))   # overflow is caught even without the flag
