"""Waiting-queue orders against a real radix tree."""

from __future__ import annotations

import torch

from radixlm.cache.memory_pool import MHATokenToKVPool
from radixlm.cache.radix_cache import RadixCache
from radixlm.sampling_params import SamplingParams
from radixlm.scheduler.policy import LPM_MAX_QUEUE, order_waiting
from radixlm.scheduler.req import Req


def _setup() -> tuple[RadixCache, MHATokenToKVPool]:
    pool = MHATokenToKVPool(256, torch.float32, 1, 4, 1, "cpu")
    cache = RadixCache(pool)
    for key in ([1, 2, 3, 4, 5, 6], [1, 2, 9, 9], [7, 7, 7]):
        cache.insert(key, pool.alloc(len(key)))
    return cache, pool


def _req(rid: str, ids: list[int]) -> Req:
    return Req(rid=rid, origin_input_ids=ids, sampling_params=SamplingParams(), seed=0)


def _matcher(cache: RadixCache):
    def match(req: Req) -> None:
        m = cache.match_prefix(req.fill_ids[:-1])
        req.prefix_indices, req.last_node = m.indices, m.node
    return match


def test_fcfs_keeps_arrival_order():
    cache, _ = _setup()
    reqs = [_req("a", [5, 5]), _req("b", [1, 2, 3, 4, 5, 6, 0]), _req("c", [7, 7, 7, 1])]
    assert order_waiting("fcfs", reqs, _matcher(cache), True) == reqs


def test_lpm_orders_by_longest_prefix_stably():
    cache, _ = _setup()
    a, b, c, d = (_req("a", [5, 5]), _req("b", [1, 2, 3, 4, 5, 6, 0]),
                  _req("c", [7, 7, 7, 1]), _req("d", [8, 8]))
    out = order_waiting("lpm", [a, b, c, d], _matcher(cache), True)
    assert out == [b, c, a, d]  # 6, 3, then the two misses in arrival order
    assert len(b.prefix_indices) == 6


def test_lpm_falls_back_to_fcfs_on_long_queues_and_without_radix():
    cache, _ = _setup()
    reqs = [_req(str(i), [5, 5] if i % 2 else [1, 2, 3, 4, 0]) for i in range(LPM_MAX_QUEUE + 1)]
    assert order_waiting("lpm", reqs, _matcher(cache), True) == reqs
    small = reqs[:4]
    assert order_waiting("lpm", small, _matcher(cache), False) == small


def test_dfs_weight_groups_requests_of_heavy_branches_first():
    cache, _ = _setup()
    # Branch [1, 2, ...] has three waiting requests, [7, 7, 7] one, none-cached two.
    reqs = [_req("x", [7, 7, 7, 0]), _req("p", [1, 2, 3, 4, 5, 6, 1]),
            _req("y", [4, 4]), _req("q", [1, 2, 9, 9, 1]), _req("r", [1, 2, 3, 4, 5, 6, 2]),
            _req("z", [4, 5])]
    out = [r.rid for r in order_waiting("dfs-weight", reqs, _matcher(cache), True)]
    assert sorted(out) == sorted(r.rid for r in reqs)
    # Requests at the root (no match) come first, then the heavy [1, 2] branch
    # (its heavier child [3..6] before [9, 9]), then [7, 7, 7].
    assert out[:2] == ["y", "z"]
    assert out[2:5] == ["p", "r", "q"]
    assert out[5] == "x"
