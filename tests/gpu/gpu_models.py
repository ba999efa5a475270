"""A small random Llama checkpoint for the GPU engine tests (HF-saved, so HF
itself can load the same weights as the reference)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import LlamaConfig, LlamaForCausalLM

_T = TypeVar("_T")

BASE_CONFIG: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
    num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
    tie_word_embeddings=False)


def save_random_llama(path: str | Path, seed: int = 0, **config: Any) -> str:
    """Save a random 6-layer Llama (BASE_CONFIG updated by `config`) to `path`."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**BASE_CONFIG, **config}))
    # Larger-than-default init so logits are not flat and greedy paths are decisive.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def save_tiny_bpe_tokenizer(path: str | Path, texts: list[str]) -> Any:
    """A byte-level BPE tokenizer (vocabulary 384) trained on `texts` here, no hub
    access, saved to `path`; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts * 50, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    # A plain role-prefixed template, so chat routes can be exercised.
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    tok.save_pretrained(path)
    return tok


def random_attention_pools(group: int, head_dim: int, dtype: torch.dtype, seed: int,
                           device: torch.device | str, max_requests: int, pool_tokens: int,
                           num_layers: int = 1, layer_id: int = 0) -> tuple[Any, ...]:
    """(heads, kv_heads, req_to_token pool, KV pool, layer) for backend tests: 2 KV
    heads x `group` query heads, every pool slot random (zeros would hide bad
    indexing), `layer_id` the layer the RadixAttention reads."""
    from radixlm.cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from radixlm.layers.attention.radix_attention import RadixAttention

    torch.manual_seed(seed)
    kvh = 2
    h = kvh * group
    r2t_pool = ReqToTokenPool(max_requests, 4096, device)
    kv_pool = MHATokenToKVPool(pool_tokens, dtype, kvh, head_dim, num_layers, device)
    for buf in kv_pool.k_buffer + kv_pool.v_buffer:
        buf.copy_(torch.randn_like(buf, dtype=torch.float32))
    layer = RadixAttention(layer_id, h, kvh, head_dim, head_dim ** -0.5)
    return h, kvh, r2t_pool, kv_pool, layer


@contextlib.contextmanager
def pdl_as(enabled: bool, device: torch.device | None = None) -> Iterator[None]:
    """Kernels launched inside with programmatic dependent launch on or off (as the
    engine's decode graphs run them on Hopper), the setting before restored after."""
    from radixlm.layers import pdl

    was = pdl.pdl_on()
    pdl.set_pdl(enabled, device)
    try:
        yield
    finally:
        pdl.set_pdl(was, device)


def capture_graph(fn: Callable[[], _T]) -> tuple[torch.cuda.CUDAGraph, _T]:
    """Run `fn` once on a side stream (Triton compiles, collectives set up, outside
    the capture), then capture it into a CUDA graph on that stream. Returns the
    graph and what the captured call returned: its outputs, rewritten by each
    replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = fn()
    return graph, out


@dataclass(frozen=True)
class Agreement:
    """How two engines' greedy results for the same prompts agree."""

    mean: float  # |prompt logprob difference|, over every prompt token but the first
    max: float
    first: int  # requests whose first output token is the same
    same: int  # output positions with the same token


def agreement(ours: list[dict], ref: list[dict]) -> Agreement:
    """Of `Engine.generate` results with `return_logprob=True, logprob_start_len=0`."""
    pairs = list(zip(ours, ref, strict=True))
    errors = [abs(a[0] - b[0]) for o, r in pairs
              for a, b in zip(o["meta_info"]["input_token_logprobs"][1:],
                              r["meta_info"]["input_token_logprobs"][1:], strict=True)]
    first = sum(o["output_ids"][0] == r["output_ids"][0] for o, r in pairs)
    same = sum(a == b for o, r in pairs
               for a, b in zip(o["output_ids"], r["output_ids"], strict=True))
    return Agreement(sum(errors) / len(errors), max(errors), first, same)


# How many of the reference's top logprobs at the first output token
# `first_token_margins` needs: its requests ask for them (`top_logprobs_num`).
MARGIN_TOP = 8


def first_token_margins(ours: list[dict], ref: list[dict]) -> list[float]:
    """For each request whose first greedy token differs from the reference's: by
    how much the reference preferred its token to ours, in nats (inf: ours is not
    among its top `MARGIN_TOP`). Margin 0 is an exact tie of the reference."""
    margins = []
    for o, r in zip(ours, ref, strict=True):
        top = r["meta_info"]["output_top_logprobs"][0]  # (logprob, id, ...) best first
        if o["output_ids"][0] != r["output_ids"][0]:
            mine = [t[0] for t in top if t[1] == o["output_ids"][0]]
            margins.append(top[0][0] - mine[0] if mine else float("inf"))
    return margins
