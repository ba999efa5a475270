"""The KV-pool registry and the memory plan: the model declares its layout, the
registry picks the pool, the plan sizes every pool and the runner uses what it
is given (a pool class registered here is built and used end to end)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import radixlm
from radixlm.cache.kv_spec import MHA, KVSpec
from radixlm.cache.memory_pool import MHATokenToKVPool, PoolOptions
from radixlm.cache.pool_registry import kv_pool_class, register_kv_pool, unregister_kv_pool
from radixlm.cache.swa_memory_pool import SWAKVPool
from radixlm.config import ServerArgs
from radixlm.models.llama import LlamaForCausalLM
from radixlm.runtime.memory_plan import KVRequest, MemoryPlan

CPU = torch.device("cpu")
FP32 = {"dtype": "float32", "quantization": "none"}


def test_registry_picks_the_pool_for_the_layout() -> None:
    plain = KVSpec(MHA, 4, 2, 16, 16)
    windowed = dataclasses.replace(plain, windows=(8, None, 8, None))
    assert kv_pool_class(plain, torch.bfloat16) is MHATokenToKVPool
    assert kv_pool_class(windowed, torch.bfloat16) is SWAKVPool
    with pytest.raises(ValueError, match="no KV pool holds 'latent' KV"):
        kv_pool_class(dataclasses.replace(plain, kind="latent"), torch.bfloat16)


def test_plan_sizes_pools_after_a_reserve(monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    target = KVRequest("target", KVSpec(MHA, 4, 2, 16, 16), torch.float32)
    draft = KVRequest("draft", KVSpec(MHA, 1, 2, 16, 8), torch.bfloat16)
    monkeypatch.setattr(MemoryPlan, "available_bytes", lambda self: 10 * 2**20)
    args = ServerArgs(device="cpu")
    alone = MemoryPlan(args, CPU, 256, [target])
    both = MemoryPlan(args, CPU, 256, [target, draft], reserve_bytes=2**20)
    per_target, per_draft = 4 * 2 * 32 * 4, 2 * 24 * 2
    assert alone.bytes_per_token() == per_target
    assert both.bytes_per_token() == per_target + per_draft
    assert alone.total_tokens() == 10 * 2**20 // per_target
    assert both.total_tokens() == 9 * 2**20 // (per_target + per_draft)
    with caplog.at_level(logging.INFO, logger="radixlm.runtime.memory_plan"):
        pools = both.build()
    assert pools.pools["draft"].size == pools.target.size == both.total_tokens()
    assert pools.pools["draft"].v_buffer[0].shape[-1] == 8
    text = caplog.text
    assert "1.0 MiB reserved" in text
    for name, per in (("target", per_target), ("draft", per_draft)):
        mib = per * both.total_tokens() / 2**20
        assert f"{name} KV pool MHATokenToKVPool, {both.total_tokens()} tokens" in text
        assert f"{mib:.1f} MiB" in text
    with pytest.raises(ValueError, match="target model's KV request first"):
        MemoryPlan(args, CPU, 256, [draft])


class CountingPool(MHATokenToKVPool):
    """A pool kind of the test's own: plain MHA storage that counts its writes."""

    writes = 0

    @classmethod
    def accepts(cls, spec: KVSpec, dtype: torch.dtype) -> bool:
        return spec.kind == "counting"

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> None:
        type(self).writes += 1
        super().set_kv_buffer(layer_id, loc, k, v)


def test_a_registered_pool_kind_is_built_and_used(monkeypatch: pytest.MonkeyPatch) -> None:
    declared = LlamaForCausalLM.kv_spec

    def counting_spec(self: LlamaForCausalLM) -> KVSpec:
        return dataclasses.replace(declared(self), kind="counting")

    params = {"max_new_tokens": 6, "temperature": 0}
    with radixlm.Engine(max_total_tokens=512, attention_backend="torch_native", **FP32) as e:
        plain = e.generate("The capital of France is", params)["text"]
    register_kv_pool(CountingPool)
    monkeypatch.setattr(LlamaForCausalLM, "kv_spec", counting_spec)
    try:
        with radixlm.Engine(max_total_tokens=512, attention_backend="torch_native",
                            **FP32) as e:
            pool = e.scheduler.worker.kv_pool
            assert type(pool) is CountingPool and pool.size == 512
            assert e.generate("The capital of France is", params)["text"] == plain
    finally:
        unregister_kv_pool(CountingPool)
    assert CountingPool.writes > 0


def test_kv_cache_dtype_is_the_pools_own() -> None:
    params = {"max_new_tokens": 8, "temperature": 0}
    prompt = "The capital of France is"
    with radixlm.Engine(max_total_tokens=512, **FP32) as e:
        full = e.generate(prompt, params)
    with radixlm.Engine(max_total_tokens=512, kv_cache_dtype="bfloat16", **FP32) as e:
        pool = e.scheduler.worker.kv_pool
        assert pool.dtype == torch.bfloat16 and pool.k_buffer[0].dtype == torch.bfloat16
        half = e.generate(prompt, params)
    assert half["meta_info"]["completion_tokens"] == 8
    # Rounding K/V to bf16 moves logits a little; greedy tokens of this prompt hold.
    assert half["text"] == full["text"]
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'"):
        ServerArgs(kv_cache_dtype="int4")


def test_a_backend_refuses_a_kv_dtype_it_cannot_read() -> None:
    from radixlm.layers.attention.base import AttentionBackend

    class SameDtypeOnly(AttentionBackend):
        def init_forward_metadata(self, fb): ...
        def forward_extend(self, q, k, v, layer, fb): ...
        def forward_decode(self, q, k, v, layer, fb): ...

    SameDtypeOnly().check_kv_dtype(torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match="needs the KV cache in the model's dtype"):
        SameDtypeOnly().check_kv_dtype(torch.bfloat16, torch.float32)


def test_pool_options_reach_the_window_pool() -> None:
    spec = KVSpec(MHA, 2, 1, 8, 8, windows=(4, None))
    pool = SWAKVPool.create(spec, torch.float32, 100, CPU, PoolOptions(0.25))
    assert pool.window_size == 25
    with pytest.raises(ValueError, match="swa_full_tokens_ratio=0.05"):
        SWAKVPool.create(spec, torch.float32, 100, CPU, PoolOptions(0.05))
