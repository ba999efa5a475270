"""The FP8 GEMV of 1-64 rows with FP8 activations (W8A8) on the FP8 tensor cores.

Why: the other FP8 GEMVs (`fp8.py`'s FMA one, `fp8_mma.py`'s tensor-core one)
keep x in bf16, so every weight byte is widened in registers first: 2.2-3.6
SASS instructions a weight. On an H100 the tensor-core one streams Llama-8B's
products at 1.9-2.6 TB/s where the bf16 GEMV, at about one instruction a
byte, streams the same products at 2.6-3.1 (BENCHMARKS.md, 2026-12-05). Here the
weight tile goes from memory through shared memory into the e4m3 MMA as it
is; only x is converted, once per step for all of the program's rows. That is
the arithmetic vLLM and SGLang run FP8 checkpoints with at every batch size
(dynamic per-token activation scales; per token and group for block weights),
so it is the same scheme our W8A8 GEMM already runs above the GEMV's rows.

Scheme (`w8a8_codes` in tests/gpu/test_quant_kernels.py spells the codes in
torch): x's features in groups of 128, per row and group amax = max(max |x|,
1e-12), codes q = e4m3(clamp(x * (448 / amax), +-448)) rounded to nearest even,
scale amax / 448. Each step of the loop
is one group: the [BN, 128] weight tile times the [128, rows] codes on the
tensor cores (a fresh fp32 sum of 128 products: Hopper's FP8 MMA sums in less
than fp32, so it is promoted each group, as DeepSeek-V3's recipe does), times
the rows' group scales (and a block weight's scale), into fp32 accumulators.
Per-row weight scales multiply once at the end. Against x in bf16 the codes
add a relative error of at most 2^-4 per feature (e4m3's 3 mantissa bits), the
error every W8A8 engine accepts.

Programs: (BN weight rows, a run of whole groups of K). With K in one run a
program writes its outputs (bias and SiLU-and-mul included: a gate row's up row
is summed in the same program); split, each writes fp32 partial sums [split,
M, N] and `int4.sum_splits` adds them in split order with the bias and the
SiLU-and-mul, as the tensor-core GEMVs do. No host sync and no allocation but
the sums and the output: CUDA graphs capture it.

Measured on an H100 (BENCHMARKS.md, 2026-12-06): at one row it streams 0.91-0.96x
what the tensor-core GEMV with x in bf16 does, with no more instructions a
weight (each step's x quantization is a chain of an L2 read, a cross-warp
reduction and barriers that the weight stream waits on); from 16 rows its
products are faster (the other one's time grows with the rows, this one's
barely), and the engine takes it from 17, where that shows end to end
(`MIN_ROWS`), to 64 (`ROUTE_MAX_ROWS`); `$RADIXLM_FP8_GEMV=w8a8` takes it at
every row. One row runs as 16 with 15 zero rows: a path that quantized the row
once and broadcast its codes took 6 barriers a step to the 3 here and was
1.1-1.5x slower; loading x's next group a step ahead was 2-12 % slower.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixlm.layers import pdl
from radixlm.layers.gemv import _silu_mul
from radixlm.layers.pdl import pdl_trigger, pdl_wait
from radixlm.layers.quantization.triton_ops.e4m3 import round_e4m3
from radixlm.layers.quantization.triton_ops.int4 import sum_splits
from radixlm.layers.quantization.triton_ops.mma_gemv import output, splits

GROUP = 128  # features a step, one activation scale per row and group
MAX_ROWS = 64  # x's rows, the MMA's N: padded to 16, 32 or 64
# Rows from which `fp8.fp8_linear` takes this GEMV over the tensor-core one with x
# in bf16 (`fp8_mma.py`). On an H100, products alone: this one 0.91-0.96x that at
# one row, 0.96-1.03x at 8, 1.00-1.22x at 16, 1.18-1.40x at 32; FP8 decode of 16
# sequences (512 in / 128 out) the same either way (3,142 against 3,153 tok/s,
# medians of 3), of 32 sequences 1.08x (5,245 against 4,855).
MIN_ROWS = 17
# Rows up to which it takes them, all it holds. At 33-64 rows it replaced the W8A8
# GEMM (64 x 64 tiles): products alone 0.91-1.35x that (qkv loses at 64 rows),
# FP8 decode of 48 sequences 1.12x, of 64 1.02x (H100, medians of 3, 2026-12-06).
ROUTE_MAX_ROWS = MAX_ROWS
# Programs a product's tiles should not exceed past 32 rows: one wave on an
# H100's 132 SMs (qkv's 192 programs of 128 rows took 25.2 us at 48 rows, 96 of
# 256 rows 17.4).
ONE_WAVE = 128


class W8A8Config(NamedTuple):
    bn: int = 64  # weight rows a program (the MMA's M: 64 a warp group)
    warps: int = 4
    stages: int = 4  # weight tiles in flight a program (Triton's pipeline)
    split: int = 4  # programs along K

    def label(self) -> str:
        return "x".join(map(str, self))


def pick_config(m: int, silu_mul: bool, n: int) -> W8A8Config:
    """From the H100 sweep of Llama-8B's four products (`benchmarks/quant_kernels.py
    --w8a8-sweep --rows 1,8,16,32,48,64`, BENCHMARKS.md 2026-12-06): one row
    128-row tiles on 4 warps, K split 4 ways. From 2 rows, up to 16 rows 64-row
    tiles on 4 warps, above 128-row ones: split 4 ways on 8 warps, but gate/up
    with its SiLU-and-mul unsplit (112-224 programs, and no second launch for the
    splits), on 4 warps to 32 rows and on 8 above (on 4 its two [128, 64]
    accumulators spill in the sm_90 SASS). Past 32 rows, a weight of `n` rows
    whose 128-row tiles would make more than `ONE_WAVE` programs takes 256-row
    ones (qkv)."""
    if m == 1:
        return W8A8Config(128, 4, 4, 4)
    if silu_mul:
        return W8A8Config(64, 4, 4, 1) if m <= 16 else W8A8Config(128, 4 if m <= 32 else 8, 4, 1)
    if m <= 16:
        return W8A8Config(64, 4, 4, 4)
    cfg = W8A8Config(128, 8, 4, 4)
    if m > 32 and triton.cdiv(n, cfg.bn) * cfg.split > ONE_WAVE:
        return cfg._replace(bn=256)
    return cfg


def takes(k: int, block_k: int, rows: int) -> bool:
    """Whether this GEMV takes the product: whole groups of K, per-row scales or
    blocks of 128 features (any rows a block), 1 to MAX_ROWS rows."""
    return k % GROUP == 0 and block_k in (0, GROUP) and 1 <= rows <= MAX_ROWS


def fp8_gemv_w8a8(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                  block_k: int = 0, scale_rows: int = 1, bias: torch.Tensor | None = None,
                  config: W8A8Config | None = None, out: torch.Tensor | None = None,
                  silu_mul: bool = False) -> torch.Tensor:
    """x [M, K] (bf16/fp16, 1-64 rows, unit feature stride) times the FP8 weight [N,
    K] (unit feature stride) with per-row scales [N] (`block_k` 0) or block scales
    [N / scale_rows, K / 128]: [M, N] in x's dtype (`silu_mul`: [M, N / 2])."""
    m, k = x.shape
    n = weight.shape[0]
    assert takes(k, block_k, m), (m, k, block_k)
    assert x.stride(1) == 1 and weight.stride(1) == 1 and weight.shape[1] == k
    assert scales.dtype == torch.float32
    cfg = config or pick_config(m, silu_mul, n)
    per, split = splits(k // GROUP, cfg.split)
    n_out = n // 2 if silu_mul else n
    y = output(x, n_out, out)
    # One split: the program writes y itself (bias, SiLU-and-mul: its gate rows'
    # up rows alongside); more: fp32 partial sums and `sum_splits`.
    direct = split == 1
    dest = y if direct else torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    rows = n_out if direct else n
    _w8a8_gemv_kernel[(triton.cdiv(rows, cfg.bn), split)](
        x, weight, scales, bias if bias is not None else scales, dest, m, rows, x.stride(0),
        weight.stride(0), scales.stride(0) if block_k else 0, 0 if direct else dest.stride(0),
        k // GROUP, per, BM=max(16, triton.next_power_of_2(m)), BN=cfg.bn, BLOCK_SCALES=block_k > 0,
        SCALE_ROWS=scale_rows, DIRECT=direct, SILU_MUL=direct and silu_mul,
        HAS_BIAS=direct and bias is not None, EXACT=not x.is_cuda, num_warps=cfg.warps,
        num_stages=cfg.stages, **pdl.launch_args())
    return y if direct else sum_splits(dest, bias, y, silu_mul)


@triton.jit
def _codes(v, EXACT: tl.constexpr):
    """fp32 x times 448 / amax -> its e4m3 codes (clamped; nearest, ties to even)."""
    v = tl.clamp(v, -448.0, 448.0)
    if EXACT:
        v = round_e4m3(v)
    return v.to(tl.float8e4nv)


@triton.jit
def _group_codes(x_ptrs, k, m_ok, EXACT: tl.constexpr):
    """x's group of 128 features at k as the MMA's B operand: (codes [128, BM]
    e4m3, scales [1, BM] for x's rows; rows past M are zeros)."""
    xv = tl.load(x_ptrs + k, mask=m_ok, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(xv), axis=1), 1e-12)
    xq = _codes(xv * tl.div_rn(448.0, amax)[:, None], EXACT)
    return tl.trans(xq), tl.div_rn(amax, 448.0)[None, :]


@triton.jit
def _w8a8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, stride_xm, stride_wn,
                      stride_sn, stride_out, STEPS, SPLIT_STEPS, BM: tl.constexpr,
                      BN: tl.constexpr, BLOCK_SCALES: tl.constexpr, SCALE_ROWS: tl.constexpr,
                      DIRECT: tl.constexpr, SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr,
                      EXACT: tl.constexpr, PDL: tl.constexpr):
    """Program (pid 0: BN of the N output rows; pid 1: SPLIT_STEPS groups of K):
    its rows' sums over its groups for x's M rows (padded to BM for the MMA), into
    out [M, N] in its dtype with the bias (DIRECT: one split), else as fp32 partial
    sums at out + pid 1 * stride_out. SILU_MUL (DIRECT): N is half the weight's
    rows; each output row's up row, N further, is summed alongside and
    silu(gate) * up stored."""
    pid_k = tl.program_id(1)
    lo = pid_k * SPLIT_STEPS
    hi = tl.minimum(STEPS, lo + SPLIT_STEPS)
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: loads need no row mask
    offs_m = tl.arange(0, BM)
    offs_k = tl.arange(0, 128)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    up_ptrs = w_ptrs + N * stride_wn  # SILU_MUL: the up rows
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    m_ok = offs_m[:, None] < M
    s_rows = s_ptr + (rows // SCALE_ROWS) * stride_sn
    s_rows_up = s_ptr + ((rows + N) // SCALE_ROWS) * stride_sn
    # Waits first: the loop is software-pipelined over num_stages weight tiles.
    pdl_wait(PDL)
    pdl_trigger(PDL)
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    acc_up = tl.zeros([BN, BM], dtype=tl.float32)
    for step in range(lo, hi):
        k = step * 128
        w = tl.load(w_ptrs + k)
        xt, xs = _group_codes(x_ptrs, k, m_ok, EXACT)
        d = tl.dot(w, xt) * xs
        if BLOCK_SCALES:
            d *= tl.load(s_rows + step)[:, None]
        acc += d
        if SILU_MUL:
            d = tl.dot(tl.load(up_ptrs + k), xt) * xs
            if BLOCK_SCALES:
                d *= tl.load(s_rows_up + step)[:, None]
            acc_up += d
    if not BLOCK_SCALES:
        acc *= tl.load(s_ptr + rows)[:, None]
        if SILU_MUL:
            acc_up *= tl.load(s_ptr + rows + N)[:, None]
    out = out_ptr + pid_k.to(tl.int64) * stride_out + offs_m[None, :] * N + offs_n[:, None]
    ok = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    if DIRECT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows).to(tl.float32)[:, None]
        if SILU_MUL:
            acc = _silu_mul(acc, acc_up, out_ptr.dtype.element_ty)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(out, acc, mask=ok)
