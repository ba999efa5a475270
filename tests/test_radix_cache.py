"""RadixCache and NoPrefixCache: unit tests, then a hypothesis state machine that
drives the cache the way the scheduler does and checks it against a plain model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from radixlm.cache.memory_pool import MHATokenToKVPool
from radixlm.cache.no_prefix_cache import NoPrefixCache
from radixlm.cache.radix_cache import RadixCache


def make_pool(size: int = 64) -> MHATokenToKVPool:
    return MHATokenToKVPool(size, torch.float32, num_kv_heads=1, head_dim=1, num_layers=1,
                            device="cpu")


def make_cache(size: int = 64) -> tuple[MHATokenToKVPool, RadixCache]:
    pool = make_pool(size)
    return pool, RadixCache(pool)


def insert_fresh(pool: MHATokenToKVPool, cache: RadixCache, key: list[int]) -> torch.Tensor:
    """Allocate slots for `key`, insert them, free the duplicates; return the slots."""
    value = pool.alloc(len(key))
    assert value is not None
    dup = cache.insert(key, value)
    pool.free(value[:dup])
    return value


def contents(cache: RadixCache, namespace: int = 0) -> dict[tuple[int, ...], int]:
    """Every cached prefix of a namespace -> the KV slot of its last token."""
    out: dict[tuple[int, ...], int] = {}
    root = cache.roots.get(namespace)
    stack = [((), root)] if root is not None else []
    while stack:
        prefix, node = stack.pop()
        for i, (tok, slot) in enumerate(zip(node.key, node.value.tolist(), strict=True)):
            out[prefix + node.key[:i] + (tok,)] = slot
        stack.extend((prefix + node.key, child) for child in node.children.values())
    return out


def assert_pool_accounting(pool: MHATokenToKVPool, cache: RadixCache,
                           held: Sequence[torch.Tensor] = ()) -> None:
    parts = [pool.free_slots, cache.all_slots(), *held]
    slots = torch.cat(parts)
    assert pool.available_size() + cache.total_size() + sum(map(len, held)) == pool.size
    assert sorted(slots.tolist()) == list(range(1, pool.size + 1)), "leaked or doubled slot"


# -- match / insert / split -------------------------------------------------------

def test_empty_match_returns_root() -> None:
    _, cache = make_cache()
    res = cache.match_prefix([1, 2, 3])
    assert res.indices.dtype == torch.int64 and len(res.indices) == 0
    assert res.node is cache.root
    assert cache.match_prefix([]).node is cache.root
    cache.check_invariants()


def test_insert_then_match_exact_partial_longer() -> None:
    pool, cache = make_cache()
    value = insert_fresh(pool, cache, [1, 2, 3, 4])
    assert torch.equal(cache.match_prefix([1, 2, 3, 4]).indices, value)
    assert torch.equal(cache.match_prefix([1, 2, 3, 4, 5, 6]).indices, value)
    assert torch.equal(cache.match_prefix([1, 2, 9]).indices, value[:2])
    assert len(cache.match_prefix([2, 1]).indices) == 0
    assert cache.evictable_size() == 4 and cache.protected_size() == 0
    cache.check_invariants()
    assert_pool_accounting(pool, cache)


def test_match_splits_node_at_match_end() -> None:
    pool, cache = make_cache()
    value = insert_fresh(pool, cache, [1, 2, 3, 4])
    res = cache.match_prefix([1, 2])
    assert res.node.key == (1, 2) and torch.equal(res.node.value, value[:2])
    (tail,) = res.node.children.values()
    assert tail.key == (3, 4) and tail.parent is res.node
    assert cache.root.children[1] is res.node
    cache.check_invariants()
    assert contents(cache) == {(1,): 1, (1, 2): 2, (1, 2, 3): 3, (1, 2, 3, 4): 4}


def test_held_handle_survives_a_later_split() -> None:
    pool, cache = make_cache()
    insert_fresh(pool, cache, [1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4]).node
    cache.match_prefix([1, 2])  # splits `node`'s segment above it
    cache.lock(node)
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    assert cache.evict(100) == 0
    cache.unlock(node)
    cache.check_invariants()


def test_insert_returns_duplicate_count_and_splits() -> None:
    pool, cache = make_cache()
    insert_fresh(pool, cache, [1, 2, 3])
    value = pool.alloc(3)
    assert cache.insert([1, 2, 4], value) == 2
    pool.free(value[:2])
    assert sorted(cache.root.children[1].children) == [3, 4]
    assert cache.insert([1, 2], value[:2]) == 2  # fully cached: all duplicates
    assert cache.insert([], value[:0]) == 0
    assert cache.total_size() == 4
    cache.check_invariants()
    assert_pool_accounting(pool, cache)


def test_insert_copies_value() -> None:
    pool, cache = make_cache()
    value = pool.alloc(3)
    cache.insert([5, 6, 7], value)
    expected = value.clone()
    value.fill_(0)  # the caller reusing its buffer must not corrupt the tree
    assert torch.equal(cache.match_prefix([5, 6, 7]).indices, expected)


def test_insert_rejects_length_mismatch() -> None:
    _, cache = make_cache()
    with pytest.raises(ValueError, match="3 tokens"):
        cache.insert([1, 2, 3], torch.tensor([1, 2]))


# -- locking ----------------------------------------------------------------------

def test_lock_protects_node_and_ancestors() -> None:
    pool, cache = make_cache()
    insert_fresh(pool, cache, [1, 2, 3, 4])
    insert_fresh(pool, cache, [1, 2, 5])  # tree: (1,2) -> {(3,4), (5,)}
    node = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(node)
    cache.lock(node)
    assert cache.protected_size() == 4 and cache.evictable_size() == 1
    cache.check_invariants()
    assert cache.evict(100) == 1
    assert len(cache.match_prefix([1, 2, 5]).indices) == 2
    cache.unlock(node)
    assert cache.protected_size() == 4  # still locked once
    cache.unlock(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    cache.check_invariants()
    assert_pool_accounting(pool, cache)


def test_lock_root_is_noop_and_unlock_below_zero_asserts() -> None:
    pool, cache = make_cache()
    cache.lock(cache.root)
    cache.unlock(cache.root)
    insert_fresh(pool, cache, [1, 2])
    node = cache.match_prefix([1, 2]).node
    with pytest.raises(AssertionError, match="unlock"):
        cache.unlock(node)


def test_lock_of_evicted_node_asserts() -> None:
    pool, cache = make_cache()
    insert_fresh(pool, cache, [1, 2])
    node = cache.match_prefix([1, 2]).node
    assert cache.evict(2) == 2
    with pytest.raises(AssertionError, match="not in this tree"):
        cache.lock(node)


def test_inc_dec_lock_ref_aliases() -> None:
    pool, cache = make_cache()
    insert_fresh(pool, cache, [1])
    node = cache.match_prefix([1]).node
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 1
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0


# -- eviction ---------------------------------------------------------------------

def test_evict_is_lru_over_leaves() -> None:
    pool, cache = make_cache()
    a = insert_fresh(pool, cache, [1, 1])
    b = insert_fresh(pool, cache, [2, 2])
    insert_fresh(pool, cache, [3, 3])
    cache.match_prefix([1, 1])  # a is now the most recent; b the least
    available = pool.available_size()
    assert cache.evict(1) == 2
    assert pool.available_size() == available + 2
    assert torch.equal(pool.free_slots[-2:], b)  # b's slots went back to the pool
    assert set(contents(cache)) == {(1,), (1, 1), (3,), (3, 3)}
    assert cache.evict(1) == 2  # then c
    assert torch.equal(cache.match_prefix([1, 1]).indices, a)
    cache.check_invariants()
    assert_pool_accounting(pool, cache)


def test_evict_parent_joins_candidates() -> None:
    pool, cache = make_cache()
    insert_fresh(pool, cache, [1, 2, 3])
    insert_fresh(pool, cache, [1, 2, 4, 5])  # (1,2) -> {(3,), (4,5)}
    assert cache.evict(100) == 5
    assert cache.total_size() == 0 and not cache.root.children
    assert pool.available_size() == pool.size
    cache.check_invariants()


def test_evict_stops_once_enough_freed() -> None:
    pool, cache = make_cache()
    for tok in range(1, 6):
        insert_fresh(pool, cache, [tok, tok])
    assert cache.evict(3) == 4  # whole leaves: two of them
    assert cache.evict(0) == 0
    assert cache.total_size() == 6
    cache.check_invariants()
    assert_pool_accounting(pool, cache)


def test_locked_leaf_never_evicted_but_unlocked_sibling_is() -> None:
    pool, cache = make_cache()
    locked = insert_fresh(pool, cache, [7, 8, 9])
    insert_fresh(pool, cache, [7, 1])
    node = cache.match_prefix([7, 8, 9]).node
    cache.lock(node)
    assert cache.evict(100) == 1
    assert torch.equal(cache.match_prefix([7, 8, 9]).indices, locked)
    cache.unlock(node)
    assert cache.evict(100) == 3
    assert_pool_accounting(pool, cache)


def test_reset_forgets_everything() -> None:
    pool, cache = make_cache()
    insert_fresh(pool, cache, [1, 2, 3])
    old = cache.match_prefix([1, 2, 3]).node
    pool.clear()
    cache.reset()
    assert cache.total_size() == 0 and len(cache.all_slots()) == 0
    assert len(cache.match_prefix([1, 2, 3]).indices) == 0
    with pytest.raises(AssertionError):
        cache.lock(old)  # a handle from before the reset
    cache.check_invariants()


def test_check_invariants_catches_corruption() -> None:
    pool, cache = make_cache()
    insert_fresh(pool, cache, [1, 2, 3])
    insert_fresh(pool, cache, [4, 5])
    cache._evictable += 1
    with pytest.raises(AssertionError, match="recount"):
        cache.check_invariants()
    cache._evictable -= 1
    cache.root.children[4].value = cache.root.children[1].value[:2].clone()
    with pytest.raises(AssertionError, match="twice"):
        cache.check_invariants()


def test_check_invariants_catches_unlocked_ancestor() -> None:
    pool, cache = make_cache()
    insert_fresh(pool, cache, [1, 2, 3])
    node = cache.match_prefix([1, 2, 3]).node
    cache.match_prefix([1])
    cache.lock(node)
    node.parent.lock_ref = 0
    with pytest.raises(AssertionError, match="fewer locks"):
        cache.check_invariants()


def test_pretty_print_shows_segments() -> None:
    pool, cache = make_cache()
    insert_fresh(pool, cache, [1, 2, 3])
    insert_fresh(pool, cache, [1, 2, 4])
    text = cache.pretty_print()
    assert "[1, 2]" in text and "[3]" in text and "[4]" in text


# -- NoPrefixCache ----------------------------------------------------------------

def test_no_prefix_cache_holds_nothing() -> None:
    pool = make_pool(8)
    cache = NoPrefixCache(pool)
    value = pool.alloc(3)
    assert cache.insert([1, 2, 3], value) == 3  # all "duplicates": the caller frees them
    pool.free(value)
    res = cache.match_prefix([1, 2, 3])
    assert len(res.indices) == 0 and res.indices.dtype == torch.int64
    cache.lock(res.node)
    cache.unlock(res.node)
    assert cache.evict(10) == 0
    assert cache.evictable_size() == cache.protected_size() == cache.total_size() == 0
    assert len(cache.all_slots()) == 0
    cache.reset()
    cache.check_invariants()
    assert pool.available_size() == pool.size
    with pytest.raises(ValueError):
        cache.insert([1], torch.tensor([1, 2]))


# -- namespaces ------------------------------------------------------------------

def test_namespaces_never_share_a_node() -> None:
    pool, cache = make_cache()
    a = insert_fresh(pool, cache, [1, 2, 3])
    assert cache.match_prefix([1, 2, 3], namespace=7).indices.tolist() == []
    b = pool.alloc(3)
    assert cache.insert([1, 2, 3], b, namespace=7) == 0  # no duplicate across namespaces
    assert cache.match_prefix([1, 2, 3]).indices.tolist() == a.tolist()
    assert cache.match_prefix([1, 2, 3], namespace=7).indices.tolist() == b.tolist()
    assert cache.total_size() == 6
    nodes0 = {id(n) for n in cache._nodes() if cache.root in _ancestors(n)}
    nodes7 = {id(n) for n in cache._nodes() if cache.roots[7] in _ancestors(n)}
    assert nodes0 and nodes7 and not nodes0 & nodes7
    cache.check_invariants()
    assert_pool_accounting(pool, cache)


def _ancestors(node: object) -> list[object]:
    out = []
    while node is not None:
        out.append(node)
        node = node.parent
    return out


def test_lock_in_one_namespace_protects_only_its_path() -> None:
    pool, cache = make_cache()
    insert_fresh(pool, cache, [1, 2])
    b = pool.alloc(2)
    cache.insert([1, 2], b, namespace=3)
    res = cache.match_prefix([1, 2], namespace=3)
    cache.lock(res.node)
    assert cache.protected_size() == 2 and cache.evictable_size() == 2
    assert cache.evict(10) == 2  # only namespace 0's copy can go
    assert cache.match_prefix([1, 2]).indices.tolist() == []
    assert cache.match_prefix([1, 2], namespace=3).indices.tolist() == b.tolist()
    cache.unlock(res.node)
    assert cache.evict(10) == 2
    cache.check_invariants()
    assert_pool_accounting(pool, cache)


def test_eviction_is_lru_across_namespaces() -> None:
    pool, cache = make_cache()
    insert_fresh(pool, cache, [1])  # oldest
    v = pool.alloc(1)
    cache.insert([1], v, namespace=1)
    cache.match_prefix([1])  # namespace 0 used again: namespace 1's leaf is now oldest
    assert cache.evict(1) == 1
    assert cache.match_prefix([1], namespace=1).indices.tolist() == []
    assert len(cache.match_prefix([1]).indices) == 1
    cache.reset()
    assert set(cache.roots) == {0} and cache.total_size() == 0


# -- property-based: the scheduler's usage against a plain model -------------------

KEYS = st.lists(st.integers(0, 2), max_size=8)  # small alphabet: prefixes collide
NAMESPACES = st.integers(0, 2)
POOL_SIZE = 40


def all_contents(cache: RadixCache) -> dict[tuple[int, tuple[int, ...]], int]:
    """(namespace, prefix) -> slot of the prefix's last token, over every namespace."""
    return {(ns, prefix): slot for ns in cache.roots
            for prefix, slot in contents(cache, ns).items()}


@dataclass
class FakeReq:
    namespace: int
    key: list[int]
    node: object
    prefix: torch.Tensor  # cache-owned slots, locked through `node`
    own: torch.Tensor  # slots the request allocated itself


class RadixCacheMachine(RuleBasedStateMachine):
    """A reference model `ref`: every cached prefix -> slot of its last token.
    Matches must be exactly the longest prefix in `ref`; eviction may drop any
    unlocked prefixes (LRU order is unit-tested) but never a locked one. Keys
    live in namespaces: `ref` is keyed by (namespace, prefix), so a match in one
    namespace must never see another's prefixes."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(POOL_SIZE)
        self.cache = RadixCache(self.pool)
        self.ref: dict[tuple[int, tuple[int, ...]], int] = {}
        self.reqs: list[FakeReq] = []

    def _expected_match(self, key: list[int], ns: int) -> list[int]:
        out = []
        for i in range(1, len(key) + 1):
            if (ns, tuple(key[:i])) not in self.ref:
                break
            out.append(self.ref[ns, tuple(key[:i])])
        return out

    def _alloc(self, n: int) -> torch.Tensor | None:
        value = self.pool.alloc(n)
        if value is None:
            self._evict(n - self.pool.available_size())
            value = self.pool.alloc(n)
        return value

    def _evict(self, n: int) -> None:
        evictable = self.cache.evictable_size()
        available = self.pool.available_size()
        before = self.ref
        freed = self.cache.evict(n)
        self.ref = all_contents(self.cache)
        assert freed >= min(n, evictable)
        assert freed == len(before) - len(self.ref) == self.pool.available_size() - available
        assert all(before[p] == s for p, s in self.ref.items()), "eviction moved a slot"

    def _insert(self, key: list[int], value: torch.Tensor, own_from: int, ns: int) -> None:
        """Insert like a finishing request whose slots before `own_from` came from the cache."""
        expected_dup = len(self._expected_match(key, ns))
        dup = self.cache.insert(key, value, ns)
        assert dup == expected_dup and dup >= own_from
        self.pool.free(value[own_from:dup])
        for i in range(dup, len(key)):
            self.ref[ns, tuple(key[:i + 1])] = int(value[i])

    @rule(key=KEYS, ns=NAMESPACES)
    def match(self, key: list[int], ns: int) -> None:
        assert self.cache.match_prefix(key, ns).indices.tolist() == \
            self._expected_match(key, ns)

    @rule(key=KEYS, ns=NAMESPACES)
    def insert(self, key: list[int], ns: int) -> None:
        value = self._alloc(len(key))
        if value is not None:
            self._insert(key, value, 0, ns)

    @rule(key=KEYS, ns=NAMESPACES)
    def start_request(self, key: list[int], ns: int) -> None:
        res = self.cache.match_prefix(key, ns)
        assert res.indices.tolist() == self._expected_match(key, ns)
        self.cache.lock(res.node)
        own = self._alloc(len(key) - len(res.indices))
        if own is None:  # not admitted: undo as the scheduler would
            self.cache.unlock(res.node)
            return
        self.reqs.append(FakeReq(ns, key, res.node, res.indices, own))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), cache_it=st.booleans())
    def finish_request(self, data: st.DataObject, cache_it: bool) -> None:
        req = self.reqs.pop(data.draw(st.integers(0, len(self.reqs) - 1)))
        if cache_it:
            self._insert(req.key, torch.cat([req.prefix, req.own]), len(req.prefix),
                         req.namespace)
        else:  # aborted or retracted: its own slots go straight back
            self.pool.free(req.own)
        self.cache.unlock(req.node)

    @rule(n=st.integers(0, POOL_SIZE))
    def evict(self, n: int) -> None:
        self._evict(n)

    @invariant()
    def tree_matches_model(self) -> None:
        self.cache.check_invariants()
        assert all_contents(self.cache) == self.ref

    @invariant()
    def locked_prefixes_survive(self) -> None:
        for req in self.reqs:
            assert self._expected_match(req.key, req.namespace)[:len(req.prefix)] == \
                req.prefix.tolist()

    @invariant()
    def pool_accounting(self) -> None:
        assert_pool_accounting(self.pool, self.cache, [r.own for r in self.reqs])


RadixCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None)
TestRadixCacheMachine = RadixCacheMachine.TestCase
