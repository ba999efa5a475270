"""The batch-invariant GEMM at decode sizes: tile candidates beside our bf16 GEMV.

    python benchmarks/invariant_gemm.py [--rows 1 8 32]

`--enable-deterministic-inference` sends every linear layer through
`layers/invariant_gemm.py`, whose K blocks and instruction family are fixed so
a row's bits do not depend on the row count; only the tile over M and N may
change with M. At decode (1-64 rows) the tile decides how many bytes of weight
are in flight, so this measures, on Llama-3.1-8B's projection shapes, each
candidate small-M tile (block_m, block_n, warps, stages): microseconds per call
(32 calls in a CUDA graph, the weights rotating through >= 512 MiB so each
call reads HBM) and weight TB/s, beside the default path's bf16 GEMV (one row)
in the same run; and whether the candidate's rows are bit-identical to the
same rows computed inside 128- and 512-row products (the large-M tiles). A
candidate that is not bit-identical cannot be used.
"""

from __future__ import annotations

import argparse

import torch

from radixlm.layers import gemv
from radixlm.layers import invariant_gemm as ig

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
# The one small-M tile used before, the two in use (ig.DEEP, ig.WIDE), other candidates.
CANDIDATES = [ig.GemmConfig(64, 32, 4, 5), ig.DEEP, ig.WIDE, ig.GemmConfig(64, 32, 4, 8),
              ig.GemmConfig(64, 16, 4, 8), ig.GemmConfig(64, 32, 4, 16),
              ig.GemmConfig(64, 64, 4, 8), ig.GemmConfig(16, 64, 4, 8)]
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


def invariant_rows(cfg: ig.GemmConfig, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether cfg's rows equal the same rows inside 128- and 512-row products."""
    m = x.shape[0]
    ig.FIXED_CONFIG = cfg
    try:
        small = ig.matmul(x, w)
    finally:
        ig.FIXED_CONFIG = None
    for rows in (128, 512):
        rest = torch.randn(rows - m, x.shape[1], device=x.device, dtype=x.dtype)
        if not torch.equal(ig.matmul(torch.cat([x, rest]), w)[:m], small):
            return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    args = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; microseconds per call (weight TB/s); "
          "'!' = rows not bit-identical to the large-M tiles")
    header = ["shape", "rows", "bf16 GEMV"] + ["x".join(map(str, c)) for c in CANDIDATES]
    print(" | ".join(header))
    for name, (n, k) in SHAPES.items():
        copies = max(2, (512 << 20) // (n * k * 2))
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
                   for _ in range(copies)]
        nbytes = n * k * 2
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            cells = []
            if m <= gemv.MAX_M:
                us = timed(lambda w, x=x: gemv.gemv(x, w), weights)
                cells.append(f"{us:.1f} ({nbytes / us / 1e6:.2f})")
            else:
                cells.append("-")
            for cfg in CANDIDATES:
                ok = invariant_rows(cfg, x, weights[0])
                ig.FIXED_CONFIG = cfg
                try:
                    us = timed(lambda w, x=x: ig.matmul(x, w), weights)
                finally:
                    ig.FIXED_CONFIG = None
                cells.append(f"{us:.1f} ({nbytes / us / 1e6:.2f}){'' if ok else ' !'}")
            print(" | ".join([name, str(m)] + cells), flush=True)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
