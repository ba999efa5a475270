"""One set of prompts served many ways, for the batch-invariance tests (CPU and GPU).

Deterministic inference means a request's tokens and logprobs do not depend on
what else the engine is doing: the same 32 prompts (shared prefixes, so the
radix cache has something to reuse) are served alone, together, in prefill
chunks of 64 and 512 tokens, with the prefix cache cold, warm and off, in a KV
pool so small that requests are retracted and resumed, and with prefill chunks
mixed into the decode batches. `serve_all` returns each way's (token ids,
logprobs) per prompt; `differing` says which prompts came out different from
the first way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

NUM_PROMPTS = 32


def shared_prefix_prompts(vocab_size: int, seed: int = 0, num: int = NUM_PROMPTS,
                          prefix_lens: tuple[int, ...] = (21, 45, 70, 97),
                          suffix_lens: tuple[int, int] = (2, 19),
                          first_id: int = 0) -> list[list[int]]:
    """`num` random prompts in groups sharing a prefix (one group per prefix
    length), each with its own suffix; ids in [first_id, vocab_size). Lengths
    straddle 64 so that chunks of 64 cut prompts and shared prefixes."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(first_id, vocab_size, (n,), generator=gen).tolist()

    prefixes = [ids(n) for n in prefix_lens]
    lo, hi = suffix_lens
    out = []
    for i in range(num):
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        out.append(prefixes[i % len(prefixes)] + ids(n))
    return out


Result = list[tuple[list[int], list[float]]]


@dataclass(frozen=True)
class Way:
    """One way of serving the prompts: engine keywords, one at a time or all in
    one call, and whether the same engine first serves them once (so the
    second pass finds every prompt in the prefix cache)."""

    engine: dict[str, Any] = field(default_factory=dict)
    alone: bool = False
    warm: bool = False


WAYS: dict[str, Way] = {
    "alone": Way({"disable_radix_cache": True}, alone=True),
    "batch": Way(),  # the radix cache cold
    "warm": Way(warm=True),
    "no-cache": Way({"disable_radix_cache": True}),
    "chunk-64": Way({"chunked_prefill_size": 64, "max_prefill_tokens": 64}),
    "chunk-512": Way({"chunked_prefill_size": 512, "max_prefill_tokens": 512}),
    # Admission reserves little for decoding, so decodes outgrow the pool.
    "retract": Way({"max_total_tokens": 640, "chunked_prefill_size": 128,
                    "schedule_conservativeness": 0.05}),
    "mixed-chunk": Way({"enable_mixed_chunk": True, "chunked_prefill_size": 64,
                        "max_prefill_tokens": 64}),
}


def _pairs(out: dict[str, Any]) -> tuple[list[int], list[float]]:
    return out["output_ids"], [pair[0] for pair in out["meta_info"]["output_token_logprobs"]]


def serve(make_engine: Callable[..., Any], prompts: list[list[int]], sp: dict[str, Any],
          way: Way) -> tuple[Result, dict[str, int]]:
    """The prompts served `way` by an engine `make_engine(**way.engine)`; also
    the engine's counters (retractions, cached tokens) to check the way did
    what it says."""
    with make_engine(**way.engine) as e:
        def run() -> Result:
            if way.alone:
                return [_pairs(e.generate(input_ids=p, sampling_params=sp, return_logprob=True))
                        for p in prompts]
            outs = e.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
            return [_pairs(o) for o in outs]

        if way.warm:
            run()
        cached_before = e.scheduler.stats.num_cached_tokens
        result = run()
        e.scheduler.check_invariants()
        stats = {"retractions": e.scheduler.stats.num_retractions,
                 "cached_tokens": e.scheduler.stats.num_cached_tokens - cached_before}
    return result, stats


def serve_all(make_engine: Callable[..., Any], prompts: list[list[int]], sp: dict[str, Any],
              ways: dict[str, Way] = WAYS) -> tuple[dict[str, Result], dict[str, dict[str, int]]]:
    results, stats = {}, {}
    for name, way in ways.items():
        results[name], stats[name] = serve(make_engine, prompts, sp, way)
    return results, stats


def differing(results: dict[str, Result]) -> dict[str, list[int]]:
    """{way: indices of the prompts whose ids or logprobs (bit for bit) differ
    from the first way's}, ways with no difference left out."""
    names = list(results)
    ref = results[names[0]]
    out = {}
    for name in names[1:]:
        bad = [i for i, (a, b) in enumerate(zip(ref, results[name], strict=True)) if a != b]
        if bad:
            out[name] = bad
    return out
