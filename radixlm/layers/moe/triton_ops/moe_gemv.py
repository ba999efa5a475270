"""The fused MoE's direct small-batch path: the routed experts in two GEMV launches,
with no alignment and no separate top-k sum.

At decode a layer has a handful of (token, expert) pairs. The aligned path sorts
them by expert, pads each expert's group to BLOCK_M rows for tl.dot and sums the
top-k in a fourth kernel; here each pair is its own row of work instead:

1. `_gate_up_kernel`, grid (T * k pairs, cdiv(I, BN)): pair p reads x[p // k] and
   BN gate rows w13[e, n] with the matching up rows w13[e, I + n] (e =
   topk_ids.flat[p]) and writes act(gate) * up into act[p, n], a [T * k, I]
   workspace in hidden's dtype. A pair whose id is outside [0, E) returns before
   reading any weight.
2. `_down_kernel`, grid (T, cdiv(H, BN)): token t, output columns c, computes
   w2[e_j, c] @ act[t * k + j] for j = 0..k-1 in that order, skipping invalid ids,
   and sums the pairs' weighted rows itself, so no [T * k, H] buffer is written.
   Where K fits one BK step (`GemvTiles.hoist`), `_down_one_block` loads all k
   pairs as one tile before any sum.

Numerics match the aligned path's rounding points (`grouped_gemm.py`,
`moe_sum.py`): fp32 sums (FMA into [BN, BK] tiles, reduced once after K); a
weight tile is converted to hidden's dtype before it multiplies (FP8 weights
widen straight to fp32: that step is exact for them, `_widen`), the
per-channel scale multiplies the row's sum; gate and up are rounded to
hidden's dtype before act-and-mul and the product rounded again; each pair's
row times its routing weight is rounded to hidden's dtype, and those rounded rows
are added in fp32 in pair order and rounded once. Only the order of the
K-summation differs from the tl.dot path, so the two agree closely, not bitwise.

Scales: none (`SCALE` 0) or one per expert and output channel (`SCALE` 1: [E, 2I]
and [E, H]); block scales stay on the aligned path. Weights may have strided
rows and experts (K contiguous); x, act and the routing tensors are contiguous.

FP8 experts with per-row scales at bf16 hidden states (H and I multiples of 128)
take the same two launches on the tensor cores instead (`moe_mma.py`).

Both kernels take part in PDL (`radixlm.layers.pdl`). Gate/up waits first: which
weights to read depends on topk_ids, which the kernel before it (the router)
writes. Down, one-block form, reads the ids and its weight tile before its wait
(gate/up stands between it and the router). No host sync, no allocation but the
workspace: CUDA-graph capturable.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixlm.layers import pdl
from radixlm.layers.moe.triton_ops import moe_mma
from radixlm.layers.moe.triton_ops.grouped_gemm import ACT_CODES, _act_mul
from radixlm.layers.pdl import pdl_trigger, pdl_wait


class GemvTiles(NamedTuple):
    block_n: int  # output rows per program (gate/up: BN gate and BN up rows)
    block_k: int  # features per loop step
    num_warps: int
    # Down, K <= BK: every pair's loads before one sum (`_down_one_block`; its sm_90
    # SASS has no barrier between the pairs): H200, Qwen3-30B-A3B's layer at one
    # token, gate/up + down 29.4 -> 24.9 us (benchmarks/moe_decode_kernels.py).
    hoist: bool = True


def pick_gemv_tiles(programs_per_row: int, n: int, k: int, down: bool = False,
                    fp8: bool = False) -> GemvTiles:
    """Tiles for one of the two kernels: `programs_per_row` is the grid's first axis
    (pairs for gate/up, tokens for down), n the output rows, k the features,
    `down` which kernel, `fp8` one-byte weights.

    Like the dense GEMV's M == 1 config: few rows and a long K step, so the grid
    has thousands of programs, each with a [BN, BK] fp32 accumulator and only loads
    and FMAs in its loop. A one-run sweep on an H200 (Qwen3-30B-A3B, Mixtral-8x7B,
    OLMoE-1B-7B at T = 1 and 2; BN 2-16, BK 256-1024, 2 or 4 warps) put BN 2,
    BK 1024, 4 warps at or within noise of the best for both kernels at T = 1;
    BN 16 with BK 256 ran up to 1.5x slower. Down in one block (K <= BK) takes
    BN 1: its tile holds all k pairs' rows, and half of it leaves room for twice
    the programs a SM (an H100, Qwen3-30B-A3B's layer: gate/up + down 30.8 ->
    29.0 us, decode 317-318 -> 328.5 tok/s; BENCHMARKS.md 2026-12-06).
    FP8 weights: a tile of the same shape holds half the bytes, and more rows
    won (an H100, Qwen3-30B-A3B's layer at one token with the other kernel's
    defaults, `moe_decode_kernels.py --pdl --fp8`): gate/up BN 4 23.2 us against
    24.3, down in one block BN 8 on 8 warps 21.7 against 24.3; together, FP8
    decode 406.6-410.2 tok/s against 385.4-386.9 (BENCHMARKS.md 2026-12-07,
    09:42 and 10:32). K not a multiple of BK is masked."""
    del programs_per_row, n  # kept for tuning by grid size
    block_k = min(1024, triton.next_power_of_2(max(k, 16)))
    one_block = down and k <= block_k
    # The interpreter runs programs one after another: wider rows keep the CPU tests
    # (which thus run BN 16, the GPU tests BN 1-8) within their budget.
    if os.environ.get("TRITON_INTERPRET") == "1":
        return GemvTiles(16, block_k, 4)
    if fp8:
        return GemvTiles(8, block_k, 8) if one_block else GemvTiles(4, block_k, 4)
    return GemvTiles(1 if one_block else 2, block_k, 4)


def moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
             topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
             activation: str, w13_scale: torch.Tensor | None,
             w2_scale: torch.Tensor | None) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * w2[e] @ (act(w13[e, :I] @ x_t) * (w13[e, I:] @ x_t)),
    in two launches. Inputs as `fused_moe.fused_experts` checks them (both scales
    per channel or both None); writes and returns out ([T, H], last dim contiguous).
    FP8 experts go to the tensor cores where `moe_mma.takes` them."""
    t, h = x.shape
    e, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    if moe_mma.takes(x, w13, w2, w13_scale, w2_scale, top_k):
        return moe_mma.moe_mma(x, w13, w2, topk_weights, topk_ids, out, activation,
                               w13_scale, w2_scale)
    act = torch.empty((t * top_k, inter), dtype=x.dtype, device=x.device)
    _gate_up(x, w13, w13_scale, topk_ids, act, e, inter, h, top_k, activation)
    _down(act, w2, w2_scale, topk_ids, topk_weights, out, e, h, inter, top_k)
    return out


def _scale_args(scale: torch.Tensor | None, dummy: torch.Tensor) -> tuple:
    """(pointer, expert stride, SCALE mode); the dummy pointer is never read."""
    if scale is None:
        return dummy, 0, 0
    return scale, scale.stride(0), 1


def _gate_up(x, w13, w13_scale, topk_ids, act, e, inter, h, top_k, activation) -> None:
    tiles = pick_gemv_tiles(topk_ids.numel(), inter, h, fp8=w13.element_size() == 1)
    scale, stride_se, mode = _scale_args(w13_scale, x)
    grid = (topk_ids.numel(), triton.cdiv(inter, tiles.block_n))
    _gate_up_kernel[grid](
        x, w13, scale, topk_ids, act, e, inter, h, w13.stride(0), w13.stride(1), stride_se,
        TOP_K=top_k, ACT=ACT_CODES[activation], SCALE=mode, EVEN_K=h % tiles.block_k == 0,
        BN=tiles.block_n, BK=tiles.block_k, num_warps=tiles.num_warps, **pdl.launch_args())


def _down(act, w2, w2_scale, topk_ids, topk_weights, out, e, h, inter, top_k) -> None:
    t = topk_ids.shape[0]
    tiles = pick_gemv_tiles(t, h, inter, down=True, fp8=w2.element_size() == 1)
    scale, stride_se, mode = _scale_args(w2_scale, act)
    grid = (t, triton.cdiv(h, tiles.block_n))
    _down_kernel[grid](
        act, w2, scale, topk_ids, topk_weights, out, e, h, inter, w2.stride(0), w2.stride(1),
        stride_se, out.stride(0), TOP_K=top_k, SCALE=mode, EVEN_K=inter % tiles.block_k == 0,
        BN=tiles.block_n, BK=tiles.block_k, HOIST=tiles.hoist and inter <= tiles.block_k,
        num_warps=tiles.num_warps, **pdl.launch_args())


@triton.jit
def _widen(w, dtype: tl.constexpr):
    """A weight tile in fp32 as it multiplies: through hidden's dtype, as the aligned
    path's tl.dot operands are, except FP8 tiles, whose every value bf16 and fp16
    hold exactly: they widen straight to fp32 (half the conversions a weight)."""
    if w.dtype.is_fp8():
        return w.to(tl.float32)
    return w.to(dtype).to(tl.float32)


@triton.jit
def _load_k(ptrs, k0, k_in, EVEN_K: tl.constexpr):
    """The tile at ptrs + k0; with a ragged K the lanes past it load zeros."""
    if EVEN_K:
        return tl.load(ptrs + k0)
    return tl.load(ptrs + k0, mask=k_in, other=0.0)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, act_ptr, E, N, K,
                    stride_we, stride_wn, stride_se,
                    TOP_K: tl.constexpr, ACT: tl.constexpr, SCALE: tl.constexpr,
                    EVEN_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    PDL: tl.constexpr):
    # The expert comes from the router's output: nothing can be read before the wait.
    pdl_wait(PDL)
    pdl_trigger(PDL)
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair)
    if (expert < 0) | (expert >= E):
        return  # another rank's expert: its act row is never read
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: loads need no row mask
    offs_k = tl.arange(0, BK)
    w_base = w_ptr + expert.to(tl.int64) * stride_we + offs_k[None, :]
    gate_ptrs = w_base + rows[:, None] * stride_wn
    up_ptrs = w_base + (rows + N)[:, None] * stride_wn
    x_ptrs = x_ptr + (pair // TOP_K) * K + offs_k
    dtype = x_ptr.dtype.element_ty
    # [BN, BK] accumulators, reduced once after the loop: the loop is loads and FMAs.
    gate = tl.zeros([BN, BK], dtype=tl.float32)
    up = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_in = k0 + offs_k < K
        xk = _load_k(x_ptrs, k0, k_in, EVEN_K).to(tl.float32)[None, :]
        # Widened through x's dtype, as the aligned path's tl.dot operands are (`_widen`).
        gate += _widen(_load_k(gate_ptrs, k0, k_in[None, :], EVEN_K), dtype) * xk
        up += _widen(_load_k(up_ptrs, k0, k_in[None, :], EVEN_K), dtype) * xk
    gate = tl.sum(gate, axis=1)
    up = tl.sum(up, axis=1)
    if SCALE == 1:
        s_base = s_ptr + expert.to(tl.int64) * stride_se
        gate = gate * tl.load(s_base + rows)
        up = up * tl.load(s_base + rows + N)
    out = _act_mul(gate, up, dtype, ACT)
    tl.store(act_ptr + pair * N + offs_n, out.to(dtype), mask=offs_n < N)


@triton.jit
def _down_kernel(act_ptr, w_ptr, s_ptr, ids_ptr, topk_w_ptr, out_ptr, E, N, K,
                 stride_we, stride_wn, stride_se, stride_out,
                 TOP_K: tl.constexpr, SCALE: tl.constexpr, EVEN_K: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, HOIST: tl.constexpr, PDL: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BK)
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BN], dtype=tl.float32)
    if HOIST:
        acc = _down_one_block(act_ptr, w_ptr, s_ptr, ids_ptr, topk_w_ptr, E, K, stride_we,
                              stride_wn, stride_se, token, rows, offs_k, acc, dtype,
                              TOP_K, SCALE, PDL)
    else:
        pdl_wait(PDL)
        pdl_trigger(PDL)
        for j in tl.static_range(TOP_K):  # fixed pair order: the sum rounds as moe_sum's
            pair = token * TOP_K + j
            expert = tl.load(ids_ptr + pair)
            if (expert >= 0) & (expert < E):
                w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + rows[:, None] * stride_wn
                          + offs_k[None, :])
                a_ptrs = act_ptr + pair * K + offs_k
                part = tl.zeros([BN, BK], dtype=tl.float32)
                for k0 in range(0, K, BK):
                    k_in = k0 + offs_k < K
                    a = _load_k(a_ptrs, k0, k_in, EVEN_K).to(tl.float32)[None, :]
                    part += _widen(_load_k(w_ptrs, k0, k_in[None, :], EVEN_K), dtype) * a
                y = tl.sum(part, axis=1)
                if SCALE == 1:
                    y = y * tl.load(s_ptr + expert.to(tl.int64) * stride_se + rows)
                # Each pair's weighted row is rounded, as the aligned path stores it.
                y = (y * tl.load(topk_w_ptr + pair)).to(dtype).to(tl.float32)
                acc += y
    tl.store(out_ptr + token * stride_out + offs_n, acc.to(dtype), mask=offs_n < N)


@triton.jit
def _down_one_block(act_ptr, w_ptr, s_ptr, ids_ptr, topk_w_ptr, E, K, stride_we, stride_wn,
                    stride_se, token, rows, offs_k, acc, dtype: tl.constexpr,
                    TOP_K: tl.constexpr, SCALE: tl.constexpr, PDL: tl.constexpr):
    """The k pairs of one token when K fits one BK step, as one [KP, BN, BK] tile:
    every pair's id, weight rows and act row are loaded before any sum, so they
    are in flight together (the looped form reduces each pair across warps
    before the next pair's loads, which the compiler does not move above that
    barrier: k round trips to memory one after another). Another rank's pair
    (id outside [0, E)) loads nothing (masked) and adds +0.0. The pairs' rounded
    rows are added in pair order, as the looped form; only the K sum's tree may
    differ from it.

    The ids, routing weights, weight rows and scales are read before the PDL wait:
    the router wrote the ids and routing weights before the gate/up kernel that
    precedes this one, so they are final once this kernel starts
    (`radixlm.layers.pdl`), and the weight tile then streams in while gate/up
    finishes. Only the act rows, gate/up's output, wait."""
    KP: tl.constexpr = triton.next_power_of_2(TOP_K)
    slots = tl.arange(0, KP)
    pairs = token * TOP_K + slots
    experts = tl.load(ids_ptr + pairs, mask=slots < TOP_K, other=-1)
    ok = (slots < TOP_K) & (experts >= 0) & (experts < E)
    e = tl.where(ok, experts, 0).to(tl.int64)
    k_in = offs_k < K
    w = tl.load(w_ptr + e[:, None, None] * stride_we + rows[None, :, None] * stride_wn
                + offs_k[None, None, :], mask=ok[:, None, None] & k_in[None, None, :], other=0.0)
    weight = tl.load(topk_w_ptr + pairs, mask=ok, other=0.0)
    if SCALE == 1:
        scale = tl.load(s_ptr + e[:, None] * stride_se + rows[None, :], mask=ok[:, None],
                        other=0.0)
    pdl_wait(PDL)
    pdl_trigger(PDL)
    a = tl.load(act_ptr + pairs[:, None] * K + offs_k[None, :], mask=ok[:, None] & k_in[None, :],
                other=0.0)
    y = tl.sum(_widen(w, dtype) * a.to(tl.float32)[:, None, :], axis=2)  # [KP, BN]
    if SCALE == 1:
        y = y * scale
    y = tl.where(ok[:, None], (y * weight[:, None]).to(dtype).to(tl.float32), 0.0)
    for j in tl.static_range(TOP_K):  # one nonzero row per sum: exact, in pair order
        acc += tl.sum(tl.where(slots[:, None] == j, y, 0.0), axis=0)
    return acc
