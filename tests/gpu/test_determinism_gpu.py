"""`--enable-deterministic-inference` on CUDA: batch-invariant attention and GEMM
kernels, and the engine's tokens and logprobs identical every way a request can
be served.

The kernel tests need CUDA, or the Triton interpreter on the CPU
(`TRITON_INTERPRET=1`; its bf16 dot is broken, so bf16 cases need CUDA). The
engine tests need CUDA; `test_without_the_flag_rows_differ` reports how many of
the 32 prompts differ without the flag (printed; run with -s).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: determinism_cases

from determinism_cases import (  # noqa: E402
    NUM_PROMPTS,
    WAYS,
    differing,
    serve_all,
    shared_prefix_prompts,
)
from devices import DEV, HAS_CUDA, needs_cuda, needs_kernels  # noqa: E402

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])


# ---- attention -------------------------------------------------------------------

def _reference(q, keys, values, pos0, scale, window, softcap):
    n, h, _ = q.shape
    group = h // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1).transpose(0, 1)
    v = values.double().repeat_interleave(group, 1).transpose(0, 1)
    s = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    qp = torch.arange(pos0, pos0 + n, device=q.device)[:, None]
    kp = torch.arange(keys.shape[0], device=q.device)[None, :]
    mask = kp <= qp
    if window:
        mask &= kp > qp - window
    return (torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v).transpose(0, 1)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 6)])
@pytest.mark.parametrize("window,softcap", [(None, None), (40, 20.0)])
def test_attention_rows_do_not_depend_on_chunking_batch_or_decode(dtype, heads, kv_heads,
                                                                  window, softcap):
    from radixlm.layers.attention.triton_ops import invariant_attention as ia

    gen = torch.Generator().manual_seed(heads)
    d, n, split = 64, 300, 128  # three splits of 128 (ia.split_size gives >= 256)
    pool = n + 16
    k_buf = torch.randn(pool, kv_heads, d, generator=gen).to(dtype)
    v_buf = torch.randn(pool, kv_heads, d, generator=gen).to(dtype)
    k_buf[0] = 0  # the padding slot
    v_buf[0] = 0
    slots = torch.randperm(pool - 1, generator=gen)[:n] + 1
    r2t = torch.zeros(4, 512, dtype=torch.int32)
    r2t[2, :n] = slots.to(torch.int32)
    q = torch.randn(n, heads, d, generator=gen).to(dtype)
    k_buf, v_buf, r2t, q = (t.to(DEV) for t in (k_buf, v_buf, r2t, q))
    scale = d ** -0.5
    t = functools.partial(torch.tensor, device=DEV)

    def extend(chunks):
        out = torch.empty_like(q)
        for pre, ext in chunks:
            tiles = ia.build_tiles([pre], [ext], heads // kv_heads, kv_heads, DEV)
            o = torch.empty_like(q[pre:pre + ext])
            ia.invariant_extend_fwd(q[pre:pre + ext].contiguous(), o, k_buf, v_buf, r2t, t([2]),
                                    t([pre]), t([ext]), t([0]), tiles, scale, split,
                                    window=window, softcap=softcap)
            out[pre:pre + ext] = o
        return out

    whole = extend([(0, n)])
    ref = _reference(q, k_buf[slots.to(DEV)], v_buf[slots.to(DEV)], 0, scale, window, softcap)
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    assert (whole.double() - ref).abs().max() <= tol
    assert torch.equal(extend([(0, 100), (100, 37), (137, 1), (138, 162)]), whole)
    for pos in (0, 63, 127, 128, 200, n - 1):
        for bs, programs in ((1, 3), (4, 1)):
            out = torch.empty(bs, heads, d, dtype=dtype, device=DEV)
            scratch = ia.alloc_invariant_scratch(bs, heads, 4, d, DEV)
            ia.invariant_decode_fwd(q[[pos] * bs].contiguous(), k_buf, v_buf, out, r2t,
                                    t([2] * bs), t([pos + 1] * bs), *scratch, scale, split,
                                    programs, window=window, softcap=softcap)
            assert all(torch.equal(out[i], whole[pos]) for i in range(bs)), (pos, bs)


# ---- GEMM ---------------------------------------------------------------------------

# Each decode tile of invariant_gemm (by K, by N) and the large-M ones.
GEMM_SHAPES = [(4096, 4096), (1024, 8192), (6144, 1024)] if HAS_CUDA else [(100, 130)]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", GEMM_SHAPES)
def test_gemm_rows_do_not_depend_on_the_row_count(dtype, n, k):
    from radixlm.layers import invariant_gemm as ig

    gen = torch.Generator().manual_seed(0)
    rows = ([1, 2, 8, 17, 32, 63, 64, 65, 128, 129, 256, 257, 1024, 1025, 1500] if HAS_CUDA
            # The interpreter's dot is numpy's matmul, whose order changes with a
            # 16-wide operand: there rows are compared within the decode tile.
            else [1, 3, 16, 130])
    w = (torch.randn(n, k, generator=gen) * 0.02).to(dtype).to(DEV)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEV)
    x = torch.randn(max(rows), k, generator=gen).to(dtype).to(DEV)
    alone = ig.matmul(x[:1], w, bias)
    for m in rows:  # every config pick_config gives for these shapes
        if HAS_CUDA or m <= 16:
            assert torch.equal(ig.matmul(x[:m], w, bias)[:1], alone), m
    ref = x.double() @ w.double().T + bias.double()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (ig.matmul(x, w, bias).double() - ref).abs().max() <= tol * ref.abs().max()


# ---- the engine ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from gpu_models import save_random_llama

    return save_random_llama(tmp_path_factory.mktemp("det-llama"))


def _make(model_dir: str, **flags):
    import radixlm

    return functools.partial(radixlm.Engine, model_path=model_dir, skip_tokenizer_init=True,
                             log_level="warning", **flags)


GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


@needs_cuda
def test_with_the_flag_every_way_gives_the_same_tokens_and_logprobs(llama_dir):
    prompts = shared_prefix_prompts(32000, first_id=10)
    results, stats = serve_all(_make(llama_dir, enable_deterministic_inference=True), prompts,
                               GREEDY)
    assert stats["retract"]["retractions"] > 0
    assert stats["warm"]["cached_tokens"] > 0
    assert differing(results) == {}


@needs_cuda
def test_without_the_flag_rows_differ(llama_dir):
    """How many of the 32 differ by default (the number is the report; the test fails
    only if the default path were invariant too, i.e. the flag bought nothing here)."""
    prompts = shared_prefix_prompts(32000, first_id=10)
    ways = {name: WAYS[name] for name in ("alone", "batch", "chunk-64", "warm")}
    results, _ = serve_all(_make(llama_dir), prompts, GREEDY, ways)
    diff = differing(results)
    ids = {name: sum(results["alone"][i][0] != results[name][i][0] for i in bad)
           for name, bad in diff.items()}
    print(f"\nwithout --enable-deterministic-inference, of {NUM_PROMPTS} prompts: "
          + ", ".join(f"{name}: {len(bad)} differ ({ids[name]} in token ids)"
                      for name, bad in diff.items()))
    assert diff, "the default path came out batch-invariant on this GPU"


@needs_cuda
def test_with_the_flag_seeded_sampling_is_the_same_alone_and_in_a_batch(llama_dir):
    prompts = shared_prefix_prompts(32000, seed=1, first_id=10)
    sp = [{"max_new_tokens": 16, "temperature": 0.8, "seed": 7 + i, "ignore_eos": True}
          for i in range(NUM_PROMPTS)]
    with _make(llama_dir, enable_deterministic_inference=True)() as e:
        alone = [e.generate(input_ids=p, sampling_params=s, return_logprob=True)
                 for p, s in list(zip(prompts, sp))[:8]]
        e.flush_cache()
        batch = e.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
    for a, b in zip(alone, batch):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
