"""Multi-GPU measurements (issue 7): tp=2 vs tp=1 and dp=2 vs dp=1 on
Llama-3.1-8B's shape with dummy bf16 weights, in one process tree.

    NCCL_NVLS_ENABLE=0 python benchmarks/multi_gpu.py

Prints: prompt-logprob agreement of tp=2 with tp=1, single-stream decode tok/s
beside the one- and two-GPU HBM rooflines, offline throughput (256 x 512 in /
256 out) for tp=1, tp=2, dp=1 (= tp=1) and dp=2, and cache-aware vs
round-robin routing on a generated shared-prefix workload.
"""

from __future__ import annotations

import gc
import os
import sys
import time

import torch

MODEL = os.path.join(os.path.dirname(__file__), "llama-3.1-8b")
COMMON = dict(model_path=MODEL, load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16")


def log(*args: object) -> None:
    print(*args, flush=True)


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 10 / (time.perf_counter() - t0)
    del x, y
    torch.cuda.empty_cache()
    return bw


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 128000, (n, length), generator=g).tolist()


def measure(engine, name: str, results: dict) -> None:
    greedy = {"temperature": 0.0, "ignore_eos": True}
    ids = prompts(1, 128, seed=7)[0]
    out = engine.generate(input_ids=ids, sampling_params={**greedy, "max_new_tokens": 1},
                          return_logprob=True, logprob_start_len=0)
    results[name + ":logprobs"] = [lp for lp, _ in out["meta_info"]["input_token_logprobs"][1:]]
    results[name + ":greedy"] = engine.generate(
        input_ids=ids, sampling_params={**greedy, "max_new_tokens": 32})["output_ids"]
    engine.flush_cache()
    t0 = time.perf_counter()
    engine.generate(input_ids=prompts(1, 128, seed=1)[0],
                    sampling_params={**greedy, "max_new_tokens": 256})
    one = 256 / (time.perf_counter() - t0)
    engine.flush_cache()
    work = prompts(256, 512)
    engine.generate(input_ids=work[:4], sampling_params={**greedy, "max_new_tokens": 4})
    engine.flush_cache()
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=work, sampling_params={**greedy, "max_new_tokens": 256})
    dt = time.perf_counter() - t0
    offline = sum(len(o["output_ids"]) for o in outs) / dt
    results[name] = (one, offline)
    log(f"{name}: single-stream decode {one:.1f} tok/s; offline 256x512/256 {offline:.0f} "
        f"tok/s ({dt:.2f} s)")


def shared_prefix(method: str) -> tuple[float, float]:
    from radixlm.bench.shared_prefix import build_workload, run
    from radixlm.config import ServerArgs

    work = build_workload(16, 16, 1024, 128, 128000, seed=0)
    r = run(ServerArgs(dp_size=2, load_balance_method=method, **COMMON), work, 128)
    log(f"dp=2 {method}: shared prefix 16x16 (1024 + 128 in, 128 out): {r['tok_s']:.0f} "
        f"tok/s, hit rate {r['hit_rate']:.1%}, routed {r['routed']}")
    return r["tok_s"], r["hit_rate"]


def main() -> None:
    import radixlm

    phases = sys.argv[1:] or ["tp", "dp", "prefix"]
    bw = copy_bandwidth()
    weight_bytes = 16.06e9
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s per GPU; rooflines: 1 GPU "
        f"{bw / weight_bytes:.0f} tok/s, 2 GPUs {2 * bw / weight_bytes:.0f} tok/s")
    results: dict = {}
    if "tp" in phases:
        for tp in (1, 2):
            e = radixlm.Engine(tp_size=tp, **COMMON)
            measure(e, f"tp={tp}", results)
            e.shutdown()
            del e  # tp=1 runs in this process: free its GPU memory for the next one
            gc.collect()
            torch.cuda.empty_cache()
        a, b = torch.tensor(results["tp=1:logprobs"]), torch.tensor(results["tp=2:logprobs"])
        g1, g2 = results["tp=1:greedy"], results["tp=2:greedy"]
        agree = next((i for i, (x, y) in enumerate(zip(g1, g2)) if x != y), len(g1))
        log(f"prompt logprobs tp=2 vs tp=1 (127 positions): max |diff| "
            f"{(a - b).abs().max():.4f}, mean {(a - b).abs().mean():.4f}; greedy prefix "
            f"agreement {agree}/32")
        one1, one2 = results["tp=1"][0], results["tp=2"][0]
        log(f"single-stream: tp=2 / tp=1 = {one2 / one1:.2f}x; tp=2 = "
            f"{one2 / (2 * bw / weight_bytes):.0%} of the two-GPU roofline")
    if "dp" in phases:
        with radixlm.Engine(dp_size=2, **COMMON) as e:
            measure(e, "dp=2", results)
        if "tp=1" in results:
            log(f"offline: dp=2 / dp=1 = {results['dp=2'][1] / results['tp=1'][1]:.2f}x")
    if "prefix" in phases:
        ca, rr = shared_prefix("cache_aware"), shared_prefix("round_robin")
        log(f"cache_aware / round_robin = {ca[0] / rr[0]:.2f}x")


if __name__ == "__main__":
    main()
