"""Decode attention over the token-level KV pool: GQA-grouped split-KV (flash-decoding).

One new query token per request attends to all `seq_len` tokens of its request,
whose K/V rows live at arbitrary slots of the pool (`req_to_token[row, pos]`).

Stage 1, grid (bs, num_kv_heads, num_splits): program (b, g, s) takes the s-th
chunk of request b's tokens and computes, for *all* query heads of KV group g
at once, the softmax-weighted sum of V over the chunk plus its log-sum-exp.
Grouping the heads is what makes GQA cheap: each K/V row is read from memory
once per group instead of once per query head (4x fewer bytes for Llama-3-8B).
The group's heads form the M side of a `tl.dot`, padded to 16 rows.

Stage 2, grid (bs, num_heads): merges the splits with their log-sum-exps.

Prefix-sharing (cascade) decode, `cascade_decode.py`, reuses both stages: with
`prefix_lens` stage 1 covers only tokens prefix_lens[b]..seq_len of each request
(its own suffix; another kernel handled the shared prefix), and stage 2 also
merges that kernel's `num_prefix[b]` partials from `mid_po` / `mid_plse`.

Split sizing is CUDA-graph friendly: `num_splits` is a host integer that depends
only on the batch size (so a graph captured for a batch size has a fixed grid),
and each program derives its chunk from the request's `seq_len` on the device:
chunk = round_up(cdiv(seq_len, num_splits), BLOCK_N). Splits that start past
the end exit at once; stage 2 recomputes how many splits were valid. A request
with seq_len 0 (padding rows) yields zeros.

Layer variants, each a compile-time flag (the plain path compiles as before):
a sliding window W starts each request's range at seq_len - W (a shorter range,
not a mask: splits divide only the window); a logit softcap c scores
c * tanh(s / c); a window pool's layer reads its K/V rows through the pool's
full-to-window slot map. An FP8 pool (`kv_scales`) is read as FP8 tiles
widened to the queries' dtype, its key scale folded into the score scale
and its value scale applied to each split's normalized output in stage 1
(`flash_block.kv_fp8_args`); stage 2 merges true-valued partials unchanged.

Exponentials use exp2 with log2(e) folded into the scale; accumulation is fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixlm.layers import pdl
from radixlm.layers.attention.triton_ops.flash_block import (
    attend_block,
    fp8_score_scale,
    fp8_value_scale,
    kv_fp8_args,
    load_slots,
    score_scales,
)
from radixlm.layers.pdl import pdl_trigger, pdl_wait


@dataclass
class DecodePrefix:
    """What the shared-prefix pass hands the split-KV stages (all on the device):
    prefix_lens [bs] int32: tokens of each request the pass covered (0: none);
    num_prefix [bs] int32: its partials per request; mid_po [>= bs, num_heads,
    max_partials, head_dim] and mid_plse [>= bs, num_heads, max_partials] fp32:
    the partials (normalized outputs, log2-domain log-sum-exps)."""

    prefix_lens: torch.Tensor
    num_prefix: torch.Tensor
    mid_po: torch.Tensor
    mid_plse: torch.Tensor


@triton.jit
def _first_token(PrefixLens, b, seq_len, window, HAS_PREFIX: tl.constexpr,
                 HAS_WINDOW: tl.constexpr):
    """First token the split-KV stages cover: after the request's shared prefix,
    and within the last `window` positions (the query's own included)."""
    first = seq_len * 0
    if HAS_PREFIX:
        first = tl.minimum(tl.load(PrefixLens + b).to(seq_len.dtype), seq_len)
    if HAS_WINDOW:
        first = tl.maximum(first, seq_len - window)
    return first


@triton.jit
def _decode_stage1_kernel(
    Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, PrefixLens, SlotMap, MidO, MidLse,
    KScale, VScale, qk_scale, cap_log2, window, num_splits,
    stride_qb, stride_qh,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_r2t,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PREC: tl.constexpr, HAS_PREFIX: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, TRANSLATE: tl.constexpr,
    PDL: tl.constexpr, KV_FP8: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    # Before the wait, the step's inputs (lengths, the token table, the window's slot
    # map: set by the host, `radixlm.layers.pdl`) down to the first block's slots,
    # so after it only q and the K/V rows (this step's written by the kernel before)
    # are read: two round trips to memory fewer on a split of one block, which is
    # what a short context's decode splits are.
    seq_len = tl.load(SeqLens + b)
    first = _first_token(PrefixLens, b, seq_len, window, HAS_PREFIX, HAS_WINDOW)
    chunk = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + s * chunk
    end = tl.minimum(start + chunk, seq_len)
    row = tl.load(ReqPoolIdx + b).to(tl.int64)
    r2t = ReqToToken + row * stride_r2t
    # Out-of-range tokens read slot 0 (the pool's padding row), so the K/V gathers
    # need no mask; their scores are masked to -inf below. int64: slot * row stride
    # overflows int32 for pools past ~2M tokens.
    offs_n = start + tl.arange(0, BLOCK_N)
    slot = load_slots(r2t, offs_n, offs_n < end, SlotMap, True, TRANSLATE)
    pdl_wait(PDL)
    pdl_trigger(PDL)
    if start >= end:  # beyond this request's length: nothing to do (stage 2 knows)
        return

    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < GROUP
    heads = g * GROUP + offs_h
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=hmask[:, None], other=0.0)
    k_base = K + g * stride_kh + offs_d[None, :]
    v_base = V + g * stride_vh + offs_d[None, :]

    qk_scale = fp8_score_scale(qk_scale, KScale, KV_FP8)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    # The first block with the slots loaded before the wait, the rest in the loop
    # (software-pipelined over num_stages blocks, as before the peel). Every block
    # has >= 1 valid token, so m_i is finite and no NaN appears (a window only
    # moves the range's start).
    m_i, l_i, acc = attend_block(q, k_base, v_base, slot, stride_kn, stride_vn,
                                 (offs_n < end)[None, :], m_i, l_i, acc, qk_scale, cap_log2,
                                 DOT_PREC=DOT_PREC, MASKED=True, SOFTCAP=SOFTCAP,
                                 EMPTY_ROWS=False, KV_FP8=KV_FP8)
    for n0 in range(start + BLOCK_N, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        slot = load_slots(r2t, offs_n, nmask, SlotMap, True, TRANSLATE)
        m_i, l_i, acc = attend_block(q, k_base, v_base, slot, stride_kn, stride_vn,
                                     nmask[None, :], m_i, l_i, acc, qk_scale, cap_log2,
                                     DOT_PREC=DOT_PREC, MASKED=True, SOFTCAP=SOFTCAP,
                                     EMPTY_ROWS=False, KV_FP8=KV_FP8)

    mo = MidO + b * stride_mob + heads[:, None] * stride_moh + s * stride_mos + offs_d[None, :]
    tl.store(mo, fp8_value_scale(acc / l_i[:, None], VScale, KV_FP8), mask=hmask[:, None])
    # log2-domain LSE of this split's scores.
    tl.store(MidLse + b * stride_mlb + heads * stride_mlh + s, m_i + tl.log2(l_i), mask=hmask)


@triton.jit
def _decode_stage2_kernel(
    MidO, MidLse, Out, SeqLens, PrefixLens, NumPrefix, MidPO, MidPLse, window, num_splits,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    stride_pob, stride_poh, stride_pos,
    stride_plb, stride_plh,
    stride_ob, stride_oh,
    BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, CHUNK_ALIGN: tl.constexpr,
    HEAD_DIM: tl.constexpr, HAS_PREFIX: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PDL: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    # The step's inputs before the wait (as in stage 1); the partials after it.
    seq_len = tl.load(SeqLens + b)
    if HAS_PREFIX:
        n_pre = tl.load(NumPrefix + b)
    n = seq_len - _first_token(PrefixLens, b, seq_len, window, HAS_PREFIX, HAS_WINDOW)
    # Same chunking as stage 1: the number of splits that did work.
    chunk = tl.cdiv(tl.cdiv(n, num_splits), CHUNK_ALIGN) * CHUNK_ALIGN
    n_valid = tl.cdiv(n, tl.maximum(chunk, 1))
    pdl_wait(PDL)
    pdl_trigger(PDL)

    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < n_valid
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(MidLse + b * stride_mlb + h * stride_mlh + offs_s, mask=smask,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(smask, tl.exp2(lse - m), 0.0)
    o = tl.load(MidO + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos
                + offs_d[None, :], mask=smask[:, None], other=0.0)
    denom = tl.sum(w, 0)
    num = tl.sum(w[:, None] * o, 0)
    if HAS_PREFIX:  # noqa: SIM102 (a compile-time branch around a run-time one)
        # The shared-prefix pass's partials, merged in by rescaling the suffix's sums.
        # A row without any skips this: the same result, bit for bit, as plain
        # decode, at the cost of one load.
        if n_pre > 0:
            offs_p = tl.arange(0, BLOCK_P)
            pmask = offs_p < n_pre
            plse = tl.load(MidPLse + b * stride_plb + h * stride_plh + offs_p, mask=pmask,
                           other=float("-inf"))
            m_all = tl.maximum(m, tl.max(plse, 0))
            wp = tl.where(pmask, tl.exp2(plse - m_all), 0.0)
            po = tl.load(MidPO + b * stride_pob + h * stride_poh
                         + offs_p[:, None] * stride_pos + offs_d[None, :],
                         mask=pmask[:, None], other=0.0)
            c = tl.exp2(m - m_all)  # 0 when the suffix had no split (m = -inf)
            denom = denom * c + tl.sum(wp, 0)
            num = num * c + tl.sum(wp[:, None] * po, 0)
    # seq_len == 0 (padding row): no valid split, write zeros instead of NaN.
    out = tl.where(denom > 0, num / denom, 0.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty))


# Defaults from the H200 sweep (docs/kernels.md): small tiles and 2 warps keep
# shared memory per program low, so more programs stay resident per SM and more
# gathers are in flight; the bench can override them.
DECODE_BLOCK_N = 32
DECODE_NUM_WARPS = 2
DECODE_NUM_STAGES = 3


def default_block_n(head_dim: int, dtype: torch.dtype) -> int:
    # Keep one K (or V) tile at <= 16 KB so two pipeline stages of K and V fit in
    # shared memory for every supported head_dim and dtype (fp32 d256 -> 16 rows).
    return max(16, min(DECODE_BLOCK_N, 16384 // (head_dim * dtype.itemsize)))


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 caches get true fp32 products (tests, CPU parity); 16-bit inputs ignore this.
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    num_splits: int,
    sm_scale: float,
    *,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    prefix: DecodePrefix | None = None,
    window: int | None = None,
    softcap: float | None = None,
    slot_map: torch.Tensor | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Decode attention; writes and returns `o`.

    q, o: [bs, num_heads, head_dim] (any strides with a unit last stride).
    k_buffer, v_buffer: [pool_size, num_kv_heads, head_dim] (slot 0 = padding).
    req_to_token: [num_rows, max_context_len] int32; req_pool_indices, seq_lens: [bs].
    mid_o: [>= bs, num_heads, >= num_splits, head_dim] fp32 scratch;
    mid_lse: [>= bs, num_heads, >= num_splits] fp32 scratch (slices of
    preallocated CUDA-graph buffers are fine). No host synchronization.
    prefix: the shared-prefix pass's results (cascade decode): stage 1 then skips
    each request's first `prefix.prefix_lens[b]` tokens and stage 2 merges the
    pass's partials; None: plain decode over all tokens.
    window: attend to the last `window` tokens only (sliding window; None: all).
    softcap: scores become softcap * tanh(score / softcap) (None: off).
    slot_map: the table holds full-pool slots and K/V live at slot_map[slot]
    (a window pool's layer; `SWAKVPool.slot_map`). Each of the three is a
    compile-time branch: None costs nothing.
    kv_scales: (k_scale, v_scale) one-element fp32 device tensors, needed when
    the buffers are FP8 (`FP8TokenToKVPool`; see `flash_block.kv_fp8_args`).
    """
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert head_dim & (head_dim - 1) == 0 and head_dim <= 256, "head_dim: power of 2 <= 256"
    assert q.stride(-1) == 1 and k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    assert mid_o.shape[2] >= num_splits and mid_lse.shape[2] >= num_splits
    if bs == 0:
        return o
    group = num_heads // num_kv_heads
    block_n = block_n or default_block_n(head_dim, q.dtype)
    has_prefix = prefix is not None
    # Without a prefix the pointer arguments are unused: any tensor will do.
    pl = prefix.prefix_lens if has_prefix else seq_lens
    qk_scale, cap_log2 = score_scales(sm_scale, softcap)
    translate = slot_map is not None
    k_scale, v_scale, kv_fp8 = kv_fp8_args(k_buffer, q, kv_scales)
    _decode_stage1_kernel[(bs, num_kv_heads, num_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, pl,
        slot_map if translate else seq_lens, mid_o, mid_lse, k_scale, v_scale,
        qk_scale, cap_log2, window or 0, num_splits,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        HEAD_DIM=head_dim, DOT_PREC=dot_precision(q.dtype), HAS_PREFIX=has_prefix,
        HAS_WINDOW=window is not None, SOFTCAP=softcap is not None, TRANSLATE=translate,
        KV_FP8=kv_fp8,
        num_warps=num_warps or DECODE_NUM_WARPS, num_stages=num_stages or DECODE_NUM_STAGES,
        **pdl.launch_args(),
    )
    po, plse = (prefix.mid_po, prefix.mid_plse) if has_prefix else (mid_o, mid_lse)
    _decode_stage2_kernel[(bs, num_heads)](
        mid_o, mid_lse, o, seq_lens, pl, prefix.num_prefix if has_prefix else seq_lens,
        po, plse, window or 0, num_splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        po.stride(0), po.stride(1), po.stride(2),
        plse.stride(0), plse.stride(1),
        o.stride(0), o.stride(1),
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_P=triton.next_power_of_2(po.shape[2]) if has_prefix else 1,
        CHUNK_ALIGN=block_n, HEAD_DIM=head_dim, HAS_PREFIX=has_prefix,
        HAS_WINDOW=window is not None, num_warps=4 if head_dim >= 128 else 2, **pdl.launch_args(),
    )
    return o


def alloc_decode_scratch(bs: int, num_heads: int, num_splits: int, head_dim: int,
                         device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for `decode_attention_fwd`: (mid_o, mid_lse), fp32."""
    mid_o = torch.empty((bs, num_heads, num_splits, head_dim), dtype=torch.float32,
                        device=device)
    mid_lse = torch.empty((bs, num_heads, num_splits), dtype=torch.float32, device=device)
    return mid_o, mid_lse
