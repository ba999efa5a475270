"""The FP8 KV cache (`--kv-cache-dtype fp8_e4m3`): per-layer scales, twice the
tokens in the same memory, greedy tokens and logprobs close to an unquantized
cache on the embedded model (CPU), scales from a quantization-param file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import radixlm
from radixlm.cache.fp8_pool import FP8TokenToKVPool
from radixlm.cache.kv_spec import MHA, KVSpec
from radixlm.cache.memory_pool import PoolOptions
from radixlm.config import ServerArgs
from radixlm.runtime.memory_plan import KVRequest, MemoryPlan

EXACT = {"dtype": "float32", "quantization": "none", "max_total_tokens": 1024}
PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time"]


def test_pool_stores_scaled_fp8_and_reads_back() -> None:
    spec = KVSpec(MHA, 2, 2, 8, 8)
    pool = FP8TokenToKVPool.create(spec, torch.float8_e4m3fn, 16, torch.device("cpu"),
                                   PoolOptions())
    pool.set_scales([4.0, 1.0], [0.5, 1.0])
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(3, 16, generator=gen) * 600  # beyond e4m3's 448 unless scaled
    v = torch.randn(3, 16, generator=gen)
    loc = pool.alloc(3)
    pool.set_kv_buffer(0, loc, k, v)
    kb, vb = pool.get_kv_buffer(0)
    assert kb.dtype == torch.float8_e4m3fn
    ks, vs = pool.layer_scales(0)
    back_k = kb[loc].float() * ks
    back_v = vb[loc].float() * vs
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2**-4, and below its
    # smallest normal (2**-6) half its fixed step of 2**-9, times the layer's scale.
    for back, x, scale in ((back_k, k, 4.0), (back_v, v, 0.5)):
        x = x.view(3, 2, 8)
        assert ((back - x).abs() <= x.abs() / 16 + 2.0 ** -10 * scale + 1e-6).all()
    with pytest.raises(ValueError, match="must be > 0"):
        pool.set_scales([0.0, 1.0], [1.0, 1.0])


def test_fp8_holds_twice_the_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MemoryPlan, "available_bytes", lambda self: 64 * 2**20)
    spec = KVSpec(MHA, 30, 3, 64, 64)
    args = ServerArgs(device="cpu")
    plans = {dt: MemoryPlan(args, torch.device("cpu"), 8192, [KVRequest("target", spec, dt)])
             for dt in (torch.bfloat16, torch.float8_e4m3fn)}
    fp8, bf16 = plans[torch.float8_e4m3fn], plans[torch.bfloat16]
    assert fp8.bytes_per_token() * 2 == bf16.bytes_per_token()
    assert fp8.total_tokens() == 64 * 2**20 // fp8.bytes_per_token() >= 2 * bf16.total_tokens()


def _run(kv: str, **kw: object) -> tuple[list[list[int]], list[list[float]]]:
    with radixlm.Engine(kv_cache_dtype=kv, **EXACT, **kw) as e:
        outs = e.generate(PROMPTS, {"max_new_tokens": 16, "temperature": 0},
                          return_logprob=True)
        if kv.startswith("fp8"):
            assert isinstance(e.scheduler.worker.kv_pool, FP8TokenToKVPool)
    return ([o["output_ids"] for o in outs],
            [[entry[0] for entry in o["meta_info"]["output_token_logprobs"]] for o in outs])


def test_fp8_kv_stays_close_to_the_full_cache() -> None:
    ref_ids, ref_lps = _run("auto")
    ids, lps = _run("fp8_e4m3")
    agree = sum(a == b for r, o in zip(ref_ids, ids) for a, b in zip(r, o))
    print(f"\n[fp8 kv] greedy tokens equal to the fp32 cache's: {agree}/{16 * len(PROMPTS)}")
    assert [r[:4] for r in ref_ids] == [o[:4] for o in ids]
    # Where the tokens agree, their logprobs move a little.
    diffs = [abs(a - b) for r, o, rl, ol in zip(ref_ids, ids, ref_lps, lps)
             for j, (a, b) in enumerate(zip(rl, ol)) if r[:j + 1] == o[:j + 1]]
    assert sum(diffs) / len(diffs) < 0.1, max(diffs)


def test_scales_from_a_quantization_param_file(tmp_path: Path) -> None:
    scales = {str(i): 0.5 + i / 100 for i in range(30)}
    path = tmp_path / "kv_scales.json"
    path.write_text(json.dumps({"kv_cache": {"dtype": "float8_e4m3fn",
                                             "scaling_factor": {"0": scales}}}))
    with radixlm.Engine(kv_cache_dtype="fp8_e4m3", quantization_param_path=str(path),
                        **EXACT) as e:
        pool = e.scheduler.worker.kv_pool
        assert torch.allclose(pool.k_scales, torch.tensor(list(scales.values())))
        assert torch.equal(pool.k_scales, pool.v_scales)
        assert e.generate(PROMPTS[0], {"max_new_tokens": 4})["meta_info"][
            "completion_tokens"] == 4
    path.write_text(json.dumps({"kv_cache": {"scaling_factor": {"0": {"0": 1.0}}}}))
    with pytest.raises(ValueError, match="no KV scale for layers"):
        radixlm.Engine(kv_cache_dtype="fp8_e4m3", quantization_param_path=str(path), **EXACT)


def test_triton_backend_reads_fp8_kv_and_refuses_other_casts() -> None:
    """The Triton kernels read FP8 pools (tests/gpu/test_fp8_kv_gpu.py); a pool in
    another float dtype than the model's is still refused by name."""
    pytest.importorskip("triton")
    from radixlm.layers.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend(4, 2, 64, "cpu")
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        backend.check_kv_dtype(torch.bfloat16, fp8)
    with pytest.raises(ValueError, match="needs the KV cache in the model's dtype"):
        backend.check_kv_dtype(torch.bfloat16, torch.float32)
