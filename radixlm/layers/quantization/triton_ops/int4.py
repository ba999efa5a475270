"""int4 weight-only products in Triton, on AWQ / GPTQ weights in our layout
(`layers/quantization/int4.py`): `qweight` int32 [K / 8, N], nibble i of row r
the weight of input feature 8 r + i; `zeros` uint8 and `scales` fp16 [groups,
N]; w = (q - z) * s, the group of feature k being k // group, or `g_idx[k]`
for act-order checkpoints.

- One row (`int4_gemv`): each program owns BN output columns and walks all of
  K; an iteration reads several [ROWS, BN] tiles of words (a row of words is
  BN * 4 contiguous bytes), each inside one group, unpacks them nibble by
  nibble in registers (a shift and one LOP3 a weight: the nibble OR-ed into
  the units of 1024.0, so the float 1024 + q with no conversion instruction)
  and sums (1024 + q) x per group and row of words, so the 1024, the zero
  point and the scale are applied once per group, row and column:
  y += s (sum_k (1024 + q) x - (1024 + z) sum_k x); the rows are summed once
  at the end (a sum per step was a cross-warp reduction, barriers included).
  fp32 throughout; with N a multiple of BN and K of the step (`EVEN`, every
  Llama shape) no load is masked or clamped, which took half the
  instructions of the loop before (address and mask arithmetic of the x
  loads; SASS counted, 14.3 -> 5.9 instructions a weight). With `silu_mul` a
  program streams matching gate and up columns of a merged [gate; up] layer
  and applies silu(gate) * up in registers (one launch for the MLP's input).
  `Int4Config.packed` (the default) does the products in packed halves of x's
  dtype instead (`_PACKED_ASM`, inline PTX; emulated in Triton operations under
  the interpreter, so CPU tests cover its indexing), and `Int4Config.lean` trims
  that loop's x loads, index arithmetic and widening (opt-in until GPU-tested).
  Split-K (`Int4Config.split` > 1): programs also split K in equal runs of
  whole steps, so a narrow layer still puts enough words in flight on every
  SM; each writes fp32 partial sums [split, N] and a second launch adds them
  in split order (a fixed order: the same bits whatever the batch), then the
  bias and the SiLU.
- More rows (`int4_gemm`), up to `DEQUANT_ABOVE`: the folded GEMM (the
  nibbles made the exact 16-bit q - z with one OR and one packed subtraction,
  tl.dot on the tensor cores into fp32, the scale applied to each step's
  sums), K split for enough programs; act-order weights dequantize each tile
  to x's dtype instead. Above (prefill): the weight dequantized whole by
  `int4_dequantize`, then cuBLAS.
No host sync and no allocation but the output, split-K's workspace and the
dequantized weight above DEQUANT_ABOVE rows (CUDA graphs capture these);
configs from fixed heuristics (no autotune).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixlm.layers import pdl
from radixlm.layers.gemv import _silu_mul
from radixlm.layers.norm_fold import FoldedNorm
from radixlm.layers.pdl import pdl_trigger, pdl_wait
from radixlm.layers.tiles import grouped_tile
from radixlm.utils import lazy_import

# The tensor-core modules import this one: loaded on their first use.
_mma = lazy_import("radixlm.layers.quantization.triton_ops.int4_mma")
_mma_gemv = lazy_import("radixlm.layers.quantization.triton_ops.mma_gemv")

MAX_SUB_STEPS = 4
# The interpreter runs no inline PTX: there the packed halves' PTX is emulated.
_EMULATE = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


class Int4Config(NamedTuple):
    bm: int  # rows per program (GEMM)
    bn: int  # output columns per program
    bk: int  # input features per loop step
    warps: int
    stages: int
    split: int = 1  # GEMV: programs along K (their partial sums added by a second launch)
    packed: bool = False  # GEMV: products in packed halves of x's dtype (`_PACKED_ASM`)
    lean: bool = False  # GEMV, packed: fewer instructions (`_gemv_sub_step_packed`)
    fold: bool = True  # GEMM: zero point and scale folded out (False: each tile dequantized)


def _pow2_divisor(n: int, cap: int) -> int:
    d = 1
    while d < cap and n % (2 * d) == 0:
        d *= 2
    return d


def pick_gemv_config(n: int, k: int, group: int) -> Int4Config:
    """64 columns (256 contiguous bytes a word row), packed halves, K split 8 ways
    (16 for a long K such as down's 14336, where 8 left too few words in flight):
    the best of 13 tiles on every Llama-8B shape in an H200 sweep
    (`benchmarks/quant_kernels.py --sweep`; packed 1.22-1.37x the unpacked tile,
    which was itself 1.2-2.9x the unsplit 16-32 columns)."""
    return Int4Config(1, 64, 256, 4, 3, 16 if k >= 8192 else 8, packed=True)


def gemv_packs(n: int, k: int, group: int, g_idx: torch.Tensor | None,
               config: Int4Config | None = None) -> bool:
    """Whether `int4_gemv` (N: the columns its programs cover, half the layer's
    with `silu_mul`) takes the packed halves: the config asks, no act-order, and N
    and K even for the tile (no masked loads). (A lean config also wants x 4-byte
    aligned: it reads x in 32-bit words. Under the interpreter the PTX is emulated.)"""
    cfg = config or pick_gemv_config(n, k, group)
    rows = _pow2_divisor(group // 8, 16) if g_idx is None else 16
    step = 8 * rows * max(1, min(MAX_SUB_STEPS, cfg.bk // (8 * rows)))
    return (cfg.packed and g_idx is None and n % cfg.bn == 0
            and k % step == 0)


# Above this many rows `int4_gemm` dequantizes the weight whole and runs cuBLAS.
DEQUANT_ABOVE = 128


def pick_gemm_config(m: int, n: int, group: int) -> Int4Config:
    """The folded GEMM's tile up to DEQUANT_ABOVE rows: the best of 15 tiles per
    row class on the Llama-8B shapes in an H100 sweep
    (`benchmarks/quant_kernels.py --int4-gemm-sweep`), where split-K (more
    programs in flight) took 1.4-2.9x off the unsplit tiles at 16-64 rows."""
    if m <= 16:
        return Int4Config(16, 64, 128, 4, 3, split=4)
    if m <= 32:
        return Int4Config(32, 64, 128, 4, 3, split=2)
    if m <= 64:
        return (Int4Config(64, 128, 128, 4, 3, split=2) if n > 8192 else
                Int4Config(64, 64, 128, 4, 3, split=4))
    return Int4Config(128, 64, 128, 4, 3, split=2)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor | None, zeros: torch.Tensor,
                scales: torch.Tensor, group: int, g_idx: torch.Tensor | None,
                bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                silu_mul: bool = False, mma: torch.Tensor | None = None) -> torch.Tensor | None:
    """x @ W^T (+ bias) for x [..., K] bf16/fp16: [..., N] in x's dtype. With
    `silu_mul` (W a merged [gate; up], no bias): silu(gate) * up [..., N / 2] where
    a GEMV runs (one row; up to `int4_mma.GEMV_ROWS` on the tensor cores), None
    otherwise. `mma`: the weights in `int4_mma.mma_layout` (then `qweight` may be
    None), read by the tensor-core GEMV at 1 to `int4_mma.GEMV_ROWS` rows (copied
    first where they are not contiguous and 16-byte aligned, unless `qweight` is
    there for them) and by `int4_gemm_mma` above."""
    k = x.shape[-1]
    n = qweight.shape[1] if qweight is not None else 16 * mma.shape[0]
    assert zeros.stride(1) == scales.stride(1) == 1
    assert qweight is not None or mma is not None
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    rows = _mma.GEMV_ROWS if mma is not None else 0
    if qweight is None and 1 <= m <= rows and not _mma_gemv.rows_fit(x2, rows):
        x2 = torch.empty_like(x2, memory_format=torch.contiguous_format).copy_(x2)
    tensor_cores = mma is not None and _mma_gemv.rows_fit(x2, rows)
    if silu_mul:
        if m != 1 and not tensor_cores:
            return None
        y = (_mma.int4_gemv_mma_rows(x2, mma, zeros, scales, group, silu_mul=True)
             if tensor_cores
             else int4_gemv(x2, qweight, zeros, scales, group, g_idx, silu_mul=True))
        return y.view(*x.shape[:-1], n // 2)
    if out is not None:
        assert out.is_contiguous() and out.dtype == x.dtype and out.numel() == m * n
        out = out.view(m, n)
    if tensor_cores:
        y = _mma.int4_gemv_mma_rows(x2, mma, zeros, scales, group, bias, out=out)
    elif mma is not None and (m > 1 or qweight is None):  # the same words, more rows
        y = _mma.int4_gemm_mma(x2, mma, zeros, scales, group, bias, out=out)
    else:
        fn = int4_gemv if m == 1 else int4_gemm
        y = fn(x2, qweight, zeros, scales, group, g_idx, bias, out=out)
    return y.view(*x.shape[:-1], n)


def _out(x: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    return torch.empty((x.shape[0], n), device=x.device, dtype=x.dtype) if out is None else out


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor,
              scales: torch.Tensor, group: int, g_idx: torch.Tensor | None,
              bias: torch.Tensor | None = None, config: Int4Config | None = None,
              out: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """One row: x [1, K] times the int4 weight, [1, N] (`silu_mul`: [1, N / 2])."""
    k, n = x.shape[1], qweight.shape[1]
    assert x.shape[0] == 1 and x.stride(1) == 1 and k == 8 * qweight.shape[0]
    cfg = config or pick_gemv_config(n, k, group)
    if silu_mul:  # each program streams matching gate and up columns
        assert bias is None and n % 2 == 0
        n //= 2
    # A sub-step is 8 * rows features inside one group (act-order: any features);
    # an iteration unrolls enough of them for cfg.bk features, at most MAX_SUB_STEPS
    # (each is 8 unrolled nibble bodies, twice: a group of 32 at bk 512 made 256,
    # and that test did not finish in 60 s on an H200, where group 128's took 1 s).
    rows = _pow2_divisor(group // 8, 16) if g_idx is None else 16
    sub_steps = max(1, min(MAX_SUB_STEPS, cfg.bk // (8 * rows)))
    step = 8 * rows * sub_steps
    # Each split a run of whole steps (so of whole groups' sub-steps); no empty split.
    k_split = triton.cdiv(triton.cdiv(k, cfg.split), step) * step
    split = triton.cdiv(k, k_split)
    even = n % cfg.bn == 0 and k % step == 0
    packed = gemv_packs(n, k, group, g_idx, cfg) and (not cfg.lean or x.data_ptr() % 4 == 0)
    assert not packed or x.dtype in (torch.bfloat16, torch.float16)
    y = _out(x, n, out)
    dummy = scales
    ws = y if split == 1 else torch.empty((split, 2 * n if silu_mul else n),
                                          device=x.device, dtype=torch.float32)
    _int4_gemv_kernel[(triton.cdiv(n, cfg.bn), split)](
        x, qweight, zeros, scales, g_idx if g_idx is not None else dummy,
        bias if bias is not None else dummy, y, ws, n, k, k_split, scales.shape[0],
        qweight.stride(0), zeros.stride(0), scales.stride(0), ws.stride(0), BN=cfg.bn,
        ROWS=rows, GROUP=group, SUB_STEPS=sub_steps, ACT_ORDER=g_idx is not None,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, PARTIAL=split > 1,
        EVEN=even, PACKED=packed, BF16=x.dtype == torch.bfloat16, LEAN=cfg.lean,
        num_warps=cfg.warps, num_stages=cfg.stages, **pdl.launch_args())
    if split > 1:
        sum_splits(ws[:, None], bias, y, silu_mul)
    return y


def sum_splits(ws: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
               silu_mul: bool, norm_in: FoldedNorm | None = None) -> torch.Tensor:
    """y [M, n_out] = the partial sums [split, M, N] added in split order (+ bias;
    silu(gate) * up with `silu_mul`): the second launch of every split-K GEMV
    (`int4_gemv` and the tensor-core ones of `mma_gemv`), one program per row and
    block of columns, so a row's sum is the same at any M; one launch for all rows.
    `norm_in`: the product's x held that folded norm unscaled (`layers/norm_fold.py`):
    the sums are multiplied by its rstd before the bias."""
    n_out, m = y.shape[-1], ws.shape[1]
    sq, p = ws, 1
    if norm_in is not None and norm_in.squares is not None:
        sq, p = norm_in.squares, norm_in.squares.shape[-1]
        assert sq.shape == (m, p) and sq.is_contiguous()
    _int4_split_sum_kernel[(triton.cdiv(n_out, 256), m)](
        ws, bias if bias is not None else ws, y, n_out, ws.stride(0), ws.stride(1), y.stride(0),
        sq, p, norm_in.x.shape[-1] if sq is not ws else 1,
        norm_in.eps if sq is not ws else 0.0, SPLIT=ws.shape[0], BLOCK=256,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, NORM_IN=sq is not ws,
        P_BLOCK=triton.next_power_of_2(p), ROWS=m > 1, num_warps=2, **pdl.launch_args())
    return y


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor,
              scales: torch.Tensor, group: int, g_idx: torch.Tensor | None,
              bias: torch.Tensor | None = None, config: Int4Config | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] times the int4 weight, [M, N]: above `DEQUANT_ABOVE` rows the weight
    dequantized whole and a cuBLAS GEMM (compute bound there; the dequantization
    reads the int4 weight once for all rows), up to it the folded GEMM (act-order
    weights: the per-tile dequantizing one)."""
    m, k = x.shape
    n = qweight.shape[1]
    assert x.stride(1) == 1 and k == 8 * qweight.shape[0]
    y = _out(x, n, out)
    if m == 0:
        return y
    if config is None and m > DEQUANT_ABOVE and x.dtype in (torch.bfloat16, torch.float16):
        return dense_product(x, int4_dequantize(qweight, zeros, scales, group, g_idx, x.dtype),
                             bias, y)
    cfg = config or pick_gemm_config(m, n, group)
    bk = _pow2_divisor(group, cfg.bk)  # one group per step (or part of one)
    assert bk >= 16, f"group {group}: the tensor cores need 16 features per step"
    dummy = scales
    args = (x, qweight, zeros, scales, g_idx if g_idx is not None else dummy,
            bias if bias is not None else dummy, y, m, n, k, x.stride(0), y.stride(0),
            qweight.stride(0), zeros.stride(0), scales.stride(0))
    if cfg.fold and g_idx is None and x.dtype in (torch.bfloat16, torch.float16):
        _folded_gemm(args, y, k, bk, cfg, group, bias is not None)
    else:
        _int4_gemm_kernel[(triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn),)](
            *args, BM=cfg.bm, BN=cfg.bn, BK=bk, GROUP=group, GROUP_M=8,
            ACT_ORDER=g_idx is not None, HAS_BIAS=bias is not None, num_warps=cfg.warps,
            num_stages=cfg.stages)
    return y


def _folded_gemm(args: tuple, y: torch.Tensor, k: int, bk: int, cfg: Int4Config,
                 group: int, has_bias: bool) -> None:
    """Launch `_int4_gemm_folded_kernel` on `args` (its operands up to the
    workspace) into y [M, N] with K split in equal runs of whole steps (at most
    cfg.split, so every program's loop has the same trip count): partial sums in
    fp32, added in split order by a second launch (a fixed order, so the same
    bits on every call of this shape)."""
    m, n = y.shape
    steps = k // bk
    split = max(d for d in range(1, min(cfg.split, steps) + 1) if steps % d == 0)
    ws = y if split == 1 else torch.empty((split, m, n), device=y.device, dtype=torch.float32)
    grid = (triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn), split)
    _int4_gemm_folded_kernel[grid](
        *args, ws, k // split, BM=cfg.bm, BN=cfg.bn, BK=bk, GROUP=group, GROUP_M=8,
        HAS_BIAS=has_bias, PARTIAL=split > 1,
        MAGIC=0x4300 if y.dtype == torch.bfloat16 else 0x6400,
        num_warps=cfg.warps, num_stages=cfg.stages)
    if split > 1:
        split_sum(ws, y)


def dense_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                  y: torch.Tensor) -> torch.Tensor:
    """y = x @ w (+ bias) on cuBLAS, w the dequantized weight [K, N]."""
    return torch.mm(x, w, out=y) if bias is None else torch.addmm(bias, x, w, out=y)


def split_sum(ws: torch.Tensor, y: torch.Tensor) -> None:
    """y [M, N] = the GEMM's fp32 partial sums ws [split, M, N] added in split order."""
    split, m, n = ws.shape
    _int4_split_sum_kernel[(triton.cdiv(m * n, 1024),)](
        ws, ws, y, m * n, m * n, 0, 0, ws, 1, 1, 0.0, SPLIT=split, BLOCK=1024, HAS_BIAS=False,
        SILU_MUL=False, NORM_IN=False, P_BLOCK=1, PDL=False, ROWS=False, num_warps=4)


def int4_dequantize(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                    group: int, g_idx: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The weight (q - z) s in `dtype`, [K, N] (x @ it is the layer's product),
    rounded once from fp32."""
    rows, n = qweight.shape
    w = torch.empty((8 * rows, n), device=qweight.device, dtype=dtype)
    br, bn = 16, 128
    _int4_dequant_kernel[(triton.cdiv(rows, br), triton.cdiv(n, bn))](
        qweight, zeros, scales, g_idx if g_idx is not None else scales, w, rows, n,
        qweight.stride(0), zeros.stride(0), scales.stride(0), w.stride(0), BR=br, BN=bn,
        GROUP=group, ACT_ORDER=g_idx is not None, num_warps=4)
    return w


@triton.jit
def _unpack(words, BK: tl.constexpr, BN: tl.constexpr):
    """[BK / 8, BN] int32 words -> [BK, BN] fp32 nibbles, feature 8 r + i from
    nibble i of row r. OR-ing a nibble into 2^23's mantissa and subtracting
    2^23 makes it a float without a conversion instruction."""
    shifts = tl.arange(0, 8) * 4
    q = (words[:, None, :] >> shifts[None, :, None]) & 0xF
    q = tl.reshape(q, [BK, BN])
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _nibbles_1024(words, i: tl.constexpr):
    """1024 + nibble i of each word, as fp32: the nibble shifted to bits 13-16 (the
    units of a float in [1024, 2048)) and OR-ed into 1024.0's bits: a shift and
    one LOP3 a weight. Products with a bf16/fp16 x are exact in fp32 (11 + 8
    significant bits); the 1024 is taken out once per group (`_gemv_sub_step`)."""
    if 4 * i <= 13:
        q = words << (13 - 4 * i)
    else:
        q = words >> (4 * i - 13)
    return ((q & 0x1E000) | 0x44800000).to(tl.float32, bitcast=True)


# One word's 8 products in packed halves (PACKED): nibble pairs (i, i + 4) masked out
# two at a time and OR-ed into the units of 128.0 (bf16) / 1024.0 (fp16), the zero
# point subtracted (exact), then multiplied by x's matching pair and summed in the
# halves; the two lanes widened and added in fp32. $1 the word, $2 the zero pair,
# $3-$6 x pairs.
_PACKED_ASM = """{{
.reg .b32 t0, t1, t2, t3, w, p;
.reg .b16 lo, hi;
.reg .f32 a, b;
lop3.b32 t0, $1, 0x000F000F, {magic}, 0xEA;
shr.u32 w, $1, 4;
lop3.b32 t1, w, 0x000F000F, {magic}, 0xEA;
shr.u32 w, $1, 8;
lop3.b32 t2, w, 0x000F000F, {magic}, 0xEA;
shr.u32 w, $1, 12;
lop3.b32 t3, w, 0x000F000F, {magic}, 0xEA;
sub.rn.{t}x2 t0, t0, $2;
sub.rn.{t}x2 t1, t1, $2;
sub.rn.{t}x2 t2, t2, $2;
sub.rn.{t}x2 t3, t3, $2;
mul.rn.{t}x2 p, t0, $3;
fma.rn.{t}x2 p, t1, $4, p;
fma.rn.{t}x2 p, t2, $5, p;
fma.rn.{t}x2 p, t3, $6, p;
{widen}
add.f32 $0, a, b;
}}"""
_CVT = """mov.b32 {{lo, hi}}, p;
cvt.f32.{t} a, lo;
cvt.f32.{t} b, hi;"""
# A bf16 is the top half of its fp32, so a shift and a mask widen the lanes exactly;
# ptxas makes each `cvt.f32.bf16` of a lane a PRMT and a shift (SASS counted).
_SHIFT_MASK = """shl.b32 t0, p, 16;
and.b32 t1, p, 0xFFFF0000;
mov.b32 a, t0;
mov.b32 b, t1;"""
PACKED_BF16_ASM = tl.constexpr(_PACKED_ASM.format(
    magic="0x43004300", t="bf16", widen=_CVT.format(t="bf16")))
PACKED_BF16_LEAN_ASM = tl.constexpr(_PACKED_ASM.format(
    magic="0x43004300", t="bf16", widen=_SHIFT_MASK))
PACKED_FP16_ASM = tl.constexpr(_PACKED_ASM.format(
    magic="0x64006400", t="f16", widen=_CVT.format(t="f16")))


@triton.jit
def _half_pair(lo, hi):
    """Two 16-bit floats as one 32-bit word (lo in the low half)."""
    lo = lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi = hi.to(tl.int16, bitcast=True).to(tl.int32)
    return lo | (hi << 16)


@triton.jit
def _halves(pair, dt: tl.constexpr):
    """The low and high 16-bit floats of a 32-bit word, as `dt`."""
    lo = (pair & 0xFFFF).to(tl.int16).to(dt, bitcast=True)
    hi = (pair >> 16).to(tl.int16).to(dt, bitcast=True)
    return lo, hi


@triton.jit
def _round_half(v, BF16: tl.constexpr):
    """fp32 v rounded to the nearest bf16 / fp16 (ties to even), as fp32. The bf16
    rounding is done on the bits: the interpreter's conversion to bf16 truncates."""
    if BF16:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        return bits.to(tl.float32, bitcast=True)
    return v.to(tl.float16).to(tl.float32)


@triton.jit
def _packed_word_emulated(words, zz, x0, x1, x2, x3, BF16: tl.constexpr):
    """`_PACKED_ASM` in Triton operations, for the interpreter (no inline PTX there):
    the same nibble pairs and the same rounding to x's dtype after each product and
    multiply-add (an fp32 sum rounded once, as the fma rounds once, except where the
    fp32 sum itself rounds), then the two lanes added in fp32. The subtraction of
    the zero is exact either way, so it is done in fp32 (the interpreter's bf16
    arithmetic is not to be trusted)."""
    dt: tl.constexpr = tl.bfloat16 if BF16 else tl.float16
    magic: tl.constexpr = 0x43004300 if BF16 else 0x64006400
    z_lo, z_hi = _halves(zz, dt)
    p_lo = tl.zeros(words.shape, dtype=tl.float32)
    p_hi = tl.zeros(words.shape, dtype=tl.float32)
    for j in tl.static_range(4):
        x = x0 if j == 0 else (x1 if j == 1 else (x2 if j == 2 else x3))
        x_lo, x_hi = _halves(x, dt)
        t_lo, t_hi = _halves(((words >> (4 * j)) & 0x000F000F) | magic, dt)
        q_lo = t_lo.to(tl.float32) - z_lo.to(tl.float32)
        q_hi = t_hi.to(tl.float32) - z_hi.to(tl.float32)
        p_lo = _round_half(q_lo * x_lo.to(tl.float32) + p_lo, BF16)
        p_hi = _round_half(q_hi * x_hi.to(tl.float32) + p_hi, BF16)
    return p_lo + p_hi


@triton.jit
def _prmt(a, b, SELECT: tl.constexpr):
    """The halves of a and b that SELECT names (0x5410: the low ones, 0x7632: the
    high ones) as one word, a's in the low half: one PRMT (a shift and a mask
    each compile to two)."""
    if _EMULATE:
        if SELECT == 0x5410:
            return (a & 0xFFFF) | (b << 16)
        return ((a >> 16) & 0xFFFF) | (b & -65536)
    if SELECT == 0x5410:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x5410;", "=r,r,r", [a, b],
                                         dtype=tl.int32, is_pure=True, pack=1)
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x7632;", "=r,r,r", [a, b],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _x_pairs(x_ptrs, k, LEAN: tl.constexpr):
    """x's features (k + j, k + j + 4) as one 32-bit word (the first in the low half),
    j = 0..3. LEAN: from four 32-bit loads of the row's 8 features; else eight
    16-bit loads and a pack each."""
    if LEAN:
        x32 = x_ptrs.to(tl.pointer_type(tl.int32)) + k // 2
        a = tl.load(x32)
        b = tl.load(x32 + 1)
        c = tl.load(x32 + 2)
        d = tl.load(x32 + 3)
        return _prmt(a, c, 0x5410), _prmt(a, c, 0x7632), _prmt(b, d, 0x5410), _prmt(b, d, 0x7632)
    return (_half_pair(tl.load(x_ptrs + k), tl.load(x_ptrs + (k + 4))),
            _half_pair(tl.load(x_ptrs + (k + 1)), tl.load(x_ptrs + (k + 5))),
            _half_pair(tl.load(x_ptrs + (k + 2)), tl.load(x_ptrs + (k + 6))),
            _half_pair(tl.load(x_ptrs + (k + 3)), tl.load(x_ptrs + (k + 7))))


@triton.jit
def _gemv_sub_step_packed(words, x_ptrs, z_ptr, s_ptr, k, cols, NUM_GROUPS, stride_z,
                          stride_s, GROUP: tl.constexpr, BF16: tl.constexpr,
                          LEAN: tl.constexpr):
    """`_gemv_sub_step` (one group, even shapes) on packed halves: per word 4 shifts,
    4 LOP3, 4 subtractions and 4 multiply-adds for its 8 weights, in x's dtype
    (products and 4-term sums rounded there), the word's sum then scaled in fp32.
    LEAN (opt-in until GPU-tested): x in 32-bit loads, bf16 lanes widened by a
    shift and a mask, no clamp of the group (EVEN: k < K), 3.77 -> 3.12
    instructions a weight in sm_90 SASS (`benchmarks/int4_gemv_sass.py`)."""
    g = k // GROUP if LEAN else tl.minimum(k // GROUP, NUM_GROUPS - 1)
    s = tl.load(s_ptr + g * stride_s + cols).to(tl.float32)
    z = tl.load(z_ptr + g * stride_z + cols).to(tl.int32)
    zz = (z | (0x4300 if BF16 else 0x6400)) * 0x10001  # (magic + z) in both halves
    x0, x1, x2, x3 = _x_pairs(x_ptrs, k, LEAN)
    if _EMULATE:
        word = _packed_word_emulated(words, zz[None, :], x0[:, None], x1[:, None],
                                     x2[:, None], x3[:, None], BF16)
    else:
        args = [words, zz[None, :], x0[:, None], x1[:, None], x2[:, None], x3[:, None]]
        if BF16 and LEAN:
            word = tl.inline_asm_elementwise(PACKED_BF16_LEAN_ASM, "=f,r,r,r,r,r,r", args,
                                             dtype=tl.float32, is_pure=True, pack=1)
        elif BF16:
            word = tl.inline_asm_elementwise(PACKED_BF16_ASM, "=f,r,r,r,r,r,r", args,
                                             dtype=tl.float32, is_pure=True, pack=1)
        else:
            word = tl.inline_asm_elementwise(PACKED_FP16_ASM, "=f,r,r,r,r,r,r", args,
                                             dtype=tl.float32, is_pure=True, pack=1)
    return word * s[None, :]


@triton.jit
def _gemv_sub_step(words, x_ptrs, z_ptr, s_ptr, g_ptr, k, cols, K, NUM_GROUPS,
                   stride_z, stride_s, BN: tl.constexpr, ROWS: tl.constexpr,
                   GROUP: tl.constexpr, ACT_ORDER: tl.constexpr, EVEN: tl.constexpr):
    """The contribution of features [k, k + 8 ROWS) ([ROWS, BN] words: feature
    k + 8 r + i in nibble i of row r) to the program's BN outputs, still per row
    ([ROWS, BN]: the rows are summed once, after the last step). `x_ptrs` [ROWS]:
    x + 8 r. Plain 2-D tiles throughout: no reshapes, so no layout conversions."""
    acc = tl.zeros([ROWS, BN], dtype=tl.float32)
    x_sum = tl.zeros([ROWS], dtype=tl.float32)
    for i in tl.static_range(8):
        if EVEN:
            xi = tl.load(x_ptrs + (k + i)).to(tl.float32)
        else:
            kk = k + tl.arange(0, ROWS) * 8 + i
            xi = tl.load(x_ptrs + (k + i), mask=kk < K, other=0.0).to(tl.float32)
        f = _nibbles_1024(words, i)
        if ACT_ORDER:  # each feature's own group
            kk = k + tl.arange(0, ROWS) * 8 + i
            g = tl.load(g_ptr + kk, mask=kk < K, other=0)
            s = tl.load(s_ptr + g[:, None] * stride_s + cols[None, :]).to(tl.float32)
            z = tl.load(z_ptr + g[:, None] * stride_z + cols[None, :]).to(tl.float32)
            acc += (f - (z + 1024.0)) * s * xi[:, None]
        else:
            acc += f * xi[:, None]
            x_sum += xi
    if ACT_ORDER:
        return acc
    # One group: s (sum_k (1024 + q) x - (1024 + z) sum_k x), the scale and zero once
    # per column. (Past K the sums are 0: any group's scale will do.)
    g = tl.minimum(k // GROUP, NUM_GROUPS - 1)
    s = tl.load(s_ptr + g * stride_s + cols).to(tl.float32)
    z = tl.load(z_ptr + g * stride_z + cols).to(tl.float32)
    return s[None, :] * acc - (s * (z + 1024.0))[None, :] * x_sum[:, None]


@triton.jit
def _gemv_step(acc, first, k0, qw_ptrs, x_ptrs, z_ptr, s_ptr, g_ptr, offs_r, cols, K,
               NUM_GROUPS, stride_qw, stride_z, stride_s, BN: tl.constexpr, ROWS: tl.constexpr,
               GROUP: tl.constexpr, SUB_STEPS: tl.constexpr, ACT_ORDER: tl.constexpr,
               FIRST: tl.constexpr, EVEN: tl.constexpr, PACKED: tl.constexpr,
               BF16: tl.constexpr, LEAN: tl.constexpr):
    """SUB_STEPS sub-steps from feature k0 (their loads independent, so in flight
    together); with FIRST the first sub-step's words are `first`, loaded earlier."""
    word_rows = K // 8
    for j in tl.static_range(SUB_STEPS):
        k = k0 + j * 8 * ROWS
        if LEAN:  # k >= 0: unsigned, so k // 8 is a shift (signed needs a sign fix)
            k = k.to(tl.uint32)
        if FIRST and j == 0:
            words = first
        else:
            words = _load_words(qw_ptrs + (k // 8) * stride_qw,
                                (k // 8 + offs_r)[:, None] < word_rows, EVEN)
        if PACKED:
            acc += _gemv_sub_step_packed(words, x_ptrs, z_ptr, s_ptr, k, cols, NUM_GROUPS,
                                         stride_z, stride_s, GROUP, BF16, LEAN)
        else:
            acc += _gemv_sub_step(words, x_ptrs, z_ptr, s_ptr, g_ptr, k, cols, K, NUM_GROUPS,
                                  stride_z, stride_s, BN, ROWS, GROUP, ACT_ORDER, EVEN)
    return acc


@triton.jit
def _load_words(ptrs, ok, EVEN: tl.constexpr):
    """A [ROWS, BN] tile of words, read once (rows past K masked unless EVEN)."""
    if EVEN:
        return tl.load(ptrs, eviction_policy="evict_first")
    return tl.load(ptrs, mask=ok, other=0, eviction_policy="evict_first")


@triton.jit
def _int4_gemv_kernel(x_ptr, qw_ptr, z_ptr, s_ptr, g_ptr, b_ptr, y_ptr, ws_ptr, N, K,
                      K_SPLIT, NUM_GROUPS, stride_qw, stride_z, stride_s, stride_ws,
                      BN: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr,
                      SUB_STEPS: tl.constexpr, ACT_ORDER: tl.constexpr,
                      HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, PARTIAL: tl.constexpr,
                      EVEN: tl.constexpr, PACKED: tl.constexpr, BF16: tl.constexpr,
                      LEAN: tl.constexpr, PDL: tl.constexpr):
    """Program (column block, K split): features [k_lo, min(K, k_lo + K_SPLIT)) of
    BN columns; the whole output (PARTIAL False) or fp32 partial sums into row
    `split` of the workspace (gate columns, then up columns with SILU_MUL)."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    k_lo = tl.program_id(1) * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    # EVEN: N a multiple of BN and K of the step, so no load needs a mask or a clamp
    # (and unclamped columns let the word loads be vectors).
    cols = offs_n if EVEN else tl.minimum(offs_n, N - 1)  # clamped: no column mask
    cols_up = cols + N  # SILU_MUL: the up columns, N right of the gate columns
    offs_r = tl.arange(0, ROWS)
    qw_ptrs = qw_ptr + offs_r[:, None].to(tl.int64) * stride_qw + cols[None, :]
    up_ptrs = qw_ptrs + N
    x_ptrs = x_ptr + offs_r * 8
    # The first words before the PDL wait: weights are constant.
    first_ok = (k_lo // 8 + offs_r)[:, None] < K // 8
    first = _load_words(qw_ptrs + (k_lo // 8) * stride_qw, first_ok, EVEN)
    first_up = first
    if SILU_MUL:
        first_up = _load_words(up_ptrs + (k_lo // 8) * stride_qw, first_ok, EVEN)
    pdl_wait(PDL)
    pdl_trigger(PDL)
    STEP: tl.constexpr = 8 * ROWS * SUB_STEPS
    acc = _gemv_step(tl.zeros([ROWS, BN], dtype=tl.float32), first, k_lo, qw_ptrs, x_ptrs, z_ptr,
                     s_ptr, g_ptr, offs_r, cols, K, NUM_GROUPS, stride_qw, stride_z, stride_s,
                     BN, ROWS, GROUP, SUB_STEPS, ACT_ORDER, True, EVEN, PACKED, BF16, LEAN)
    acc_up = acc
    if SILU_MUL:
        acc_up = _gemv_step(tl.zeros([ROWS, BN], dtype=tl.float32), first_up, k_lo, up_ptrs,
                            x_ptrs, z_ptr, s_ptr, g_ptr, offs_r, cols_up, K, NUM_GROUPS,
                            stride_qw, stride_z, stride_s, BN, ROWS, GROUP, SUB_STEPS, ACT_ORDER,
                            True, EVEN, PACKED, BF16, LEAN)
    for k0 in range(k_lo + STEP, k_hi, STEP):
        acc = _gemv_step(acc, first, k0, qw_ptrs, x_ptrs, z_ptr, s_ptr, g_ptr, offs_r, cols, K,
                         NUM_GROUPS, stride_qw, stride_z, stride_s, BN, ROWS, GROUP, SUB_STEPS,
                         ACT_ORDER, False, EVEN, PACKED, BF16, LEAN)
        if SILU_MUL:
            acc_up = _gemv_step(acc_up, first_up, k0, up_ptrs, x_ptrs, z_ptr, s_ptr, g_ptr,
                                offs_r, cols_up, K, NUM_GROUPS, stride_qw, stride_z, stride_s,
                                BN, ROWS, GROUP, SUB_STEPS, ACT_ORDER, False, EVEN, PACKED, BF16,
                                LEAN)
    acc = tl.sum(acc, axis=0)  # the rows, once
    if SILU_MUL:
        acc_up = tl.sum(acc_up, axis=0)
    if PARTIAL:
        ws_row = ws_ptr + tl.program_id(1) * stride_ws
        tl.store(ws_row + offs_n, acc, mask=offs_n < N)
        if SILU_MUL:
            tl.store(ws_row + N + offs_n, acc_up, mask=offs_n < N)
        return
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols).to(tl.float32)
    if SILU_MUL:
        acc = _silu_mul(acc, acc_up, y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def rstd_of(sq_ptr, row, P, features, eps, P_BLOCK: tl.constexpr):
    """rsqrt(mean + eps) of a folded norm's row (`layers/norm_fold.py`), a scalar:
    its P partial sums of squares at `sq_ptr` + row * P, over `features` features,
    added in one fixed order. (A [1] tensor broadcast over the sums instead
    compiled to layout shuffles through local memory: 40 us a call on an H100.)"""
    p = tl.arange(0, P_BLOCK)
    sq = tl.load(sq_ptr + row * P + p, mask=p < P, other=0.0)
    return tl.rsqrt(tl.sum(sq, 0) / features + eps)


@triton.jit
def rstd_rows(sq_ptr, rows, P, features, eps, P_BLOCK: tl.constexpr):
    """`rstd_of` each of `rows` (a [R] tensor): [R]."""
    p = tl.arange(0, P_BLOCK)
    sq = tl.load(sq_ptr + rows[:, None] * P + p[None, :], mask=p[None, :] < P, other=0.0)
    return tl.rsqrt(tl.sum(sq, 1) / features + eps)


@triton.jit
def _int4_split_sum_kernel(ws_ptr, b_ptr, y_ptr, N, stride_ws, stride_wr, stride_yr,
                           sq_ptr, P, features, eps,
                           SPLIT: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                           SILU_MUL: tl.constexpr, NORM_IN: tl.constexpr,
                           P_BLOCK: tl.constexpr, PDL: tl.constexpr, ROWS: tl.constexpr):
    """y = the split-K partial sums added in split order (+ bias; SiLU-and-mul).
    ROWS: program (block, r) does row r of [M, ...] partial sums and outputs
    (row strides `stride_wr`, `stride_yr`), so one launch takes every row; a
    row's sum is the same however many there are. NORM_IN: the sums times the
    row's rstd (`rstd_of` the P partial sums of squares at sq_ptr) first."""
    pdl_wait(PDL)
    pdl_trigger(PDL)
    row = tl.program_id(1) if ROWS else 0
    if ROWS:
        ws_ptr += tl.program_id(1).to(tl.int64) * stride_wr
        y_ptr += tl.program_id(1).to(tl.int64) * stride_yr
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.load(ws_ptr + offs, mask=ok, other=0.0)
    acc_up = acc
    if SILU_MUL:
        acc_up = tl.load(ws_ptr + N + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(ws_ptr + s * stride_ws + offs, mask=ok, other=0.0)
        if SILU_MUL:
            acc_up += tl.load(ws_ptr + s * stride_ws + N + offs, mask=ok, other=0.0)
    if NORM_IN:
        rstd = rstd_of(sq_ptr, row, P, features, eps, P_BLOCK)
        acc *= rstd
        acc_up *= rstd
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if SILU_MUL:
        acc = _silu_mul(acc, acc_up, y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _int4_gemm_kernel(x_ptr, qw_ptr, z_ptr, s_ptr, g_ptr, b_ptr, y_ptr, M, N, K,
                      stride_xm, stride_ym, stride_qw, stride_z, stride_s,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      GROUP: tl.constexpr, GROUP_M: tl.constexpr, ACT_ORDER: tl.constexpr,
                      HAS_BIAS: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rm = tl.minimum(offs_m, M - 1).to(tl.int64)
    cols = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BK)
    offs_r = tl.arange(0, BK // 8)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + offs_k[None, :]
    qw_ptrs = qw_ptr + offs_r[:, None].to(tl.int64) * stride_qw + cols[None, :]
    word_rows = K // 8
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(0, K, BK):
        words = tl.load(qw_ptrs + (k // 8) * stride_qw,
                        mask=(k // 8 + offs_r)[:, None] < word_rows, other=0)
        q = _unpack(words, BK, BN)
        k_ok = k + offs_k < K
        xa = tl.load(x_ptrs + k, mask=k_ok[None, :], other=0.0)
        if ACT_ORDER:
            g = tl.load(g_ptr + k + offs_k, mask=k_ok, other=0)
            s = tl.load(s_ptr + g[:, None] * stride_s + cols[None, :]).to(tl.float32)
            z = tl.load(z_ptr + g[:, None] * stride_z + cols[None, :]).to(tl.float32)
            w = (q - z) * s
        else:  # GROUP % BK == 0: the step lies in one group
            g = k // GROUP
            s = tl.load(s_ptr + g * stride_s + cols).to(tl.float32)
            z = tl.load(z_ptr + g * stride_z + cols).to(tl.float32)
            w = (q - z[None, :]) * s[None, :]
        acc = tl.dot(xa, w.to(xa.dtype), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _int4_gemm_folded_kernel(x_ptr, qw_ptr, z_ptr, s_ptr, g_ptr, b_ptr, y_ptr, M, N, K,
                             stride_xm, stride_ym, stride_qw, stride_z, stride_s, ws_ptr,
                             K_SPLIT, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                             GROUP: tl.constexpr, GROUP_M: tl.constexpr,
                             HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                             MAGIC: tl.constexpr):
    """The GEMM with the scale folded out of the weights: a nibble OR-ed into the
    units of 128.0 (bf16; 1024.0 in fp16: MAGIC) is the 16-bit float 128 + q with
    no arithmetic, minus 128 + z (one packed subtraction for two weights) the
    exact q - z; the tensor cores sum x (q - z) exactly into fp32 and each step
    (inside one group) adds s times the tile's sums: no rounding of the weight
    and no per-weight multiply. K_SPLIT is whole steps and divides K (as the group,
    whole steps, divides K): no load is masked; rows and columns past the edge
    read clamped and store nothing. PARTIAL: program (tile, j) sums the K_SPLIT
    features from j K_SPLIT into fp32 ws[j] (the bias in j = 0's), for
    `_int4_split_sum_kernel`. (Taking the product as y^T = W x^T, the weight
    tile the dot's first operand, won nothing in the H100 sweep.)"""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    k_lo = tl.program_id(1) * K_SPLIT
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rm = tl.minimum(offs_m, M - 1).to(tl.int64)
    cols = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BK)
    offs_r = tl.arange(0, BK // 8)
    shifts = tl.arange(0, 8) * 4
    dt = x_ptr.dtype.element_ty
    x_ptrs = x_ptr + rm[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    qw_ptrs = qw_ptr + offs_r[:, None].to(tl.int64) * stride_qw + cols[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    x_ptrs += k_lo
    qw_ptrs += (k_lo // 8) * stride_qw
    for kk in range(0, K_SPLIT, BK):
        k = k_lo + kk
        words = tl.load(qw_ptrs + (kk // 8) * stride_qw)
        xa = tl.load(x_ptrs + kk)
        g = k // GROUP
        s = tl.load(s_ptr + g * stride_s + cols).to(tl.float32)
        z = (tl.load(z_ptr + g * stride_z + cols).to(tl.int16) | MAGIC).to(dt, bitcast=True)
        q = ((words[:, None, :] >> shifts[None, :, None]) & 0xF) | MAGIC
        w = tl.reshape(q, [BK, BN]).to(tl.int16).to(dt, bitcast=True) - z[None, :]
        acc += s[None, :] * tl.dot(xa, w)
    if HAS_BIAS and tl.program_id(1) == 0:
        acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    if PARTIAL:
        out_ptr = ws_ptr + tl.program_id(1).to(tl.int64) * M * N
        stride_o = N
    else:
        out_ptr = y_ptr
        stride_o = stride_ym
    ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_o + offs_n[None, :]
    ok = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _int4_dequant_kernel(qw_ptr, z_ptr, s_ptr, g_ptr, w_ptr, R, N, stride_qw, stride_z,
                         stride_s, stride_w, BR: tl.constexpr, BN: tl.constexpr,
                         GROUP: tl.constexpr, ACT_ORDER: tl.constexpr):
    """[BR, BN] words -> their [8 BR, BN] weights (q - z) s, rounded once to w's dtype."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = (rows[:, None] < R) & (cols[None, :] < N)
    words = tl.load(qw_ptr + rows[:, None].to(tl.int64) * stride_qw + cols[None, :],
                    mask=ok, other=0)
    q = _unpack(words, 8 * BR, BN)
    feats = rows[:, None] * 8 + tl.arange(0, 8)[None, :]
    feats = tl.reshape(feats, [8 * BR])
    ok = (feats[:, None] < 8 * R) & (cols[None, :] < N)
    if ACT_ORDER:
        g = tl.load(g_ptr + feats, mask=feats < 8 * R, other=0).to(tl.int64)
    else:
        g = (feats // GROUP).to(tl.int64)
    z = tl.load(z_ptr + g[:, None] * stride_z + cols[None, :], mask=ok, other=0).to(tl.float32)
    s = tl.load(s_ptr + g[:, None] * stride_s + cols[None, :], mask=ok, other=0).to(tl.float32)
    tl.store(w_ptr + feats[:, None].to(tl.int64) * stride_w + cols[None, :],
             ((q - z) * s).to(w_ptr.dtype.element_ty), mask=ok)
