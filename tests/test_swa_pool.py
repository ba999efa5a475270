"""The window pool (SWAKVPool) under the KV manager and the radix cache: window
KV is given up once it left every window that reads it, never while a request
still reads it; matches stop where window KV is missing; the accounting holds
in both slot spaces after every operation.

The workload test drives the KV manager as the scheduler does (match, admit in
chunks, hand-over to the cache, decode steps, finish, retraction) and checks
every forward's reads: each key a window layer's query reads, and each key of a
full layer, holds the KV of the right token (K/V stand-ins are a hash of the
token's prefix, as real KV is a function of it).
"""

from __future__ import annotations

import random

import pytest
import torch

from radixlm.cache.memory_pool import ReqToTokenPool
from radixlm.cache.no_prefix_cache import NoPrefixCache
from radixlm.cache.radix_cache import RadixCache
from radixlm.cache.swa_memory_pool import SWAKVPool
from radixlm.sampling_params import SamplingParams
from radixlm.scheduler.kv_manager import KVManager
from radixlm.scheduler.req import Req

FULL, WIN = 0, 1  # layer ids: a full-attention layer and a window layer


def make_pool(size: int, window_size: int, window: int) -> SWAKVPool:
    return SWAKVPool(size, window_size, torch.float64, 1, 1, 2, {WIN: window}, "cpu")


def test_pool_slots_and_window_slots() -> None:
    pool = make_pool(10, 4, 3)
    assert pool.available_size() == 4
    a = pool.alloc(3)
    assert a is not None and pool.alloc(2) is None  # one window slot left
    assert pool.has_window(a).all()
    assert pool.free_window(a[:2]) == 2 and pool.free_window(a[:2]) == 0
    assert pool.has_window(a).tolist() == [False, False, True]
    assert pool.full_available_size() == 7 and pool.window_available_size() == 3
    b = pool.alloc(3)
    assert b is not None
    pool.check_invariants()
    # Adoption: a[0] (no window KV) takes b[0]'s window slot; b[1] -> a[2] is refused
    # (a[2] still has its own).
    w = pool.slot_map[b[0]].item()
    assert pool.adopt_window(torch.stack([a[0], a[2]]), b[:2]) == 1
    assert pool.slot_map[a[0]].item() == w and not pool.has_window(b[:1]).any()
    pool.check_invariants()
    pool.free(torch.cat([a, b]))
    assert pool.full_available_size() == 10 and pool.window_available_size() == 4
    pool.check_invariants()


def test_set_kv_buffer_writes_window_layers_at_window_slots() -> None:
    pool = make_pool(8, 8, 2)
    pool.free_window(pool.alloc(3))  # window slots now differ from full slots
    loc = pool.alloc(2)
    k = torch.tensor([[1.0], [2.0]], dtype=torch.float64)
    pool.set_kv_buffer(WIN, loc, k, -k)
    pool.set_kv_buffer(FULL, loc, k, -k)
    kb = pool.get_kv_buffer(WIN)[0]
    assert kb.shape[0] == 9
    assert kb[pool.slot_map[loc]].flatten().tolist() == [1.0, 2.0]
    assert pool.get_kv_buffer(FULL)[0][loc].flatten().tolist() == [1.0, 2.0]
    assert pool.layer_slot_map(FULL) is None and pool.layer_slot_map(WIN) is pool.slot_map


def test_match_stops_where_window_kv_is_missing() -> None:
    """Tokens inserted after their window KV was given up (a finished request's
    early tokens): matches end where the last W - 1 tokens still have it."""
    window = 4
    for gone, want in (([], 30), ([27], 27), ([20, 27], 27), ([28, 29], 28), ([23, 26], 30),
                       ([24, 26, 28], 24), ([2, 5], 30), ([1, 2, 3, 27], 27)):
        pool = make_pool(64, 64, window)
        cache = RadixCache(pool)
        tokens = list(range(100, 130))
        slots = pool.alloc(30)
        if gone:
            pool.free_window(slots[gone])
        cache.insert(tokens, slots)
        cache.check_invariants()
        m = cache.match_prefix(tokens + [7])
        assert len(m.indices) == want, (gone, len(m.indices))
        assert torch.equal(m.indices, slots[:want])
        cache.check_invariants()


def _brute_usable(has: list[bool], need: int) -> int:
    for n in range(len(has), -1, -1):
        if all(has[max(0, n - need):n]):
            return n
    return 0


def test_usable_prefix_matches_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(300):
        window = rng.randrange(1, 9)
        n = rng.randrange(0, 40)
        pool = make_pool(64, 64, window)
        cache = RadixCache(pool)
        slots = pool.alloc(n)
        has = [rng.random() < 0.8 for _ in range(n)]
        gone = [i for i, h in enumerate(has) if not h]
        if gone:
            pool.free_window(slots[gone])
        assert cache._window_usable_len(slots) == _brute_usable(has, window - 1)


# ---- the scheduler's use of the KV manager, every read checked -------------------------

def _kv_value(tokens: list[int], pos: int) -> float:
    """Stand-in K/V of the token at `pos`: a function of tokens[:pos + 1]."""
    h = 0
    for t in tokens[:pos + 1]:
        h = (h * 1000003 + t) % 2_147_483_647
    return float(h)


class Workload:
    """A scripted scheduler over KVManager(SWAKVPool): chunked prefill, decode,
    finish, retraction; `forward` writes the new tokens' K/V and checks reads."""

    def __init__(self, radix: bool, window: int, size: int, window_size: int, chunk: int,
                 seed: int) -> None:
        self.pool = make_pool(size, window_size, window)
        cache = RadixCache(self.pool) if radix else NoPrefixCache()
        self.kv = KVManager(ReqToTokenPool(8, 512, "cpu"), self.pool, cache)
        self.radix, self.window, self.chunk = radix, window, chunk
        self.rng = random.Random(seed)
        self.waiting: list[Req] = []
        self.prefilling: Req | None = None
        self.running: list[Req] = []
        self.done = 0
        self.reads = 0

    def add(self, rid: str, prompt: list[int], new_tokens: int) -> None:
        req = Req(rid=rid, origin_input_ids=prompt, seed=0,
                  sampling_params=SamplingParams(max_new_tokens=new_tokens))
        self.waiting.append(req)

    def _forward(self, req: Req, start: int) -> None:
        """Write K/V of positions start..kv_len-1, then check the queries' reads."""
        tokens = req.fill_ids
        loc = self.kv.table_slots(req, start, req.kv_len)
        vals = torch.tensor([[_kv_value(tokens, p)] for p in range(start, req.kv_len)],
                            dtype=torch.float64)
        for layer in (FULL, WIN):
            self.pool.set_kv_buffer(layer, loc, vals, -vals)
        slots = self.kv.table_slots(req, 0, req.kv_len)
        want = torch.tensor([_kv_value(tokens, p) for p in range(req.kv_len)],
                            dtype=torch.float64)
        full_k = self.pool.get_kv_buffer(FULL)[0][slots].flatten()
        assert torch.equal(full_k, want), f"{req.rid}: full-layer KV wrong"
        lo = max(0, start - self.window + 1)  # the first query's window
        win = self.pool.slot_map[slots[lo:]]
        assert (win > 0).all(), f"{req.rid}: window KV missing inside the window"
        win_k = self.pool.get_kv_buffer(WIN)[0][win].flatten()
        assert torch.equal(win_k, want[lo:]), f"{req.rid}: window-layer KV wrong"
        self.reads += len(win)

    def _prefill(self) -> bool:
        req = self.prefilling
        if req is None:
            if not self.waiting:
                return False
            req = self.waiting[0]
            self.kv.match(req)
        start = req.kv_len if req.req_pool_idx is not None else len(req.prefix_indices)
        n = min(self.chunk, len(req.fill_ids) - start)
        if self.kv.available() < n or self.kv.admit(req, n) is None:
            return False
        if self.prefilling is None:
            self.waiting.pop(0)
        self._forward(req, start)
        if self.radix:
            self.kv.cache_unfinished(req)
        if req.kv_len < len(req.fill_ids):
            self.prefilling = req
        else:
            self.prefilling = None
            req.output_ids.append(self.rng.randrange(50))  # the prefill's sample
            self.running.append(req)
        return True

    def _decode(self) -> None:
        while self.running and self.kv.available() < len(self.running):
            victim = self.running.pop()  # retraction: KV to the cache, back to the queue
            self.kv.release(victim)
            self.waiting.insert(0, victim)
        if not self.running:
            return
        locs = self.kv.alloc(len(self.running))
        assert locs is not None
        starts = [r.kv_len for r in self.running]
        self.kv.extend_decode(self.running, locs)
        for req, start in zip(self.running, starts):
            self._forward(req, start)
            req.output_ids.append(self.rng.randrange(50))
        for req in [r for r in self.running
                    if len(r.output_ids) >= r.sampling_params.max_new_tokens]:
            self.running.remove(req)
            self.kv.release(req)
            self.done += 1

    def live(self) -> list[Req]:
        return self.running + ([self.prefilling] if self.prefilling else []) + self.waiting

    def run(self, steps: int) -> None:
        for _ in range(steps):
            if not self._prefill():
                self._decode()
            self.kv.check_invariants(self.live())
            if not self.live():
                return


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts over a few shared prefixes (so the radix cache matches, splits and
    dedups), some of them longer than the window."""
    bases = [[rng.randrange(50) for _ in range(rng.randrange(5, 60))] for _ in range(3)]
    out = []
    for _ in range(n):
        base = rng.choice(bases)
        out.append(base[:rng.randrange(1, len(base) + 1)] +
                   [rng.randrange(50) for _ in range(rng.randrange(1, 40))])
    return out


@pytest.mark.parametrize("radix", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_workload_reads_stay_right(radix: bool, seed: int) -> None:
    rng = random.Random(seed)
    window = rng.choice([1, 4, 8, 16])
    # Window slots tight enough that the cache must give window KV up (and some
    # requests are retracted), full slots enough for the contexts.
    w = Workload(radix, window, size=600, window_size=6 * (window + 12) + 40, chunk=12,
                 seed=seed)
    for i, p in enumerate(_prompts(rng, 14)):
        w.add(f"r{i}", p, rng.randrange(1, 50))
    w.run(3000)
    assert not w.live(), "workload did not finish"
    assert w.done >= 14 and w.reads > 0
    w.kv.check_invariants([])
    if radix:  # free everything the cache holds: both spaces come back whole
        w.kv.cache.evict(10**9)
        assert w.pool.full_available_size() == 600
        assert w.pool.window_available_size() == w.pool.window_size
        w.kv.check_invariants([])


def test_long_context_fits_in_few_window_slots() -> None:
    """A 400-token context with window 8 runs in 40 window slots: the window
    layers hold about one window plus a chunk, not the context."""
    w = Workload(True, 8, size=500, window_size=40, chunk=16, seed=1)
    rng = random.Random(5)
    w.add("long", [rng.randrange(50) for _ in range(300)], 100)
    w.run(2000)
    assert w.done == 1 and w.reads > 0
