"""The engine on a window pool: greedy outputs and logprobs equal to the plain
pool's (same Triton kernels, so the same keys read in the same order) through
the real scheduler: chunked prefill shorter than the window, shared prefixes
in the radix cache (on and off), mixed chunked prefill, retraction, and a
window space small enough that cached window KV is given up.

Half of a tiny random Llama's layers get a sliding window after loading (the
model families set it from the config; this isolates the pool). CUDA, or the
CPU under the Triton interpreter (`TRITON_INTERPRET=1`, a few minutes).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytestmark = pytest.mark.gpu
HAS_CUDA = torch.cuda.is_available()
if not (HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

WINDOW = 8


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from gpu_models import save_random_llama

    return save_random_llama(tmp_path_factory.mktemp("tiny-swa"), vocab_size=256,
                             hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             max_position_embeddings=256)


@pytest.fixture
def windowed_layers(monkeypatch):
    """Layer 1 of every loaded model attends over a window of WINDOW tokens."""
    from radixlm.layers.attention.radix_attention import RadixAttention
    from radixlm.models import loader

    real = loader.load_model

    def load(*args, **kwargs):
        model = real(*args, **kwargs)
        for m in model.modules():
            if isinstance(m, RadixAttention) and m.layer_id == 1:
                m.sliding_window = WINDOW
        return model

    monkeypatch.setattr(loader, "load_model", load)


def _prompts() -> tuple[list[list[int]], list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(3, 256) for _ in range(30)]
    prompts = [shared[:rng.randrange(10, 31)] + [rng.randrange(3, 256)
                                                 for _ in range(rng.randrange(1, 20))]
               for _ in range(6)]
    prompts.append([rng.randrange(3, 256) for _ in range(60)])
    return prompts, [rng.randrange(4, 24) for _ in prompts]


def _run(model_dir: str, new_tokens: int | None = None, **kw):
    import radixlm

    prompts, new = _prompts()
    if new_tokens is not None:
        new = [new_tokens] * len(prompts)
    sp = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in new]
    dev = {} if HAS_CUDA else {"device": "cpu"}
    kw = {"max_total_tokens": 2000, **dev, **kw}
    with radixlm.Engine(model_dir, dtype="float32", skip_tokenizer_init=True,
                        attention_backend="triton", chunked_prefill_size=6,
                        max_running_requests=4, **kw) as e:
        pool = e.scheduler.worker.runner.kv_pool
        outs = e.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
        e.scheduler.kv.check_invariants([])
        retractions = e.scheduler.stats.num_retractions
    logprobs = [[x[0] for x in o["meta_info"]["output_token_logprobs"]] for o in outs]
    return [o["output_ids"] for o in outs], logprobs, pool, retractions


CASES = {
    "radix": {},
    "no-radix": {"disable_radix_cache": True},
    "mixed-chunk": {"enable_mixed_chunk": True},
    # Full slots for fewer than 4 running contexts of ~100 tokens: decoding
    # retracts (the window space, 80 slots, holds four requests' windows).
    "retraction": {"max_total_tokens": 160, "swa_full_tokens_ratio": 0.5, "new_tokens": 48},
}


@pytest.mark.parametrize("case", list(CASES))
def test_window_pool_matches_plain_pool(tiny_model, windowed_layers, case):
    from radixlm.cache.swa_memory_pool import SWAKVPool

    # By default 5 window slots per 100 full ones: the window layer keeps about a
    # window per request, and the cache must give window KV up.
    kw = {"swa_full_tokens_ratio": 0.05, **CASES[case]}
    ids, lps, pool, retracted = _run(tiny_model, **kw)
    plain_ids, plain_lps, plain_pool, _ = _run(tiny_model, disable_hybrid_swa_memory=True,
                                               **kw)
    assert isinstance(pool, SWAKVPool) and pool.window == WINDOW
    assert pool.window_size == int(pool.size * kw["swa_full_tokens_ratio"])
    assert not isinstance(plain_pool, SWAKVPool)
    if case == "retraction":
        assert retracted > 0
    assert ids == plain_ids
    for a, b in zip(lps, plain_lps):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def test_too_few_window_slots_are_refused(tiny_model, windowed_layers):
    # 2000 x 0.004 = 8 window slots, fewer than two windows of 8.
    with pytest.raises(ValueError, match="swa_full_tokens_ratio=0.004"):
        _run(tiny_model, swa_full_tokens_ratio=0.004)
