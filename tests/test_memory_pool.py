"""ReqToTokenPool and MHATokenToKVPool: counts, the never-handed-out slot 0, and a
hypothesis state machine over alloc/free sequences."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixlm.cache.kv_spec import MHA, KVSpec
from radixlm.cache.memory_pool import (
    MHATokenToKVPool,
    PoolOptions,
    ReqToTokenPool,
    row_kv_buffers,
)


def make_kv_pool(size: int = 16, num_layers: int = 2) -> MHATokenToKVPool:
    return MHATokenToKVPool(size, torch.float32, num_kv_heads=2, head_dim=4,
                            num_layers=num_layers, device="cpu")


# -- ReqToTokenPool ---------------------------------------------------------------

def test_req_pool_alloc_free_counts() -> None:
    pool = ReqToTokenPool(3, max_context_len=8, device="cpu")
    assert pool.req_to_token.shape == (3, 8) and pool.req_to_token.dtype == torch.int32
    slots = [pool.alloc() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and pool.available_size() == 0
    assert pool.alloc() is None
    pool.free(slots[1])
    assert pool.available_size() == 1 and pool.alloc() == slots[1]


def test_req_pool_double_free_and_range_assert() -> None:
    pool = ReqToTokenPool(2, max_context_len=4, device="cpu")
    slot = pool.alloc()
    pool.free(slot)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(slot)
    with pytest.raises(AssertionError):
        pool.free(2)


def test_req_pool_clear() -> None:
    pool = ReqToTokenPool(4, max_context_len=4, device="cpu")
    pool.alloc()
    pool.alloc()
    pool.clear()
    assert pool.available_size() == 4


# -- MHATokenToKVPool: allocation -------------------------------------------------

def test_kv_alloc_free_counts() -> None:
    pool = make_kv_pool(16)
    a = pool.alloc(5)
    assert a.dtype == torch.int64 and a.device.type == "cpu" and len(a) == 5
    assert pool.available_size() == 11
    b = pool.alloc(11)
    assert pool.available_size() == 0
    assert len(set(a.tolist()) | set(b.tolist())) == 16
    pool.free(a)
    assert pool.available_size() == 5
    assert sorted(pool.alloc(5).tolist()) == sorted(a.tolist())


def test_kv_slot_zero_never_handed_out() -> None:
    pool = make_kv_pool(10)
    assert sorted(pool.alloc(10).tolist()) == list(range(1, 11))
    assert pool.k_buffer[0].shape[0] == 11  # the padding slot exists in the buffer


def test_kv_alloc_beyond_capacity_takes_nothing() -> None:
    pool = make_kv_pool(8)
    held = pool.alloc(5)
    assert pool.alloc(4) is None
    assert pool.available_size() == 3
    assert pool.alloc(3) is not None and pool.alloc(1) is None
    pool.free(held)
    assert pool.available_size() == 5


def test_kv_alloc_zero_and_free_empty() -> None:
    pool = make_kv_pool(4)
    empty = pool.alloc(0)
    assert empty is not None and len(empty) == 0
    pool.free(empty)
    pool.free(torch.empty(0, dtype=torch.int64))
    assert pool.available_size() == 4


def test_kv_alloc_negative_rejected() -> None:
    pool = make_kv_pool(4)
    with pytest.raises(ValueError, match="n must be >= 0"):
        pool.alloc(-1)
    assert pool.available_size() == 4


def test_kv_free_accepts_int32() -> None:
    # req_to_token rows are int32; freeing from them must restore int64 slots.
    pool = make_kv_pool(4)
    slots = pool.alloc(3)
    pool.free(slots.to(torch.int32))
    assert pool.free_slots.dtype == torch.int64 and pool.available_size() == 4


def test_kv_clear_restores_everything() -> None:
    pool = make_kv_pool(6)
    pool.alloc(4)
    pool.clear()
    assert sorted(pool.free_slots.tolist()) == list(range(1, 7))


# -- MHATokenToKVPool: buffers ----------------------------------------------------

def test_kv_set_get_round_trip() -> None:
    pool = make_kv_pool(8, num_layers=2)
    loc = pool.alloc(3)
    k = torch.randn(3, 2 * 4)  # flat [tokens, heads * dim], as projections produce it
    v = torch.randn(3, 2, 4)
    pool.set_kv_buffer(1, loc, k, v)
    k_buf, v_buf = pool.get_kv_buffer(1)
    assert k_buf.shape == (9, 2, 4)
    assert torch.equal(k_buf[loc], k.view(3, 2, 4)) and torch.equal(v_buf[loc], v)
    k0, v0 = pool.get_kv_buffer(0)
    assert not k0.any() and not v0.any(), "another layer was written"
    others = torch.ones(9, dtype=torch.bool)
    others[loc] = False
    assert not k_buf[others].any(), "a slot outside loc was written"


def test_kv_release_and_restore_buffers() -> None:
    pool = make_kv_pool(4)
    pool.release_buffers()
    assert pool.k_buffer == [] and pool.v_buffer == []
    pool.restore_buffers()
    assert len(pool.k_buffer) == 2 and pool.k_buffer[0].shape == (5, 2, 4)


def test_bytes_per_slot_and_separate_v_head_dim() -> None:
    spec = KVSpec(MHA, 32, 8, 128, 128)
    assert MHATokenToKVPool.bytes_per_slot(spec, torch.bfloat16, PoolOptions()) == \
        2 * 8 * 128 * 32 * 2
    spec = KVSpec(MHA, 2, 2, 8, 4)  # K and V heads of different sizes
    pool = MHATokenToKVPool.create(spec, torch.float32, 6, torch.device("cpu"), PoolOptions())
    assert pool.k_buffer[0].shape == (7, 2, 8) and pool.v_buffer[0].shape == (7, 2, 4)
    assert MHATokenToKVPool.bytes_per_slot(spec, torch.float32, PoolOptions()) == \
        2 * 2 * (8 + 4) * 4
    loc = pool.alloc(2)
    pool.set_kv_buffer(1, loc, torch.ones(2, 16), torch.full((2, 8), 2.0))
    k, v = pool.get_kv_buffer(1)
    assert k[loc].eq(1).all() and v[loc].eq(2).all()


# -- property-based ---------------------------------------------------------------

SIZE = 24


class KVAllocMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = make_kv_pool(SIZE, num_layers=1)
        self.held: list[torch.Tensor] = []

    @rule(n=st.integers(0, SIZE + 2))
    def alloc(self, n: int) -> None:
        available = self.pool.available_size()
        out = self.pool.alloc(n)
        if n > available:
            assert out is None and self.pool.available_size() == available
        else:
            assert out is not None and len(out) == n
            self.held.append(out)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        chunk = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        cut = data.draw(st.integers(0, len(chunk)))
        # Callers free parts of an allocation at different times (duplicates, retraction).
        self.pool.free(chunk[:cut])
        self.held.append(chunk[cut:])

    @rule()
    def clear(self) -> None:
        self.pool.clear()
        self.held = []

    @invariant()
    def accounting(self) -> None:
        held = sum(map(len, self.held))
        assert self.pool.available_size() + held == self.pool.size
        every = torch.cat([self.pool.free_slots, *self.held]).tolist()
        assert sorted(every) == list(range(1, SIZE + 1)), "slot lost, doubled or out of range"


class ReqAllocMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = ReqToTokenPool(6, max_context_len=4, device="cpu")
        self.held: list[int] = []

    @rule()
    def alloc(self) -> None:
        slot = self.pool.alloc()
        assert (slot is None) == (len(self.held) == 6)
        if slot is not None:
            self.held.append(slot)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.pool.free(self.held.pop(data.draw(st.integers(0, len(self.held) - 1))))

    @invariant()
    def accounting(self) -> None:
        assert sorted(self.pool.free_slots + self.held) == list(range(6))


KVAllocMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None)
ReqAllocMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=30, deadline=None)
TestKVAllocMachine = KVAllocMachine.TestCase
TestReqAllocMachine = ReqAllocMachine.TestCase


def test_row_kv_buffers_only_for_the_plain_layout_in_its_dtype():
    """Kernels that copy K/V rows straight into the pool (the CPU and Triton
    backends' stores) get the buffers only where set_kv_buffer is the plain one."""
    pool = MHATokenToKVPool(8, torch.float32, 2, 4, 2, "cpu")
    k_buf, v_buf = row_kv_buffers(pool, 1, torch.float32)
    assert k_buf is pool.get_kv_buffer(1)[0] and v_buf is pool.get_kv_buffer(1)[1]
    assert row_kv_buffers(pool, 1, torch.bfloat16) is None

    class OtherLayout(MHATokenToKVPool):
        def set_kv_buffer(self, layer_id, loc, k, v):  # e.g. a quantized cache
            super().set_kv_buffer(layer_id, loc, k, v)

    other = OtherLayout(8, torch.float32, 2, 4, 2, "cpu")
    assert row_kv_buffers(other, 1, torch.float32) is None
