"""The direct path's FP8 experts on the tensor cores: `moe_gemv`'s two launches with
each pair's products in the dense FP8 GEMV's PTX (`fp8_mma.gemv_ptx`, reading the
weight where it lies) instead of FMAs on the CUDA cores.

Why: at one token the FMA kernels read FP8 experts at 1.5-1.8 TB/s on an H100,
against bf16's 2.3-2.6: half the bytes a tile, the same round trips, so FP8
bought 13-19 % at Qwen3-30B-A3B's shape. The dense FP8 GEMV went the same way
from the FMA loop to the tensor-core PTX (single stream 1.33x -> 1.56x bf16):
~2 instructions a weight and the next step's loads in flight under this
step's MMAs. Here it bought less, as the two kernels' chain of round trips
(ids, weights, sums) stays: on an H100 both kernels 19.5 us against 21.4,
FP8 single stream 421 tok/s against 403, 1.24x bf16 against 1.18x
(BENCHMARKS.md 2026-12-07, 11:46).

Each warp runs the PTX for one 16-row tile of one expert over a run of K
(`splits`), writing fp32 partial sums (times the row scale) to a workspace; a
barrier, then the program adds its warps' sums in run order:

1. `_gate_up_kernel`, grid (T * k pairs, I / 16): program (p, i), 2 x SPLIT warps,
   the first SPLIT on gate rows 16 i.. of w13[e], the others on up rows I + 16 i..
   (e = topk_ids.flat[p], x row p // k); then act(gate) * up into act[p, 16 i..]
   in hidden's dtype, rounded as `moe_gemv` rounds. A pair whose id is outside
   [0, E) returns before reading any weight.
2. `_down_kernel`, grid (T, H / 16): program (t, j), k x SPLIT warps (padded to a
   power of two), warp (slot, run) on rows 16 j.. of w2[e_slot] against
   act[t k + slot]; then each pair's row times its routing weight, rounded to
   hidden's dtype, added in pair order and rounded once (`moe_gemv`'s sum). The
   ids and the weights' first step load before the PDL wait (inside the PTX):
   gate/up stands between this kernel and the router, as for `moe_gemv`'s
   one-block down.

Takes (`takes`): FP8 e4m3 weights with one fp32 scale per expert row (online FP8
and per-channel checkpoints), bf16 hidden states, H and I multiples of 128, rows
and experts 16-byte aligned (an online weight's codes with their scale bytes
after them are fine). Everything else stays on `moe_gemv`'s FMA kernels, as does
every call with $RADIXLM_MOE_GEMV=fma. Inline PTX: CUDA only, never under the
interpreter, so the tests are tests/gpu/test_fused_moe.py's (`-k mma`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixlm.layers import pdl
from radixlm.layers.moe.triton_ops.grouped_gemm import ACT_CODES, _act_mul
from radixlm.layers.pdl import pdl_trigger, pdl_wait
from radixlm.layers.quantization.triton_ops import fp8_mma
from radixlm.layers.quantization.triton_ops.mma_gemv import CHUNK, _run_ptx, splits

ENV = "RADIXLM_MOE_GEMV"  # "fma": the direct path's FMA kernels for FP8 experts too
STEP = fp8_mma.STEP_CHUNKS * CHUNK  # features a PTX loop step covers (128)
MAX_WARPS = 16


class MmaSplits(NamedTuple):
    gate_up: int  # warps along K for each gate (and each up) tile
    down: int  # warps along K for each (pair, tile)


def pick_splits(h: int, inter: int, top_k: int) -> MmaSplits:
    """About eight steps of 128 features a gate/up warp and three a down warp; at
    most MAX_WARPS a program. On an H100 at Qwen3-30B-A3B's layer (one token,
    `moe_decode_kernels.py --pdl --mma`): splits 2 / 2 19.5 us for both kernels,
    2 / 1 19.8-20.0, 4 / 2 20.2, 4 / 1 21.1-21.5, 8 / 1 22.5 (the FMA kernels
    21.4); end to end 2 / 2 took FP8 single stream from 403 to 421 tok/s, where
    4 / 1 had been level (BENCHMARKS.md 2026-12-07)."""
    return MmaSplits(_split(h // STEP, 8, MAX_WARPS // 2),
                     _split(inter // STEP, 3, max(1, MAX_WARPS // _pow2(top_k))))


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


def _split(steps: int, per_warp: int, cap: int) -> int:
    """The largest power of two <= cap and <= steps / per_warp (>= 1) whose runs
    of whole steps are all non-empty (`exact_split`)."""
    split = 1
    while split * 2 <= cap and split * 2 * per_warp <= steps:
        split *= 2
    return exact_split(steps, split)


def exact_split(steps: int, split: int) -> int:
    """`split` halved until `splits` gives that many non-empty runs."""
    while split > 1 and splits(steps, split)[1] != split:
        split //= 2
    return split


def mode() -> str:
    return os.environ.get(ENV, "mma").lower()


def _aligned(w: torch.Tensor) -> bool:
    return (w.stride(-1) == 1 and w.data_ptr() % 16 == 0
            and w.stride(0) % 16 == 0 and w.stride(1) % 16 == 0)


def takes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
          w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
          top_k: int) -> bool:
    """Whether `moe_mma` computes this call (module docstring)."""
    if mode() == "fma" or not x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    fp8 = torch.float8_e4m3fn
    h, inter = x.shape[1], w2.shape[2]
    return (x.dtype == torch.bfloat16 and w13.dtype == fp8 and w2.dtype == fp8
            and w13_scale is not None and w2_scale is not None
            and w13_scale.dim() == 2 and w2_scale.dim() == 2
            and w13_scale.dtype == torch.float32 and w2_scale.dtype == torch.float32
            and w13_scale.stride(1) == 1 and w2_scale.stride(1) == 1
            and h % STEP == 0 and inter % STEP == 0
            and _aligned(w13) and _aligned(w2)
            and x.is_contiguous() and x.data_ptr() % 16 == 0 and _pow2(top_k) <= MAX_WARPS)


def moe_mma(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
            activation: str, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
            split: MmaSplits | None = None) -> torch.Tensor:
    """`moe_gemv.moe_gemv`'s contract for what `takes` accepts; `split` overrides
    `pick_splits` (benchmarks)."""
    t, h = x.shape
    e, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    split = split or pick_splits(h, inter, top_k)
    pairs = topk_ids.numel()
    act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    steps = h // STEP
    up_split = exact_split(steps, split.gate_up)
    ws = torch.empty((pairs, up_split, 2 * inter), dtype=torch.float32, device=x.device)
    _gate_up_kernel[(pairs, inter // 16)](
        x, w13, w13_scale, topk_ids, ws, act, e, inter, h, w13.stride(0), w13.stride(1),
        w13_scale.stride(0), steps, splits(steps, up_split)[0], TOP_K=top_k,
        ACT=ACT_CODES[activation], SPLIT=up_split,
        PTX=fp8_mma.gemv_ptx(1, True, plain=True), num_warps=2 * up_split,
        **pdl.launch_args())
    steps = inter // STEP
    down_split = exact_split(steps, split.down)
    warps = _pow2(top_k * down_split)
    assert warps <= MAX_WARPS, (top_k, down_split)
    ws = torch.empty((pairs, down_split, h), dtype=torch.float32, device=x.device)
    _down_kernel[(t, h // 16)](
        act, w2, w2_scale, topk_ids, topk_weights, ws, out, e, h, inter, w2.stride(0),
        w2.stride(1), w2_scale.stride(0), out.stride(0), steps, splits(steps, down_split)[0],
        TOP_K=top_k, SPLIT=down_split, WARPS=warps,
        PTX=fp8_mma.gemv_ptx(1, True, pdl=pdl.pdl_on(), plain=True), num_warps=warps,
        **pdl.launch_args())
    return out


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, ws_ptr, act_ptr, E, N, K,
                    stride_we, stride_wn, stride_se, STEPS, SPLIT_STEPS,
                    TOP_K: tl.constexpr, ACT: tl.constexpr, SPLIT: tl.constexpr,
                    PTX: tl.constexpr, PDL: tl.constexpr):
    # The expert comes from the router's output: nothing can be read before the wait.
    pdl_wait(PDL)
    pdl_trigger(PDL)
    pair = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    expert = tl.load(ids_ptr + pair)
    if (expert < 0) | (expert >= E):
        return  # another rank's expert: its act row is never read
    warp = tl.arange(0, 64 * SPLIT) // 32
    half = warp // SPLIT  # 0: gate rows, 1: up rows
    run = warp % SPLIT
    zero = tl.zeros([64 * SPLIT], dtype=tl.int32)
    lo = run * SPLIT_STEPS
    hi = tl.minimum(STEPS, lo + SPLIT_STEPS)
    e = expert.to(tl.int64)
    x = x_ptr.to(tl.int64, bitcast=True) + (pair // TOP_K) * K * 2
    w = w_ptr.to(tl.int64, bitcast=True) + e * stride_we
    s = s_ptr.to(tl.int64, bitcast=True) + e * stride_se * 4
    ws = ws_ptr.to(tl.int64, bitcast=True) + (pair * SPLIT + run) * (2 * N) * 4
    _run_ptx(PTX, zero, x, w, s, s, ws, tile + half * (N // 16) - warp, lo, hi, 2 * N // 16, 0,
             0, stride_wn, 0, 1, False, True)
    tl.debug_barrier()  # every warp's sums stored (CTA-scope ordering)
    cols = tile * 16 + tl.arange(0, 16)
    at = ws_ptr + pair * SPLIT * 2 * N + cols
    # .cg: from L2, where the other warps' stores went (not a stale L1 line)
    gate = tl.load(at, cache_modifier=".cg")
    up = tl.load(at + N, cache_modifier=".cg")
    for r in tl.static_range(1, SPLIT):
        gate += tl.load(at + r * 2 * N, cache_modifier=".cg")
        up += tl.load(at + r * 2 * N + N, cache_modifier=".cg")
    dtype = x_ptr.dtype.element_ty
    tl.store(act_ptr + pair * N + cols, _act_mul(gate, up, dtype, ACT).to(dtype))


@triton.jit
def _down_kernel(act_ptr, w_ptr, s_ptr, ids_ptr, topk_w_ptr, ws_ptr, out_ptr, E, N, K,
                 stride_we, stride_wn, stride_se, stride_out, STEPS, SPLIT_STEPS,
                 TOP_K: tl.constexpr, SPLIT: tl.constexpr, WARPS: tl.constexpr,
                 PTX: tl.constexpr, PDL: tl.constexpr):
    # PDL's wait is inside the PTX, after the first step's weight loads: the ids
    # were written before gate/up, the act rows (x here) by it.
    token = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    warp = tl.arange(0, 32 * WARPS) // 32
    slot = warp // SPLIT
    run = warp % SPLIT
    pair = token * TOP_K + slot
    expert = tl.load(ids_ptr + pair, mask=slot < TOP_K, other=-1)
    ok = (slot < TOP_K) & (expert >= 0) & (expert < E)
    e = tl.where(ok, expert, 0).to(tl.int64)
    zero = tl.zeros([32 * WARPS], dtype=tl.int32)
    lo = run * SPLIT_STEPS
    hi = tl.minimum(STEPS, lo + SPLIT_STEPS)
    x = act_ptr.to(tl.int64, bitcast=True) + pair * K * 2
    w = w_ptr.to(tl.int64, bitcast=True) + e * stride_we
    s = s_ptr.to(tl.int64, bitcast=True) + e * stride_se * 4
    ws = ws_ptr.to(tl.int64, bitcast=True) + (pair * SPLIT + run) * N * 4
    # Another rank's pair (or a padding warp) gets no tiles: its warps do nothing.
    _run_ptx(PTX, zero, x, w, s, s, ws, tile - warp, lo, hi, tl.where(ok, N // 16, 0), 0, 0,
             stride_wn, 0, 1, False, True)
    tl.debug_barrier()
    cols = tile * 16 + tl.arange(0, 16)
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([16], dtype=tl.float32)
    # Each pair's weighted row rounded, then added in pair order (`moe_gemv`'s sum);
    # a row of 16 a pair, so no sum crosses threads.
    for j in tl.static_range(TOP_K):
        pj = token * TOP_K + j
        ej = tl.load(ids_ptr + pj)
        okj = (ej >= 0) & (ej < E)
        at = ws_ptr + pj * SPLIT * N + cols
        y = tl.load(at, mask=okj, other=0.0, cache_modifier=".cg")
        for r in tl.static_range(1, SPLIT):
            y += tl.load(at + r * N, mask=okj, other=0.0, cache_modifier=".cg")
        y = (y * tl.load(topk_w_ptr + pj)).to(dtype).to(tl.float32)
        acc += tl.where(okj, y, 0.0)
    tl.store(out_ptr + token * stride_out + cols, acc.to(dtype))
