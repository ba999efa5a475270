"""Deterministic inference on the CPU: a request's tokens and logprobs, bit for bit,
do not depend on the batch, the chunking, the prefix cache or a retraction.

- The CPU default (the embedded GGUF model, its blocks in our kernels, bf16
  where the CPU computes it) is batch-invariant without any flag.
- Float weights (fp32 here) are with --enable-deterministic-inference.
- Seeded sampling at temperature 0.8 draws the same tokens alone and in a batch.
- The kernels underneath, row by row: attention rows of a decode step equal
  the prefill's rows at those positions however the prompt is chunked; the
  dense products and the sampler's logsumexp give a row the same bits at any
  row count.

Before the batch-invariant kernels, the first test failed on 31 of the 32
prompts (11-12 with different tokens); the fp32 one fails without the flag
(MKL's sgemm reduces a row differently at 1, 2-15 and 16+ rows).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from determinism_cases import NUM_PROMPTS, differing, serve_all, shared_prefix_prompts
from family_models import save_random_model, tiny
from transformers import MistralConfig

import radixlm
from radixlm.layers import cpu_ops
from radixlm.layers.sampler import row_logsumexp

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
needs_kernels = pytest.mark.skipif(not cpu_ops.load(), reason="no C++ compiler")


def _check_all_the_same(make_engine, vocab_size: int) -> None:
    prompts = shared_prefix_prompts(vocab_size)
    results, stats = serve_all(make_engine, prompts, GREEDY)
    # Each way did what it says.
    assert stats["retract"]["retractions"] > 0
    assert stats["warm"]["cached_tokens"] > sum(len(p) for p in prompts) // 2
    assert stats["no-cache"]["cached_tokens"] == 0
    assert all(len(ids) == GREEDY["max_new_tokens"] for ids, _ in results["alone"])
    assert differing(results) == {}


@needs_kernels
def test_cpu_default_gives_the_same_tokens_and_logprobs_every_way() -> None:
    _check_all_the_same(functools.partial(radixlm.Engine, log_level="warning"), 49152)


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Mistral (head dim 64, a 24-token window shorter than most prompts)."""
    path = tmp_path_factory.mktemp("mistral")
    config = tiny(MistralConfig, vocab_size=512, hidden_size=256, intermediate_size=512,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  sliding_window=24, max_position_embeddings=512)
    save_random_model(config, path)
    return path


@needs_kernels
def test_cpu_fp32_with_the_flag_gives_the_same_tokens_and_logprobs_every_way(
        windowed_model: Path) -> None:
    make = functools.partial(radixlm.Engine, model_path=str(windowed_model),
                             skip_tokenizer_init=True, dtype="float32", quantization="none",
                             enable_deterministic_inference=True, log_level="warning")
    _check_all_the_same(make, 512)


@needs_kernels
def test_seeded_sampling_draws_the_same_tokens_alone_and_in_a_batch() -> None:
    prompts = shared_prefix_prompts(49152, seed=1)
    sp = [{"max_new_tokens": 8, "temperature": 0.8, "seed": 100 + i, "ignore_eos": True}
          for i in range(NUM_PROMPTS)]
    with radixlm.Engine(log_level="warning", disable_radix_cache=True) as e:
        alone = [e.generate(input_ids=p, sampling_params=s, return_logprob=True)
                 for p, s in list(zip(prompts, sp))[:6]]
        batch = e.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
    for a, b in zip(alone, batch):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    # Seeds matter: not every request drew its greedy tokens.
    assert len({tuple(b["output_ids"]) for b in batch}) > NUM_PROMPTS // 2


def test_the_flag_refuses_tensor_parallelism_by_name() -> None:
    with pytest.raises(ValueError, match="enable_deterministic_inference with tp_size=2"):
        radixlm.Engine(enable_deterministic_inference=True, tp_size=2)


@needs_kernels
def test_the_flag_refuses_the_torch_native_backend(windowed_model: Path) -> None:
    with pytest.raises(ValueError, match="attention_backend='torch_native'"):
        radixlm.Engine(model_path=str(windowed_model), skip_tokenizer_init=True,
                       dtype="float32", attention_backend="torch_native",
                       enable_deterministic_inference=True)


# ---- the kernels, row by row -------------------------------------------------------

def _pool(dtype: torch.dtype, kv_heads: int, dim: int, tokens: int, gen: torch.Generator):
    pool = tokens + 9
    k = torch.randn(pool, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(pool, kv_heads, dim, generator=gen).to(dtype)
    slots = torch.randperm(pool - 1, generator=gen)[:tokens] + 1
    r2t = torch.zeros(3, tokens + 8, dtype=torch.int32)
    r2t[1, :tokens] = slots.to(torch.int32)
    return k, v, r2t


def _extend(q, k, v, r2t, chunks, scale, window, softcap):
    """The rows of one request prefilled in `chunks` (prefix, new) after each other."""
    out = torch.empty_like(q)
    t = torch.tensor
    for pre, ext in chunks:
        o = torch.empty_like(q[pre:pre + ext])
        cpu_ops.extend_attention(q[pre:pre + ext].contiguous(), k, v, o, r2t, t([1]), t([pre]),
                                 t([ext]), scale, window, softcap)
        out[pre:pre + ext] = o
    return out


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 1, 80)])
@pytest.mark.parametrize("window,softcap", [(None, None), (40, 5.0)])
def test_attention_rows_do_not_depend_on_chunking_or_decode(dtype, heads, kv_heads, dim,
                                                            window, softcap) -> None:
    gen = torch.Generator().manual_seed(dim)
    n = 560  # three 256-position splits
    k, v, r2t = _pool(dtype, kv_heads, dim, n, gen)
    q = torch.randn(n, heads, dim, generator=gen).to(dtype)
    scale = dim ** -0.5
    whole = _extend(q, k, v, r2t, [(0, n)], scale, window, softcap)
    chunked = _extend(q, k, v, r2t, [(0, 100), (100, 157), (257, 1), (258, 302)], scale,
                      window, softcap)
    assert torch.equal(whole, chunked)
    for pos in (0, 31, 255, 256, 300, n - 1):
        for bs in (1, 5):  # alone, and beside other requests
            out = torch.empty(bs, heads, dim, dtype=dtype)
            cpu_ops.decode_attention(q[[pos] * bs].contiguous(), k, v, out, r2t,
                                     torch.ones(bs, dtype=torch.int64),
                                     torch.full((bs,), pos + 1), scale, window, softcap)
            assert all(torch.equal(out[i], whole[pos]) for i in range(bs)), (pos, bs)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 1, 80)])
@pytest.mark.parametrize("window,softcap", [(None, None), (40, 5.0)])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "offset"])
def test_attention_rows_do_not_depend_on_the_batch_or_the_query_layout(
        dtype, heads, kv_heads, dim, window, softcap, layout) -> None:
    """A long request alone is cut into several work units; in a batch of others it
    is one (on two threads; fewer than alone on more); the queries are read in place
    or copied depending on their layout: the rows are the same bits every way."""
    gen = torch.Generator().manual_seed(dim + 1)
    n = 560
    k, v, r2t = _pool(dtype, kv_heads, dim, n, gen)
    q = torch.randn(n, heads, dim, generator=gen).to(dtype)
    scale = dim ** -0.5
    whole = _extend(q, k, v, r2t, [(0, n)], scale, window, softcap)
    # Every request is a piece of the same context (one req_to_token row): each of
    # its rows must equal the row prefilled alone.
    batch = [(0, 40), (300, 20), (0, n), (10, 5), (255, 2)] + [(0, 256)] * 64
    rows = sum(ext for _, ext in batch)
    pad = {"contiguous": 0, "strided": 16, "offset": 1}[layout]
    buf = torch.zeros(rows, heads * dim + pad, dtype=dtype)
    qb = (buf[:, pad:] if layout == "offset" else buf[:, :heads * dim]).view(rows, heads, dim)
    at = 0
    for pre, ext in batch:
        qb[at:at + ext] = q[pre:pre + ext]
        at += ext
    out = torch.empty(rows, heads, dim, dtype=dtype)
    t = torch.tensor
    cpu_ops.extend_attention(qb, k, v, out, r2t, torch.ones(len(batch), dtype=torch.int64),
                             t([pre for pre, _ in batch]), t([ext for _, ext in batch]),
                             scale, window, softcap)
    at = 0
    for pre, ext in batch:
        assert torch.equal(out[at:at + ext], whole[pre:pre + ext]), (pre, ext)
        at += ext


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_products_do_not_depend_on_the_row_count(dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    n, k = 200, 577  # a partial panel, an odd K
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    packed = cpu_ops.dense_pack(w)
    x = torch.randn(300, k, generator=gen).to(dtype)
    alone = cpu_ops.dense_linear(x[5:6], packed, n, bias)
    for rows in (6, 7, 12, 13, 64, 193, 300):
        assert torch.equal(cpu_ops.dense_linear(x[:rows], packed, n, bias)[5:6], alone), rows
    ref = x.double() @ w.double().T + bias.double()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    full = cpu_ops.dense_linear(x, packed, n, bias)
    assert (full.double() - ref).abs().max() <= tol * ref.abs().max()


def test_row_logsumexp_does_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 49152, generator=gen) * 5
    x[3, :100] = float("-inf")
    alone = row_logsumexp(x[3:4])
    for rows in (4, 7, 40):
        assert torch.equal(row_logsumexp(x[:rows])[3:4], alone)
    torch.testing.assert_close(alone, torch.logsumexp(x[3:4].double(), -1).float())
