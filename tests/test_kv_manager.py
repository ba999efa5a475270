"""KVManager: who owns which KV slot, through admission, decoding, draft tokens
rolled back (`truncate`), hand-over to the prefix cache and release. The pool
accounting invariant must hold after every operation, in every namespace."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixlm.cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from radixlm.cache.no_prefix_cache import NoPrefixCache
from radixlm.cache.radix_cache import RadixCache
from radixlm.sampling_params import SamplingParams
from radixlm.scheduler.kv_manager import KVManager
from radixlm.scheduler.req import Req

POOL = 48


def make_kv(radix: bool = True, size: int = POOL, slots: int = 6) -> KVManager:
    pool = MHATokenToKVPool(size, torch.float32, 1, 1, 1, "cpu")
    cache = RadixCache(pool) if radix else NoPrefixCache()
    return KVManager(ReqToTokenPool(slots, 64, "cpu"), pool, cache)


def new_req(rid: str, tokens: list[int], namespace: int = 0) -> Req:
    return Req(rid=rid, origin_input_ids=list(tokens),
               sampling_params=SamplingParams(max_new_tokens=32), seed=0, namespace=namespace)


def admit_whole(kv: KVManager, req: Req) -> bool:
    kv.match(req)
    return kv.admit(req, len(req.fill_ids) - len(req.prefix_indices)) is not None


def test_truncate_frees_the_newest_slots() -> None:
    kv = make_kv()
    req = new_req("a", [1, 2, 3])
    assert admit_whole(kv, req)
    req.output_ids += [7, 8, 9]  # three draft tokens
    assert kv.admit(req, 3) is not None
    before = kv.kv_pool.available_size()
    kept = req.slots[:4]
    kv.truncate(req, 2)
    del req.output_ids[-2:]
    assert req.kv_len == 4 and req.slots == kept
    assert kv.kv_pool.available_size() == before + 2
    kv.check_invariants([req])
    kv.release(req)
    kv.check_invariants([])


def test_truncate_cannot_reach_into_the_cached_prefix() -> None:
    kv = make_kv()
    first = new_req("a", [1, 2, 3, 4])
    assert admit_whole(kv, first)
    kv.release(first)  # [1, 2, 3, 4] is now in the tree
    req = new_req("b", [1, 2, 3, 4, 5])
    assert admit_whole(kv, req) and len(req.prefix_indices) == 4
    with pytest.raises(ValueError, match="owns 1"):
        kv.truncate(req, 2)
    kv.truncate(req, 0)
    kv.truncate(req, 1)
    assert req.kv_len == 4
    kv.check_invariants([req])


def test_same_tokens_in_two_namespaces_do_not_share() -> None:
    kv = make_kv()
    a = new_req("a", [5, 6, 7, 8])
    assert admit_whole(kv, a)
    kv.release(a)
    b = new_req("b", [5, 6, 7, 8, 9], namespace=2)
    kv.match(b)
    assert len(b.prefix_indices) == 0
    c = new_req("c", [5, 6, 7, 8, 9])
    kv.match(c)
    assert len(c.prefix_indices) == 4


class KVManagerMachine(RuleBasedStateMachine):
    """Requests come and go in random order; some decode, some take draft tokens
    and have part of them rolled back, some share their KV with the cache early."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = make_kv(radix=True)
        self.live: list[Req] = []
        self.count = 0

    def _pick(self, data: st.DataObject) -> Req:
        return self.live[data.draw(st.integers(0, len(self.live) - 1))]

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=8),
          namespace=st.integers(0, 1))
    def admit(self, tokens: list[int], namespace: int) -> None:
        self.count += 1
        req = new_req(f"r{self.count}", tokens, namespace)
        if admit_whole(self.kv, req):
            self.live.append(req)
        else:
            assert req.req_pool_idx is None and req.kv_len == 0  # nothing taken

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data: st.DataObject, token: int) -> None:
        req = self._pick(data)
        locs = self.kv.alloc(1)
        if locs is None:
            return
        req.output_ids.append(token)
        self.kv.extend_decode([req], locs)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), drafts=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def verify(self, data: st.DataObject, drafts: list[int]) -> None:
        req = self._pick(data)
        req.output_ids += drafts
        if self.kv.admit(req, len(drafts)) is None:
            del req.output_ids[-len(drafts):]
            return
        rejected = data.draw(st.integers(0, len(drafts)))
        self.kv.truncate(req, rejected)
        if rejected:
            del req.output_ids[-rejected:]
        assert req.kv_len == len(req.fill_ids)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        self.kv.cache_unfinished(self._pick(data))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def too_much_truncation_is_refused(self, data: st.DataObject) -> None:
        req = self._pick(data)
        with pytest.raises(ValueError):
            self.kv.truncate(req, req.own_kv_len + 1)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        req = self._pick(data)
        self.live.remove(req)
        self.kv.release(req)

    @invariant()
    def accounting(self) -> None:
        self.kv.check_invariants(self.live)
        for req in self.live:
            assert len(req.slots) == req.kv_len
            row = self.kv.req_to_token_pool.req_to_token[req.req_pool_idx, :req.kv_len]
            assert row.tolist() == req.slots


KVManagerMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=30,
                                              deadline=None)
TestKVManagerMachine = KVManagerMachine.TestCase
