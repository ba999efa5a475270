"""How many tokens of context fit: the window pool (SWAKVPool) beside the plain
pool in the same KV memory, for a model with sliding-window layers.

The pools are sized from the model's shape and the memory (what the model
runner does), then the real KV manager and radix cache run a workload the way
the scheduler does (chunked prefill with the hand-over to the cache, decode
steps, retraction when the pool runs short) without computing attention, so
the slot accounting and nothing else decides what fits. Reported: the largest
number of context tokens resident at once, and the number of requests that ran
at once. Run it on the CPU: `python -m radixlm.bench.swa_capacity`.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import torch

from radixlm.cache.kv_spec import MHA, KVSpec
from radixlm.cache.memory_pool import MHATokenToKVPool, PoolOptions, ReqToTokenPool
from radixlm.cache.pool_registry import kv_pool_class
from radixlm.cache.radix_cache import RadixCache
from radixlm.cache.swa_memory_pool import SWAKVPool
from radixlm.sampling_params import SamplingParams
from radixlm.scheduler.kv_manager import KVManager
from radixlm.scheduler.req import Req


@dataclass(frozen=True)
class Shape:
    """KV shape of a model: layers, of which `window_layers` use `window`."""
    name: str
    num_layers: int
    window_layers: int
    num_kv_heads: int
    head_dim: int
    window: int


# Gemma 3 12B: 48 layers, 5 of every 6 sliding (window 1024), 8 KV heads of 256.
GEMMA3_12B = Shape("Gemma-3-12B", 48, 40, 8, 256, 1024)
# Gemma 2 9B: 42 layers alternating (window 4096), 8 KV heads of 256.
GEMMA2_9B = Shape("Gemma-2-9B", 42, 21, 8, 256, 4096)


def pool_sizes(shape: Shape, memory: float, ratio: float | None) -> tuple[int, int]:
    """(full slots, window slots) in `memory` bytes of bf16 KV; ratio None: plain."""
    windows = tuple(shape.window if i < shape.window_layers else None
                    for i in range(shape.num_layers))
    spec = KVSpec(MHA, shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.head_dim,
                  windows if ratio is not None else ())
    options = PoolOptions(swa_full_tokens_ratio=ratio or 1.0)
    per = kv_pool_class(spec, torch.bfloat16).bytes_per_slot(spec, torch.bfloat16, options)
    full = int(memory // per)
    if ratio is None:
        return full, 0
    return full, max(1, int(full * ratio))


def _make_kv(full: int, window_slots: int, window: int, rows: int, context: int) -> KVManager:
    # One-element rows: only the slot bookkeeping matters here.
    if window_slots:
        pool = SWAKVPool(full, window_slots, torch.float16, 1, 1, 2, {1: window}, "cpu")
    else:
        pool = MHATokenToKVPool(full, torch.float16, 1, 1, 1, "cpu")
    return KVManager(ReqToTokenPool(rows, context + 8, "cpu"), pool, RadixCache(pool))


@dataclass
class Result:
    peak_tokens: int = 0  # context tokens resident at once (sum of kv_len)
    peak_running: int = 0
    finished: int = 0
    retractions: int = 0
    seconds: float = 0.0


def run_workload(kv: KVManager, num_reqs: int, prompt_len: int, decode_len: int, chunk: int,
                 seed: int = 0, max_steps: int = 200_000) -> Result:
    """`num_reqs` requests of `prompt_len` random tokens and `decode_len` new ones."""
    rng = random.Random(seed)
    waiting = [Req(rid=str(i), origin_input_ids=[rng.randrange(1, 30000)
                                                 for _ in range(prompt_len)],
                   sampling_params=SamplingParams(max_new_tokens=decode_len), seed=0)
               for i in range(num_reqs)]
    running: list[Req] = []
    prefilling: Req | None = None
    res = Result()
    t0 = time.perf_counter()
    for _ in range(max_steps):
        if not (waiting or running or prefilling):
            break
        reserve = sum(min(r.sampling_params.max_new_tokens - len(r.output_ids), 8)
                      for r in running)
        req = prefilling or (waiting[0] if waiting else None)
        admitted = False
        if req is not None:
            if prefilling is None:
                kv.match(req)
            start = req.kv_len if req.req_pool_idx is not None else len(req.prefix_indices)
            n = min(chunk, len(req.fill_ids) - start)
            if n > kv.available() - reserve and not running:
                n = kv.available()  # as the scheduler: alone, take what fits now
            if 0 < n <= kv.available() - reserve and kv.admit(req, n) is not None:
                admitted = True
                if prefilling is None:
                    waiting.pop(0)
                kv.cache_unfinished(req)
                prefilling = req if req.kv_len < len(req.fill_ids) else None
                if prefilling is None:
                    req.output_ids.append(1)
                    running.append(req)
        if not admitted and running:
            while len(running) > 1 and kv.available() < len(running):
                victim = running.pop()
                kv.release(victim)
                waiting.insert(0, victim)
                res.retractions += 1
            locs = kv.alloc(len(running))
            if locs is None:
                raise RuntimeError("the pool cannot hold one request's decode step")
            kv.extend_decode(running, locs)
            for r in running:
                r.output_ids.append(1)
            for r in [r for r in running if len(r.output_ids) >= r.sampling_params.max_new_tokens]:
                running.remove(r)
                kv.release(r)
                res.finished += 1
        elif not admitted:
            raise RuntimeError("nothing fits: the pool is smaller than one chunk")
        live = running + ([prefilling] if prefilling else [])
        res.peak_tokens = max(res.peak_tokens, sum(r.kv_len for r in live))
        res.peak_running = max(res.peak_running, len(running))
    res.seconds = time.perf_counter() - t0
    kv.check_invariants([])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory-gib", type=float, default=8.0, help="KV memory (bf16)")
    ap.add_argument("--model", choices=["gemma3-12b", "gemma2-9b"], default="gemma3-12b")
    ap.add_argument("--ratios", default="0.8,0.25,0.1", help="swa_full_tokens_ratio values")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=16384)
    ap.add_argument("--decode-len", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=8192)
    args = ap.parse_args()
    shape = GEMMA3_12B if args.model == "gemma3-12b" else GEMMA2_9B
    memory = args.memory_gib * 2**30
    print(f"{shape.name}: {shape.window_layers}/{shape.num_layers} layers windowed "
          f"(window {shape.window}), {args.memory_gib:g} GiB of bf16 KV; workload: "
          f"{args.requests} requests x ({args.prompt_len} prompt + {args.decode_len} new), "
          f"chunk {args.chunk}")
    print("| pool | full slots | window slots | peak resident tokens | peak running | "
          "retractions | vs plain |")
    print("|---|---|---|---|---|---|---|")
    plain_peak = None
    for ratio in [None] + [float(r) for r in args.ratios.split(",")]:
        full, win = pool_sizes(shape, memory, ratio)
        name = "plain" if ratio is None else f"window, ratio {ratio:g}"
        if args.prompt_len + args.decode_len > full:
            print(f"| {name} | {full} | {win or '-'} | one request does not fit | 0 | - | - |")
            continue
        kv = _make_kv(full, win, shape.window, args.requests,
                      args.prompt_len + args.decode_len)
        res = run_workload(kv, args.requests, args.prompt_len, args.decode_len, args.chunk)
        assert res.finished == args.requests
        plain_peak = plain_peak or res.peak_tokens
        print(f"| {name} | {full} | {win or '-'} | {res.peak_tokens} | {res.peak_running} | "
              f"{res.retractions} | {res.peak_tokens / plain_peak:.2f}x |")


if __name__ == "__main__":
    main()
