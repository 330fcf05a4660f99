"""RadixCache: a radix tree over token ids whose nodes hold the kv_locs of their tokens, so requests
that share a prompt prefix share its KV rows. Owned and called only by the router's Scheduler.

Row ownership: every kv_loc is owned by exactly one of the KVAllocator's free pool, one request
(rows it allocated and has not inserted yet), or this tree. Rows a request got from match_prefix
stay the tree's; the request borrows them and must keep the returned node locked while it uses them.

Namespaces: KV computed under one LoRA adapter is not the base model's KV of the same tokens, so each adapter id
has a root of its own (`namespace`, 0 for the base model); a match never crosses from one root into another.
"""
from __future__ import annotations

import heapq
import itertools

import numpy as np

from lightserve.router.kv_allocator import KVAllocator

_EMPTY = np.zeros(0, dtype=np.int32)


class RadixNode:
    """One run of tokens. key[i] is a token id and value[i] the kv_loc holding its K/V.
    The router treats a node as an opaque handle for lock/unlock."""

    __slots__ = ("key", "value", "parent", "children", "ref", "last_access", "in_heap")

    def __init__(self, key: np.ndarray, value: np.ndarray, parent: RadixNode | None) -> None:
        self.key = key                      # [n] int32 token ids
        self.value = value                  # [n] int32 kv_locs
        self.parent = parent                # None for the root and for evicted nodes
        self.children: dict[int, RadixNode] = {}   # keyed by the child's first token id
        self.ref = 0                        # locks held on this node or on any descendant
        self.last_access = 0                # RadixCache clock tick of the last match/insert through it
        self.in_heap = False                # has an entry in RadixCache._heap (at most one)


class RadixCache:
    """Prefix cache over token-granular KV rows (SGLang's radix cache on LightLLM's kv_locs).

    Typical use by the scheduler:
        locs, node = cache.match_prefix(ids); cache.lock(node)        # admit: borrow the prefix
        ...compute ids[len(locs):] into rows the request allocates...
        n = cache.insert(ids, all_locs)                                # finish: hand the rows over
        allocator.free(all_locs[len(locs):n]); cache.unlock(node)
    """

    def __init__(self, allocator: KVAllocator) -> None:
        self.allocator = allocator
        self.root = RadixNode(_EMPTY, _EMPTY, None)   # namespace 0's (the base model's)
        self._roots: dict[int, RadixNode] = {0: self.root}
        self._clock = 0
        # LRU candidates: (last_access when pushed, tie-break, node). Entries go stale when a node is
        # touched, gains a child or is locked; evict() re-checks each entry as it pops it.
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._tiebreak = itertools.count()
        self._total_size = 0
        self._evictable_size = 0

    # ---- sizes (O(1); read every step for metrics and admission) -----------------------------------
    @property
    def total_size(self) -> int:
        """Rows held by the tree."""
        return self._total_size

    @property
    def evictable_size(self) -> int:
        """Rows held by unlocked nodes: evict() can free all of them."""
        return self._evictable_size

    @property
    def protected_size(self) -> int:
        """Rows held by locked nodes (borrowed by running requests)."""
        return self._total_size - self._evictable_size

    @property
    def roots(self) -> list[RadixNode]:
        """The root of every namespace (the base model's first)."""
        return list(self._roots.values())

    # ---- lookups and updates -----------------------------------------------------------------------
    def match_prefix(self, token_ids: np.ndarray, namespace: int = 0) -> tuple[np.ndarray, RadixNode]:
        """Find the longest cached prefix of `token_ids`.

        Returns (kv_locs, node): a new int32 array of the prefix's rows (len = matched length) and
        the deepest node reached, which covers exactly the matched prefix (the root when nothing
        matched). Modifies: splits the node the match ends inside, and marks the path as used now
        (LRU). Locks nothing: the rows stay the tree's, and the caller must lock(node) before the
        next evict() if it will use them. `namespace`: the adapter id whose KV the match may use.
        """
        ids = np.asarray(token_ids, dtype=np.int32)
        ids_bytes = ids.tobytes()
        self._clock += 1
        node, pos, n = self._root(namespace), 0, len(ids)
        values = []
        while pos < n:
            child = node.children.get(int(ids[pos]))
            if child is None:
                break
            m = _match_len(child.key, ids, ids_bytes, pos)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = self._clock
            values.append(child.value)
            node, pos = child, pos + m
        return (np.concatenate(values) if values else _EMPTY.copy()), node

    def insert(self, token_ids: np.ndarray, kv_locs: np.ndarray, namespace: int = 0) -> int:
        """Hand the KV rows of a computed sequence to the tree: kv_locs[i] holds token_ids[i].

        Returns prefix_len, the length of the prefix of token_ids that was already in the tree.
        Ownership after the call:
        - kv_locs[prefix_len:] are now the tree's (it copies the arrays; the caller may reuse them);
        - for i < prefix_len the tree keeps its own row. Where the caller's kv_locs[i] differs from it,
          kv_locs[i] is a duplicate that is still the caller's, and the caller must free it.
        A caller that got kv_locs[:cached_len] from match_prefix and has kept that node locked since
        holds the tree's own rows there (locked rows are never evicted or replaced), so its
        duplicates are exactly kv_locs[cached_len:prefix_len] (prefix_len >= cached_len).
        Modifies: may split one node and add one leaf (unlocked, hence evictable); marks the path
        as used now (LRU). Locks nothing. `namespace`: the adapter id the rows were computed under.
        """
        ids = np.asarray(token_ids, dtype=np.int32)
        locs = np.asarray(kv_locs, dtype=np.int32)
        assert ids.shape == locs.shape and ids.ndim == 1, f"token_ids {ids.shape} vs kv_locs {locs.shape}"
        ids_bytes = ids.tobytes()
        self._clock += 1
        node, pos, n = self._root(namespace), 0, len(ids)
        while pos < n:
            first = int(ids[pos])
            child = node.children.get(first)
            if child is None:
                # Copy: the caller's arrays are often views of buffers it reuses (shm token_ids).
                leaf = RadixNode(ids[pos:].copy(), locs[pos:].copy(), node)
                leaf.last_access = self._clock
                node.children[first] = leaf
                self._total_size += n - pos
                self._evictable_size += n - pos
                self._push(leaf)
                break
            m = _match_len(child.key, ids, ids_bytes, pos)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = self._clock
            node, pos = child, pos + m
        return pos

    def lock(self, node: RadixNode) -> None:
        """Protect `node` and its ancestors from eviction (increments their ref). Locks nest: each
        lock needs one unlock. Locking a root is a no-op. Modifies evictable/protected sizes."""
        assert _is_root(node) or node.parent is not None, "lock of an evicted node"
        moved = 0
        while not _is_root(node):
            if node.ref == 0:
                moved += len(node.key)
            node.ref += 1
            node = node.parent
        self._evictable_size -= moved

    def unlock(self, node: RadixNode) -> None:
        """Undo one lock(node). Nodes whose ref drops to 0 become evictable again."""
        bottom, moved = node, 0
        while not _is_root(node):
            assert node.ref > 0, "unlock without a matching lock"
            node.ref -= 1
            if node.ref == 0:
                moved += len(node.key)
            node = node.parent
        self._evictable_size += moved
        if not _is_root(bottom) and bottom.ref == 0 and not bottom.children:
            self._push(bottom)

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` rows, or every evictable row if there are fewer, by removing
        unlocked leaves least recently used first (a parent left childless becomes a candidate).
        The rows go back to the allocator. Returns how many rows were freed (may exceed num_tokens
        by up to one node's length). Never touches locked nodes or the root."""
        freed: list[np.ndarray] = []
        num_freed = 0
        while num_freed < num_tokens and self._heap:
            pushed_at, _, node = heapq.heappop(self._heap)
            node.in_heap = False
            if node.parent is None or node.children or node.ref > 0:
                continue   # no longer a candidate; it is pushed again when it becomes one
            if pushed_at != node.last_access:
                self._push(node)   # touched since it was pushed: requeue at its true time
                continue
            parent = node.parent
            del parent.children[int(node.key[0])]
            node.parent = None
            freed.append(node.value)
            num_freed += len(node.value)
            if not _is_root(parent) and parent.ref == 0 and not parent.children:
                self._push(parent)
        if freed:
            self._total_size -= num_freed
            self._evictable_size -= num_freed
            self.allocator.free(np.concatenate(freed))
        return num_freed

    def reset(self) -> None:
        """Free every row the tree holds and empty it. Requires that no node is locked."""
        assert self.protected_size == 0, "reset while requests still borrow cached rows"
        freed, stack = [], [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            node.parent = None
            freed.append(node.value)
        if freed:
            self.allocator.free(np.concatenate(freed))
        self.root = RadixNode(_EMPTY, _EMPTY, None)
        self._roots = {0: self.root}
        self._heap.clear()
        self._total_size = self._evictable_size = 0

    # ---- private -------------------------------------------------------------------------------------
    def _root(self, namespace: int) -> RadixNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = RadixNode(_EMPTY, _EMPTY, None)
        return root

    def _split(self, child: RadixNode, m: int) -> RadixNode:
        """Cut `child` after its first m tokens; return the new node holding them. `child` keeps its
        identity (and its locks, heap entry and children) as the suffix, so handles stay valid."""
        head = RadixNode(child.key[:m].copy(), child.value[:m].copy(), child.parent)
        head.ref = child.ref            # every lock through child also passes through head
        head.last_access = child.last_access
        head.children[int(child.key[m])] = child
        child.parent.children[int(child.key[0])] = head
        child.key, child.value = child.key[m:].copy(), child.value[m:].copy()
        child.parent = head
        return head

    def _push(self, node: RadixNode) -> None:
        if not node.in_heap:
            node.in_heap = True
            heapq.heappush(self._heap, (node.last_access, next(self._tiebreak), node))


def _is_root(node: RadixNode) -> bool:
    """Roots are the only nodes with an empty key (every other node holds at least one token)."""
    return not node.key.size


def _match_len(key: np.ndarray, ids: np.ndarray, ids_bytes: bytes, pos: int) -> int:
    """Length of the common prefix of `key` and ids[pos:] (ids_bytes is ids.tobytes()).
    A full match, the case for every node but the last on a path, costs one memcmp of bytes; only
    the mismatching node pays for the vectorized search (argmax finds the first differing token)."""
    n = min(len(key), len(ids) - pos)
    if key[:n].tobytes() == ids_bytes[4 * pos: 4 * (pos + n)]:
        return n
    return int((key[:n] != ids[pos: pos + n]).argmax())
