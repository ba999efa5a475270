"""Long-context decode with sliding-window layers (CUDA):
`python -m radixlm.bench.swa_decode [--context 32768 --bs 8 --window 1024]`.

Gemma-3-12B's attention shape (16 query heads, 8 KV heads, head_dim 256, bf16;
40 of 48 layers with window 1024, 8 full):
1. one decode layer's attention over `bs` requests of `context` tokens with
   shuffled slots: a full layer, a softcapped full layer, a window layer on a
   plain pool, and a window layer on the window pool (slot translation), with
   a model step's attention time for the 8 + 40 layers beside 48 full layers;
2. the KV memory: the plain pool and the window pool (`swa_full_tokens_ratio`
   values) allocated for real in the same bytes, with the tokens each holds;
3. a decode loop on the window pool at a context the plain pool cannot hold:
   the KV manager gives up window KV as tokens leave the window, so the window
   slots the requests need stay at about two windows each while the context
   grows (the radix cache keeps the rest until the space is wanted).
Timings are medians of `triton.testing.do_bench` (cold L2 between repetitions).
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton

from radixlm.bench.swa_capacity import GEMMA3_12B, pool_sizes
from radixlm.cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from radixlm.cache.radix_cache import RadixCache
from radixlm.cache.swa_memory_pool import SWAKVPool
from radixlm.layers.attention.triton_backend import TritonAttentionBackend
from radixlm.layers.attention.triton_ops.decode_attention import (
    alloc_decode_scratch,
    decode_attention_fwd,
)
from radixlm.sampling_params import SamplingParams
from radixlm.scheduler.kv_manager import KVManager
from radixlm.scheduler.req import Req

H, KVH, D = 16, 8, 256
DT = torch.bfloat16
DEV = torch.device("cuda")


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def layer_times(bs: int, context: int, window: int) -> dict[str, float]:
    gen = torch.Generator(device=DEV).manual_seed(0)
    total = bs * context
    k = torch.randn((total + 1, KVH, D), device=DEV, generator=gen).to(DT)
    v = torch.randn_like(k)
    r2t = (torch.randperm(total, device=DEV, generator=gen) + 1).int().view(bs, context)
    rows = torch.arange(bs, device=DEV)
    seq = torch.full((bs,), context, device=DEV)
    # Window pool: the last `window` tokens of each request have window slots.
    win_rows = bs * window
    wk = torch.randn((win_rows + 1, KVH, D), device=DEV, generator=gen).to(DT)
    wv = torch.randn_like(wk)
    slot_map = torch.zeros(total + 1, dtype=torch.int64, device=DEV)
    tail = r2t[:, -window:].reshape(-1).long()
    slot_map[tail] = torch.randperm(win_rows, device=DEV, generator=gen) + 1
    q = torch.randn((bs, H, D), device=DEV, generator=gen).to(DT)
    o = torch.empty_like(q)
    splits = TritonAttentionBackend(H, KVH, D, DEV).num_kv_splits(bs)
    mid_o, mid_lse = alloc_decode_scratch(bs, H, splits, D, DEV)
    run = functools.partial(decode_attention_fwd, q, k, v, o, r2t, rows, seq, mid_o, mid_lse,
                            splits, D ** -0.5)
    return {
        "full": bench_ms(run),
        "full, softcap 50": bench_ms(functools.partial(run, softcap=50.0)),
        f"window {window}, plain pool": bench_ms(functools.partial(run, window=window)),
        f"window {window}, window pool": bench_ms(
            lambda: decode_attention_fwd(q, wk, wv, o, r2t, rows, seq, mid_o, mid_lse, splits,
                                         D ** -0.5, window=window, slot_map=slot_map)),
    }


def pool_memory(memory_gib: float, ratios: list[float]) -> list[tuple[str, int, int, float]]:
    """(pool, full slots, window slots, GiB allocated) for each pool in the bytes."""
    s = GEMMA3_12B
    windows = {i: s.window for i in range(s.num_layers) if i % 6 != 5}  # 5 of every 6
    out = []
    for ratio in [None, *ratios]:
        full, win = pool_sizes(s, memory_gib * 2**30, ratio)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        if ratio is None:
            pool = MHATokenToKVPool(full, DT, s.num_kv_heads, s.head_dim, s.num_layers, DEV)
        else:
            pool = SWAKVPool(full, win, DT, s.num_kv_heads, s.head_dim, s.num_layers, windows,
                             DEV)
        torch.cuda.synchronize()
        used = (torch.cuda.memory_allocated() - before) / 2**30
        out.append(("plain" if ratio is None else f"window, ratio {ratio:g}", full, win, used))
        del pool
        torch.cuda.empty_cache()
    return out


def decode_loop(memory_gib: float, ratio: float, bs: int, context: int, steps: int,
                chunk: int) -> list[tuple[int, int, int, int]]:
    """Prefill `bs` requests of `context` tokens on the window pool (chunked, with the
    cache hand-over), then decode `steps` steps; (step, context tokens resident,
    window slots the requests need, window slots the cache keeps but could drop)
    every steps // 4 steps. Bookkeeping only: the attention cost is part 1's."""
    s = GEMMA3_12B
    full, win = pool_sizes(s, memory_gib * 2**30, ratio)
    if bs * (context + steps) > full:
        raise SystemExit(f"{bs} x {context + steps} tokens exceed the window pool's {full}")
    # Bookkeeping runs on the GPU pool's slot map; one-element rows keep memory small.
    pool = SWAKVPool(full, win, torch.float16, 1, 1, 2, {1: s.window}, DEV)
    kv = KVManager(ReqToTokenPool(bs, context + steps + 8, DEV), pool, RadixCache(pool))
    reqs = [Req(rid=str(i), origin_input_ids=list(range(i * 7 + 1, i * 7 + 1 + context)),
                sampling_params=SamplingParams(max_new_tokens=steps), seed=0)
            for i in range(bs)]
    for r in reqs:
        kv.match(r)
        while r.kv_len < context:
            n = min(chunk, context - r.kv_len)
            assert kv.admit(r, n) is not None, "prefill did not fit"
            kv.cache_unfinished(r)
    out = []
    for step in range(steps + 1):
        if step % max(1, steps // 4) == 0:
            in_use = pool.window_size - pool.window_available_size()
            cached = kv.cache.window_sizes()[0]  # kept lazily, evictable
            out.append((step, sum(r.kv_len for r in reqs), in_use - cached, cached))
        if step == steps:
            break
        locs = kv.alloc(bs)
        assert locs is not None
        kv.extend_decode(reqs, locs)
        for r in reqs:
            r.output_ids.append(1)
    for r in reqs:
        kv.release(r)
    kv.check_invariants([])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--memory-gib", type=float, default=40.0)
    ap.add_argument("--ratios", default="0.8,0.25,0.1")
    ap.add_argument("--loop-context", type=int, default=49152, help="part 3: per request")
    ap.add_argument("--loop-steps", type=int, default=512)
    args = ap.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}; Gemma-3-12B attention ({H} q / {KVH} kv "
          f"heads, d{D}, bf16)")

    t = layer_times(args.bs, args.context, args.window)
    print(f"\n1. one decode layer, bs {args.bs} x {args.context} tokens")
    print("| layer | us |\n|---|---|")
    for name, ms in t.items():
        print(f"| {name} | {ms * 1e3:.1f} |")
    full = t["full"]
    win = t[f"window {args.window}, window pool"]
    print(f"model step's attention: 48 full layers {48 * full * 1e3:.0f} us; 8 full + 40 window "
          f"layers {(8 * full + 40 * win) * 1e3:.0f} us")

    print(f"\n2. KV memory: {args.memory_gib:g} GiB")
    print("| pool | tokens (full slots) | window slots | GiB allocated |\n|---|---|---|---|")
    plain = None
    for name, n_full, n_win, used in pool_memory(args.memory_gib,
                                                 [float(r) for r in args.ratios.split(",")]):
        plain = plain or n_full
        print(f"| {name} | {n_full} ({n_full / plain:.2f}x) | {n_win or '-'} | {used:.2f} |")

    ratio = float(args.ratios.split(",")[-1])
    print(f"\n3. decode on the window pool (ratio {ratio:g}), {args.bs} requests from "
          f"{args.loop_context} tokens")
    print("| step | context tokens resident | window slots needed | window slots cached, "
          "evictable |\n|---|---|---|---|")
    for step, tokens, need, cached in decode_loop(args.memory_gib, ratio, args.bs,
                                                  args.loop_context, args.loop_steps, 8192):
        print(f"| {step} | {tokens} | {need} | {cached} |")


if __name__ == "__main__":
    main()
