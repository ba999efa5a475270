"""Triton GEMV for decode: `y = x @ weight.T (+ bias)` with 1 to 8 rows in x.

Why: at batch 1 a decode step is bound by reading the weights once, and on an
H200 cuBLAS streams the smaller Llama-8B matrices at well under the copy
bandwidth. These kernels read each weight byte once, with 16-byte loads and
enough independent work in flight to keep HBM busy.

Contract:
- x: [..., K] (flattened to [M, K], M from 1 to 8, last dim contiguous),
  weight: [N, K] contiguous, bias: [N] or None; bf16 or fp16, all one dtype,
  all on one CUDA device. Returns [..., N] in x's dtype; fp32 accumulation,
  one rounding at the end.
- One kernel launch, no host sync, no allocation besides the output: safe to
  capture in a CUDA graph. Configs come from a fixed heuristic
  (`pick_config`, no autotune), so the only warm-up is Triton's compile of
  each variant (config, dtype, bias or not, K % BK == 0): call each
  (M, weight shape) once eagerly before capturing, as an engine warm-up does.
- `use_gemv(x, weight)` says when to call `gemv` instead of F.linear: where
  the inputs fit the contract and the shape is one where it measured faster.

Two kernels, picked by M:
- M == 1: each program owns BN output columns and loops over all of K, adding
  w * x into an fp32 [BN, BK] register tile; the K reduction happens once at
  the end, so the loop is loads and FMAs only.
- M >= 2: the same loop on tensor cores: tl.dot(w_tile [BN, BK], x^T [BK, 16])
  with x's rows zero-padded to 16 (masked loads, no extra traffic); Triton
  pipelines the weight loads through shared memory (num_stages).
Both take part in programmatic dependent launch (`radixlm.layers.pdl`); the
M == 1 kernel loads its first weight tile before waiting for the previous
kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radixlm.layers import pdl

try:  # CPU-only installs may lack Triton; callers then use F.linear.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAS_TRITON = False

MAX_M = 8


class GemvConfig(NamedTuple):
    kernel: str  # "fma" (M == 1 only) or "mma"
    bn: int  # output columns per program
    bk: int  # K elements per loop step
    warps: int
    stages: int


def pick_config(m: int, n: int, k: int) -> GemvConfig:
    """The config measured best on an H200 for the Llama-8B shapes (benchmarks/gemv.py --sweep),
    and at one row on an H100 for smaller matrices.

    Mostly a matter of how many programs the grid gets: enough to fill the 132 SMs
    without a small second wave.
    """
    if m == 1:
        if n * k < 4096 * 4096 and k >= 2048:
            # Below Llama-8B's smallest at tp=1 (a MoE model's attention: Qwen3-30B-A3B's
            # qkv 2048 -> 5120 and o 4096 -> 2048), an H100 sweep (benchmarks/
            # moe_decode_kernels.py) put these at 7.5 and 6.3 us against 9.2 and 7.2.
            # Llama-8B's per-rank qkv and o at tp=2 fall here too (not measured).
            return GemvConfig("fma", 2, 512, 2, 1) if n > k else GemvConfig("fma", 4, 2048, 4, 1)
        return GemvConfig("fma", 4, 1024, 2 if 3072 < n <= 4096 else 4, 1)
    if n <= 4096:
        return GemvConfig("mma", 64, 128, 4, 6) if k <= 2048 else GemvConfig("mma", 16, 512, 2, 4)
    if n <= 8192:
        return GemvConfig("mma", 64, 256, 4, 4)
    return GemvConfig("mma", 128, 128, 4, 4)


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True where `gemv` fits the inputs and beats F.linear (measured on an H200)."""
    if not (HAS_TRITON and x.is_cuda and weight.is_cuda):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return False
    if weight.dim() != 2 or not weight.is_contiguous() or x.dim() < 1:
        return False
    n, k = weight.shape
    if x.shape[-1] != k or k % 8 or x.stride(-1) != 1:
        return False
    if x.dim() > 2 and not x.is_contiguous():  # flattening would copy
        return False
    m = x.numel() // k if k else 0
    # Measured on 2048 <= K <= 14336, 3072 <= N <= 128256 (no smaller matrices). At
    # M >= 2, 4096 -> 28672 (tp1 gate_up) was a tie with cuBLAS (0.97x to 1.07x over
    # runs), so cuBLAS keeps 16384 < N < 32768 there.
    return 1 <= m <= MAX_M and n * k >= 2048 * 4096 and (m == 1 or not 16384 < n < 32768)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, out: torch.Tensor | None = None,
         silu_mul: bool = False) -> torch.Tensor:
    """x @ weight.T (+ bias) for few rows, into `out` if given (contiguous, x's
    dtype, [..., N]); see the module docstring for the contract.

    `silu_mul`: weight is a merged [gate; up] of [2 * D, K] (no bias); returns
    silu(x gate^T) * (x up^T), [..., D]. Each program computes matching gate and
    up columns, so the product never leaves registers; both are rounded to x's
    dtype before the activation, as the unfused matmul + `silu_and_mul` do."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    assert 1 <= m <= MAX_M and x2.stride(1) == 1 and weight.is_contiguous()
    cfg = config or pick_config(m, n, k)
    if silu_mul:
        assert bias is None and n % 2 == 0
        n //= 2
        if config is None and cfg.bn >= (32 if cfg.kernel == "mma" else 2):
            # Each program streams gate and up tiles: half the columns keeps its
            # registers (fma) or shared memory (mma) what the merged width's
            # config had. At full width the fma variant held two [4, 1024] fp32
            # tiles and ran tp=2's gate_up ~4 us slower than GEMV + silu_and_mul.
            cfg = cfg._replace(bn=cfg.bn // 2)
    if out is None:
        y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    else:
        assert out.is_contiguous() and out.dtype == x.dtype and out.numel() == m * n
        y = out.view(m, n)
    b = bias if bias is not None else weight  # dummy pointer when HAS_BIAS is False
    grid = (triton.cdiv(n, cfg.bn),)
    common = dict(BN=cfg.bn, BK=cfg.bk, HAS_BIAS=bias is not None, EVEN_K=k % cfg.bk == 0,
                  SILU_MUL=silu_mul, num_warps=cfg.warps, num_stages=cfg.stages,
                  **pdl.launch_args())
    if cfg.kernel == "fma":
        assert m == 1
        _gemv_fma_kernel[grid](x2, weight, b, y, n, k, **common)
    else:
        _gemv_mma_kernel[grid](x2, weight, b, y, m, n, k, x2.stride(0), y.stride(0),
                               BM=16, **common)
    return y.view(*x.shape[:-1], n)


if HAS_TRITON:
    from radixlm.layers.pdl import pdl_trigger, pdl_wait

    @triton.jit
    def _silu_mul(gate, up, dtype: tl.constexpr):
        """silu(gate) * up from fp32 sums, each first rounded to the output dtype."""
        g = gate.to(dtype).to(tl.float32)
        return g / (1.0 + tl.exp(-g)) * up.to(dtype).to(tl.float32)

    @triton.jit
    def _load_w(w_ptrs, up_ptrs, k, offs_k, K, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr):
        """The [BN, BK] weight tile at k (and its up tile with SILU_MUL; else a copy)."""
        if EVEN_K:
            w = tl.load(w_ptrs + k, eviction_policy="evict_first")
            wu = w
            if SILU_MUL:
                wu = tl.load(up_ptrs + k, eviction_policy="evict_first")
        else:
            k_ok = k + offs_k < K
            w = tl.load(w_ptrs + k, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            wu = w
            if SILU_MUL:
                wu = tl.load(up_ptrs + k, mask=k_ok[None, :], other=0.0,
                             eviction_policy="evict_first")
        return w, wu

    @triton.jit
    def _load_x(x_ptr, k, offs_k, K, EVEN_K: tl.constexpr):
        if EVEN_K:
            return tl.load(x_ptr + k + offs_k)
        return tl.load(x_ptr + k + offs_k, mask=k + offs_k < K, other=0.0)

    @triton.jit
    def _gemv_fma_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K,
                         BN: tl.constexpr, BK: tl.constexpr,
                         HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr,
                         PDL: tl.constexpr):
        offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: loads need no row mask
        offs_k = tl.arange(0, BK)
        w_ptrs = w_ptr + rows[:, None] * K + offs_k[None, :]
        up_ptrs = w_ptrs + N * K  # SILU_MUL: the up rows, N below the gate rows
        # The first weight tile (and the bias) is loaded before the PDL wait: weights
        # are constant, so these reads overlap the previous kernel's tail.
        w, wu = _load_w(w_ptrs, up_ptrs, 0, offs_k, K, EVEN_K, SILU_MUL)
        bias = 0.0
        if HAS_BIAS:
            bias = tl.load(b_ptr + rows).to(tl.float32)
        pdl_wait(PDL)
        pdl_trigger(PDL)
        xk = _load_x(x_ptr, 0, offs_k, K, EVEN_K).to(tl.float32)[None, :]
        acc = w.to(tl.float32) * xk
        acc_up = wu.to(tl.float32) * xk
        for k in range(BK, K, BK):
            w, wu = _load_w(w_ptrs, up_ptrs, k, offs_k, K, EVEN_K, SILU_MUL)
            xk = _load_x(x_ptr, k, offs_k, K, EVEN_K).to(tl.float32)[None, :]
            acc += w.to(tl.float32) * xk
            if SILU_MUL:
                acc_up += wu.to(tl.float32) * xk
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += bias
        if SILU_MUL:
            y = _silu_mul(y, tl.sum(acc_up, axis=1), y_ptr.dtype.element_ty)
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)

    @triton.jit
    def _gemv_mma_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr,
                         PDL: tl.constexpr):
        # Waits first (no weight prefetch): the loop below is software-pipelined
        # over num_stages weight tiles, which a peeled first tile would disturb.
        pdl_wait(PDL)
        pdl_trigger(PDL)
        offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)
        offs_m = tl.arange(0, BM)
        offs_k = tl.arange(0, BK)
        w_ptrs = w_ptr + rows[:, None] * K + offs_k[None, :]
        up_ptrs = w_ptrs + N * K  # SILU_MUL: the up rows, N below the gate rows
        xt_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # x^T tile [BK, BM]
        m_ok = offs_m[None, :] < M  # rows past M load as zeros
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        acc_up = tl.zeros([BN, BM], dtype=tl.float32)
        for k in range(0, K, BK):
            w, wu = _load_w(w_ptrs, up_ptrs, k, offs_k, K, EVEN_K, SILU_MUL)
            if EVEN_K:
                xt = tl.load(xt_ptrs + k, mask=m_ok, other=0.0)
            else:
                xt = tl.load(xt_ptrs + k, mask=m_ok & (k + offs_k < K)[:, None], other=0.0)
            acc = tl.dot(w, xt, acc)
            if SILU_MUL:
                acc_up = tl.dot(wu, xt, acc_up)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows).to(tl.float32)[:, None]
        if SILU_MUL:
            acc = _silu_mul(acc, acc_up, y_ptr.dtype.element_ty)
        y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok & (offs_n[:, None] < N))
