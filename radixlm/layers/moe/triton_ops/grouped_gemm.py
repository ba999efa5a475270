"""The grouped GEMM of the fused MoE: each program multiplies one BLOCK_M-row block of
the expert-sorted layout (`moe_align.py`) by a BLOCK_N-column tile of that block's
expert's weight.

Two uses, chosen by constexpr flags:

- gate/up (`ACT_MUL`): A = hidden states, row `pair // TOP_K` of each sorted row;
  B = w13[e] ([2I, K]); the program keeps a gate and an up accumulator for the same
  columns (weight rows n and I + n) and writes act(gate) * up (`ACT`: SiLU, GELU or
  GELU-tanh), so the [rows, 2I] product never reaches memory. Output: the
  intermediate [rows, I] in sorted-row order, which the down GEMM then reads as
  contiguous row blocks (`A_SORTED`).
- down (`MUL_WEIGHT`): A = the intermediate; B = w2[e] ([H, I]); each row is
  multiplied by its pair's routing weight and written at the pair's index
  (`C_BY_PAIR`), [T * k, H], for the top-k sum.

Without ACT_MUL and C_BY_PAIR it is a plain grouped GEMM into sorted rows (the
unfused variant the benchmark compares against).

Accumulation in fp32; fp32 inputs use true fp32 products ("ieee"). Weights may be
stored in another dtype than the activations (FP8 experts): each B tile is
converted to A's dtype before the product and scaled by `SCALE` = 1 (a scale per
expert and output channel, [E, N], applied once at the end) or 2 (a scale per
expert and [SCALE_BN, SCALE_BK] weight block, [E, cdiv(N, SBN), cdiv(K, SBK)],
applied per K step; BLOCK_K divides SCALE_BK so a K step never straddles blocks).

Every row index is widened to int64 before it multiplies a stride: an expert's
offset `e * stride_be` passes 2**31 at 256 experts of 4096 x 7168.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Gated activations, by the code moe_gemm_kernel's ACT takes.
ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def _act_mul(gate, up, dtype: tl.constexpr, ACT: tl.constexpr):
    """act(gate) * up in fp32, gate and up first rounded to the activation dtype (as
    an unfused matmul's outputs are)."""
    g = gate.to(dtype).to(tl.float32)
    u = up.to(dtype).to(tl.float32)
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g))
    elif ACT == 1:
        a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    else:  # tanh(v) = 1 - 2 / (exp(2v) + 1): portable where libdevice is not
        v = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * v) + 1.0))
    return a * u


@triton.jit
def _step(acc, a, b, s_ptrs, k0, stride_sk, SCALE: tl.constexpr, SCALE_BK: tl.constexpr,
          DOT_PREC: tl.constexpr):
    """acc += a @ b, b converted to a's dtype and, for block scales, scaled per column."""
    b = b.to(a.dtype)
    if SCALE == 2:
        s = tl.load(s_ptrs + (k0 // SCALE_BK) * stride_sk)
        return acc + tl.dot(a, b, input_precision=DOT_PREC) * s[None, :]
    return tl.dot(a, b, acc, input_precision=DOT_PREC)


@triton.jit
def moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, b_scale_ptr, topk_w_ptr,
    sorted_ids_ptr, expert_ids_ptr, npp_ptr,
    N, K, numel, num_blocks_m,
    stride_am, stride_be, stride_bn, stride_cm,
    stride_se, stride_sn, stride_sk,
    TOP_K: tl.constexpr, A_SORTED: tl.constexpr, C_BY_PAIR: tl.constexpr,
    ACT_MUL: tl.constexpr, ACT: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    SCALE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped launch order: GROUP_M row blocks share each weight tile while it is in L2.
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    if pid_m * BLOCK_M >= tl.load(npp_ptr):
        return  # past the last expert's rows

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows)
    valid = pair < numel  # padding rows hold numel
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if A_SORTED:
        a_rows = rows.to(tl.int64)
    else:
        a_rows = (pair // TOP_K).to(tl.int64)
    # Wrapped columns (instead of masks) keep the weight loads unmasked; the store masks.
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    b_cols = (cols % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_base = b_ptr + expert * stride_be + offs_k[:, None]
    b_ptrs = b_base + b_cols[None, :] * stride_bn
    s_ptrs = b_scale_ptr + expert * stride_se + (b_cols // SCALE_BN) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if ACT_MUL:  # the up half: weight rows N + n
        up_ptrs = b_base + (b_cols + N)[None, :] * stride_bn
        up_s_ptrs = b_scale_ptr + expert * stride_se + ((b_cols + N) // SCALE_BN) * stride_sn
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            k_in = offs_k < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_in[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_in[:, None], other=0.0)
        acc = _step(acc, a, b, s_ptrs, k0, stride_sk, SCALE, SCALE_BK, DOT_PREC)
        if ACT_MUL:
            if EVEN_K:
                b_up = tl.load(up_ptrs)
            else:
                b_up = tl.load(up_ptrs, mask=k_in[:, None], other=0.0)
            acc_up = _step(acc_up, a, b_up, up_s_ptrs, k0, stride_sk, SCALE, SCALE_BK, DOT_PREC)
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    if SCALE == 1:
        acc = acc * tl.load(s_ptrs)[None, :]
        if ACT_MUL:
            acc_up = acc_up * tl.load(up_s_ptrs)[None, :]
    if ACT_MUL:
        acc = _act_mul(acc, acc_up, c_ptr.dtype.element_ty, ACT)
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_w_ptr + pair, mask=valid, other=0.0)[:, None]
    if C_BY_PAIR:
        c_rows = pair.to(tl.int64)
    else:
        c_rows = rows.to(tl.int64)
    c_ptrs = c_ptr + c_rows[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (cols < N)[None, :])
