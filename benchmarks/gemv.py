"""F.linear (cuBLAS) vs radixlm.layers.gemv on the Llama-3.1-8B decode shapes.

Weights rotate through enough copies (>= 256 MiB in all) that each call reads
from HBM, not L2, as in a real decode step. Eager: CUDA events around single
calls, each after a 256 MiB memset and a ~100 us GPU sleep so the launch is
queued before the GPU gets there (kernel time, not Python launch time; the
host column gives the CPU cost of one launch). Graph: 64 back-to-back calls in
one CUDA graph, replayed, time / 64. Medians throughout.

    python benchmarks/gemv.py            # the table
    python benchmarks/gemv.py --sweep    # graph time of every candidate config
    python benchmarks/gemv.py --sweep --m1    # ... at one row only
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixlm.layers.gemv import GemvConfig, gemv, pick_config, use_gemv

SHAPES = [("tp1 qkv", 4096, 6144), ("tp1 o", 4096, 4096), ("tp1 gate_up", 4096, 28672),
          ("tp1 down", 14336, 4096), ("tp1 lm_head", 4096, 128256),
          ("tp2 qkv", 4096, 3072), ("tp2 o", 2048, 4096), ("tp2 gate_up", 4096, 14336),
          ("tp2 down", 7168, 4096), ("tp2 lm_head", 4096, 64128)]
MS = (1, 2, 4, 8)
CANDIDATES = [GemvConfig("fma", *c) for c in [
    (4, 1024, 4, 1), (16, 1024, 8, 1), (8, 1024, 8, 1), (16, 512, 4, 1), (4, 1024, 2, 1),
    (2, 1024, 2, 1), (8, 2048, 8, 1), (32, 512, 8, 1), (16, 1024, 4, 1), (2, 2048, 4, 1)]
] + [GemvConfig("mma", *c) for c in [
    (16, 512, 2, 4), (64, 128, 4, 6), (64, 256, 4, 4), (32, 128, 2, 6), (16, 1024, 2, 3),
    (16, 512, 2, 6), (16, 512, 1, 4), (32, 512, 2, 4), (64, 128, 4, 8), (64, 64, 4, 10),
    (128, 128, 4, 4), (128, 64, 4, 6), (64, 256, 8, 4), (128, 128, 8, 4), (32, 256, 2, 5)]]
DEV = torch.device("cuda")
REPS = 5 if "--sweep" in sys.argv else 10
FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
Fn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def weight_copies(k: int, n: int) -> list[torch.Tensor]:
    count = max(2, math.ceil((256 << 20) / (n * k * 2)))
    return [(torch.randn(n, k, device=DEV) * 0.02).bfloat16() for _ in range(count)]


def time_eager(fn: Fn, x: torch.Tensor, ws: list[torch.Tensor], reps: int = 40) -> float:
    fn(x, ws[0])
    times = []
    for i in range(reps):
        FLUSH.zero_()
        torch.cuda._sleep(200_000)  # ~100 us of backlog, so the launch is queued in time
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x, ws[i % len(ws)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def time_graph(fn: Fn, x: torch.Tensor, ws: list[torch.Tensor], calls: int = 64,
               reps: int = REPS) -> float:
    fn(x, ws[0])  # compile / pick the cuBLAS kernel outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(x, ws[i % len(ws)])
    graph.replay()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / calls)
    del graph
    return statistics.median(times)


def host_time(fn: Fn, x: torch.Tensor, ws: list[torch.Tensor], calls: int = 200) -> float:
    fn(x, ws[0])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(calls):
        fn(x, ws[i % len(ws)])
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls


def copy_bandwidth() -> tuple[float, float]:
    """(read + write) / time of a 1 GiB copy: as a memcpy node, and as an SM kernel."""
    a = torch.randn(1 << 29, device=DEV).bfloat16()
    b = torch.empty_like(a)
    nbytes = 2 * a.numel() * a.element_size()
    t_memcpy = time_graph(lambda x, w: b.copy_(a), a, [a], calls=8)
    t_kernel = time_graph(lambda x, w: torch.mul(a, 1, out=b), a, [a], calls=8)
    return nbytes / t_memcpy, nbytes / t_kernel


def table() -> None:
    memcpy, kernel = copy_bandwidth()
    print(f"1 GiB copy, (read + write) / time: memcpy {memcpy / 1e9:.0f} GB/s,"
          f" mul kernel {kernel / 1e9:.0f} GB/s")
    hdr = (f"{'shape':<12} {'K->N':>13} {'M':>2} | {'eager us':>16} {'eager GB/s':>16} {'x':>5}"
           f" | {'graph us':>16} {'graph GB/s':>16} {'x':>5} | {'host us':>11} | use cfg")
    print(hdr)
    print(f"{'':<33}| {'cublas  gemv':>16} {'cublas   gemv':>16} {'':>5} |"
          f" {'cublas  gemv':>16} {'cublas   gemv':>16} {'':>5} | cublas gemv |")
    for name, k, n in SHAPES:
        ws = weight_copies(k, n)
        nbytes = n * k * 2
        for m in MS:
            x = torch.randn(m, k, device=DEV).bfloat16()
            cfg = pick_config(m, n, k)
            row = []
            for timer in (time_eager, time_graph):
                t_ref = timer(lambda x, w: F.linear(x, w), x, ws)
                t_new = timer(lambda x, w: gemv(x, w), x, ws)
                row.append(f"{t_ref * 1e6:7.1f} {t_new * 1e6:7.1f}  {nbytes / t_ref / 1e9:7.0f}"
                           f" {nbytes / t_new / 1e9:7.0f}  {t_ref / t_new:5.2f}")
            h_ref = host_time(lambda x, w: F.linear(x, w), x, ws) * 1e6
            h_new = host_time(lambda x, w: gemv(x, w), x, ws) * 1e6
            print(f"{name:<12} {k:>6}->{n:<6} {m:>2} | {row[0]} | {row[1]} | "
                  f"{h_ref:5.1f} {h_new:5.1f} | "
                  f"{'Y' if use_gemv(x, ws[0]) else 'n'} {tuple(cfg)}", flush=True)
        del ws


def sweep() -> None:
    for name, k, n in SHAPES:
        ws = weight_copies(k, n)
        nbytes = n * k * 2
        for m in (1,) if "--m1" in sys.argv else MS:
            x = torch.randn(m, k, device=DEV).bfloat16()
            ref = nbytes / time_graph(lambda x, w: F.linear(x, w), x, ws) / 1e9
            res = []
            for cfg in CANDIDATES:
                if cfg.kernel == "fma" and m > 1:
                    continue
                try:
                    t = time_graph(lambda x, w, cfg=cfg: gemv(x, w, config=cfg), x, ws)
                    res.append((nbytes / t / 1e9, cfg))
                except Exception as e:  # out of shared memory etc.
                    print(f"  {cfg} failed: {type(e).__name__}: {str(e)[:100]}")
            res.sort(key=lambda r: -r[0])
            best = res[0]
            print(f"{name:<12} K={k:<5} N={n:<6} M={m} cublas {ref:5.0f} GB/s | best {best[0]:5.0f}"
                  f" {tuple(best[1])} | " + " ".join(
                      f"{c.kernel[0]}{c.bn}/{c.bk}/{c.warps}/{c.stages}:{g:.0f}" for g, c in res),
                  flush=True)
        del ws


if __name__ == "__main__":
    torch.manual_seed(0)
    if "--sweep" in sys.argv:
        sweep()
    else:
        table()
