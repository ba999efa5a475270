"""The radix-tree prefix cache (seed: "radix tree cache").

Each node holds one segment of token ids and the KV slots of those tokens; a
path from a root spells a cached prefix. Nodes are split where a match or an
insert diverges (or stops) inside a segment, so every prefix a caller gets back
ends exactly at a node, and locking that node protects exactly that prefix.

One root per namespace (`PrefixCache`): a namespace's tree is a tree of its
own, so two namespaces cannot share a node; eviction picks least recently used
leaves across all of them.

Over a window pool (`KVPool.window` W set: sliding-window layers keep their KV
in a second slot space, see swa_memory_pool.py) a cached token may have lost
its window-layer KV while keeping the full layers'. Then:
- a match stops at the longest prefix whose last W - 1 tokens still have it
  (what the next query of the request reads), however far the tokens match;
- `lock(node)` also window-locks the nodes holding the last W - 1 tokens of
  the node's prefix: window KV of window-locked nodes is never freed;
- eviction frees window KV too: when the window space is short it drops it
  from the least recently used window-unlocked nodes (an unlocked leaf goes
  whole, the others keep their full KV: a later match can still end after
  them where window KV remains);
- an insert over tokens whose window KV is gone takes the window KV of the
  duplicate slots the caller brings (the same tokens' KV, computed again).
Window locks are recorded per lock as the first position they cover, made a
node boundary when taken (by a split); since splits only add boundaries, the
nodes a lock covers stay exactly those inside [that position, the node's end).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence

import torch

from radixlm.cache.base import MatchResult, PrefixCache
from radixlm.cache.memory_pool import KVPool


def _empty_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


def _common_prefix_len(segment: tuple[int, ...], key: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of `segment` and `key[start:]`."""
    n = min(len(segment), len(key) - start)
    # Whole-segment hits are the common case; one slice compare runs in C.
    if segment[:n] == key[start:start + n]:
        return n
    i = 0
    while segment[i] == key[start + i]:
        i += 1
    return i


class TreeNode:
    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access_time",
                 "window_lock_ref", "window_count")

    def __init__(self, key: tuple[int, ...], value: torch.Tensor, parent: TreeNode | None,
                 last_access_time: int) -> None:
        self.key = key
        self.value = value  # int64 CPU KV slots, one per token of `key`
        self.children: dict[int, TreeNode] = {}  # keyed by the child's first token
        self.parent = parent  # None for roots and for evicted (detached) nodes
        self.lock_ref = 0
        self.last_access_time = last_access_time
        # Window pools only: locks that need this node's window KV, and how many of
        # its tokens still have window KV.
        self.window_lock_ref = 0
        self.window_count = 0

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return f"TreeNode(key={list(self.key)}, lock_ref={self.lock_ref})"


class RadixCache(PrefixCache):
    """Radix tree over token ids with LRU eviction of unlocked leaves.

    Beyond the `PrefixCache` contract: `all_slots()` lists every slot the tree
    holds (for the pool accounting invariant) and `check_invariants()` asserts
    the tree's structure and counters.
    """

    def __init__(self, kv_pool: KVPool) -> None:
        self.kv_pool = kv_pool
        self.window = kv_pool.window  # None: a plain pool, none of the window logic runs
        self.reset()

    def reset(self) -> None:
        # A counter, not wall time: deterministic LRU order and no clock ties.
        self._clock = itertools.count()
        self.roots: dict[int, TreeNode] = {}
        self.root = self._root(0)  # plain text, the namespace most requests use
        self._evictable = 0
        self._protected = 0
        self._leaves: set[TreeNode] = set()  # every non-root node without children
        # Window pools: window-KV tokens of window-unlocked / window-locked nodes, and
        # each locked handle's window-lock starts (see the module docstring).
        self._window_evictable = 0
        self._window_protected = 0
        self._window_locks: dict[TreeNode, list[int]] = {}

    def _root(self, namespace: int) -> TreeNode:
        root = self.roots.get(namespace)
        if root is None:
            # Roots stay once made (an empty node each): namespaces are few.
            root = self.roots[namespace] = TreeNode((), _empty_slots(), None, next(self._clock))
        return root

    @staticmethod
    def _is_root(node: TreeNode) -> bool:
        return len(node.key) == 0  # every other node holds at least one token

    # -- lookup and insertion ------------------------------------------------

    def match_prefix(self, key: Sequence[int], namespace: int = 0) -> MatchResult:
        key = tuple(key)
        node, _, pieces = self._walk(key, namespace)
        indices = torch.cat(pieces) if pieces else _empty_slots()
        if self.window is not None:
            usable = self._window_usable_len(indices)
            if usable < len(indices):
                node, _, pieces = self._walk(key[:usable], namespace)
                indices = indices[:usable]
        return MatchResult(indices=indices, node=node)

    def _window_usable_len(self, indices: torch.Tensor) -> int:
        """Longest n <= len(indices) whose last W - 1 slots all have window KV."""
        assert self.window is not None
        need = self.window - 1
        missing = (~self.kv_pool.has_window(indices)).nonzero().flatten()
        if not len(missing) or len(indices) - int(missing[-1]) > need:
            return len(indices)
        # Ending at a missing token is fine if the W - 1 before it are all there.
        ok = torch.ones(len(missing), dtype=torch.bool)
        ok[1:] = missing[1:] - missing[:-1] > need
        return int(missing[ok][-1])

    def insert(self, key: Sequence[int], value: torch.Tensor, namespace: int = 0) -> int:
        key = tuple(key)
        if len(value) != len(key):
            raise ValueError(f"value has {len(value)} slots for a key of {len(key)} tokens")
        node, matched, _ = self._walk(key, namespace)
        if self.window is not None and matched:
            self._adopt_window(node, value[:matched])
        if matched < len(key):
            self._add_leaf(node, key[matched:], value[matched:])
        return matched

    def _adopt_window(self, node: TreeNode, value: torch.Tensor) -> None:
        """The path ending at `node` holds value's tokens: where a path slot lost its
        window KV and value's slot still has it, the path slot takes it over."""
        end = len(value)
        while not self._is_root(node):
            start = end - len(node)
            moved = self.kv_pool.adopt_window(node.value, value[start:end])
            if moved:
                self._window_count_add(node, moved)
            node, end = node.parent, start

    def _walk(self, key: tuple[int, ...],
              namespace: int) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow `key` down the namespace's tree, splitting the last node if the key
        stops or diverges inside it. Returns the deepest matched node, the matched
        length and the matched nodes' slots, in order."""
        now = next(self._clock)
        node, pos, pieces = self._root(namespace), 0, []
        node.last_access_time = now
        while pos < len(key) and (child := node.children.get(key[pos])) is not None:
            n = _common_prefix_len(child.key, key, pos)
            if n < len(child):
                child = self._split(child, n)
            child.last_access_time = now
            pieces.append(child.value)
            node, pos = child, pos + n
        return node, pos, pieces

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut `node` after its first n tokens; return the new upper part.

        The original object keeps the lower part, so a handle a caller holds
        still ends where it did and still covers its whole prefix. Every lock
        through `node` also passes through its new parent: same lock_ref, and
        the evictable/protected counters do not change.
        """
        parent = node.parent
        assert parent is not None and 0 < n < len(node)
        upper = TreeNode(node.key[:n], node.value[:n], parent, node.last_access_time)
        upper.lock_ref = node.lock_ref
        upper.children = {node.key[n]: node}
        parent.children[upper.key[0]] = upper
        node.key, node.value, node.parent = node.key[n:], node.value[n:], upper
        if self.window is not None:
            # Every window lock covering `node` starts at or before its first token,
            # so it covers the upper part too; the counters' sums do not change.
            upper.window_lock_ref = node.window_lock_ref
            upper.window_count = int(self.kv_pool.has_window(upper.value).sum())
            node.window_count -= upper.window_count
        return upper

    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], value: torch.Tensor) -> None:
        # A private copy: the caller's tensor (often a row view) may be reused.
        slots = value.to(device="cpu", dtype=torch.int64, copy=True)
        leaf = TreeNode(key, slots, parent, parent.last_access_time)
        parent.children[key[0]] = leaf
        self._leaves.discard(parent)
        self._leaves.add(leaf)
        self._evictable += len(leaf)
        if self.window is not None:
            self._window_count_add(leaf, int(self.kv_pool.has_window(slots).sum()))

    # -- locking -------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        path = self._path_to_root(node)
        for n in path:
            if n.lock_ref == 0:
                self._evictable -= len(n)
                self._protected += len(n)
            n.lock_ref += 1
        if self.window is not None:
            self._window_lock(node, path)

    def unlock(self, node: TreeNode) -> None:
        path = self._path_to_root(node)
        assert all(n.lock_ref > 0 for n in path), f"unlock of an unlocked node {node!r}"
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._evictable += len(n)
                self._protected -= len(n)
        if self.window is not None:
            self._window_unlock(node, path)

    # -- window locks (window pools) -------------------------------------------

    def _window_lock(self, node: TreeNode, path: list[TreeNode]) -> None:
        """Window-lock the last W - 1 tokens of node's prefix (the keys the next query
        of a request that continues it reads), splitting the node where they start
        so that the tokens before stay evictable."""
        assert self.window is not None
        end = sum(len(n) for n in path)
        first_needed = max(0, end - (self.window - 1))
        start = end
        for n in path:  # node first, then up
            if start <= first_needed:
                break
            if start - len(n) < first_needed:
                self._split(n, first_needed - (start - len(n)))
            start -= len(n)
            self._window_lock_add(n, 1)
        self._window_locks.setdefault(node, []).append(start)

    def _window_unlock(self, node: TreeNode, path: list[TreeNode]) -> None:
        starts = self._window_locks.get(node)
        assert starts, f"window unlock of {node!r} without its lock"
        start = starts.pop()
        if not starts:
            del self._window_locks[node]
        end = sum(len(n) for n in path)
        for n in path:
            if end <= start:
                break
            end -= len(n)
            self._window_lock_add(n, -1)

    def _window_lock_add(self, node: TreeNode, delta: int) -> None:
        before = node.window_lock_ref
        node.window_lock_ref += delta
        assert node.window_lock_ref >= 0, f"window lock count below 0 on {node!r}"
        if (before == 0) != (node.window_lock_ref == 0):
            sign = 1 if before == 0 else -1
            self._window_protected += sign * node.window_count
            self._window_evictable -= sign * node.window_count

    def _window_count_add(self, node: TreeNode, delta: int) -> None:
        node.window_count += delta
        if node.window_lock_ref:
            self._window_protected += delta
        else:
            self._window_evictable += delta

    inc_lock_ref = lock
    dec_lock_ref = unlock

    def _path_to_root(self, node: TreeNode) -> list[TreeNode]:
        """`node` and its ancestors, its root excluded (roots are never evictable).
        Built in full before any lock count changes, so a stale handle fails
        without touching the counters."""
        path = []
        while not self._is_root(node):
            assert node.parent is not None, f"{node!r} is not in this tree (evicted or reset)"
            path.append(node)
            node = node.parent
        assert any(node is root for root in self.roots.values()), \
            "a handle from before a reset is not in this tree"
        return path

    # -- eviction ------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        if self.window is None:
            return self._evict_leaves(num_tokens)
        # Both slot spaces must gain: full slots from whole leaves (their window
        # slots come along), then window slots from window-unlocked nodes.
        before = self.kv_pool.available_size()
        target = before + num_tokens
        self._evict_leaves(target - self.kv_pool.full_available_size())
        self._evict_window(target - self.kv_pool.window_available_size())
        return self.kv_pool.available_size() - before

    def _evict_window(self, num_slots: int) -> None:
        """Free >= num_slots window slots (if that many are window-evictable), least
        recently used nodes first; an unlocked leaf is evicted whole."""
        if num_slots <= 0:
            return
        order = itertools.count()
        heap = [(n.last_access_time, next(order), n) for n in self._nodes()
                if n.window_lock_ref == 0 and n.window_count > 0]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_slots and heap:
            _, _, n = heapq.heappop(heap)
            whole = not n.children and n.lock_ref == 0
            if n.parent is None or not (n.window_count or whole):  # gone meanwhile
                continue
            num_freed += n.window_count
            if whole:
                parent = self._detach_leaf(n)
                freed.append(n.value)
                if (not self._is_root(parent) and not parent.children
                        and parent.lock_ref == 0 and parent.window_count == 0):
                    # A leaf now, of no use without window KV at its end: goes too.
                    heapq.heappush(heap, (parent.last_access_time, next(order), parent))
            else:
                self.kv_pool.free_window(n.value)
                self._window_count_add(n, -n.window_count)
        if freed:
            self.kv_pool.free(torch.cat(freed))

    def _evict_leaves(self, num_tokens: int) -> int:
        order = itertools.count()  # tie-break: TreeNode is not orderable
        heap = [(leaf.last_access_time, next(order), leaf)
                for leaf in self._leaves if leaf.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = self._detach_leaf(leaf)
            freed.append(leaf.value)
            num_freed += len(leaf)
            if not self._is_root(parent) and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_time, next(order), parent))
        if freed:
            # One free call: the pool concatenates its free list on every call.
            self.kv_pool.free(torch.cat(freed))
        return num_freed

    def _detach_leaf(self, leaf: TreeNode) -> TreeNode:
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0
        del parent.children[leaf.key[0]]
        leaf.parent = None  # later lock() of this stale handle fails loudly
        self._leaves.discard(leaf)
        if not parent.children and not self._is_root(parent):
            self._leaves.add(parent)
        self._evictable -= len(leaf)
        self._window_evictable -= leaf.window_count  # unlocked: window-unlocked too
        return parent

    # -- sizes and introspection ---------------------------------------------

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def obtainable_size(self, kv_pool: KVPool) -> int:
        if self.window is None:
            return super().obtainable_size(kv_pool)
        full = kv_pool.full_available_size() + self._evictable
        return min(full, kv_pool.window_available_size() + self._window_evictable)

    def window_sizes(self) -> tuple[int, int]:
        """(window-evictable, window-protected) window slots the tree holds."""
        return self._window_evictable, self._window_protected

    def _nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, parents before children; iterative for deep trees."""
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_slots(self) -> torch.Tensor:
        values = [node.value for node in self._nodes()]
        return torch.cat(values) if values else _empty_slots()

    def check_invariants(self) -> None:
        for root in self.roots.values():
            assert root.parent is None and len(root) == 0 and len(root.value) == 0
            assert root.lock_ref == 0, "a root is never locked"
            self._check_children(root)
        evictable = protected = 0
        leaves = set()
        for node in self._nodes():
            self._check_node(node)
            if node.lock_ref:
                protected += len(node)
            else:
                evictable += len(node)
            if not node.children:
                leaves.add(node)
        assert (evictable, protected) == (self._evictable, self._protected), (
            f"counters {(self._evictable, self._protected)} != recount {(evictable, protected)}")
        assert leaves == self._leaves, "leaf set out of date"
        self._check_slots()
        if self.window is not None:
            self._check_window()

    def _check_window(self) -> None:
        evictable = protected = 0
        for node in self._nodes():
            count = int(self.kv_pool.has_window(node.value).sum())
            assert node.window_count == count, f"{node!r}: window count {node.window_count} " \
                f"!= {count} slots with window KV"
            assert 0 <= node.window_lock_ref <= node.lock_ref, \
                f"{node!r}: window locks {node.window_lock_ref} beyond its locks"
            if node.window_lock_ref:
                protected += count
            else:
                evictable += count
        assert (evictable, protected) == (self._window_evictable, self._window_protected), (
            f"window counters {(self._window_evictable, self._window_protected)} != recount "
            f"{(evictable, protected)}")
        assert sum(map(len, self._window_locks.values())) == sum(
            n.lock_ref for root in self.roots.values() for n in root.children.values()), \
            "a lock without its window-lock record"

    def _check_node(self, node: TreeNode) -> None:
        assert len(node) > 0, "empty non-root node"
        assert node.value.dtype == torch.int64 and node.value.dim() == 1
        assert len(node.value) == len(node), f"{node!r} has {len(node.value)} slots"
        assert node.lock_ref >= 0, f"negative lock_ref on {node!r}"
        self._check_children(node)

    @staticmethod
    def _check_children(node: TreeNode) -> None:
        for first, child in node.children.items():
            assert child.parent is node, f"{child!r} has a wrong parent"
            assert len(child) > 0 and child.key[0] == first, f"{child!r} filed under {first}"
        # A lock on a node passes through its parent: the parent carries at
        # least the sum of its children's locks (more if locked itself).
        if node.parent is not None:
            locks_below = sum(child.lock_ref for child in node.children.values())
            assert node.lock_ref >= locks_below, f"{node!r} has fewer locks than below it"

    def _check_slots(self) -> None:
        slots = self.all_slots()
        assert len(slots) == self.total_size()
        assert len(torch.unique(slots)) == len(slots), "a KV slot appears twice in the tree"
        if len(slots):
            assert int(slots.min()) >= 1 and int(slots.max()) <= self.kv_pool.size, (
                "slot outside the pool's range (slot 0 is never handed out)")

    def pretty_print(self) -> str:
        """The tree as indented lines of `tokens  slots  lock_ref  last_access`."""
        lines = [f"evictable={self._evictable} protected={self._protected}"]
        for namespace, root in self.roots.items():
            lines.append(f"root of namespace {namespace}")
            lines += self._pretty_subtree(root)
        return "\n".join(lines)

    @staticmethod
    def _pretty_subtree(root: TreeNode) -> list[str]:
        lines = []
        stack = [(child, 1) for child in reversed(root.children.values())]
        while stack:
            node, depth = stack.pop()
            lines.append(f"{'  ' * depth}{list(node.key)}  slots={node.value.tolist()}"
                         f"  lock={node.lock_ref}  t={node.last_access_time}")
            stack.extend((child, depth + 1) for child in reversed(node.children.values()))
        return lines
