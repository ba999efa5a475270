"""Who owns which KV slot: the only code that moves slots between the free list,
the prefix cache and live requests.

Accounting invariant (checked when idle and in tests):
    free slots + slots held by the prefix cache + slots owned by live requests == pool size
and over a window pool (`KVPool.window`, swa_memory_pool.py) the same for its
window slots, counting the slots that still have window KV. A request's own
tokens give up their window KV as they leave its window (the prefix cache
handles the tokens it holds).

Keys in the prefix cache carry the request's namespace (`Req.namespace`), so
KV computed under one adapter or one set of images never serves another.
"""

from __future__ import annotations

import torch

from radixlm.cache.base import PrefixCache
from radixlm.cache.memory_pool import KVPool, ReqToTokenPool
from radixlm.scheduler.req import Req
from radixlm.utils import ints_to_device, to_device


class KVManager:
    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool,
                 cache: PrefixCache) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.cache = cache
        # Window pools: per request row, the first of its own positions that may
        # still hold window KV (everything before it was given up).
        self._window_front: dict[int, int] = {}

    # ---- capacity --------------------------------------------------------
    def available(self) -> int:
        """Slots obtainable now: free plus evictable."""
        return self.cache.obtainable_size(self.kv_pool)

    def alloc(self, n: int) -> torch.Tensor | None:
        short = n - self.kv_pool.available_size()
        if short > 0:
            self.cache.evict(short)
        return self.kv_pool.alloc(n)

    # ---- admission ---------------------------------------------------------
    def match(self, req: Req) -> None:
        """Find the cached prefix of the request's tokens (not yet locked)."""
        fill = req.fill_ids
        # Keep at least one token to compute: its logits give the next token.
        limit = len(fill) - 1 if req.shares_kv else 0
        if req.wants_input_logprobs:
            limit = min(limit, req.first_logprob_row)
        match = self.cache.match_prefix(fill[:limit], req.namespace)
        req.prefix_indices, req.last_node = match.indices, match.node

    def admit(self, req: Req, extend_len: int) -> torch.Tensor | None:
        """Take `extend_len` new KV slots for the request's next prefill round; on its
        first round also lock the prefix found by `match` (call it just before, so no
        eviction can intervene) and take a request slot. Returns the new slots, or
        None if memory ran short, in which case nothing is taken."""
        fresh = req.req_pool_idx is None
        if fresh:
            req.req_pool_idx = self.req_to_token_pool.alloc()
            if req.req_pool_idx is None:
                return None
            self.cache.lock(req.last_node)
            req.kv_len = len(req.prefix_indices)
            self._write_table(req, 0, req.prefix_indices)
        slots = self.alloc(extend_len)
        if slots is None:
            if fresh:
                self.cache.unlock(req.last_node)
                self.req_to_token_pool.free(req.req_pool_idx)
                req.req_pool_idx, req.kv_len, req.slots = None, 0, []
            return None
        self._write_table(req, req.kv_len, slots)
        self._drop_window(req, req.kv_len)
        req.kv_len += extend_len
        return slots

    def extend_decode(self, reqs: list[Req], slots: torch.Tensor,
                      counts: list[int] | None = None) -> None:
        """`counts[i]` (default 1) new slots per request at its next positions (a
        verify step's newest token and drafts): a single scatter, not one small
        host-to-device copy per request."""
        counts = counts or [1] * len(reqs)
        table = self.req_to_token_pool.req_to_token
        rows = [r.req_pool_idx for r, n in zip(reqs, counts) for _ in range(n)]
        cols = [r.kv_len + j for r, n in zip(reqs, counts) for j in range(n)]
        flat, at = slots.tolist(), 0
        rows_d, cols_d, slots_d = ints_to_device([rows, cols, flat], table.device)
        table[rows_d, cols_d] = slots_d.to(torch.int32)
        gone = [self._window_gone(r, r.kv_len) for r in reqs] if self.kv_pool.window else []
        for r, n in zip(reqs, counts):
            r.slots += flat[at:at + n]
            r.kv_len += n
            at += n
        if any(gone):
            self.kv_pool.free_window(torch.tensor([s for g in gone for s in g],
                                                  dtype=torch.int64))

    def _window_gone(self, req: Req, first_query: int) -> list[int]:
        """The request's own slots whose window KV no query from `first_query` on
        reads (window pools), marked as given up; the caller frees them."""
        window = self.kv_pool.window
        assert window is not None
        lo = max(self._window_front.get(req.req_pool_idx, 0), len(req.prefix_indices))
        hi = first_query - window + 1
        if hi <= lo:
            return []
        self._window_front[req.req_pool_idx] = hi
        return req.slots[lo:hi]

    def _drop_window(self, req: Req, first_query: int) -> None:
        if self.kv_pool.window:
            gone = self._window_gone(req, first_query)
            if gone:
                self.kv_pool.free_window(torch.tensor(gone, dtype=torch.int64))

    def truncate(self, req: Req, n: int) -> None:
        """Free the request's last `n` KV slots (draft tokens a verify step rejected).
        Only slots the request allocated itself can go: ValueError if `n` reaches
        into the prefix it shares with the cache."""
        if not 0 <= n <= req.own_kv_len:
            raise ValueError(f"cannot truncate {n} KV slots of request {req.rid!r}: it owns "
                             f"{req.own_kv_len}")
        if n == 0:
            return
        self.kv_pool.free(torch.tensor(req.slots[req.kv_len - n:], dtype=torch.int64))
        del req.slots[req.kv_len - n:]
        req.kv_len -= n
        front = self._window_front.get(req.req_pool_idx)
        if front is not None and front > req.kv_len:
            self._window_front[req.req_pool_idx] = req.kv_len

    def keep_rows(self, req: Req, start: int, rows: list[int], num_rows: int) -> None:
        """A verify of a draft tree wrote its `num_rows` rows' KV at the slots of
        positions start.. in row order: make the kept path's `rows` (root first)
        positions start.. (its KV stays where it is: only the table changes) and put
        the other rows' slots after them, where `truncate` frees them."""
        own = req.slots[start:start + num_rows]
        assert len(own) == num_rows, "the verify's slots are the request's last ones"
        taken = set(rows)
        order = [own[r] for r in rows] + [s for r, s in enumerate(own) if r not in taken]
        if order == own:
            return
        req.slots[start:start + num_rows] = order
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        row[start:start + num_rows] = to_device(torch.tensor(order, dtype=torch.int32),
                                                row.device)

    def _write_table(self, req: Req, start: int, slots: torch.Tensor) -> None:
        """Writes go to the device table and to the request's host mirror, so reading
        them back never waits for the device. They start at 0 or append."""
        assert start in (0, len(req.slots)), "table writes restart or append"
        del req.slots[start:]
        req.slots += slots.tolist()
        if len(slots):
            row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
            row[start:start + len(slots)] = to_device(slots, row.device, torch.int32)

    def table_slots(self, req: Req, start: int, end: int) -> torch.Tensor:
        return torch.tensor(req.slots[start:end], dtype=torch.int64)

    # ---- hand-over to the prefix cache ----------------------------------------
    def _insert(self, req: Req) -> list[int]:
        """Hand the request's computed KV to the cache, freeing the slots it
        allocated for a prefix the cache already held; returns the tokens."""
        tokens = req.fill_ids[:req.kv_len]
        slots = self.table_slots(req, 0, req.kv_len)
        dup = self.cache.insert(tokens, slots, req.namespace)
        self.kv_pool.free(slots[len(req.prefix_indices):dup])
        return tokens

    def cache_unfinished(self, req: Req) -> None:
        """Insert the request's KV into the cache and re-point it at the cache's slots,
        so others can share it while this request keeps running."""
        if not req.shares_kv:
            return
        tokens = self._insert(req)
        match = self.cache.match_prefix(tokens, req.namespace)
        assert len(match.indices) == req.kv_len, "inserted prefix must match in full"
        self._write_table(req, 0, match.indices)
        self.cache.lock(match.node)
        self.cache.unlock(req.last_node)
        req.prefix_indices, req.last_node = match.indices, match.node

    def release(self, req: Req) -> None:
        """Give up the request's KV: the computed part goes to the cache (the radix
        cache keeps it, the no-sharing cache reports it all as duplicates to free)."""
        if req.req_pool_idx is None:
            return
        if req.shares_kv:
            self._insert(req)
        else:  # placeholder ids key nothing: its KV goes back to the pool
            self.kv_pool.free(self.table_slots(req, len(req.prefix_indices), req.kv_len))
        self.cache.unlock(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        self._window_front.pop(req.req_pool_idx, None)
        req.req_pool_idx, req.kv_len, req.last_node = None, 0, None
        req.slots = []
        req.prefix_indices = torch.empty(0, dtype=torch.int64)

    # ---- invariant -----------------------------------------------------------
    def check_invariants(self, live: list[Req]) -> None:
        owned = sum(r.own_kv_len for r in live if r.req_pool_idx is not None)
        free = self.kv_pool.full_available_size()
        held = self.cache.total_size()
        total = free + held + owned
        assert total == self.kv_pool.size, (
            f"KV accounting broken: free {free} + cached {held} + requests {owned} = {total} "
            f"!= pool size {self.kv_pool.size}")
        slots_in_use = sum(1 for r in live if r.req_pool_idx is not None)
        assert self.req_to_token_pool.available_size() + slots_in_use == \
            self.req_to_token_pool.size, "request-slot accounting broken"
        self.cache.check_invariants()
        if self.kv_pool.window:
            self._check_window_slots(live)

    def _check_window_slots(self, live: list[Req]) -> None:
        pool = self.kv_pool
        owned = sum(int(pool.has_window(self.table_slots(r, len(r.prefix_indices),
                                                         r.kv_len)).sum())
                    for r in live if r.req_pool_idx is not None)
        held = int(pool.has_window(self.cache.all_slots()).sum())
        free = pool.window_available_size()
        assert free + held + owned == pool.window_size, (
            f"window KV accounting broken: free {free} + cached {held} + requests {owned} "
            f"!= window slots {pool.window_size}")
        pool.check_invariants()
