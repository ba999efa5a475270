"""Which KV pool holds a model's KV layout: one registry of pool classes.

A pool class answers for itself (`KVPool.accepts(spec, dtype)`), so a new layout
(an MLA latent pool, an FP8 pool with per-layer scales) is one class and one
line here (or a `register_kv_pool` call), and the memory plan sizes and builds
it like any other.
"""

from __future__ import annotations

import torch

from radixlm.cache.fp8_pool import FP8TokenToKVPool
from radixlm.cache.kv_spec import KVSpec
from radixlm.cache.memory_pool import KVPool, MHATokenToKVPool
from radixlm.cache.swa_memory_pool import SWAKVPool

_POOLS: list[type[KVPool]] = [MHATokenToKVPool, SWAKVPool, FP8TokenToKVPool]


def register_kv_pool(cls: type[KVPool]) -> type[KVPool]:
    """Add a pool class (usable as a decorator). Its `accepts` must not overlap
    with a registered class's: `kv_pool_class` refuses an ambiguous layout."""
    if cls not in _POOLS:
        _POOLS.append(cls)
    return cls


def unregister_kv_pool(cls: type[KVPool]) -> None:
    _POOLS.remove(cls)


def kv_pool_class(spec: KVSpec, dtype: torch.dtype) -> type[KVPool]:
    """The one registered class that holds `spec` in `dtype`."""
    found = [c for c in _POOLS if c.accepts(spec, dtype)]
    if not found:
        name = str(dtype).removeprefix("torch.")
        raise ValueError(f"no KV pool holds {spec.kind!r} KV in {name}"
                         f" (registered: {', '.join(c.__name__ for c in _POOLS)})")
    if len(found) > 1:
        raise RuntimeError(f"KV pools {', '.join(c.__name__ for c in found)} all accept "
                           f"{spec.kind!r} KV in {dtype}: their accepts() overlap")
    return found[0]
