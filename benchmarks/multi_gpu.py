"""Multi-GPU measurements (issue 7): tp=2 vs tp=1 and dp=2 vs dp=1 on
Llama-3.1-8B's shape with dummy bf16 weights, in one process tree.

    NCCL_NVLS_ENABLE=0 python benchmarks/multi_gpu.py [ar] [tp] [cublas] [nccl] [nopdl]
        [profile] [dp] [prefix]

Prints: prompt-logprob agreement of tp=2 with tp=1, single-stream decode tok/s
beside the one- and two-GPU HBM rooflines, offline throughput (256 x 512 in /
256 out) for tp=1, tp=2, tp=2 with the all-reduce and the add + RMSNorm
after it as separate kernels, and tp=2 without programmatic dependent launch
(`nopdl`: also tp=1 without it; `cublas`: also tp=1 and tp=2 with cuBLAS in
place of our decode GEMV; `nccl`: also tp=2 with NCCL in place of the custom
all-reduce), dp=1 (= tp=1)
and dp=2, and cache-aware vs round-robin routing on a generated
shared-prefix workload. `ar`: latency of one all-reduce, NCCL vs the custom
one, and each followed by add + RMSNorm against the fused kernel, eager and
replayed from a CUDA graph. `profile` (with `tp`): a
torch.profiler breakdown of 40 tp=2 decode steps on rank 0 (GPU kernels per
step by kind, GPU idle time, host time waiting on the GPU).
"""

from __future__ import annotations

import gc
import os
import sys
import time

import torch
from decode_profile import profile_decode  # noqa: E402 (benchmarks/ is on sys.path)

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


def measure(engine, name: str, results: dict, profile: bool = False) -> None:
    greedy = {"temperature": 0.0, "ignore_eos": True}
    ids = prompts(1, 128, seed=7)[0]
    out = engine.generate(input_ids=ids, sampling_params={**greedy, "max_new_tokens": 1},
                          return_logprob=True, logprob_start_len=0)
    results[name + ":logprobs"] = [lp for lp, _ in out["meta_info"]["input_token_logprobs"][1:]]
    results[name + ":greedy"] = engine.generate(
        input_ids=ids, sampling_params={**greedy, "max_new_tokens": 32})["output_ids"]
    # Single stream, 128 in / 256 out: end to end (prefill and request handling
    # included), and decode alone: the same request cut to 1 output token, timed
    # too, is subtracted (255 decode steps in the difference).
    single = prompts(1, 128, seed=1)[0]
    took = {}
    for n in (1, 256, 1, 256):  # each twice, the faster kept
        engine.flush_cache()
        t0 = time.perf_counter()
        engine.generate(input_ids=single, sampling_params={**greedy, "max_new_tokens": n})
        took[n] = min(took.get(n, float("inf")), time.perf_counter() - t0)
    one = 256 / took[256]
    decode = 255 / (took[256] - took[1])
    engine.flush_cache()
    if profile:
        profile_decode(engine, name)
    work = prompts(256, 512)
    engine.generate(input_ids=work[:4], sampling_params={**greedy, "max_new_tokens": 4})
    engine.flush_cache()
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=work, sampling_params={**greedy, "max_new_tokens": 256})
    dt = time.perf_counter() - t0
    offline = sum(len(o["output_ids"]) for o in outs) / dt
    results[name] = (one, offline, decode)
    log(f"{name}: single stream {one:.1f} tok/s end to end, decode alone {decode:.1f} tok/s "
        f"({1e3 / decode:.2f} ms per step; first token {took[1] * 1e3:.1f} ms); offline "
        f"256x512/256 {offline:.0f} tok/s ({dt:.2f} s)")


# ---- all-reduce latency -------------------------------------------------------------
AR_SIZES = [8 << 10, 64 << 10, 512 << 10, 2 << 20]


def _ar_worker(rank: int, port: int) -> None:
    from radixlm import distributed as tp

    torch.cuda.set_device(rank)
    tp.init_distributed("nccl", f"tcp://127.0.0.1:{port}", 2, rank, 120)
    from radixlm.layers.fused_ops import rms_norm

    custom = tp._CUSTOM_AR
    rows = []
    for nbytes in AR_SIZES:
        x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        fns = {"nccl": lambda x=x: torch.distributed.all_reduce(x)}
        if custom is not None:
            fns["custom"] = lambda x=x: custom(x)
            # The same sum followed by add + RMSNorm (hidden 4096), apart and fused.
            x2, w = x.view(-1, 4096), torch.ones(4096, dtype=torch.bfloat16, device="cuda")
            fns["custom+norm"] = lambda x2=x2, w=w: rms_norm(custom(x2), w, 1e-5, x2)
            if tp.partial_sum_buffer(x2.shape, x2.dtype, x2.device) is not None:
                fns["fused"] = lambda x2=x2, w=w: tp.all_reduce_add_rms_norm(
                    tp.partial_sum_buffer(x2.shape, x2.dtype, x2.device), x2, w, 1e-5)
        for label, fn in fns.items():
            rows.append((nbytes, label, _time_eager(fn), _time_graph(fn)))
    if rank == 0:
        log(f"custom all-reduce: {'on' if custom is not None else 'UNAVAILABLE'}")
        log("bytes     impl         eager us  in-graph us (mean of 64 back to back)")
        for nbytes, label, eager, graph in rows:
            log(f"{nbytes:>8} {label:>12} {eager:9.1f} {graph:11.1f}")
    torch.distributed.destroy_process_group()


def _time_eager(fn, iters: int = 200) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    torch.distributed.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def _time_graph(fn, calls: int = 64, replays: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    torch.distributed.barrier()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1e3 / (calls * replays)


def all_reduce_latency() -> None:
    import torch.multiprocessing as mp

    from radixlm.server.workers import free_port

    mp.spawn(_ar_worker, args=(free_port(),), nprocs=2)


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

    phases = sys.argv[1:] or ["ar", "tp", "dp", "prefix"]
    if "ar" in phases:
        all_reduce_latency()
    bw = copy_bandwidth()
    weight_bytes = 16.06e9
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s per GPU; rooflines: 1 GPU "
        f"{bw / weight_bytes:.0f} tok/s, 2 GPUs {2 * bw / weight_bytes:.0f} tok/s")
    results: dict = {}
    if "tp" in phases:
        # Peers in the same run: cuBLAS instead of our GEMV, and with `nccl`, NCCL
        # instead of the custom all-reduce.
        variants = [("tp=1", {}), ("tp=2", {"tp_size": 2}),
                    ("tp=2 unfused", {"tp_size": 2, "disable_allreduce_fusion": True}),
                    ("tp=2 no-pdl", {"tp_size": 2, "disable_pdl": True})]
        if "nopdl" in phases:
            variants.append(("tp=1 no-pdl", {"disable_pdl": True}))
        if "cublas" in phases:
            variants += [("tp=1 cublas", {"disable_gemv": True}),
                         ("tp=2 cublas", {"tp_size": 2, "disable_gemv": True})]
        if "nccl" in phases:
            variants.append(("tp=2 nccl", {"tp_size": 2, "disable_custom_all_reduce": True}))
        for name, kw in variants:
            e = radixlm.Engine(**kw, **COMMON)
            measure(e, name, results, profile="profile" in phases and name == "tp=2")
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
        one1, dec1 = results["tp=1"][0], results["tp=1"][2]
        roof1, roof2 = bw / weight_bytes, 2 * bw / weight_bytes
        for name in [v[0] for v in variants if v[0].startswith("tp=1")]:
            one, _, dec = results[name]
            log(f"single-stream: {name} = {one / roof1:.0%} of the one-GPU roofline end to "
                f"end, {dec / roof1:.0%} decode alone")
        for name in [v[0] for v in variants if v[0].startswith("tp=2")]:
            one2, _, dec2 = results[name]
            log(f"single-stream: {name} / tp=1 = {one2 / one1:.2f}x end to end, "
                f"{dec2 / dec1:.2f}x decode alone; {name} = {one2 / roof2:.0%} of the two-GPU "
                f"roofline end to end ({1e3 / one2:.2f} ms per token), {dec2 / roof2:.0%} "
                f"decode alone ({1e3 / dec2:.2f} ms per step)")
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
