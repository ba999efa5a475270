"""The batch-invariant GEMM's tiles beside the default path's products (our bf16
GEMV, cuBLAS).

    python benchmarks/invariant_gemm.py [--rows 1 8 32 256] [--large-rows 512 4096]

`--enable-deterministic-inference` sends every linear layer through
`layers/invariant_gemm.py`, whose K blocks and instruction family are fixed so
a row's bits do not depend on the row count; only the tile over M and N may
change with M. At decode (1-64 rows) the tile decides how many bytes of weight
are in flight, so this measures, on Llama-3.1-8B's projection shapes, each
candidate small-M tile (token rows, weight rows, warps, stages): microseconds
per call (32 calls in a CUDA graph, the weights rotating through >= 512 MiB so
each call reads HBM) and weight TB/s, beside the default path's product (our
bf16 GEMV up to its rows, cuBLAS above: batched decode) in the same run;
`--large-rows` does the same for prefill tiles in TFLOP/s; and whether the
candidate's rows are bit-identical to the same rows computed inside 128- and
512-row products (the large-M tiles). A candidate that is not bit-identical
cannot be used.
"""

from __future__ import annotations

import argparse

import torch

from radixlm.layers import gemv
from radixlm.layers import invariant_gemm as ig

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
# Small-M tiles (token rows, weight rows, warps, stages): the two in use
# (ig.DECODE*), then other depths and widths.
C = ig.GemmConfig
CANDIDATES = [ig.DECODE, ig.DECODE_LONG_K, C(16, 64, 4, 8), C(16, 64, 4, 16), C(32, 64, 4, 16),
              C(64, 64, 4, 12), C(16, 128, 8, 10)]
# Batched decode (65-256 rows, e.g. offline decode at batch 256): the tiles in use
# (ig.BATCHED, pick_config's choice among them by programs), the same through
# pointer loads or TMA (whichever they are not), then others wider, deeper, taller.
MID = [*ig.BATCHED, *(c._replace(tma=not c.tma) for c in ig.BATCHED), C(64, 128, 4, 4),
       C(128, 64, 8, 4), C(256, 64, 8, 3)]
# Large-M tiles: the two in use (ig.CONFIGS), the same through pointer loads or
# TMA (whichever they are not), then wider and deeper ones.
LARGE = [ig.CONFIGS[0][1], ig.CONFIGS[1][1],
         *(c._replace(tma=not c.tma) for _, c in ig.CONFIGS),
         C(128, 128, 8, 3, True), C(128, 256, 8, 3, True), C(256, 128, 8, 3, True)]
CALLS = 32


def timed(fn, weights: list[torch.Tensor]) -> float:
    """Microseconds per call of fn(w), CALLS calls per CUDA graph, median of 5 replays."""
    for w in weights[:2]:
        fn(w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(weights[i % len(weights)])
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return sorted(times)[2]


def fixed(cfg: ig.GemmConfig, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T on tile cfg, whatever pick_config would take."""
    ig.FIXED_CONFIG = cfg
    try:
        return ig.matmul(x, w)
    finally:
        ig.FIXED_CONFIG = None


def invariant_rows(cfg: ig.GemmConfig, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether cfg's rows equal the same rows inside two larger products (at least
    128 and 512 rows: the tiles pick_config gives there)."""
    m = x.shape[0]
    small = fixed(cfg, x, w)
    for rows in sorted({max(128, 2 * m), max(512, 4 * m)}):
        rest = torch.randn(rows - m, x.shape[1], device=x.device, dtype=x.dtype)
        if not torch.equal(ig.matmul(torch.cat([x, rest]), w)[:m], small):
            return False
    return True


def label(cfg: ig.GemmConfig) -> str:
    return "x".join(map(str, cfg[:4])) + ("-tma" if cfg.tma else "")


def large_rows(rows: list[int], dev: torch.device) -> None:
    """Prefill sizes: the large-M tiles beside cuBLAS (F.linear), TFLOP/s; '!' as above."""
    print("large M: microseconds per call (TFLOP/s); peer: cuBLAS")
    print(" | ".join(["shape", "rows", "cuBLAS"] + [label(c) for c in LARGE]))
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        one = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        alone = ig.matmul(one, w)
        for m in rows:
            x = torch.cat([one, torch.randn(m - 1, k, device=dev, dtype=torch.bfloat16)])
            flop = 2 * m * n * k
            us = timed(lambda w, x=x: torch.nn.functional.linear(x, w), [w])
            cells = [f"{us:.1f} ({flop / us / 1e6:.0f})"]
            for cfg in LARGE:
                ok = torch.equal(fixed(cfg, x, w)[:1], alone)
                us = timed(lambda w, x=x, cfg=cfg: fixed(cfg, x, w), [w])
                cells.append(f"{us:.1f} ({flop / us / 1e6:.0f}){'' if ok else ' !'}")
            print(" | ".join([name, str(m)] + cells), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--large-rows", type=int, nargs="*", default=[512, 4096])
    args = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; microseconds per call (weight TB/s); "
          "'!' = rows not bit-identical to the large-M tiles")
    header = None
    for name, (n, k) in SHAPES.items():
        copies = max(2, (512 << 20) // (n * k * 2))
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
                   for _ in range(copies)]
        nbytes = n * k * 2
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            cells = []
            # The default path's product: our GEMV up to its rows, cuBLAS above.
            if m <= gemv.MAX_M:
                us = timed(lambda w, x=x: gemv.gemv(x, w), weights)
            else:
                us = timed(lambda w, x=x: torch.nn.functional.linear(x, w), weights)
            cells.append(f"{us:.1f} ({nbytes / us / 1e6:.2f})")
            cands = CANDIDATES if m <= 64 else MID
            if header != cands:  # a table per candidate list
                header = cands
                print(" | ".join(["shape", "rows", "GEMV / cuBLAS"] + [label(c) for c in cands]))
            for cfg in cands:
                ok = invariant_rows(cfg, x, weights[0])
                us = timed(lambda w, x=x, cfg=cfg: fixed(cfg, x, w), weights)
                cells.append(f"{us:.1f} ({nbytes / us / 1e6:.2f}){'' if ok else ' !'}")
            print(" | ".join([name, str(m)] + cells), flush=True)
        del weights
        torch.cuda.empty_cache()
    large_rows(args.large_rows, dev)


if __name__ == "__main__":
    main()
