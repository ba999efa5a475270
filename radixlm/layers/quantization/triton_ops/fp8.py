"""FP8 (e4m3) weight products in Triton: the decode GEMV, the W8A8 GEMM and the
activation quantization that feeds it.

Why our own: at one row a decode step reads every weight once, and
`torch._scaled_mm` (cuBLAS) streams FP8 weights at 2.0-2.5 TB/s on an H200,
barely faster than a bf16 GEMV in time per token. The GEMV here reads them
like our bf16 GEMV (`layers/gemv.py`): 16-byte loads, the same bytes in flight
per program, the first weight tile loaded before the PDL wait.

Weights: `w` [N, K] FP8 (row stride may exceed K) with either one fp32 scale
per row (`block_k` 0: `scales` [N]) or block scales (`scales` [N /
scale_rows, cdiv(K, block_k)]: row r of the weight, features of block j,
scale `scales[r // scale_rows, j]`). w_true = w * scale.

- `fp8_gemv` (1-8 rows, x bf16/fp16): y = x (w * s)^T at the activations'
  precision, fp32 sums. M == 1: products and sums in fp32 registers, one
  reduction at the end; block scales multiply x's features instead of the
  weights (a program's rows share their scale row), so the loop stays loads
  and FMAs. M 2-8: the weight tile widened to x's dtype (exact: e4m3 fits
  bf16 and fp16) on the tensor cores against x^T padded to 16 rows, one
  block of K per step, its partial sum scaled by the program's block scale.
  `silu_mul` fuses a merged [gate; up] product with silu(gate) * up.
- `quantize_activations`: x -> (FP8, fp32 scales) per token (one scale per
  row), per token and group of `block_k` features, or by a given static
  scale; scale = max |x| / 448 over the group.
- `fp8_gemm` (any rows): the quantized activations times the weight on the
  FP8 tensor cores. Block scales are applied per K block, which promotes each
  block's sum to fp32 (DeepSeek-V3's recipe); per-row scales once at the end,
  the sums kept in the MMA's own accumulator over the whole K (fast
  accumulation, the default: ~1.4x the rate; `pick_gemm_config` says why) or,
  with `GemmConfig.promote`, promoted to fp32 every K block. Where rows are 16-byte
  aligned the operand tiles come through TMA descriptors
  (`_fp8_gemm_tma_kernel`), the largest per-channel tile with one persistent
  program per SM (`pick_gemm_config`).
No host sync and no allocation but the outputs (CUDA graphs capture these);
configs come from fixed heuristics, so the only warm-up is Triton's compile.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from radixlm.layers import pdl, tiles
from radixlm.layers.fp8_rows import Fp8Rows
from radixlm.layers.gemv import _load_w, _load_x, _silu_mul
from radixlm.layers.pdl import pdl_trigger, pdl_wait
from radixlm.layers.quantization.triton_ops import fp8_mma, fp8_w8a8_gemv
from radixlm.layers.quantization.triton_ops.e4m3 import e4m3_codes, e4m3_scale
from radixlm.layers.quantization.triton_ops.mma_gemv import rows_fit
from radixlm.layers.tiles import grouped_tile

FP8 = torch.float8_e4m3fn
MAX_GEMV_ROWS = 8


class GemvConfig(NamedTuple):
    kernel: str  # "fma" (one row) or "mma"
    bn: int  # weight rows per program
    bk: int  # features per loop step
    warps: int
    stages: int  # "fma": 2 loads its tiles in pairs (its loop is not pipelined)
    # "fma": weights in 8-byte vectors, so a thread's weights and its bf16 x lanes
    # share one layout. With 16-byte vectors (the default) x moves through shared
    # memory every step, 2-16 barriers (`benchmarks/fp8_gemv_sass.py`); at BK =
    # 256 x warps there is none. The one-row default (`pick_gemv_config`).
    vec8: bool = False


class GemmConfig(NamedTuple):
    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    group_m: int = 8
    # Operand tiles through TMA descriptors (FP8 activations, 16-byte rows), and
    # with `persistent` one program per SM walking the tiles, the next tile's
    # loads issued under this one's epilogue.
    tma: bool = False
    persistent: bool = False
    # Per channel: the FP8 MMA's sums promoted to fp32 every BK terms (False: over
    # the whole K, Hopper's "fast accumulation"). Block scales promote per block.
    promote: bool = True

    def label(self) -> str:
        """bm x bn x bk x warps x stages, -tma / -p / -fast (sweeps, test ids)."""
        return ("x".join(map(str, self[:5])) + ("-tma" if self.tma else "")
                + ("-p" if self.persistent else "") + ("" if self.promote else "-fast"))


def pick_gemv_config(m: int, n: int, k: int, block_k: int) -> GemvConfig:
    """bf16's `pick_config` at the same bytes per step (twice the features: one
    byte each; 4 warps, so the [4, 2048] fp32 products stay in 64 registers a
    thread); the tensor-core variant steps one scale block at a time."""
    if m == 1:  # H200 sweep of Llama-8B's shapes (benchmarks/quant_kernels.py --sweep),
        # 8-byte weight vectors at BK = 256 x warps (no barrier in the loop): wide
        # layers (qkv, gate_up) 2.80 / 3.68 TB/s with 4 x 512 tiles on 2 warps (16-byte
        # 8 x 512 pairs: 2.73 / 3.48), square and long-K ones (o, down) 2.58 / 3.53
        # with 4 x 1024 on 4 warps (16-byte 8 x 1024: 2.50 / 3.40)
        if n > k:
            return GemvConfig("fma", 4, 512, 2, 1, vec8=True)
        return GemvConfig("fma", 4, 1024, 4, 1, vec8=True)
    bk = block_k or 256
    if n <= 4096:
        return GemvConfig("mma", 32 if k > 2048 else 64, bk, 4, 6)
    return GemvConfig("mma", 64, bk, 4, 4)


def pick_gemm_config(m: int, n: int, block_k: int, a_fp8: bool = True) -> GemmConfig:
    """From the sweeps (benchmarks/quant_kernels.py --gemm-sweep, --accum-sweep;
    Llama-8B's four projections at 256 and 4096 rows):
    - per channel: Hopper's "fast accumulation" (the FP8 MMA's own accumulator
      over the whole K, `promote=False`, as vLLM's CUTLASS kernels and
      `_scaled_mm(use_fast_accum=True)` do), in a persistent 128 x 256 tile
      over TMA descriptors wherever it gives >= 128 tiles for the 132 SMs, else
      64 x 128. It ran 1,217-1,525 TFLOP/s on an H100 against 879-1,092 with the
      sums promoted to fp32 every 128 terms (the best promoted tile, 256 x 128,
      934-990 on an H200). Its error is larger (rms 2.1-3.3e-3 of the output's,
      max up to 1.0e-2 at K = 14,336, against 1.7e-3 / 2.4e-3) and the answers
      the same: over 200 prompts (benchmarks/fp8_sums_agreement.py) both forms
      flip the same first token (the reference's margin 0.125 nats), and in the
      engine test's twenty (tests/gpu/test_quant_gpu.py) the fast sums flip
      that one alone. Offline FP8 + FP8 KV 1.34-1.35x bf16 against 1.22-1.23x
      promoted (BENCHMARKS 2026-12-07, 09:15). Promoting by hand every 2 or 4
      blocks (a second accumulator, flushed under a branch) ran slower than both.
    - 128 x 128 block scales: 64 x 128 through TMA above 64 rows (563-711 on
      an H200, against 418-582 for 128 x 128); a block's scales promote its sum
      by construction; a 256-row tile holds two accumulators and spills.
    - bf16 activations (weight-only): no TMA (its rows are FP8 here) and no
      256-row tile (240 KB of shared memory)."""
    bk = block_k or 128
    if m <= 64:
        return GemmConfig(64, 64, bk, 4, 4)
    if not a_fp8:
        if m <= 128 or n <= 4096:
            return GemmConfig(64, 128, bk, 4, 4)
        return GemmConfig(128, 128, bk, 8, 4)
    if block_k:
        return GemmConfig(64, 128, bk, 4, 4, tma=True)
    if triton.cdiv(m, 128) * triton.cdiv(n, 256) >= 128:
        return GemmConfig(128, 256, bk, 8, 3, tma=True, persistent=True, promote=False)
    return GemmConfig(64, 128, bk, 4, 4, promote=False)


def _pow2_divisor(n: int, cap: int) -> int:
    d = 1
    while d < cap and n % (2 * d) == 0:
        d *= 2
    return d


def gemv_fits(m: int, block_k: int, scale_rows: int) -> bool:
    """Whether the GEMV takes this shape: 1-8 rows, and with block scales a
    program's rows (4 at one row, >= 16 on the tensor cores) in one scale row."""
    if not 1 <= m <= MAX_GEMV_ROWS:
        return False
    return not block_k or scale_rows % (4 if m == 1 else 16) == 0


def route(m: int, block_k: int, scale_rows: int, w8a8_from: int, mma_fits: bool) -> str:
    """Which product `fp8_linear` runs for m rows of x: "w8a8_gemv" (from
    `w8a8_from` rows, 0: never, to `fp8_w8a8_gemv.ROUTE_MAX_ROWS`), "mma_gemv"
    (`mma_fits`: a tensor-core layout exists and x's rows suit it), "gemv"
    (`gemv_fits`) or "gemm"."""
    if 0 < w8a8_from <= m <= fp8_w8a8_gemv.ROUTE_MAX_ROWS:
        return "w8a8_gemv"
    if mma_fits:
        return "mma_gemv"
    if gemv_fits(m, block_k, scale_rows):
        return "gemv"
    return "gemm"


def takes_fp8_rows(m: int, block_k: int, scale_rows: int, input_scale: torch.Tensor | None,
                   weight_only: bool, mma: torch.Tensor | None, w8a8_from: int) -> bool:
    """Whether `fp8_linear` with these arguments quantizes m rows per token (one
    scale a row) for the W8A8 GEMM: rows a producer may hand over as `Fp8Rows`.
    The tensor-core GEMV is assumed to take any m rows it could (bf16, aligned):
    where it would not, the producer writes bf16 rows, which is merely slower."""
    if block_k or input_scale is not None or weight_only:
        return False
    mma_fits = mma is not None and m <= fp8_mma.GEMV_ROWS
    return route(m, block_k, scale_rows, w8a8_from, mma_fits) == "gemm"


def fp8_linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scales: torch.Tensor,
               block_k: int, scale_rows: int, input_scale: torch.Tensor | None,
               bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
               silu_mul: bool = False, weight_only: bool = False,
               mma: torch.Tensor | None = None, w8a8_from: int = 0) -> torch.Tensor | None:
    """x @ (weight * scales)^T (+ bias), through the GEMV or the W8A8 GEMM
    (`weight_only`: x stays in its dtype, the weight tiles widened to it); with
    `silu_mul` (weight [2 D, K], no bias) silu(gate) * up, or None where only
    the GEMV fuses it. Returns [..., N] in x's dtype (into `out` if given). `mma`:
    the weight in `fp8_mma.mma_layout`, or `weight` itself (read where it lies:
    `fp8_gemv_mma_plain`), for the tensor-core GEMV at 1 to `fp8_mma.GEMV_ROWS`
    contiguous, bf16, 16-byte aligned rows (its scales as `fp8_mma.takes` says).
    `w8a8_from`: from that many rows (0: never) to `fp8_w8a8_gemv.ROUTE_MAX_ROWS`
    through that GEMV (FP8 activations, dynamic scales: `fp8_w8a8_gemv.takes`).
    x may be `Fp8Rows` where `takes_fp8_rows` says so: its codes go to the GEMM as
    they are (None with `silu_mul`)."""
    n, k = weight.shape
    if isinstance(x, Fp8Rows):
        if silu_mul:
            return None
        assert x.q.shape[-1] == k and x.q.dim() == 2
        return fp8_gemm(x.q, x.scales, weight, scales, block_k, scale_rows, bias, x.dtype,
                        out=out)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    mma_fits = (mma is not None and x2.dtype == torch.bfloat16
                and rows_fit(x2, fp8_mma.GEMV_ROWS))
    way = route(x2.shape[0], block_k, scale_rows, w8a8_from, mma_fits)
    if way == "w8a8_gemv":
        y = fp8_w8a8_gemv.fp8_gemv_w8a8(x2, weight, scales, block_k, scale_rows, bias,
                                        out=out, silu_mul=silu_mul)
        return y.view(*x.shape[:-1], y.shape[-1])
    if way == "mma_gemv":
        gemv_mma = fp8_mma.fp8_gemv_mma_plain if mma is weight else fp8_mma.fp8_gemv_mma
        y = gemv_mma(x2, mma, scales, bias, out=out, silu_mul=silu_mul,
                     scale_rows=scale_rows if block_k else 0)
        return y.view(*x.shape[:-1], y.shape[-1])
    if way == "gemv":
        y = fp8_gemv(x2, weight, scales, block_k, scale_rows, bias, out=out, silu_mul=silu_mul)
        return y.view(*x.shape[:-1], y.shape[-1])
    if silu_mul:
        return None
    if weight_only:
        xq, xs = x2, scales  # (no activation scales: a dummy pointer)
    else:
        xq, xs = quantize_activations(x2, block_k, input_scale)
    y = fp8_gemm(xq, xs, weight, scales, block_k, scale_rows, bias, x.dtype, out=out)
    return y.view(*x.shape[:-1], n)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, block_k: int,
             scale_rows: int, bias: torch.Tensor | None = None,
             config: GemvConfig | None = None, out: torch.Tensor | None = None,
             silu_mul: bool = False) -> torch.Tensor:
    """[M, K] x (1-8 rows, bf16/fp16, rows contiguous) times the FP8 weight: [M, N]
    (N / 2 with `silu_mul`)."""
    n, k = weight.shape
    m = x.shape[0]
    assert gemv_fits(m, block_k, scale_rows) and x.stride(1) == 1 and weight.stride(1) == 1
    cfg = config or pick_gemv_config(m, n, k, block_k)
    if block_k:
        cfg = cfg._replace(bk=block_k) if cfg.kernel == "mma" else cfg
        cfg = cfg._replace(bn=min(cfg.bn, _pow2_divisor(scale_rows, cfg.bn)))
    if silu_mul:
        assert bias is None and n % 2 == 0
        n //= 2
        if config is None and cfg.bn >= (32 if cfg.kernel == "mma" else 2):
            cfg = cfg._replace(bn=cfg.bn // 2)  # gate and up tiles: the registers of one
    if out is None:
        y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    else:
        assert out.is_contiguous() and out.dtype == x.dtype and out.numel() == m * n
        y = out.view(m, n)
    b = bias if bias is not None else scales  # a dummy pointer without bias
    stride_s = scales.stride(0) if block_k else 0
    common = dict(BN=cfg.bn, BK=cfg.bk, BLOCK_K=block_k, SCALE_ROWS=scale_rows,
                  HAS_BIAS=bias is not None, EVEN_K=k % cfg.bk == 0, SILU_MUL=silu_mul,
                  num_warps=cfg.warps, num_stages=cfg.stages, **pdl.launch_args())
    grid = (triton.cdiv(n, cfg.bn),)
    if cfg.kernel == "fma":
        assert m == 1
        # stages > 1: tiles loaded in pairs (the loop is not pipelined: no dot)
        common.update(num_stages=1, PAIRS=cfg.stages > 1, VEC8=cfg.vec8)
        _fp8_gemv_fma_kernel[grid](x, weight, scales, b, y, n, k, weight.stride(0), stride_s,
                                   **common)
    else:
        _fp8_gemv_mma_kernel[grid](x, weight, scales, b, y, m, n, k, x.stride(0), y.stride(0),
                                   weight.stride(0), stride_s, BM=16, **common)
    return y


def quantize_activations(x: torch.Tensor, block_k: int = 0,
                         static_scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 [M, K], fp32 scales): [M, cdiv(K, block_k)] per token and
    group (block_k > 0), [M, 1] per token, or `static_scale` [1] expanded to
    that shape (strides 0)."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    if m == 0:
        return q, torch.empty((0, 1), dtype=torch.float32, device=x.device)
    if block_k and static_scale is None:
        # Programs of 1024 features (8 groups of 128): one per group would be
        # ~450k tiny programs for a 4096-token prefill of Llama-8B's down_proj.
        groups = triton.cdiv(k, block_k)
        s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
        per = max(1, 1024 // block_k)
        _quant_groups_kernel[(m, triton.cdiv(groups, per))](
            x, q, s, k, groups, x.stride(0), q.stride(0), s.stride(0), GROUP=block_k,
            GROUPS=per, num_warps=4)
        return q, s
    if static_scale is not None:
        s = static_scale.reshape(1, 1).expand(m, triton.cdiv(k, block_k) if block_k else 1)
    else:
        s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    _quant_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), s.stride(0),
                             STEPS=triton.cdiv(k, 1024), BLOCK=1024,
                             STATIC=static_scale is not None, num_warps=4)
    return q, s


def tma_fits(xq: torch.Tensor, weight: torch.Tensor) -> bool:
    """The TMA kernel takes FP8 activations whose rows (and the weight's) TMA
    can read (`tiles.tma_fits`)."""
    return xq.dtype == FP8 and xq.shape[1] % 16 == 0 and tiles.tma_fits(xq, weight)


def fp8_gemm(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
             block_k: int, scale_rows: int, bias: torch.Tensor | None, out_dtype: torch.dtype,
             config: GemmConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """(xq * xs) @ (weight * scales)^T (+ bias) in `out_dtype`, [M, N]. An xq in
    bf16/fp16 rather than FP8 has no scales (`xs` is ignored): weight-only."""
    m, k = xq.shape
    n = weight.shape[0]
    cfg = config or pick_gemm_config(m, n, block_k, xq.dtype == FP8)
    if block_k:
        cfg = cfg._replace(bk=block_k)  # one K block per step: its scales are two vectors
    if out is None:
        y = torch.empty((m, n), device=xq.device, dtype=out_dtype)
    else:
        assert out.is_contiguous() and out.dtype == out_dtype and out.numel() == m * n
        y = out.view(m, n)
    if m == 0:
        return y
    b = bias if bias is not None else scales
    n_tiles = triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn)
    if cfg.tma and tma_fits(xq, weight):
        persistent = cfg.persistent and xq.is_cuda  # the interpreter: a program a tile
        grid = (min(n_tiles, tiles.sm_count(xq.device)) if persistent else n_tiles,)
        a_desc = TensorDescriptor(xq, [m, k], [xq.stride(0), 1], [cfg.bm, cfg.bk])
        b_desc = TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [cfg.bn, cfg.bk])
        _fp8_gemm_tma_kernel[grid](
            a_desc, b_desc, xs, scales, b, y, m, n, k, xs.stride(0),
            xs.stride(1) if xs.dim() == 2 else 0, scales.stride(0) if block_k else 0,
            y.stride(0), BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m,
            BLOCK_K=block_k, SCALE_ROWS=scale_rows, HAS_BIAS=bias is not None,
            FLATTEN=persistent, PROMOTE=cfg.promote, num_warps=cfg.warps, num_stages=cfg.stages)
        return y
    grid = (n_tiles,)
    _fp8_gemm_kernel[grid](xq, xs, weight, scales, b, y, m, n, k, xq.stride(0), xs.stride(0),
                           xs.stride(1) if xs.dim() == 2 else 0, weight.stride(0),
                           scales.stride(0) if block_k else 0, y.stride(0),
                           BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m,
                           BLOCK_K=block_k, SCALE_ROWS=scale_rows, HAS_BIAS=bias is not None,
                           EVEN_K=k % cfg.bk == 0, A_FP8=xq.dtype == FP8, PROMOTE=cfg.promote,
                           num_warps=cfg.warps, num_stages=cfg.stages)
    return y


@triton.jit
def _fp8_gemm_tma_kernel(a_desc, b_desc, as_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K,
                         stride_asm, stride_ask, stride_bsn, stride_cm,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         GROUP_M: tl.constexpr, BLOCK_K: tl.constexpr,
                         SCALE_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                         FLATTEN: tl.constexpr, PROMOTE: tl.constexpr):
    """`_fp8_gemm_kernel` (FP8 activations) with its operand tiles through TMA:
    edges read as zeros, no masks or address arithmetic in the loop. Programs
    walk the tiles with a stride of the grid (one tile each unless persistent)."""
    n_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = grouped_tile(tile, M, N, BM, BN, GROUP_M)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        rm = tl.minimum(offs_m, M - 1).to(tl.int64)
        rn = tl.minimum(offs_n, N - 1).to(tl.int64)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k in range(0, K, BK):
            a = a_desc.load([pid_m * BM, k])
            b = b_desc.load([pid_n * BN, k])
            if BLOCK_K:  # BK == BLOCK_K
                b_s = tl.load(bs_ptr + (rn // SCALE_ROWS) * stride_bsn + k // BLOCK_K)
                a_s = tl.load(as_ptr + rm * stride_asm + (k // BLOCK_K) * stride_ask)
                acc += tl.dot(a, b.T) * a_s[:, None] * b_s[None, :]
            elif PROMOTE:  # promoted every BK terms, as in `_fp8_gemm_kernel`
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BK)
            else:
                acc = tl.dot(a, b.T, acc)
        _gemm_store(acc, as_ptr, bs_ptr, bias_ptr, c_ptr, M, N, stride_asm, stride_cm,
                    offs_m, offs_n, rm, rn, BLOCK_K, HAS_BIAS, True)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm,
                       STEPS: tl.constexpr, BLOCK: tl.constexpr, STATIC: tl.constexpr):
    """Program per row: the row's scale (max |x| / 448, or the static one), then its
    FP8 codes, round to nearest even."""
    m = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + m * stride_xm
    if STATIC:
        s = tl.load(s_ptr)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(STEPS):
            k = i * BLOCK + offs
            v = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        s = e4m3_scale(tl.max(amax, 0))
        tl.store(s_ptr + m * stride_sm, s)
    for i in range(STEPS):
        k = i * BLOCK + offs
        v = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        q = e4m3_codes(v, s)
        tl.store(q_ptr + m * stride_qm + k, q.to(q_ptr.dtype.element_ty), mask=k < K)


@triton.jit
def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, K, NUM_GROUPS, stride_xm, stride_qm, stride_sm,
                         GROUP: tl.constexpr, GROUPS: tl.constexpr):
    """Program (row, GROUPS consecutive groups): each group's scale and codes."""
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    k = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = k < K
    v = tl.load(x_ptr + m * stride_xm + k, mask=ok, other=0.0).to(tl.float32)
    s = e4m3_scale(tl.max(tl.abs(v), 1))
    tl.store(s_ptr + m * stride_sm + g, s, mask=g < NUM_GROUPS)
    q = e4m3_codes(v, s[:, None])
    tl.store(q_ptr + m * stride_qm + k, q.to(q_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _block_scaled(xk, s_row_ptr, k, offs_k, K, BLOCK_K: tl.constexpr):
    """x's features k + offs_k times the block scale of each (this program's row
    of the scale table); unchanged without block scales."""
    if BLOCK_K:
        s = tl.load(s_row_ptr + (k + offs_k) // BLOCK_K, mask=k + offs_k < K, other=0.0)
        return xk * s
    return xk


@triton.jit
def _fma_tile(acc, acc_up, w, wu, x_ptr, s_row, s_row_up, k, offs_k, K, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr):
    """acc (+ acc_up) += the weight tile(s) at k times x's features there, in fp32."""
    xk = _load_x(x_ptr, k, offs_k, K, EVEN_K).to(tl.float32)
    acc += w.to(tl.float32) * _block_scaled(xk, s_row, k, offs_k, K, BLOCK_K)[None, :]
    if SILU_MUL:
        acc_up += wu.to(tl.float32) * _block_scaled(xk, s_row_up, k, offs_k, K,
                                                    BLOCK_K)[None, :]
    return acc, acc_up


@triton.jit
def _fp8_gemv_fma_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, K, stride_wn, stride_sn,
                         BN: tl.constexpr, BK: tl.constexpr, BLOCK_K: tl.constexpr,
                         SCALE_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                         EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr, PAIRS: tl.constexpr,
                         VEC8: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BN + tl.arange(0, BN)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: loads need no row mask
    offs_k = tl.arange(0, BK)
    if VEC8:  # see GemvConfig.vec8
        offs_k = tl.max_contiguous(offs_k, 8)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    up_ptrs = w_ptrs + N * stride_wn  # SILU_MUL: the up rows, N below the gate rows
    # BN divides SCALE_ROWS: the program's rows (gate, and up) share a scale row.
    s_row = s_ptr + ((pid * BN) // SCALE_ROWS) * stride_sn
    s_row_up = s_ptr + ((pid * BN + N) // SCALE_ROWS) * stride_sn
    # The first weight tile, the row scales and the bias before the PDL wait: they
    # are constant, and loaded after the loop they were one more round trip to
    # memory at the end of every program.
    w, wu = _load_w(w_ptrs, up_ptrs, 0, offs_k, K, EVEN_K, SILU_MUL)
    scale = 1.0
    scale_up = 1.0
    if not BLOCK_K:
        scale = tl.load(s_ptr + rows)
        if SILU_MUL:
            scale_up = tl.load(s_ptr + rows + N)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + rows).to(tl.float32)
    pdl_wait(PDL)
    pdl_trigger(PDL)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    acc_up = acc
    acc, acc_up = _fma_tile(acc, acc_up, w, wu, x_ptr, s_row, s_row_up, 0, offs_k, K, BLOCK_K,
                            EVEN_K, SILU_MUL)
    if PAIRS:
        # Two tiles' loads issued before either is used: twice the bytes in flight a
        # program, without a wider fp32 accumulator (Triton does not pipeline this
        # loop: no dot consumes the loads).
        for k in range(BK, K - BK, 2 * BK):
            w, wu = _load_w(w_ptrs, up_ptrs, k, offs_k, K, EVEN_K, SILU_MUL)
            w2, wu2 = _load_w(w_ptrs, up_ptrs, k + BK, offs_k, K, EVEN_K, SILU_MUL)
            acc, acc_up = _fma_tile(acc, acc_up, w, wu, x_ptr, s_row, s_row_up, k, offs_k, K,
                                    BLOCK_K, EVEN_K, SILU_MUL)
            acc, acc_up = _fma_tile(acc, acc_up, w2, wu2, x_ptr, s_row, s_row_up, k + BK,
                                    offs_k, K, BLOCK_K, EVEN_K, SILU_MUL)
        if tl.cdiv(K, BK) % 2 == 0:  # the last tile, left over by the pairs
            k = K - (K - 1) % BK - 1
            w, wu = _load_w(w_ptrs, up_ptrs, k, offs_k, K, EVEN_K, SILU_MUL)
            acc, acc_up = _fma_tile(acc, acc_up, w, wu, x_ptr, s_row, s_row_up, k, offs_k, K,
                                    BLOCK_K, EVEN_K, SILU_MUL)
    else:
        for k in range(BK, K, BK):
            w, wu = _load_w(w_ptrs, up_ptrs, k, offs_k, K, EVEN_K, SILU_MUL)
            acc, acc_up = _fma_tile(acc, acc_up, w, wu, x_ptr, s_row, s_row_up, k, offs_k, K,
                                    BLOCK_K, EVEN_K, SILU_MUL)
    y = tl.sum(acc, axis=1)
    y_up = tl.sum(acc_up, axis=1)
    if not BLOCK_K:
        y *= scale
        if SILU_MUL:
            y_up *= scale_up
    if HAS_BIAS:
        y += bias
    if SILU_MUL:
        y = _silu_mul(y, y_up, y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _fp8_gemv_mma_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                         stride_wn, stride_sn,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         BLOCK_K: tl.constexpr, SCALE_ROWS: tl.constexpr,
                         HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr,
                         PDL: tl.constexpr):
    # Waits first: the loop is software-pipelined over num_stages weight tiles.
    pdl_wait(PDL)
    pdl_trigger(PDL)
    pid = tl.program_id(0)
    offs_n = pid * BN + tl.arange(0, BN)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_m = tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    up_ptrs = w_ptrs + N * stride_wn
    s_row = s_ptr + ((pid * BN) // SCALE_ROWS) * stride_sn
    s_row_up = s_ptr + ((pid * BN + N) // SCALE_ROWS) * stride_sn
    xt_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # x^T tile [BK, BM]
    m_ok = offs_m[None, :] < M
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    acc_up = tl.zeros([BN, BM], dtype=tl.float32)
    for k in range(0, K, BK):
        w, wu = _load_w(w_ptrs, up_ptrs, k, offs_k, K, EVEN_K, SILU_MUL)
        if EVEN_K:
            xt = tl.load(xt_ptrs + k, mask=m_ok, other=0.0)
        else:
            xt = tl.load(xt_ptrs + k, mask=m_ok & (k + offs_k < K)[:, None], other=0.0)
        if BLOCK_K:  # BK == BLOCK_K: one scale per step for the program's rows
            acc += tl.dot(w.to(xt.dtype), xt) * tl.load(s_row + k // BLOCK_K)
            if SILU_MUL:
                acc_up += tl.dot(wu.to(xt.dtype), xt) * tl.load(s_row_up + k // BLOCK_K)
        else:
            acc = tl.dot(w.to(xt.dtype), xt, acc)
            if SILU_MUL:
                acc_up = tl.dot(wu.to(xt.dtype), xt, acc_up)
    if not BLOCK_K:
        acc *= tl.load(s_ptr + rows)[:, None]
        if SILU_MUL:
            acc_up *= tl.load(s_ptr + rows + N)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows).to(tl.float32)[:, None]
    if SILU_MUL:
        acc = _silu_mul(acc, acc_up, y_ptr.dtype.element_ty)
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok & (offs_n[:, None] < N))


@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K,
                     stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_cm,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     GROUP_M: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_ROWS: tl.constexpr,
                     HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, A_FP8: tl.constexpr,
                     PROMOTE: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rm = tl.minimum(offs_m, M - 1).to(tl.int64)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + rm[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + rn[None, :] * stride_bn + offs_k[:, None]  # [BK, BN], K contiguous
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(0, K, BK):
        if EVEN_K:
            a = tl.load(a_ptrs + k)
            b = tl.load(b_ptrs + k)
        else:
            k_ok = k + offs_k < K
            a = tl.load(a_ptrs + k, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs + k, mask=k_ok[:, None], other=0.0)
        if not A_FP8:  # weight-only: the FP8 tile widened to x's dtype (exact)
            b = b.to(a.dtype)
        if BLOCK_K:  # BK == BLOCK_K
            b_s = tl.load(bs_ptr + (rn // SCALE_ROWS) * stride_bsn + k // BLOCK_K)
            if A_FP8:
                a_s = tl.load(as_ptr + rm * stride_asm + (k // BLOCK_K) * stride_ask)
                acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            else:
                acc += tl.dot(a, b) * b_s[None, :]
        elif A_FP8 and PROMOTE:
            # Hopper's FP8 MMA sums in less than fp32 (Triton's default lets it
            # run the whole K): promote into the fp32 accumulator every BK terms,
            # as the block path does by construction (DeepSeek-V3's recipe).
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BK)
        else:
            acc = tl.dot(a, b, acc)
    _gemm_store(acc, as_ptr, bs_ptr, bias_ptr, c_ptr, M, N, stride_asm, stride_cm,
                offs_m, offs_n, rm, rn, BLOCK_K, HAS_BIAS, A_FP8)


@triton.jit
def _gemm_store(acc, as_ptr, bs_ptr, bias_ptr, c_ptr, M, N, stride_asm, stride_cm,
                offs_m, offs_n, rm, rn, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                A_FP8: tl.constexpr):
    """The W8A8 GEMMs' epilogue: per-row scales (block scales were applied per K
    step), the bias, the masked store in the output's dtype."""
    if not BLOCK_K:
        acc *= tl.load(bs_ptr + rn)[None, :]
        if A_FP8:
            acc *= tl.load(as_ptr + rm * stride_asm)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
