"""`fused_topk`: a MoE router's softmax top-k in two launches, each token's result
independent of the batch it is in.

    logits  = x.float() @ weight.T            (IEEE fp32 products and sums)
    probs   = softmax(logits) over the E experts, in fp32
    ids     = the top_k largest probs, in descending order, ties to the lower expert id
    weights = probs[ids]; divided by their sum if renormalize; rounded to round_dtype
              and back to fp32 if round_dtype is given (and not fp32)

is what `TopKRouter.forward` (`radixlm/layers/moe/router.py`) computes in torch with
~10 launches: a profile of Qwen3-30B-A3B's decode on an H200 put those at ~23 us a
layer, more than the experts' own grouped GEMMs.

1. Logits (`_logits_kernel`), grid [cdiv(T, BLOCK_T), cdiv(E, BLOCK_E), S]: program
   (i, j, s) takes BLOCK_T tokens, BLOCK_E experts and the s-th CHUNK_K slice of H,
   and writes those partial dot products to an fp32 workspace [S, T, E]. Splitting H
   as well as E is what gives one decode token enough programs to stream the weight
   (128 x 2048 fp32 = 1 MiB) at bandwidth: 128 programs there.
2. Top-k (`_topk_kernel`), one program per token: the S partials added in order of
   s, softmax, top_k rounds of (max, lowest id holding it), renormalisation,
   rounding, one store of each output tile.

Both kernels are short chains of dependent memory reads, so what they cost at one
decode token is how many round trips to memory follow one another, not bytes.
The top-k kernel unrolls its loop over the S partials (S is a constant of the
layer), so the S loads are in flight together rather than one after another (an
H200 profile of Qwen3-30B-A3B's decode had the rolled loop at 5.2 us a layer for
16 partials; `benchmarks/pdl_sass.py` shows the 16 loads issued back to back). The
logits kernel loads its first weight tile before the PDL wait; after it, each
step's x tile still moves through shared memory before the next step's loads
issue (a round trip a step).

`fused_norm_topk`, for decode batches (T <= NORM_FUSED_MAX_TOKENS): the layer's
post-attention add + RMSNorm and the router in two launches instead of three.
`_norm_logits_kernel`, grid [T, cdiv(E, NORM_BLOCK_E)]: program (t, j) holds its
NORM_BLOCK_E experts' whole weight rows (loaded before the PDL wait), adds token t's
attention output and residual, normalizes the row, and writes the full-H logits of
its experts (the top-k kernel then adds S = 1 partial); programs (t, 0) also write
the normalized row and the new residual. What it removes is the logits launch on
the chain between the attention and the experts: removing it (ablation, H100,
Qwen3-30B-A3B's decode) took 330 to 343 tok/s. Numerics: the norm's as
`fused_ops.rms_norm` computes it (the sum of the row, rounded to x's dtype, then
one rounding of s * rstd * w), each logit one fp32 dot over H; both sums are
ordered otherwise than the two-launch path's (the norm kernel's tree, S partials),
so logits differ from it in their last bits and ids only at near-ties. A token's
result does not depend on the other tokens of the call (one program row per token),
but a decode row's router is not bit-identical to the same row in a prefill batch:
the MoE layers are refused by --enable-deterministic-inference anyway
(`FusedMoEMethod.batch_invariant`).

Contract:
- x [T, H] bf16 / fp16 / fp32 with contiguous rows (stride(1) == 1); weight [E, H]
  fp32, contiguous; 1 <= top_k <= E <= MAX_EXPERTS; one device: CUDA, or CPU under
  the Triton interpreter (`TRITON_INTERPRET=1`). Returns fresh contiguous (weights
  [T, top_k] float32, ids [T, top_k] int32); T = 0 returns them empty, launching
  nothing.
- Numerics: IEEE fp32 products (never TF32); each logit is S partial sums, added in
  order; a partial is BLOCK_K fp32 FMA chains over its chunk of H (lane j takes
  features j, j + BLOCK_K, ...), summed once at the end.
  The exponential is libdevice's expf on CUDA (tl.exp's ex2.approx is a few ulps
  coarser than torch's); probs = exp(l - max) / sum, the sum a tree over the token's
  [EP] row whose shape depends on E only. Rounding is to nearest even, as
  torch's `.to(dtype)`. Not bit-identical to the torch path (cuBLAS and torch's
  reductions add in other orders): logits differ in their last bits and weights by
  about as much relative (a rounded weight then by one ulp of round_dtype where the
  value is that close to a rounding midpoint), ids only where probabilities are that
  close to a tie.
- Batch invariance: every tile size and the split of H are functions of (E, H) only,
  never of T, and T is not a specialised argument, so one compiled kernel serves every
  T; the rows of a tile run the same instructions. A token's logits, weights and ids
  are therefore bit-identical whatever T is and wherever the token sits in it
  (`--enable-deterministic-inference` relies on this); `tests/gpu/test_fused_moe.py`
  checks it bit for bit on the GPU. Passes of CHUNK_TOKENS rows only split the rows.
  Not promised across devices or Triton versions (another compiler may order a dot's
  sums otherwise).
- Experts padded up to a power of two are never chosen. A row with a NaN (or an
  infinite) logit gets NaN weights, as torch does, and ids in [0, E).
- No host synchronisation and no data-dependent shapes: the call can be captured in
  a CUDA graph (after one eager call, which compiles the kernels for the layer's
  shape; T is not specialised, so that call serves every token count).
  Both kernels take part in programmatic dependent launch (`radixlm.layers.pdl`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from radixlm.layers import pdl
from radixlm.layers.moe.triton_ops.moe_gemv import _load_k
from radixlm.layers.pdl import pdl_trigger, pdl_wait

MAX_EXPERTS = 512  # the top-k kernel holds a [BLOCK_R, E rounded up] fp32 register tile
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Tokens per pass: bounds the workspace [S, tokens, E] (64 MiB at E 128, H 2048, S 16).
CHUNK_TOKENS = 8192
# The H split is chosen for at least this many logits programs at T = 1, so that one
# decode token streams the weight from that many SMs (an H200 has 132); each further
# chunk adds E floats per token to the workspace a prefill writes and rereads.
# H200, E 128 / H 2048 (benchmarks/moe_decode_kernels.py): 8 tokens x 16 experts x 128
# features a program (128 programs) took the router from 16.1 to 8.4 us at one token
# and from 600 to 332 us at 4096; 32 programs of 32 x 256 on a dot took the 16.1.
DECODE_PROGRAMS = 128
MIN_CHUNK_K = 128
ROUND_CODES = {torch.bfloat16: 1, torch.float16: 2}


class LogitsTiles(NamedTuple):
    block_t: int  # tokens per program
    block_e: int
    chunk_k: int  # H per program; the top-k kernel adds the chunks' partials in order
    block_k: int
    warps: int
    stages: int


def logits_tiles(num_experts: int, hidden: int, *, block_e: int = 16,
                 programs: int = DECODE_PROGRAMS, block_k: int = 32, warps: int = 4,
                 stages: int = 1, block_t: int = 8) -> LogitsTiles:
    """The logits kernel's tiles for weight [num_experts, hidden]: shapes of the layer
    only, never the token count, which keeps every token's sums in one order. H is
    split for about `programs` programs at one token; the keywords are the knobs a
    tuning run (`benchmarks/moe_decode_kernels.py`) sweeps."""
    blocks_e = triton.cdiv(num_experts, block_e)
    splits = max(1, min(triton.cdiv(programs, blocks_e),
                        triton.cdiv(hidden, max(MIN_CHUNK_K, block_k))))
    chunk_k = triton.cdiv(triton.cdiv(hidden, splits), block_k) * block_k
    return LogitsTiles(block_t, block_e, chunk_k, block_k, warps, stages)


def topk_warps(num_experts: int) -> int:
    """Warps of a top-k program (one token's [E rounded up] row): one, whatever E.
    Its reductions then stay inside the warp (a round of the selection is two
    `redux.sync`), where 4 warps took a barrier and a trip through shared memory
    for each of a round's reductions (51 barriers at E 128, top-8 in the sm_90
    SASS, `benchmarks/pdl_sass.py`). Fixed, as the softmax's sum is a tree over
    the row whose shape the warps set."""
    return 1


# Decode batches up to this many rows take `fused_norm_topk`: a program holds one
# token's row and re-reads the weight rows of its experts per token (1 MiB a token at
# E 128 / H 2048 fp32), which stays small beside a decode step's weights.
NORM_FUSED_MAX_TOKENS = 8
# Experts a `_norm_logits_kernel` program takes: 64 programs at E 128, each holding
# 2 x H fp32 weights in registers (16 KiB at H 2048, 32 a thread on 4 warps).
NORM_BLOCK_E = 2
# Rows up to this H fit the kernel's register tiles (row, norm weight, weight rows).
NORM_MAX_HIDDEN = 4096
NORM_WARPS = 4


def _experts_pow2(num_experts: int) -> int:
    return max(16, triton.next_power_of_2(num_experts))


def fused_topk(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
               round_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, ids [T, top_k] int32) of the softmax top-k router
    `weight` for x [T, H] (see the module docstring)."""
    _check_inputs(x, weight, top_k, round_dtype)
    t, h = x.shape
    e = weight.shape[0]
    weights = torch.empty((t, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=x.device)
    tiles = logits_tiles(e, h)
    rnd = ROUND_CODES.get(round_dtype, 0)
    for lo in range(0, t, CHUNK_TOKENS):
        hi = min(t, lo + CHUNK_TOKENS)
        partials = _logits(x[lo:hi], weight, tiles)
        _topk(partials, weights[lo:hi], ids[lo:hi], renormalize, rnd)
    return weights, ids


def norm_fusable(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                 weight: torch.Tensor) -> bool:
    """True where `fused_norm_topk` takes these inputs: a decode batch of half-precision
    rows (contiguous, as the attention's output projection writes them), a norm
    weight of x's dtype, a float32 router of H <= NORM_MAX_HIDDEN; CUDA tensors, or
    CPU ones under the interpreter (the tests)."""
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    t, h = x.shape if x.dim() == 2 else (0, 0)
    return (1 <= t <= NORM_FUSED_MAX_TOKENS and h <= NORM_MAX_HIDDEN
            and x.dtype in (torch.bfloat16, torch.float16) and x.is_contiguous()
            and residual.shape == x.shape and residual.dtype == x.dtype
            and residual.is_contiguous() and norm_weight.dtype == x.dtype
            and norm_weight.shape == (h,) and norm_weight.is_contiguous()
            and weight.dtype == torch.float32 and weight.dim() == 2 and weight.shape[1] == h
            and weight.is_contiguous() and 1 <= weight.shape[0] <= MAX_EXPERTS
            and x.device == residual.device == norm_weight.device == weight.device)


def fused_norm_topk(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, weight: torch.Tensor, top_k: int, renormalize: bool,
                    round_dtype: torch.dtype | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, x + residual, weights, ids): `fused_ops.rms_norm(x, norm_weight, eps,
    residual)` and `fused_topk(h, weight, ...)` in two launches, for inputs
    `norm_fusable` accepts (see the module docstring)."""
    if not norm_fusable(x, residual, norm_weight, weight):
        raise ValueError(f"fused_norm_topk: inputs outside norm_fusable: x {x.dtype} "
                         f"{tuple(x.shape)}, residual {residual.dtype} {tuple(residual.shape)}, "
                         f"norm weight {norm_weight.dtype} {tuple(norm_weight.shape)}, "
                         f"router {weight.dtype} {tuple(weight.shape)}")
    _check_inputs(x, weight, top_k, round_dtype)
    t, h = x.shape
    e = weight.shape[0]
    normed = torch.empty_like(x)
    new_res = torch.empty_like(x)
    logits = torch.empty((1, t, e), dtype=torch.float32, device=x.device)
    _norm_logits_kernel[(t, triton.cdiv(e, NORM_BLOCK_E))](
        x, residual, norm_weight, weight, normed, new_res, logits, e, h, eps,
        BLOCK_H=triton.next_power_of_2(h), BLOCK_E=NORM_BLOCK_E, num_warps=NORM_WARPS,
        **pdl.launch_args())
    weights = torch.empty((t, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=x.device)
    _topk(logits, weights, ids, renormalize, ROUND_CODES.get(round_dtype, 0))
    return normed, new_res, weights, ids


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, top_k: int,
                  round_dtype: torch.dtype | None) -> None:
    """Refuse, by name, any input the kernels cannot compute as the contract says."""
    if (x.dtype not in DTYPES or x.dim() != 2 or x.shape[1] < 1
            or (x.shape[0] and x.stride(1) != 1)):
        raise ValueError(f"fused_topk: x must be a bf16/fp16/fp32 [T, H >= 1] with contiguous "
                         f"rows, got {x.dtype} {tuple(x.shape)} strides {x.stride()}")
    e = weight.shape[0] if weight.dim() == 2 else 0
    if (weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] != x.shape[1]
            or not weight.is_contiguous() or not 1 <= e <= MAX_EXPERTS):
        raise ValueError(f"fused_topk: weight must be a contiguous float32 [E, H={x.shape[1]}], "
                         f"1 <= E <= {MAX_EXPERTS}, got {weight.dtype} {tuple(weight.shape)}")
    if not 1 <= top_k <= e:
        raise ValueError(f"fused_topk: top_k={top_k}: expected 1..{e} (the number of experts)")
    if round_dtype not in (None, *DTYPES):
        raise ValueError(f"fused_topk: round_dtype={round_dtype}: expected None or one of "
                         "bfloat16, float16, float32")
    if weight.device != x.device:
        raise ValueError(f"fused_topk: weight is on {weight.device}, x on {x.device}")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("fused_topk runs Triton kernels: CUDA tensors, or TRITON_INTERPRET=1 "
                         "for CPU tensors")


def _logits(x: torch.Tensor, weight: torch.Tensor, tiles: LogitsTiles) -> torch.Tensor:
    """Launch 1: the partial logits [S, T, E] of every chunk of H."""
    t, h = x.shape
    e = weight.shape[0]
    splits = triton.cdiv(h, tiles.chunk_k)
    partials = torch.empty((splits, t, e), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(t, tiles.block_t), triton.cdiv(e, tiles.block_e), splits)
    _logits_kernel[grid](
        x, weight, partials, t, e, h, x.stride(0),
        BLOCK_T=tiles.block_t, BLOCK_E=tiles.block_e, CHUNK_K=tiles.chunk_k,
        BLOCK_K=tiles.block_k, EVEN_K=h % tiles.chunk_k == 0,
        num_warps=tiles.warps, num_stages=tiles.stages, **pdl.launch_args())
    return partials


def _topk(partials: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, renormalize: bool,
          rnd: int) -> None:
    """Launch 2: softmax top-k of the summed partials into weights / ids [T, k]."""
    splits, t, e = partials.shape
    top_k = ids.shape[1]
    _topk_kernel[(t,)](
        partials, weights, ids, t, e,
        S=splits, TOP_K=top_k, EP=_experts_pow2(e), KP=triton.next_power_of_2(top_k),
        RENORM=renormalize, ROUND=rnd, LIBDEVICE_EXP=partials.is_cuda,
        num_warps=topk_warps(e), **pdl.launch_args())


@triton.jit(do_not_specialize=["T"])
def _logits_kernel(x_ptr, w_ptr, out_ptr, T, E, H, stride_x,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK_K: tl.constexpr,
                   BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    k_lo = tl.program_id(2) * CHUNK_K
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past T or E are clamped, not masked: each output depends only on its own
    # row and column, and the clamped ones are never stored.
    rows_t = tl.minimum(offs_t, T - 1).to(tl.int64)
    rows_e = tl.minimum(offs_e, E - 1).to(tl.int64)
    x_ptrs = x_ptr + rows_t[:, None] * stride_x + k_lo + offs_k[None, :]
    w_ptrs = w_ptr + rows_e[:, None] * H + k_lo + offs_k[None, :]
    # The first weight tile is read before the wait (the weight is constant), so it
    # overlaps the kernel before this one.
    w = _load_k(w_ptrs, 0, (k_lo + offs_k < H)[None, :], EVEN_K)
    # Guarded, though pdl_wait checks PDL itself: an interpreted kernel cannot call a
    # device function that was jitted before TRITON_INTERPRET was set (the tests).
    if PDL:
        pdl_wait(PDL)
        pdl_trigger(PDL)
    # Products FMA-ed into a [BLOCK_T, BLOCK_E, BLOCK_K] register tile, one sum over
    # its K lanes after the chunk: neither operand goes through shared memory (an
    # ieee tl.dot stages both and reads the weight across rows: 2x slower here).
    acc = tl.zeros([BLOCK_T, BLOCK_E, BLOCK_K], dtype=tl.float32)
    for kk in tl.static_range(0, CHUNK_K, BLOCK_K):
        if kk > 0:
            w = _load_k(w_ptrs, kk, (k_lo + kk + offs_k < H)[None, :], EVEN_K)
        # Lanes past H load zeros: fma(0, 0, acc) leaves acc as it is.
        x = _load_k(x_ptrs, kk, (k_lo + kk + offs_k < H)[None, :], EVEN_K)
        acc += x.to(tl.float32)[:, None, :] * w[None, :, :]
    out = out_ptr + (tl.program_id(2) * T + offs_t[:, None].to(tl.int64)) * E + offs_e[None, :]
    tl.store(out, tl.sum(acc, axis=2), mask=(offs_t < T)[:, None] & (offs_e < E)[None, :])


@triton.jit
def _norm_logits_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, h_ptr, ro_ptr, out_ptr, E, H, eps,
                        BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    rows_e = tl.minimum(offs_e, E - 1).to(tl.int64)  # clamped: never stored
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    # The router's rows and the norm's weight are constant: read before the wait,
    # they overlap the output projection before this kernel.
    w = tl.load(w_ptr + rows_e[:, None] * H + offs_h[None, :], mask=hmask[None, :], other=0.0)
    nw = tl.load(nw_ptr + offs_h, mask=hmask, other=0.0).to(tl.float32)
    if PDL:  # guarded as in _logits_kernel
        pdl_wait(PDL)
        pdl_trigger(PDL)
    x = tl.load(x_ptr + t * H + offs_h, mask=hmask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + t * H + offs_h, mask=hmask, other=0.0).to(tl.float32)
    # As `fused_ops.rms_norm`: the sum rounded to the activations' dtype first, as the
    # next layer's residual stream holds it.
    s = (x + r).to(ro_ptr.dtype.element_ty)
    sf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(sf * sf, 0) / H + eps)
    normed = (sf * rstd * nw).to(h_ptr.dtype.element_ty)
    if tl.program_id(1) == 0:
        tl.store(ro_ptr + t * H + offs_h, s, mask=hmask)
        tl.store(h_ptr + t * H + offs_h, normed, mask=hmask)
    # IEEE fp32 products of the rounded row, as the logits kernel takes them.
    logits = tl.sum(w * normed.to(tl.float32)[None, :], axis=1)
    tl.store(out_ptr + t * E + offs_e, logits, mask=offs_e < E)


@triton.jit
def _exp(v, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        # torch's softmax calls expf; tl.exp is ex2.approx, off by a few more ulps.
        return libdevice.exp(v)
    return tl.exp(v)


@triton.jit
def _round_bf16(w):
    """w rounded to bfloat16 (nearest, ties to even) and back, on the bits: the
    interpreter's float32 -> bfloat16 cast truncates."""
    bits = w.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(w != w, w, bits.to(tl.float32, bitcast=True))


@triton.jit(do_not_specialize=["T"])
def _topk_kernel(part_ptr, w_out_ptr, id_out_ptr, T, E,
                 S: tl.constexpr, TOP_K: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr,
                 RENORM: tl.constexpr, ROUND: tl.constexpr,
                 LIBDEVICE_EXP: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # guarded as in _logits_kernel
        pdl_wait(PDL)
        pdl_trigger(PDL)
    # One token a program, as a [1, EP] tile (the code below reduces along axis 1).
    rows = tl.program_id(0) + tl.arange(0, 1)
    cols = tl.arange(0, EP)
    col_ok = (cols < E)[None, :]
    ptrs = part_ptr + rows[:, None].to(tl.int64) * E + cols[None, :]
    # Unrolled, the S loads are in flight together; added in order of s, the sum a
    # token gets whatever the batch.
    logits = tl.zeros([1, EP], dtype=tl.float32)
    for s in tl.static_range(S):
        logits += tl.load(ptrs + s * T * E, mask=col_ok, other=0.0)
    logits = tl.where(col_ok, logits, float("-inf"))
    p = _exp(logits - tl.max(logits, axis=1)[:, None], LIBDEVICE_EXP)
    probs = p / tl.sum(p, axis=1)[:, None]
    # A round picks the largest prob, of equal probs the lowest id, as two 32-bit
    # max reductions: over rank = the prob's fp32 bits (order-preserving for
    # probs >= 0; NaN, which torch.topk ranks above all, mapped above inf) plus
    # one, then over EP - 1 - id among the lanes holding that rank. In a warp
    # each is one `redux.sync`, where one max over 64-bit keys took five shuffle
    # pairs (this router alone at one token on an H100: 4.7 -> 4.2 us a call,
    # BENCHMARKS.md 2026-12-06). Padded and picked experts hold rank 0, below
    # every real one (top_k <= E leaves a real one in every round); the rank
    # carries the prob bit for bit.
    bits = tl.where(probs != probs, 0x7FC00000, probs.to(tl.int32, bitcast=True))
    rank = tl.where(col_ok, bits + 1, 0)
    rev_id = EP - 1 - cols[None, :]
    slots = tl.arange(0, KP)[None, :]
    out_w = tl.zeros([1, KP], dtype=tl.float32)
    out_id = tl.zeros([1, KP], dtype=tl.int32)
    total = tl.zeros([1], dtype=tl.float32)
    for j in range(TOP_K):
        best = tl.max(rank, axis=1)
        pick = EP - 1 - tl.max(tl.where(rank == best[:, None], rev_id, -1), axis=1)
        w = (best - 1).to(tl.float32, bitcast=True)  # the prob, exactly
        rank = tl.where(cols[None, :] == pick[:, None], 0, rank)
        total += w  # in order of j, like the slots
        out_w = tl.where(slots == j, w[:, None], out_w)
        out_id = tl.where(slots == j, pick[:, None], out_id)
    if RENORM:
        out_w = out_w / total[:, None]
    if ROUND == 1:
        out_w = _round_bf16(out_w)
    elif ROUND == 2:
        out_w = out_w.to(tl.float16).to(tl.float32)
    offs = rows[:, None].to(tl.int64) * TOP_K + slots
    mask = slots < TOP_K
    tl.store(w_out_ptr + offs, out_w, mask=mask)
    tl.store(id_out_ptr + offs, out_id, mask=mask)
