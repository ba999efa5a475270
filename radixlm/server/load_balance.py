"""Routing of requests over data-parallel replicas (the DP controller's policy).

`round_robin`: replica after replica. `shortest_queue`: the replica with the
fewest live tokens (running + queued prompt and generated tokens), as the
replicas last reported plus what was routed to them since. `cache_aware`:
the replica whose radix tree most likely holds the longest prefix of the
prompt (an approximate copy of each tree is kept here), unless the replicas'
loads are too far apart, when it falls back to shortest-queue (the scheme of
SGLang's router). Prefixes are told apart by their prefix-cache namespace, as
the replicas' trees tell them apart: the same tokens under another adapter or
other images are another prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

# An approximate tree keeps prefixes in blocks of this many tokens: a match is
# counted in whole blocks, so it errs short by at most one block.
PREFIX_BLOCK = 16
# Cache-aware routing follows the cache while the busiest replica carries at
# most this many live requests more than the idlest, and this factor more.
BALANCE_ABS_REQS = 16
BALANCE_REL = 1.5
# Below this fraction of the prompt found in any tree, the prefix is not worth
# a queue: route by load.
CACHE_MATCH_MIN = 0.3


@dataclass
class ReplicaLoad:
    """What the controller knows of one replica's load."""

    reported_reqs: int = 0
    reported_tokens: int = 0
    reported_received: int = 0
    # Requests routed here that the last report did not count yet: (seq, tokens).
    unreported: list[tuple[int, int]] = field(default_factory=list)
    num_routed: int = 0

    @property
    def num_reqs(self) -> int:
        return self.reported_reqs + len(self.unreported)

    @property
    def num_tokens(self) -> int:
        return self.reported_tokens + sum(t for _, t in self.unreported)

    def routed(self, num_tokens: int) -> None:
        self.num_routed += 1
        self.unreported.append((self.num_routed, num_tokens))

    def report(self, num_reqs: int, num_tokens: int, num_received: int) -> None:
        self.reported_reqs, self.reported_tokens = num_reqs, num_tokens
        self.reported_received = num_received
        self.unreported = [(seq, t) for seq, t in self.unreported if seq > num_received]


class ApproxPrefixIndex:
    """Which token prefixes a replica has seen, as a chain of block hashes kept in
    LRU order and bounded by the replica's KV capacity: an approximation of its
    radix tree (the replica's own evictions are not visible from here)."""

    def __init__(self, capacity_tokens: int) -> None:
        self.max_blocks = max(1, capacity_tokens // PREFIX_BLOCK)
        self.blocks: OrderedDict[int, None] = OrderedDict()

    @staticmethod
    def _chain(tokens: list[int], namespace: int) -> list[int]:
        hashes, h = [], hash(namespace)  # hash(0) == 0: plain text chains are unchanged
        for start in range(0, len(tokens) - PREFIX_BLOCK + 1, PREFIX_BLOCK):
            h = hash((h, tuple(tokens[start:start + PREFIX_BLOCK])))
            hashes.append(h)
        return hashes

    def match(self, tokens: list[int], namespace: int = 0) -> int:
        """Tokens of the longest known prefix of `tokens` in `namespace`."""
        n = 0
        for h in self._chain(tokens, namespace):
            if h not in self.blocks:
                break
            n += PREFIX_BLOCK
        return n

    def insert(self, tokens: list[int], namespace: int = 0) -> None:
        for h in self._chain(tokens, namespace):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)


class LoadBalancer:
    def __init__(self, method: str, num_replicas: int, capacity_tokens: int = 1 << 20) -> None:
        if method not in ("round_robin", "shortest_queue", "cache_aware"):
            raise ValueError(f"unknown load_balance_method {method!r}")
        self.method = method
        self.loads = [ReplicaLoad() for _ in range(num_replicas)]
        self.trees = [ApproxPrefixIndex(capacity_tokens) for _ in range(num_replicas)]
        self.next_rr = 0
        self.num_cache_routed = 0

    def route(self, input_ids: list[int], namespace: int = 0) -> int:
        """The replica for a request, with the load it adds recorded."""
        if self.method == "round_robin":
            dp = self.next_rr
            self.next_rr = (self.next_rr + 1) % len(self.loads)
        elif self.method == "shortest_queue":
            dp = self.shortest()
        else:
            dp = self.cache_aware(input_ids, namespace)
        self.assign(dp, input_ids, namespace)
        return dp

    def assign(self, dp: int, input_ids: list[int], namespace: int = 0) -> None:
        """Record a request sent to replica `dp` (by `route` or by session affinity)."""
        self.loads[dp].routed(len(input_ids))
        self.trees[dp].insert(input_ids, namespace)

    def shortest(self) -> int:
        return min(range(len(self.loads)),
                   key=lambda i: (self.loads[i].num_tokens, self.loads[i].num_reqs))

    def balanced(self) -> bool:
        reqs = [load.num_reqs for load in self.loads]
        lo, hi = min(reqs), max(reqs)
        return hi - lo <= BALANCE_ABS_REQS or hi <= BALANCE_REL * lo

    def cache_aware(self, input_ids: list[int], namespace: int = 0) -> int:
        if not self.balanced():
            return self.shortest()
        matches = [tree.match(input_ids, namespace) for tree in self.trees]
        best = max(range(len(matches)),
                   key=lambda i: (matches[i], -self.loads[i].num_tokens))
        if matches[best] < CACHE_MATCH_MIN * len(input_ids):
            return self.shortest()
        self.num_cache_routed += 1
        return best

    def report(self, dp_rank: int, num_reqs: int, num_tokens: int, num_received: int) -> None:
        self.loads[dp_rank].report(num_reqs, num_tokens, num_received)
