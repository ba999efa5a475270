"""Orders the waiting queue (`--schedule-policy`).

- fcfs: arrival order.
- lpm: longest cached prefix first, so requests that share a prefix run while
  it is still cached (falls back to fcfs on long queues, where matching every
  request each round costs more than it saves).
- dfs-weight: walk the radix tree depth first, heavier subtrees (more waiting
  requests below) first, so requests sharing a branch run together.

With priority scheduling, requests are ordered by priority first (higher
first); the policy orders requests of equal priority.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from radixlm.scheduler.req import Req

LPM_MAX_QUEUE = 128


def order_waiting(policy: str, waiting: list[Req], match: Callable[[Req], None],
                  radix_enabled: bool, by_priority: bool = False) -> list[Req]:
    ordered = _by_policy(policy, waiting, match, radix_enabled)
    if by_priority:
        ordered.sort(key=lambda r: -r.priority)  # stable: the policy's order within a level
    return ordered


def _by_policy(policy: str, waiting: list[Req], match: Callable[[Req], None],
               radix_enabled: bool) -> list[Req]:
    if policy == "fcfs" or not radix_enabled or len(waiting) > LPM_MAX_QUEUE:
        return list(waiting)
    for req in waiting:
        match(req)
    if policy == "lpm":
        # sorted() is stable: equal matches keep arrival order.
        return sorted(waiting, key=lambda r: -len(r.prefix_indices))
    return _dfs_weight(waiting)


def _dfs_weight(waiting: list[Req]) -> list[Req]:
    by_node: dict[int, list[Req]] = defaultdict(list)
    nodes: dict[int, object] = {}
    weight: dict[int, int] = defaultdict(int)
    children: dict[int, list[object]] = defaultdict(list)
    roots: dict[int, object] = {}  # one per prefix-cache namespace
    for req in waiting:
        node = req.last_node
        by_node[id(node)].append(req)
        # Every ancestor's weight counts the requests below it.
        while node is not None:
            weight[id(node)] += 1
            parent = node.parent
            if id(node) not in nodes:
                nodes[id(node)] = node
                if parent is not None:
                    children[id(parent)].append(node)
            if parent is None:
                roots[id(node)] = node
            node = parent
    out: list[Req] = []
    stack = sorted(roots.values(), key=lambda n: weight[id(n)])
    while stack:
        node = stack.pop()
        out.extend(by_node.get(id(node), []))
        kids = sorted(children.get(id(node), []), key=lambda n: weight[id(n)])
        stack.extend(kids)  # heaviest popped first
    return out
