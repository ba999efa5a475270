"""Does asking the L2 for a one-row product's weights during a window of idle DRAM
make the product faster? (Llama-3.1-8B's projection shapes.) The question behind
an `--l2-prefetch` that was built and taken out: end to end it cost FP8 single
stream 19 % (BENCHMARKS.md, 2026-12-05, 23:10).

    python benchmarks/l2_prefetch.py                  # window 8 us, PDL as the engine
    python benchmarks/l2_prefetch.py --window-us 4 --no-pdl

Each row times CUDA graphs of 32 steps, replayed 10 times (median, time / 32);
a step's weights rotate through copies of >= 256 MiB, so without help each
product reads them from HBM, as a decode step does. Steps: a kernel that spins
`--window-us` (what RoPE and attention are to o_proj), then the product; the
columns are us of the product:
- cold: as it is; warm: the product run a second time (from L2 where it fits);
- bulk / lines / read: after asking for its weights on a side stream as the
  window starts: sm_90's bulk prefetch (`cp.async.bulk.prefetch.L2`, 4 KiB a
  lane), one `prefetch.global.L2` a 128-byte line, or a kernel reading them.
The product's forms are the engine's at one row: our bf16 GEMV, the FP8
tensor-core GEMV reading the weight where it lies (per-row scales), the int4
tensor-core GEMV (group 128).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from quant_kernels import DEV, SHAPES, copies, fp8_row_weights, int4_weights, replay_seconds

from radixlm.layers import pdl
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


BULK_PTX = """{
.reg .pred p;
setp.gt.s32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}"""  # $1 the address, $2 the bytes (a multiple of 16; none where <= 0)
CHUNK, LANES = 1 << 17, 32  # bytes a program asks for, in 4 KiB a lane


@triton.jit
def _bulk_prefetch_kernel(base_ptr, size, CHUNK: tl.constexpr, LANES: tl.constexpr,
                          PTX: tl.constexpr):
    """Lane l of program p asks for bytes [p CHUNK + l CHUNK / LANES, + CHUNK / LANES)
    of the `size` from `base_ptr` (clipped at `size`)."""
    sub: tl.constexpr = CHUNK // LANES
    offset = tl.program_id(0).to(tl.int64) * CHUNK + tl.arange(0, LANES) * sub
    nbytes = tl.minimum(size - offset, sub).to(tl.int32)
    address = base_ptr.to(tl.int64, bitcast=True) + offset
    tl.inline_asm_elementwise(PTX, "=r,l,r", [address, nbytes], dtype=tl.int32,
                              is_pure=False, pack=1)


def by_bulk(t: torch.Tensor) -> None:
    """The tensor's bytes (contiguous, 16-byte aligned) in bulk prefetches."""
    size = t.numel() * t.element_size() // 16 * 16
    _bulk_prefetch_kernel[(triton.cdiv(size, CHUNK),)](t, size, CHUNK=CHUNK, LANES=LANES,
                                                       PTX=BULK_PTX, num_warps=1)


@triton.jit
def _line_prefetch_kernel(base_ptr, nbytes, BLOCK: tl.constexpr):
    """One `prefetch.global.L2` a 128-byte line, a line a thread."""
    line = (tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)) * 128
    address = base_ptr.to(tl.int64, bitcast=True) + tl.minimum(line, nbytes - 1)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [address],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _read_kernel(ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Reads n int32 (16 bytes a thread at a time) and writes one xor a program."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(v, 0))


def by_lines(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    _line_prefetch_kernel[(triton.cdiv(nbytes, 128 * 256),)](t, nbytes, BLOCK=256, num_warps=8)


def by_reading(t: torch.Tensor, sink: torch.Tensor) -> None:
    flat = t.view(-1).view(torch.int32)
    _read_kernel[(triton.cdiv(flat.numel(), 4096),)](flat, sink, flat.numel(), BLOCK=4096,
                                                      num_warps=8)


def measure(call: Callable, make: Callable, nbytes: int, tensors: Callable, k: int,
            cycles: int) -> dict[str, float]:
    """us a step: the window alone, + the product cold, + twice (the second from
    L2 where it fits), and + the product after each way of asking for its weights
    on a side stream as the window starts. `nbytes`: the weight bytes a product
    reads (the copies rotate through >= 256 MiB of them)."""
    x = torch.randn(1, k, device=DEV).bfloat16()
    ws = copies(make, nbytes)
    side = torch.cuda.Stream()
    sink = torch.empty(1 << 20, device=DEV, dtype=torch.int32)
    ways = {"bulk": by_bulk, "lines": by_lines,
            "read": lambda t: by_reading(t, sink)}

    def window(i: int) -> None:
        torch.cuda._sleep(cycles)

    def cold(i: int) -> None:
        window(i)
        call(x, ws[i % len(ws)])

    def twice(i: int) -> None:
        cold(i)
        call(x, ws[i % len(ws)])

    def prefetched(how: Callable, i: int) -> None:
        w = ws[i % len(ws)]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for t in tensors(w):
                how(t)
        window(i)
        call(x, w)

    out = {"window": time_steps(window), "cold": time_steps(cold), "twice": time_steps(twice)}
    for name, how in ways.items():
        out[name] = time_steps(lambda i, how=how: prefetched(how, i), side)
    return out


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
    print("us of the product after the window: cold; warm (run twice, the second); after "
          "asking for its weights by bulk prefetch (the engine's), by a prefetch a line, by "
          "reading them")
    print("| shape | form | weight MB | window | cold | warm | bulk | lines | read |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, k, n in SHAPES:
        for form, (call, make, tensors) in forms(n, k).items():
            size = sum(t.numel() * t.element_size() for t in tensors(make()))
            r = measure(call, make, size, tensors, k, cycles)
            torch.cuda.empty_cache()
            win = r["window"]
            cells = [r["cold"] - win, r["twice"] - r["cold"],
                     *(r[h] - win for h in ("bulk", "lines", "read"))]
            print(f"| {name} | {form} | {size / 1e6:.1f} | {win:.1f} | "
                  + " | ".join(f"{c:.1f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
