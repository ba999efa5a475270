"""The one-row FP8 GEMV's loop, read from its sm_90 SASS on a machine without a GPU.

Compiled for a Hopper target here (`sass.py`), so a tile's instruction mix can be
counted before device time is spent on it. Compiled with the launch's divisibility hints (pointers,
N, K and the row stride multiples of 16, as every Llama shape is); per tile,
with 16-byte weight vectors and with 8-byte ones (`GemvConfig.vec8`): the
loop's instructions per weight and its barriers and shared-memory traffic; then
the tensor-core GEMV (`fp8_mma.py`) per configuration; then the W8A8 GEMV
(`fp8_w8a8_gemv.py`), whose weights go from shared memory into the e4m3 MMA
without passing through registers, per tile.

    python benchmarks/fp8_gemv_sass.py

The Triton installed here may differ from the device's (3.6 there), so read the
counts as a guide to what a tile's loop does, not as the device's code.
"""

from __future__ import annotations

import collections

import triton
from sass import divisibility, main_loop, mma_gemv_loop, opcode_counts, signature, sm90_sass

from radixlm.layers.quantization.triton_ops import fp8 as F8
from radixlm.layers.quantization.triton_ops import fp8_mma as F8M
from radixlm.layers.quantization.triton_ops import fp8_w8a8_gemv as W8

KERNEL = F8._fp8_gemv_fma_kernel
SIGNATURE = signature(KERNEL, {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                               "b_ptr": "*fp32", "y_ptr": "*bf16"})
HINTS = divisibility(KERNEL, {"x_ptr", "w_ptr", "s_ptr", "b_ptr", "y_ptr", "N", "K",
                              "stride_wn"})  # all but stride_sn
TILES = [(8, 1024, 4, False), (8, 512, 4, True), (4, 2048, 4, False), (2, 2048, 4, False),
         (16, 512, 4, False), (4, 1024, 2, False), (2, 1024, 1, False)]


def loop_ops(bn: int, bk: int, warps: int, pairs: bool,
             vec8: bool) -> tuple[int, collections.Counter]:
    """(instructions, opcode counts) of the kernel's main loop for this tile."""
    consts = dict(BN=bn, BK=bk, BLOCK_K=0, SCALE_ROWS=1, HAS_BIAS=False, EVEN_K=True,
                  SILU_MUL=False, PAIRS=pairs, VEC8=vec8, PDL=False)
    body = main_loop(sm90_sass(KERNEL, SIGNATURE, consts, warps, hints=HINTS))
    return len(body), opcode_counts(body)


def main() -> None:
    print(f"Triton {triton.__version__}, sm_90; the one-row FP8 GEMV's main loop per tile")
    print(f"{'tile':<32}{'instr':>7}{'/weight':>9}{'BAR':>5}{'LDS':>5}{'STS':>5}{'LDG':>5}")
    for vec8 in (False, True):
        for bn, bk, warps, pairs in TILES:
            n, ops = loop_ops(bn, bk, warps, pairs, vec8)
            weights = bn * bk * (2 if pairs else 1) // (32 * warps)
            name = (f"{bn}x{bk}, {warps} warps" + (", pairs" if pairs else "")
                    + (", vec8" if vec8 else ""))
            print(f"{name:<32}{n:>7}{n / weights:>9.2f}{ops['BAR']:>5}{ops['LDS']:>5}"
                  f"{ops['STS']:>5}{ops['LDG']:>5}")


def main_mma() -> None:
    """The tensor-core GEMV (`fp8_mma.py`): its loop per configuration."""
    print("\nthe tensor-core GEMV's loop (a step: 128 features)")
    for warps, nt, prefetch, plain in [(4, 1, False, False), (4, 2, False, False),
                                       (4, 1, True, False), (4, 2, True, False),
                                       (4, 1, True, True), (4, 2, True, True)]:
        body = mma_gemv_loop(F8M.gemv_ptx(nt, prefetch, plain=plain), warps)
        ops = opcode_counts(body)
        weights = nt * 16 * 128 // 32 * (2 if prefetch else 1)
        name = (f"{warps} warps, {nt} tiles a warp" + (", prefetch" if prefetch else "")
                + (", plain" if plain else ""))
        print(f"{name:<32}{len(body):>7}{len(body) / weights:>9.2f}{ops['BAR']:>5}"
              f"{ops['LDS']:>5}{ops['STS']:>5}{ops['LDG']:>5}")


def main_w8a8() -> None:
    """The W8A8 GEMV at one row and at 16 (one row runs as 16, 15 of them zeros:
    the same loop), per tile; a step is 128 features of BN rows. Its weights
    never pass through registers, so "/weight" counts what the loop spends on x,
    scales and addresses per weight."""
    kernel = W8._w8a8_gemv_kernel
    sig = signature(kernel, {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                             "b_ptr": "*bf16", "out_ptr": "*fp32"})
    hints = divisibility(kernel, {"x_ptr", "w_ptr", "s_ptr", "out_ptr", "stride_xm",
                                  "stride_wn", "N"})
    print("\nthe W8A8 GEMV's loop (a step: 128 features of BN rows, 1-16 rows of x)")
    for bn, warps, stages in [(64, 4, 4), (128, 4, 4), (128, 8, 4), (256, 8, 4)]:
        consts = dict(BM=16, BN=bn, BLOCK_SCALES=False, SCALE_ROWS=1, DIRECT=False,
                      SILU_MUL=False, HAS_BIAS=False, EXACT=False, PDL=True)
        body = main_loop(sm90_sass(kernel, sig, consts, warps, stages, hints))
        ops = opcode_counts(body)
        name = f"{bn} rows, {warps} warps"
        print(f"{name:<32}{len(body):>7}{len(body) / (bn * 128 / (32 * warps)):>9.2f}"
              f"{ops['BAR']:>5}{ops['LDS']:>5}{ops['STS']:>5}{ops['LDG']:>5}")


if __name__ == "__main__":
    main()
    main_mma()
    main_w8a8()
