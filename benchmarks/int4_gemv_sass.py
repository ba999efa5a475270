"""The one-row int4 GEMV's loop, read from its sm_90 SASS on a machine without a GPU.

Compiled for a Hopper target here (`sass.py`) with the launch's divisibility hints
(pointers, N, K and strides multiples of 16, as every Llama shape is), group 128,
bf16 x; per tile, the unpacked fp32 form, the packed halves (today's default) and
the packed halves with `Int4Config.lean`; then the tensor-core GEMV
(`int4_mma.py`) per `MmaConfig`: the loop's instructions per weight (a thread's
share) and the opcodes that make them up.

    python benchmarks/int4_gemv_sass.py

The Triton installed here may differ from the device's (3.6 there), so read the
counts as a guide to what a tile's loop does, not as the device's code.
"""

from __future__ import annotations

import collections

import triton
from sass import divisibility, main_loop, mma_gemv_loop, opcode_counts, signature, sm90_sass

from radixlm.layers.quantization.triton_ops import int4 as I4
from radixlm.layers.quantization.triton_ops import int4_mma as I4M

KERNEL = I4._int4_gemv_kernel
SIGNATURE = signature(KERNEL, {"x_ptr": "*bf16", "qw_ptr": "*i32", "z_ptr": "*u8",
                               "s_ptr": "*fp16", "g_ptr": "*fp16", "b_ptr": "*fp16",
                               "y_ptr": "*bf16", "ws_ptr": "*fp32"})
HINTS = divisibility(KERNEL, {"x_ptr", "qw_ptr", "z_ptr", "s_ptr", "g_ptr", "b_ptr", "y_ptr",
                              "ws_ptr", "N", "K", "K_SPLIT", "stride_qw", "stride_z",
                              "stride_s", "stride_ws"})
TILES = [(64, 256, 4), (128, 256, 4), (64, 512, 4), (32, 256, 2)]  # (BN, BK, warps)
FORMS = {"fp32": dict(PACKED=False, LEAN=False), "packed": dict(PACKED=True, LEAN=False),
         "packed, lean": dict(PACKED=True, LEAN=True)}


def loop_ops(bn: int, bk: int, warps: int, form: dict,
             silu_mul: bool = False) -> tuple[int, collections.Counter]:
    """(instructions, opcode counts) of the kernel's main loop for this tile."""
    consts = dict(BN=bn, ROWS=16, GROUP=128, SUB_STEPS=bk // 128, ACT_ORDER=False,
                  HAS_BIAS=False, SILU_MUL=silu_mul, PARTIAL=True, EVEN=True, BF16=True,
                  PDL=False, **form)
    body = main_loop(sm90_sass(KERNEL, SIGNATURE, consts, warps, stages=3, hints=HINTS))
    return len(body), opcode_counts(body)


def main() -> None:
    print(f"Triton {triton.__version__}, sm_90; the one-row int4 GEMV's main loop "
          "(group 128, bf16 x)")
    print(f"{'tile':<30}{'instr':>7}{'/weight':>9}  most frequent opcodes")
    for bn, bk, warps in TILES:
        for name, form in FORMS.items():
            n, ops = loop_ops(bn, bk, warps, form)
            weights = bn * bk // (32 * warps)
            top = " ".join(f"{op}x{c}" for op, c in ops.most_common(8))
            print(f"{f'{bn}x{bk}, {warps} warps, {name}':<30}{n:>7}{n / weights:>9.2f}  {top}")


def mma_loop_ops(warps: int, nt: int, prefetch: bool = False,
                 chunks: int = 2) -> tuple[int, collections.Counter]:
    """(instructions, opcode counts) of the tensor-core GEMV's group loop (two
    groups with `prefetch`: that loop is unrolled twice)."""
    body = mma_gemv_loop(I4M.gemv_ptx(nt, chunks, True, prefetch), warps)
    return len(body), opcode_counts(body)


def main_mma() -> None:
    print("\nthe tensor-core GEMV's group loop (group 128: 2 chunks of 64 features)")
    for warps, nt, prefetch in [(4, 1, False), (4, 2, False), (4, 4, False), (4, 1, True),
                                (4, 2, True)]:
        n, ops = mma_loop_ops(warps, nt, prefetch)
        weights = nt * 16 * 128 // 32 * (2 if prefetch else 1)
        top = " ".join(f"{op}x{c}" for op, c in ops.most_common(8))
        name = f"{warps} warps, {nt} tiles a warp" + (", prefetch" if prefetch else "")
        print(f"{name:<30}{n:>7}{n / weights:>9.2f}  {top}")


if __name__ == "__main__":
    main()
    main_mma()
