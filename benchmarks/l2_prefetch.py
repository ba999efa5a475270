"""Does an L2 prefetch during a window of idle DRAM make the next one-row product
faster? (`radixlm/layers/l2_prefetch.py`, Llama-3.1-8B's projection shapes.)

    python benchmarks/l2_prefetch.py                  # window 8 us, PDL as the engine
    python benchmarks/l2_prefetch.py --window-us 4 --no-pdl

Each row times three CUDA graphs of 32 steps, replayed 10 times (median, time /
32); a step's weights rotate through copies of >= 256 MiB, so without the
prefetch each product reads them from HBM, as a decode step does:
- window: a kernel that spins `--window-us` (what RoPE and attention are to o_proj);
- cold: the window, then the product;
- prefetched: the same, with the product's weights asked for on a side stream
  as the window starts (as the engine forks after the qkv product).
Columns: us a step; "product" = step - window. The product's forms are the
engine's at one row: our bf16 GEMV, the FP8 tensor-core GEMV reading the
weight where it lies (per-row scales), the int4 tensor-core GEMV (group 128).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from quant_kernels import DEV, SHAPES, copies, fp8_row_weights, int4_weights, replay_seconds

from radixlm.layers import l2_prefetch, pdl
from radixlm.layers.gemv import gemv
from radixlm.layers.quantization.triton_ops import fp8_mma as F8M
from radixlm.layers.quantization.triton_ops import int4_mma as M4

STEPS = 32


def forms(n: int, k: int) -> dict[str, tuple[Callable, Callable, Callable]]:
    """name -> (product of x and a weight, weight maker, the weight's tensors to prefetch)."""
    return {
        "bf16 GEMV": (lambda x, w: gemv(x, w),
                      lambda: (torch.randn(n, k, device=DEV) * 0.02).bfloat16(),
                      lambda w: [w]),
        "fp8 MMA plain": (lambda x, w: F8M.fp8_gemv_mma_plain(x, w[0], w[1]),
                          lambda: fp8_row_weights(n, k)[:2], lambda w: list(w)),
        "int4 g128 MMA": (lambda x, w: M4.int4_gemv_mma(x, w[3], w[1], w[2], 128),
                          lambda: int4_weights(n, k), lambda w: [w[3], w[1], w[2]]),
    }


def time_steps(step: Callable[[int], None], side: torch.cuda.Stream | None = None,
               reps: int = 10) -> float:
    """us a step of a graph of STEPS calls of `step(i)`; `side`: the stream the steps
    fork, joined at the end (a capture may wait only on streams it forked)."""
    for i in range(2):  # compile outside capture
        step(i)
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=stream):
        for i in range(STEPS):
            step(i)
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
    return replay_seconds(graph, reps) * 1e6 / STEPS


def measure(call: Callable, make: Callable, tensors: Callable, k: int,
            cycles: int) -> tuple[float, float, float]:
    """us a step: (window, window + cold product, window + prefetched product)."""
    x = torch.randn(1, k, device=DEV).bfloat16()
    one = make()
    ws = copies(make, sum(t.numel() * t.element_size() for t in tensors(one)))
    side = torch.cuda.Stream()

    def window(i: int) -> None:
        torch.cuda._sleep(cycles)

    def cold(i: int) -> None:
        window(i)
        call(x, ws[i % len(ws)])

    def prefetched(i: int) -> None:
        w = ws[i % len(ws)]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for t in tensors(w):
                l2_prefetch.prefetch(t)
        window(i)
        call(x, w)

    return time_steps(window), time_steps(cold), time_steps(prefetched, side)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window-us", type=float, default=8.0)
    p.add_argument("--no-pdl", action="store_true")
    args = p.parse_args()
    on = pdl.set_pdl(not args.no_pdl, DEV)
    props = torch.cuda.get_device_properties(DEV)
    cycles = int(args.window_us * props.clock_rate * 1e-3)  # clock_rate: kHz
    print(f"{torch.cuda.get_device_name()}, L2 {props.L2_cache_size / 2**20:.0f} MiB, "
          f"PDL {on}, window {args.window_us} us ({cycles} cycles)")
    print("| shape | form | weight MB | window | cold: product | prefetched: product | "
          "product cold / prefetched |")
    print("|---|---|---|---|---|---|---|")
    for name, k, n in SHAPES:
        for form, (call, make, tensors) in forms(n, k).items():
            size = sum(t.numel() * t.element_size() for t in tensors(make()))
            win, cold, pre = measure(call, make, tensors, k, cycles)
            torch.cuda.empty_cache()
            print(f"| {name} | {form} | {size / 1e6:.1f} | {win:.1f} | {cold - win:.1f} | "
                  f"{pre - win:.1f} | {(cold - win) / max(pre - win, 1e-3):.2f}x |", flush=True)


if __name__ == "__main__":
    main()
