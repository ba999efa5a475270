"""The no-sharing cache behind `--disable-radix-cache`.

Same API as `RadixCache`, holding nothing: every match is empty and every
inserted slot is reported as a duplicate, so the caller frees all of it and
the scheduler's code path is the same with or without prefix sharing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from radixlm.cache.base import MatchResult, PrefixCache
from radixlm.cache.memory_pool import KVPool


class _NoNode:
    """The one node handle this cache hands out; locking it does nothing."""

    def __repr__(self) -> str:
        return "NoPrefixCache.NODE"


class NoPrefixCache(PrefixCache):
    NODE = _NoNode()

    def __init__(self, kv_pool: KVPool | None = None) -> None:
        # Takes the pool only so both caches are built the same way; never touches it.
        self.kv_pool = kv_pool

    def match_prefix(self, key: Sequence[int], namespace: int = 0) -> MatchResult:
        return MatchResult(indices=torch.empty(0, dtype=torch.int64), node=self.NODE)

    def insert(self, key: Sequence[int], value: torch.Tensor, namespace: int = 0) -> int:
        if len(value) != len(key):
            raise ValueError(f"value has {len(value)} slots for a key of {len(key)} tokens")
        return len(key)

    def lock(self, node: Any) -> None:
        assert node is self.NODE, f"{node!r} did not come from a NoPrefixCache"

    def unlock(self, node: Any) -> None:
        assert node is self.NODE, f"{node!r} did not come from a NoPrefixCache"

    inc_lock_ref = lock
    dec_lock_ref = unlock

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    def all_slots(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64)

    def check_invariants(self) -> None:
        pass  # holds no state that could be wrong

    def pretty_print(self) -> str:
        return "NoPrefixCache (holds nothing)"
