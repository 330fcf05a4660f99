"""RadixCache: prefix matching, splits, insert ownership, locking, LRU eviction and size accounting,
plus a hypothesis model check of random request workloads against a dict of cached prefixes."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lightserve.router.kv_allocator import KVAllocator
from lightserve.router.radix_cache import RadixCache, RadixNode


def ids(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


def make(num_rows: int = 64) -> tuple[KVAllocator, RadixCache]:
    allocator = KVAllocator(num_rows, check_double_free=True)
    return allocator, RadixCache(allocator)


def put(allocator: KVAllocator, cache: RadixCache, tokens: np.ndarray) -> np.ndarray:
    """Insert `tokens` the way a request without a prefix hit would; return the tree's rows."""
    locs = allocator.alloc(len(tokens))
    present = cache.insert(tokens, locs)
    allocator.free(locs[:present])
    return cache.match_prefix(tokens)[0]


def tree_rows(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Every cached prefix -> the row of its last token; checks the tree's structure on the way."""
    rows: dict[tuple[int, ...], int] = {}
    stack: list[tuple[RadixNode, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        assert node.ref >= sum(c.ref for c in node.children.values()) or node is cache.root
        if node is not cache.root and node.ref == 0 and not node.children:
            assert node.in_heap, "an evictable leaf is missing from the LRU heap"
        for first, child in node.children.items():
            assert child.parent is node and len(child.key) == len(child.value) > 0
            assert int(child.key[0]) == first
            assert child.last_access <= node.last_access or node is cache.root
            key = child.key.tolist()
            for i, row in enumerate(child.value.tolist()):
                rows[prefix + tuple(key[: i + 1])] = row
            stack.append((child, prefix + tuple(key)))
    return rows


def free_rows(allocator: KVAllocator) -> np.ndarray:
    rows = allocator.alloc(allocator.num_free)
    allocator.free(rows)
    return rows


# ---- examples ----------------------------------------------------------------------------------------
def test_empty_match_returns_root():
    _, cache = make()
    locs, node = cache.match_prefix(ids(1, 2))
    assert len(locs) == 0 and locs.dtype == np.int32 and node is cache.root
    locs, node = cache.match_prefix(ids())
    assert len(locs) == 0 and node is cache.root
    cache.lock(node)
    cache.unlock(node)   # the root: no-op


def test_insert_then_match_returns_the_rows():
    allocator, cache = make()
    locs = allocator.alloc(4)
    assert cache.insert(ids(1, 2, 3, 4), locs) == 0
    got, node = cache.match_prefix(ids(1, 2, 3, 4, 5))
    assert got.tolist() == locs.tolist()
    assert node.key.tolist() == [1, 2, 3, 4]
    assert (cache.total_size, cache.evictable_size, cache.protected_size) == (4, 4, 0)
    assert allocator.num_free == 60


def test_match_ending_inside_a_node_splits_it():
    allocator, cache = make()
    rows = put(allocator, cache, ids(1, 2, 3, 4))
    got, node = cache.match_prefix(ids(1, 2, 9))
    assert got.tolist() == rows[:2].tolist()
    assert node.key.tolist() == [1, 2] and node.parent is cache.root
    assert [c.key.tolist() for c in node.children.values()] == [[3, 4]]
    got, node = cache.match_prefix(ids(1))    # ends inside [1, 2]: splits again, at the input's end
    assert got.tolist() == rows[:1].tolist() and node.key.tolist() == [1]
    assert cache.total_size == 4 and tree_rows(cache) == {(1,): rows[0], (1, 2): rows[1],
                                                          (1, 2, 3): rows[2], (1, 2, 3, 4): rows[3]}


def test_insert_extending_an_existing_sequence():
    allocator, cache = make()
    rows = put(allocator, cache, ids(1, 2, 3))
    locs, node = cache.match_prefix(ids(1, 2, 3, 4, 5))
    cache.lock(node)
    own = allocator.alloc(2)
    full = np.concatenate([locs, own])
    assert cache.insert(ids(1, 2, 3, 4, 5), full) == 3   # nothing to free: [0, 3) were the tree's
    cache.unlock(node)
    assert cache.match_prefix(ids(1, 2, 3, 4, 5))[0].tolist() == rows.tolist() + own.tolist()
    assert cache.total_size == 5 and allocator.num_free == 59


def test_insert_of_a_sibling_branch_shares_the_common_prefix():
    allocator, cache = make()
    a = put(allocator, cache, ids(1, 2, 3, 4))
    b_locs = allocator.alloc(4)
    assert cache.insert(ids(1, 2, 7, 8), b_locs) == 2
    allocator.free(b_locs[:2])                  # duplicates of the tree's rows for (1, 2)
    assert cache.match_prefix(ids(1, 2, 7, 8))[0].tolist() == a[:2].tolist() + b_locs[2:].tolist()
    assert cache.match_prefix(ids(1, 2, 3, 4))[0].tolist() == a.tolist()
    assert cache.total_size == 6 and allocator.num_free == 58


def test_duplicate_insert_returns_full_length_and_keeps_the_trees_rows():
    allocator, cache = make()
    rows = put(allocator, cache, ids(5, 6, 7))
    again = allocator.alloc(3)
    assert cache.insert(ids(5, 6, 7), again) == 3
    assert cache.insert(ids(5, 6), again[:2]) == 2       # a prefix of a cached run, too
    allocator.free(again)
    assert cache.match_prefix(ids(5, 6, 7))[0].tolist() == rows.tolist()
    assert cache.total_size == 3 and allocator.num_free == 61
    assert cache.insert(ids(), np.zeros(0, np.int32)) == 0


def test_lock_prevents_eviction_and_unlock_allows_it():
    allocator, cache = make()
    put(allocator, cache, ids(1, 2, 3))
    put(allocator, cache, ids(1, 2, 4))
    _, node = cache.match_prefix(ids(1, 2, 3))
    cache.lock(node)
    cache.lock(node)                            # locks nest
    assert (cache.evictable_size, cache.protected_size) == (1, 3)   # (1, 2, 4)'s leaf only
    assert cache.evict(100) == 1
    assert cache.evict(100) == 0 and cache.total_size == 3
    cache.unlock(node)
    assert cache.evict(100) == 0
    cache.unlock(node)
    assert (cache.evictable_size, cache.protected_size) == (3, 0)
    assert cache.evict(100) == 3 and cache.total_size == 0 and allocator.num_free == 64


def test_locking_an_ancestor_path_protects_only_the_path():
    allocator, cache = make()
    put(allocator, cache, ids(1, 2, 3, 4))
    _, node = cache.match_prefix(ids(1, 2))     # split: lock covers [1, 2], not [3, 4]
    cache.lock(node)
    assert (cache.evictable_size, cache.protected_size) == (2, 2)
    assert cache.evict(10) == 2
    assert cache.match_prefix(ids(1, 2, 3, 4))[0].size == 2
    cache.unlock(node)
    assert cache.evict(10) == 2 and cache.total_size == 0


def test_eviction_is_least_recently_used_first():
    allocator, cache = make()
    put(allocator, cache, ids(1, 1))
    put(allocator, cache, ids(2, 2))
    put(allocator, cache, ids(3, 3))
    cache.match_prefix(ids(1, 1))               # 1 is now the most recent, 2 the oldest
    assert cache.evict(1) == 2
    assert cache.match_prefix(ids(2, 2))[0].size == 0
    assert cache.evict(1) == 2                  # then 3
    assert cache.match_prefix(ids(3, 3))[0].size == 0
    assert cache.match_prefix(ids(1, 1))[0].size == 2


def test_a_childless_parent_becomes_a_candidate():
    allocator, cache = make()
    put(allocator, cache, ids(1, 2, 3))
    put(allocator, cache, ids(1, 2, 4))         # tree: [1, 2] -> {[3], [4]}
    put(allocator, cache, ids(9))
    cache.match_prefix(ids(9))                  # [9] is the most recent
    assert cache.evict(3) == 4                  # [3], [4], then their parent [1, 2] (older than [9])
    assert cache.match_prefix(ids(9))[0].size == 1 and cache.total_size == 1


def test_evict_frees_exactly_the_rows_and_sizes_stay_consistent():
    allocator, cache = make(32)
    a = put(allocator, cache, ids(1, 2, 3, 4, 5))
    b = put(allocator, cache, ids(1, 2, 3, 7, 8, 9))
    assert allocator.num_free == 32 - 8
    assert cache.evict(2) == 2                  # the LRU leaf: [4, 5]
    assert sorted(free_rows(allocator).tolist()) == sorted(set(range(32)) - set(b.tolist()))
    assert (cache.total_size, cache.evictable_size, cache.protected_size) == (6, 6, 0)
    assert set(a[3:].tolist()) <= set(free_rows(allocator).tolist())


def test_reset_frees_everything():
    allocator, cache = make()
    put(allocator, cache, ids(1, 2, 3))
    put(allocator, cache, ids(1, 5))
    cache.reset()
    assert cache.total_size == 0 and allocator.num_free == 64
    assert cache.match_prefix(ids(1, 2, 3))[0].size == 0


# ---- model check ---------------------------------------------------------------------------------------
NUM_ROWS = 40
seqs = st.lists(st.integers(0, 2), min_size=1, max_size=8)
ops = st.lists(st.one_of(
    st.tuples(st.just("start"), seqs),          # match + lock + allocate the rest (a request arrives)
    st.tuples(st.just("finish"), st.integers(0, 7)),   # insert + free duplicates + unlock
    st.tuples(st.just("abort"), st.integers(0, 7)),    # free own rows + unlock, no insert
    st.tuples(st.just("match"), seqs),          # a lookup that is not followed by a lock
    st.tuples(st.just("evict"), st.integers(0, 12)),
), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_random_workload_matches_a_reference_model(ops):
    allocator, cache = make(NUM_ROWS)
    model: dict[tuple[int, ...], int] = {}      # every cached prefix -> row of its last token
    touched: dict[tuple[int, ...], int] = {}    # every cached prefix -> time of its last use
    reqs: list[tuple[np.ndarray, RadixNode, np.ndarray, np.ndarray]] = []   # tokens, node, prefix rows, own rows

    def model_match(tokens: list[int]) -> list[int]:
        k = 0
        while k < len(tokens) and tuple(tokens[: k + 1]) in model:
            k += 1
        return [model[tuple(tokens[: i + 1])] for i in range(k)]

    def locked_prefixes() -> set[tuple[int, ...]]:
        return {tuple(t[:i + 1].tolist()) for t, _, p, _ in reqs for i in range(len(p))}

    def evict(num_tokens: int) -> None:
        nonlocal model
        before, locked = dict(model), locked_prefixes()
        evictable = cache.evictable_size
        freed = cache.evict(num_tokens)
        model = tree_rows(cache)
        removed = set(before) - set(model)
        assert set(model) <= set(before) and all(model[k] == before[k] for k in model)
        assert not (removed & locked), "a locked prefix was evicted"
        assert freed == len(removed) and freed >= min(num_tokens, evictable)
        # LRU: nothing evicted was used more recently than any unlocked leaf that survived.
        leaves = {k for k in model if k not in locked and not any(k + (t,) in model for t in range(3))}
        if removed and leaves:
            assert max(touched[k] for k in removed) <= min(touched[k] for k in leaves)
        for k in removed:
            del touched[k]

    for clock, (op, arg) in enumerate(ops, start=1):
        if op in ("start", "match"):
            tokens = np.array(arg, dtype=np.int32)
            expect = model_match(arg)
            locs, node = cache.match_prefix(tokens)
            assert locs.tolist() == expect
            for i in range(len(expect)):
                touched[tuple(arg[: i + 1])] = clock
            if op == "start":
                cache.lock(node)
                need = len(arg) - len(locs)
                if allocator.num_free < need:
                    evict(need - allocator.num_free)
                own = allocator.alloc(need)
                if own is None:
                    cache.unlock(node)
                else:
                    reqs.append((tokens, node, locs, own))
        elif op in ("finish", "abort") and reqs:
            tokens, node, prefix, own = reqs.pop(arg % len(reqs))
            if op == "finish":
                full = np.concatenate([prefix, own])
                present = cache.insert(tokens, full)
                tree = [model.get(tuple(tokens[: i + 1].tolist())) for i in range(present)]
                expect_present = len(model_match(tokens.tolist()))
                assert present == expect_present
                # General contract and the locked-prefix shortcut name the same duplicates.
                dup = [r for r, t in zip(full[:present].tolist(), tree) if r != t]
                assert dup == full[len(prefix): present].tolist()
                allocator.free(full[len(prefix): present])
                for i in range(len(tokens)):
                    key = tuple(tokens[: i + 1].tolist())
                    model.setdefault(key, int(full[i]))
                    touched[key] = clock
            else:
                allocator.free(own)
            cache.unlock(node)
        elif op == "evict":
            evict(arg)

        # Invariants after every operation.
        assert tree_rows(cache) == model
        protected = len(locked_prefixes())
        assert (cache.total_size, cache.protected_size, cache.evictable_size) == (
            len(model), protected, len(model) - protected)
        own_rows = [r for *_, own in reqs for r in own.tolist()]
        everything = free_rows(allocator).tolist() + list(model.values()) + own_rows
        assert sorted(everything) == list(range(NUM_ROWS)), "a row was lost or is owned twice"

    for _, node, _, own in reqs:
        allocator.free(own)
        cache.unlock(node)
    cache.reset()
    assert allocator.num_free == NUM_ROWS
