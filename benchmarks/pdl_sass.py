"""Where the decode-path kernels' memory reads sit around their PDL wait, from their
sm_90 SASS, on a machine without a GPU (`sass.py`).

At batch 1 these kernels are short chains of dependent reads, so what one costs
is how many round trips to memory follow its wait (`radixlm/layers/pdl.py`). Per
kernel, compiled with PDL on at a decode shape (Qwen3-30B-A3B's where it has one):
the global loads (LDG) issued before the wait (ACQBULK, `griddepcontrol.wait`) and
after it, and the order of loads, float adds/FMAs, barriers and stores after it,
run-length coded (`LDGx16 FADDx16`: sixteen loads in flight before the first add).

    python benchmarks/pdl_sass.py
"""

from __future__ import annotations

import triton
from sass import divisibility, opcode, signature, sm90_sass

from radixlm.layers import allreduce_norm, fused_ops, gemv
from radixlm.layers.attention.triton_ops import decode_attention as DA
from radixlm.layers.moe.triton_ops import moe_gemv as MG
from radixlm.layers.moe.triton_ops import moe_mma as MOE_MMA
from radixlm.layers.moe.triton_ops import topk as TK
from radixlm.layers.quantization.triton_ops import fp8 as F8
from radixlm.layers.quantization.triton_ops import fp8_mma as F8M
from radixlm.layers.quantization.triton_ops import fp8_w8a8_gemv as W8
from radixlm.layers.quantization.triton_ops import int4 as I4
from radixlm.layers.quantization.triton_ops import int4_mma as I4M
from radixlm.layers.quantization.triton_ops import mma_gemv as MMA

SHOWN = ("LDG", "ACQBULK", "FADD", "FFMA", "BAR", "STG", "HMMA")


def kernels():
    """(name, jitted fn, pointer types, fp32 scalars, constexprs, warps): every kernel
    that takes part in PDL, at its decode configuration (`tests/test_pdl_contract.py`
    checks that none is missing)."""
    f32, b16, i32, i64 = "*fp32", "*bf16", "*i32", "*i64"
    yield ("router logits", TK._logits_kernel, {"x_ptr": b16, "w_ptr": f32, "out_ptr": f32}, (),
           dict(BLOCK_T=8, BLOCK_E=16, CHUNK_K=128, BLOCK_K=32, EVEN_K=True, PDL=True), 4)
    yield ("router top-k", TK._topk_kernel, {"part_ptr": f32, "w_out_ptr": f32, "id_out_ptr": i32},
           (), dict(S=16, TOP_K=8, EP=128, KP=8, RENORM=True, ROUND=1, LIBDEVICE_EXP=True,
                    PDL=True), TK.topk_warps(128))
    yield ("RMSNorm + router logits", TK._norm_logits_kernel,
           {"x_ptr": b16, "r_ptr": b16, "nw_ptr": b16, "w_ptr": f32, "h_ptr": b16, "ro_ptr": b16,
            "out_ptr": f32}, ("eps",), dict(BLOCK_H=2048, BLOCK_E=TK.NORM_BLOCK_E, PDL=True),
           TK.NORM_WARPS)
    moe = {"x_ptr": b16, "act_ptr": b16, "w_ptr": b16, "s_ptr": f32, "ids_ptr": i32,
           "topk_w_ptr": f32, "out_ptr": b16}
    yield ("MoE gate/up", MG._gate_up_kernel, moe, (),
           dict(TOP_K=8, ACT=0, SCALE=0, EVEN_K=True, BN=2, BK=1024, PDL=True), 4)
    yield ("MoE down (one block)", MG._down_kernel, moe, (),
           dict(TOP_K=8, SCALE=0, EVEN_K=False, BN=2, BK=1024, HOIST=True, PDL=True), 4)
    mma_moe = {"x_ptr": b16, "act_ptr": b16, "w_ptr": "*fp8e4nv", "s_ptr": f32, "ids_ptr": i32,
               "topk_w_ptr": f32, "ws_ptr": f32, "out_ptr": b16}
    yield ("MoE gate/up, FP8 on the tensor cores", MOE_MMA._gate_up_kernel, mma_moe, (),
           dict(TOP_K=8, ACT=0, SPLIT=2, PTX=F8M.gemv_ptx(1, True, plain=True), PDL=True), 4)
    yield ("MoE down, FP8 on the tensor cores", MOE_MMA._down_kernel, mma_moe, (),
           dict(TOP_K=8, SPLIT=2, WARPS=16, PTX=F8M.gemv_ptx(1, True, pdl=True, plain=True),
                PDL=True), 16)
    yield ("RMSNorm + residual", fused_ops._rms_norm_kernel,
           {**{k: b16 for k in ("X", "R", "W", "Y", "RO", "PW")}, "S": f32}, ("eps",),
           dict(HAS_RES=True, HAS_PRE=False, BLOCK=2048, QUANT=False, PDL=True), 4)
    yield ("QK-norm + RoPE + KV store", fused_ops._rope_kernel,
           {"Q": b16, "K": b16, "CosSin": f32, "Pos": i64, "V": b16, "KBuf": b16, "VBuf": b16,
            "Loc": i64, "WQ": b16, "WK": b16}, ("eps",),
           dict(QK_NORM=True, NQ=32, NK=4, BLOCK_HQ=32, BLOCK_HK=4, HALF=64, BLOCK_HALF=64,
                STORE=True, HEAD_DIM=128, BLOCK_D=128, PDL=True), 4)
    yield ("qkv split-K sum + RoPE + KV store", fused_ops._rope_sums_kernel,
           {"WS": f32, "Bias": b16, "Y": b16, "CosSin": b16, "Pos": i64, "KBuf": b16,
            "VBuf": b16, "Loc": i64, "WQ": b16, "WK": b16}, ("eps",),
           dict(SPLIT=4, HAS_BIAS=False, QK_NORM=False, NQ=32, NK=8, HALF=64, BLOCK_HALF=64,
                HEAD_DIM=128, PDL=True), 1)
    attn = {"Q": b16, "K": b16, "V": b16, "ReqToToken": i32, "ReqPoolIdx": i64, "SeqLens": i32,
            "PrefixLens": i32, "SlotMap": i64, "MidO": f32, "MidLse": f32, "KScale": f32,
            "VScale": f32}
    yield ("decode attention, stage 1", DA._decode_stage1_kernel, attn,
           ("qk_scale", "cap_log2"),
           dict(GROUP=8, BLOCK_H=16, BLOCK_N=32, HEAD_DIM=128, DOT_PREC="tf32", HAS_PREFIX=False,
                HAS_WINDOW=False, SOFTCAP=False, TRANSLATE=False, PDL=True, KV_FP8=False), 2)
    yield ("decode attention, stage 2", DA._decode_stage2_kernel,
           {"MidO": f32, "MidLse": f32, "Out": b16, "SeqLens": i32, "PrefixLens": i32,
            "NumPrefix": i32, "MidPO": f32, "MidPLse": f32}, (),
           dict(BLOCK_S=16, BLOCK_P=16, CHUNK_ALIGN=32, HEAD_DIM=128, HAS_PREFIX=False,
                HAS_WINDOW=False, PDL=True), 4)
    yield ("SiLU-and-mul", fused_ops._act_and_mul_kernel, {"X": b16, "Y": b16}, (),
           dict(BLOCK=1024, GELU_TANH=False, PDL=True), 4)
    yield ("SiLU-and-mul to FP8 rows", fused_ops._silu_mul_fp8_kernel,
           {"X": b16, "Q": "*fp8e4nv", "S": f32}, (), dict(BLOCK=16384, STEPS=1, PDL=True), 16)
    gemv_ptrs = {"x_ptr": b16, "w_ptr": b16, "b_ptr": b16, "y_ptr": b16}
    yield ("bf16 GEMV, one row", gemv._gemv_fma_kernel, gemv_ptrs, (),
           dict(BN=4, BK=1024, HAS_BIAS=True, EVEN_K=True, SILU_MUL=False, PDL=True), 4)
    yield ("bf16 GEMV, 2-8 rows", gemv._gemv_mma_kernel, gemv_ptrs, (),
           dict(BM=16, BN=64, BK=128, HAS_BIAS=False, EVEN_K=True, SILU_MUL=False, PDL=True),
           4)
    fp8 = {"x_ptr": b16, "w_ptr": "*fp8e4nv", "s_ptr": f32, "b_ptr": b16, "y_ptr": b16}
    yield ("FP8 GEMV, one row", F8._fp8_gemv_fma_kernel, fp8, (),
           dict(BN=4, BK=1024, BLOCK_K=0, SCALE_ROWS=1, HAS_BIAS=False, EVEN_K=True,
                SILU_MUL=False, PAIRS=False, VEC8=True, PDL=True), 4)
    yield ("FP8 GEMV, 2-8 rows", F8._fp8_gemv_mma_kernel, fp8, (),
           dict(BM=16, BN=64, BK=128, BLOCK_K=128, SCALE_ROWS=128, HAS_BIAS=False,
                EVEN_K=True, SILU_MUL=False, PDL=True), 4)
    w8a8 = {"x_ptr": b16, "w_ptr": "*fp8e4nv", "s_ptr": f32, "b_ptr": b16, "out_ptr": b16}
    yield ("FP8 W8A8 GEMV, gate/up", W8._w8a8_gemv_kernel, w8a8, (),
           dict(BM=16, BN=64, BLOCK_SCALES=False, SCALE_ROWS=1, DIRECT=True,
                SILU_MUL=True, HAS_BIAS=False, EXACT=False, PDL=True), 4)
    int4 = {"x_ptr": b16, "qw_ptr": i32, "z_ptr": i32, "s_ptr": b16, "g_ptr": i32,
            "b_ptr": b16, "y_ptr": b16, "ws_ptr": f32}
    yield ("int4 GEMV, split K", I4._int4_gemv_kernel, int4, (),
           dict(BN=64, ROWS=16, GROUP=128, SUB_STEPS=2, ACT_ORDER=False, HAS_BIAS=False,
                SILU_MUL=False, PARTIAL=True, EVEN=True, PACKED=True, BF16=True, LEAN=False,
                PDL=True), 4)
    mma = {"x_ptr": b16, "w_ptr": i32, "ws_ptr": f32}
    mma_consts = dict(WARPS=4, PDL=True)
    yield ("int4 GEMV on the tensor cores", MMA.mma_gemv_kernel,
           {**mma, "a_ptr": i32, "b_ptr": b16}, (),
           dict(PTX=I4M.gemv_ptx(1, 2, True, True, pdl=True), PTX_WAITS=True, **mma_consts), 4)
    yield ("FP8 GEMV on the tensor cores", MMA.mma_gemv_kernel,
           {**mma, "a_ptr": f32, "b_ptr": f32}, (),
           dict(PTX=F8M.gemv_ptx(1, True, pdl=True), PTX_WAITS=True, **mma_consts), 4)
    cta = {**mma, "a_ptr": f32, "b_ptr": f32, "bias_ptr": b16, "y_ptr": b16, "sq_in_ptr": f32,
           "res_ptr": b16, "gamma_ptr": b16, "res_out_ptr": b16, "sq_out_ptr": f32}
    fp8_plain = F8M.gemv_ptx(1, True, pdl=True, plain=True)
    yield ("FP8 GEMV on the tensor cores, the split-K sum in the program",
           MMA.mma_gemv_cta_kernel, cta, ("eps_in",),
           dict(SPLIT=8, ROWS=1, HAS_BIAS=False, NORM_IN=False, P_BLOCK=1, NORM_OUT=False,
                SILU_W=0, PTX=fp8_plain, PDL=True, PTX_WAITS=True), 8)
    yield ("the same, a folded norm in and out", MMA.mma_gemv_cta_kernel, cta, ("eps_in",),
           dict(SPLIT=8, ROWS=1, HAS_BIAS=False, NORM_IN=True, P_BLOCK=256, NORM_OUT=True,
                SILU_W=0, PTX=fp8_plain, PDL=True, PTX_WAITS=True), 8)
    yield ("int4 gate/up in pairs, the sum and SiLU in the program", MMA.mma_gemv_cta_kernel,
           {**cta, "a_ptr": i32, "b_ptr": b16}, ("eps_in",),
           dict(SPLIT=2, ROWS=1, HAS_BIAS=False, NORM_IN=False, P_BLOCK=1, NORM_OUT=False,
                SILU_W=16, PTX=I4M.gemv_ptx(2, 2, True, True, pdl=True, pair=True), PDL=True,
                PTX_WAITS=True), 2)
    yield ("FP8 gate/up in halves, the sum and SiLU in the program", MMA.mma_gemv_cta_kernel,
           cta, ("eps_in",),
           dict(SPLIT=4, ROWS=1, HAS_BIAS=False, NORM_IN=False, P_BLOCK=1, NORM_OUT=False,
                SILU_W=8, PTX=F8M.gemv_ptx(1, True, pdl=True, plain=True, halves=True),
                PDL=True, PTX_WAITS=True), 4)
    sums = {"ws_ptr": f32, "b_ptr": b16, "y_ptr": b16, "sq_ptr": f32}
    yield ("int4 split-K sum", I4._int4_split_sum_kernel, sums, ("eps",),
           dict(SPLIT=8, BLOCK=256, HAS_BIAS=False, SILU_MUL=False, NORM_IN=False, P_BLOCK=1,
                PDL=True, ROWS=False), 2)
    yield ("int4 split-K sum, all rows, a folded norm in", I4._int4_split_sum_kernel, sums,
           ("eps",), dict(SPLIT=4, BLOCK=256, HAS_BIAS=True, SILU_MUL=True, NORM_IN=True,
                          P_BLOCK=256, PDL=True, ROWS=True), 2)
    yield ("all-reduce + RMSNorm (2 ranks)", allreduce_norm._allreduce_add_rms_norm_kernel,
           {"BufPtrs": i64, "PadPtrs": i64, "R": b16, "W": b16, "Y": b16, "RO": b16}, ("eps",),
           dict(RANK=0, WORLD=2, BLOCK=4096, PDL=True), 8)


def run_length(ops: list[str]) -> str:
    out: list[list] = []
    for op in ops:
        if out and out[-1][0] == op:
            out[-1][1] += 1
        else:
            out.append([op, 1])
    return " ".join(f"{op}x{n}" for op, n in out)


def case_ops(case) -> list[str]:
    """The opcodes of one `kernels()` entry's sm_90 SASS, in order."""
    _, fn, pointers, floats, consts, warps = case
    # Pointers, strides and the layer's sizes are multiples of 16 at these shapes.
    aligned = {p.name for p in fn.params if p.name in pointers
               or p.name.startswith("stride") or p.name in ("N", "K", "H")}
    return [opcode(text) for _, text in
            sm90_sass(fn, signature(fn, pointers, floats), consts, warps,
                      hints=divisibility(fn, aligned))]


def main() -> None:
    print(f"Triton {triton.__version__}, sm_90, PDL on; loads before / after the wait, then "
          f"the code after the wait")
    for case in kernels():
        name, ops = case[0], case_ops(case)
        wait = ops.index("ACQBULK")
        before, after = ops[:wait].count("LDG"), ops[wait:].count("LDG")
        shown = [op for op in ops[wait + 1:] if op in SHOWN]
        print(f"\n{name}: {before} LDG before the wait, {after} after")
        print(f"  {run_length(shown)[:300]}")


if __name__ == "__main__":
    main()
