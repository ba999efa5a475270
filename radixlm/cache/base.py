"""The prefix-cache seam: the radix tree and the no-sharing fallback."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class MatchResult:
    indices: torch.Tensor  # int64 KV slots of the matched prefix (CPU), len == matched tokens
    node: Any  # handle to pass to lock()/unlock(); opaque to the caller


class PrefixCache(ABC):
    """Maps (namespace, token-id prefix) to KV slots that already hold their keys/values.

    Namespaces: equal tokens give equal K/V only under the same adapter and the
    same images behind placeholder tokens, so every key lives in a namespace (an
    int; 0 = plain text with the base model) and two namespaces never share a
    slot or a node. Everything below holds within one namespace; eviction and
    the sizes span all of them.

    Ownership contract:
    - Slots handed to `insert` belong to the cache from then on, except the
      first `n` (the returned count), whose key prefix the cache already held:
      those are duplicates and the caller frees the ones it allocated itself.
    - A node returned by `match_prefix` may be evicted at any time unless it is
      locked; `lock(node)` protects the node and all its ancestors until the
      matching `unlock(node)`.
    - `evict(n)` frees at least n slots back to the KV pool if that many are
      evictable (unlocked), least recently used leaves first.
    - Sizes count slots: evictable (held by the cache only) + protected
      (locked by live requests) = total held by the cache.
    """

    @abstractmethod
    def match_prefix(self, key: list[int], namespace: int = 0) -> MatchResult: ...

    @abstractmethod
    def insert(self, key: list[int], value: torch.Tensor, namespace: int = 0) -> int: ...

    @abstractmethod
    def lock(self, node: Any) -> None: ...

    @abstractmethod
    def unlock(self, node: Any) -> None: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int: ...

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    def obtainable_size(self, kv_pool: Any) -> int:
        """Slots an allocation from `kv_pool` can have now: free ones plus what
        `evict` would free (over a window pool, the smaller of its two spaces')."""
        return kv_pool.available_size() + self.evictable_size()

    @abstractmethod
    def all_slots(self) -> torch.Tensor:
        """Every slot the cache holds (int64, CPU), for the pool accounting check."""

    @abstractmethod
    def check_invariants(self) -> None:
        """Assert the cache's internal consistency (a real check, run in tests and idle)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget everything; the caller has already freed the KV pool."""
