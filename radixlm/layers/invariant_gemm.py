"""A GEMM whose result for a row does not depend on the row count (CUDA, Triton),
for `--enable-deterministic-inference`.

`y = x @ weight.T (+ bias)`. cuBLAS picks its kernel, tile and split-K by the
shape, so a row alone (a decode step) and the same row among 512 (a prefill)
get different low bits; our GEMV serves 1-8 rows with yet another order.
Here every output is one accumulator chained over K in blocks of BLOCK_K, in
order, never split across programs: a program owns a [BLOCK_M, BLOCK_N] tile
and walks all of K.

The tile is picked by M (and, at decode sizes, by the weight's shape, which
is fixed per layer) from `CONFIGS` / `pick_config`. The weight is the tensor
core's row operand (y.T = W @ x.T): its 64-row side covers weight rows, so a
decode tile pads the tokens to 16 rows, not 64, and a stage of shared memory
is mostly weight: at one row an H200 reads Llama-8B's projections at 2.9-4.0
TB/s of weights with it (benchmarks/invariant_gemm.py; 2.2-3.3 with the tokens
as the row operand, 3.1-4.3 for our bf16 GEMV). That keeps a row's bits only
if the tensor-core instruction computes each output from its own row and
column whatever the tile's extent, which holds for one instruction family and
one operand order: every config has BLOCK_N >= 64 and warps in multiples of 4,
so on Hopper all of them compile to wgmma, on Ampere to mma.sync, with the
same BLOCK_K. `tests/gpu/test_determinism_gpu.py` checks it bit for bit on
the GPU; `FIXED_CONFIG` pins one tile for every M if a device ever disagreed.

Contract: x [..., K] (last dim contiguous), weight [N, K] contiguous, bias [N]
or None, one dtype (bf16, fp16 or fp32; fp32 products in IEEE fp32), one CUDA
device; returns [..., N] in x's dtype, fp32 accumulation, one rounding. No
host sync, no allocation besides the output: CUDA-graph safe.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from radixlm.layers.attention.triton_ops.decode_attention import dot_precision
from radixlm.layers.tiles import grouped_tile, tma_fits

BLOCK_K = 64  # every config's: the K blocks fix each output's summation order


class GemmConfig(NamedTuple):
    block_m: int  # token rows a program (the instruction's column operand)
    block_n: int  # weight rows a program (its row operand: >= 64 for wgmma)
    warps: int
    stages: int
    # Operand tiles through TMA descriptors (Hopper): the same wgmma chain over
    # the same K blocks, fed by the copy engine instead of per-thread loads.
    tma: bool = False


# Up to 64 rows a step streams the weight: 16 padded token rows, 64 weight rows, a
# deep pipeline (deeper for a long K); wide layers take 64 token rows from 17 on
# (H200, Llama-8B's projections).
DECODE = GemmConfig(16, 64, 4, 12)
DECODE_LONG_K = GemmConfig(16, 64, 4, 20)  # K >= 8192: down
NARROW_MAX_N = 4096
NARROW = GemmConfig(64, 64, 4, 12)  # 17-64 rows where N > NARROW_MAX_N
# Batched decode (65-256 rows): the largest of these tiles that still gives most of
# a wave of programs (an H200 has 132 SMs). At 128 / 256 rows on Llama-8B's
# projections (qkv, o, gate_up, down; us, cuBLAS 16.3 / 14.1 / 65.7 / 36.6 at 128):
# 21.8 / 15.0 / 73.2 / 43.9 and 32.1 / 20.5 / 129.2 / 65.5, against one 64 x 128
# tile for all, 27.4 / 25.2 / 80.0 / 80.9 and 36.5 / 25.5 / 149.1 / 81.7.
# Through TMA these take 0-15 % less (same benchmark, --rows 128 256).
BATCHED = (GemmConfig(128, 128, 8, 4, tma=True), GemmConfig(128, 64, 8, 6, tma=True),
           NARROW._replace(tma=True))
BATCHED_MAX_M = 256
MIN_PROGRAMS = 96
# Prefill (H200, Llama-8B's projections; benchmarks/invariant_gemm.py --large-rows):
# TMA-fed tiles, 128 x 128 up to 1024 rows and 256 x 128 beyond (at 512 rows those
# leave SMs idle). At 4096 rows 632-676 TFLOP/s against 545-573 for the same tile
# through per-thread loads and cuBLAS's 668-785; at 512 rows 510-705 against
# 457-501. (largest M, config).
CONFIGS: tuple[tuple[int, GemmConfig], ...] = (
    (1024, GemmConfig(128, 128, 8, 4, tma=True)),
    (1 << 62, GemmConfig(256, 128, 8, 4, tma=True)),
)
FIXED_CONFIG: GemmConfig | None = None  # one tile for every M when set


SHARED_MEMORY = 200 * 1024  # of an H100/H200 SM's 227 KiB, with room for the epilogue


def fit_stages(cfg: GemmConfig, elem_bytes: int) -> GemmConfig:
    """cfg with as many of its pipeline stages as fit shared memory (fp32 tiles take
    twice bf16's); stages change only timing, never a sum's order."""
    per_stage = (cfg.block_m + cfg.block_n) * BLOCK_K * elem_bytes
    return cfg._replace(stages=max(2, min(cfg.stages, SHARED_MEMORY // per_stage)))


def pick_config(m: int, n: int, k: int) -> GemmConfig:
    if FIXED_CONFIG is not None:
        return FIXED_CONFIG
    if m <= 16 or (m <= 64 and n <= NARROW_MAX_N):
        return DECODE_LONG_K if k >= 8192 else DECODE
    if m <= 64:
        return NARROW
    if m <= BATCHED_MAX_M:
        return next((c for c in BATCHED if programs(c, m, n) >= MIN_PROGRAMS), BATCHED[-1])
    return next(cfg for limit, cfg in CONFIGS if m <= limit)


def programs(cfg: GemmConfig, m: int, n: int) -> int:
    return triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)


@triton.jit
def _store(acc_t, B, Y, M, N, stride_ym, pid_m, pid_n, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.trans(acc_t)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_ptr = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _matmul_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K_: tl.constexpr,
                   HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K_)
    x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # y.T's tile
    for k0 in range(0, K, BLOCK_K_):
        cols = k0 + offs_k[None, :]
        # Padding rows, columns and K lanes load zeros: exact zero products.
        x = tl.load(x_rows + cols, mask=(offs_m[:, None] < M) & (cols < K), other=0.0)
        w = tl.load(w_rows + cols, mask=(offs_n[:, None] < N) & (cols < K), other=0.0)
        acc_t = tl.dot(w, tl.trans(x), acc_t, input_precision=DOT_PREC)
    _store(acc_t, B, Y, M, N, stride_ym, pid_m, pid_n, BLOCK_M, BLOCK_N, HAS_BIAS)


@triton.jit
def _matmul_tma_kernel(x_desc, w_desc, B, Y, M, N, K, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K_: tl.constexpr,
                       HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr, GROUP_M: tl.constexpr):
    """`_matmul_kernel` with its tiles through TMA: edges read as zeros, as the
    masked loads do, so every output is the same chain of products."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K_):
        x = x_desc.load([pid_m * BLOCK_M, k0])
        w = w_desc.load([pid_n * BLOCK_N, k0])
        acc_t = tl.dot(w, tl.trans(x), acc_t, input_precision=DOT_PREC)
    _store(acc_t, B, Y, M, N, stride_ym, pid_m, pid_n, BLOCK_M, BLOCK_N, HAS_BIAS)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) (the module docstring's contract); `out`: an output
    [rows, N] view to write into."""
    k = x.shape[-1]
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.stride(1) == 1, "weight [N, K], contiguous rows"
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = (torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None
         else out.view(m, n))
    if m == 0:
        return y.view(*x.shape[:-1], n)
    cfg = fit_stages(pick_config(m, n, k), x.element_size())
    grid = (programs(cfg, m, n),)
    b = bias if bias is not None else weight
    consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K_=BLOCK_K,
                  HAS_BIAS=bias is not None, DOT_PREC=dot_precision(x.dtype), GROUP_M=8,
                  num_warps=cfg.warps, num_stages=cfg.stages)
    if cfg.tma and tma_fits(x2, weight):
        x_desc = TensorDescriptor(x2, [m, k], [x2.stride(0), 1], [cfg.block_m, BLOCK_K])
        w_desc = TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [cfg.block_n, BLOCK_K])
        _matmul_tma_kernel[grid](x_desc, w_desc, b, y, m, n, k, y.stride(0), **consts)
    else:
        _matmul_kernel[grid](x2, weight, b, y, m, n, k, x2.stride(0), weight.stride(0),
                             y.stride(0), **consts)
    return y.view(*x.shape[:-1], n)
