"""Batch-invariant attention (CUDA), for `--enable-deterministic-inference`.

The default kernels choose their work split by the batch: decode cuts each
request into `f(batch size)` chunks, extend walks a query block's keys from
wherever its chunk of the prompt begins. So a row's low bits depend on what
else runs, on how the prompt was chunked and on how much of it the prefix
cache held, and a decode step differs from the prefill that recomputes the
same position after a retraction. Here every query row, a decode step's or
any row of an extend (after any cached prefix, in any chunk), is computed by
the same code in the same order:

- keys in blocks of BLOCK_N positions and splits of `split` positions (a
  multiple of BLOCK_N), both aligned to absolute positions: block b covers
  [b * BLOCK_N, (b + 1) * BLOCK_N), whoever asks;
- one split: an online softmax over its blocks from fresh state
  (`_attend_split`) on a tile of ROWS query rows, the MMA's M side. A row's
  result depends only on its own query, keys and mask: keys it does not see
  get probability exactly 0 (a block wholly outside its range is an exact
  no-op), and the MMA computes each output from its own row;
- the splits' partial results (max, sum, unnormalized output) folded in
  position order (`_fold`) and normalized once.

Extend: one program per row tile (positions x the heads of one KV group)
walks its splits in order, folding in registers. Decode: programs per
(request, KV-head tile) take the request's splits (a program count chosen by
the batch size, which only decides who computes a split, not how), store
each split's partial, and a merge program per (request, head) folds them in
order. Both kernels inline the same helpers with the same tile shape, warps
and stages, so the same code computes every row. Rows the window hides and
positions past a request's length read the pool's padding slot 0.

An FP8 pool (`kv_scales`): both kernels fold k_scale into the score scale
with the same multiply and apply v_scale after the one normalization
(`flash_block.kv_fp8_args`), so rows stay the same bits across the two.

CUDA graphs: the decode grid depends on the batch size only and the scratch
is sized for `max_splits(context)` splits, so graphs capture it unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.layers.attention.triton_ops.decode_attention import dot_precision
from radixlm.layers.attention.triton_ops.flash_block import (
    attend_block,
    fp8_score_scale,
    fp8_value_scale,
    kv_fp8_args,
    load_slots,
    score_scales,
)

ROWS = 16  # query rows per tile (the MMA's M side)
MIN_SPLIT = 256  # positions per split, at least
MAX_SPLITS = 64  # splits per request at the context length, at most


def split_size(max_context_len: int) -> int:
    """Positions per split for a model served with this context: fixed for the
    process (so for every batch), large enough that a request has at most
    MAX_SPLITS splits."""
    per = -(-max_context_len // MAX_SPLITS)
    return max(MIN_SPLIT, -(-per // MIN_SPLIT) * MIN_SPLIT)


def num_splits(max_context_len: int) -> int:
    return -(-max_context_len // split_size(max_context_len))


def invariant_config(head_dim: int) -> dict[str, int]:
    """The tile both kernels compile with (one per head dim: never per batch)."""
    return dict(block_n=64 if head_dim <= 128 else 32, num_warps=4, num_stages=2)


def _launch_options(x: torch.Tensor) -> dict[str, bool]:
    # No multiply-add contraction left to the compiler: the fold runs in two
    # kernels (registers in extend, memory in the merge) and must round alike.
    # (The interpreter, on CPU tensors, computes each op as written.)
    return {"enable_fp_fusion": False} if x.is_cuda else {}


@triton.jit
def _attend_split(q, pos, lo, valid, r2t, k_base, v_base, SlotMap, stride_kn, stride_vn, sb,
                  split, qk_scale, cap_log2, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  ROWS_: tl.constexpr, DOT_PREC: tl.constexpr, SOFTCAP: tl.constexpr,
                  TRANSLATE: tl.constexpr, KV_FP8: tl.constexpr):
    """(m, l, acc) of the split [sb, sb + split) for the tile's rows: row i at
    position pos[i] sees keys lo[i]..pos[i] (rows not `valid` see none), m in
    the log2 domain, -inf for a row that sees nothing here."""
    lo_min = tl.min(tl.where(valid, lo, 1 << 30), 0)
    p_max = tl.max(tl.where(valid, pos, -1), 0)
    first = tl.maximum(sb, (lo_min // BLOCK_N) * BLOCK_N)
    last = tl.minimum(sb + split - 1, p_max)
    m_i = tl.full([ROWS_], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS_], tl.float32)
    acc = tl.zeros([ROWS_, HEAD_DIM], tl.float32)
    for n0 in range(first, last + 1, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        # Keys no row of the tile sees read the padding slot (never a freed one).
        slot = load_slots(r2t, offs_n, (offs_n >= lo_min) & (offs_n <= p_max), SlotMap, True,
                          TRANSLATE)
        visible = (valid[:, None] & (offs_n[None, :] >= lo[:, None])
                   & (offs_n[None, :] <= pos[:, None]))
        m_i, l_i, acc = attend_block(q, k_base, v_base, slot, stride_kn, stride_vn, visible,
                                     m_i, l_i, acc, qk_scale, cap_log2, DOT_PREC=DOT_PREC,
                                     MASKED=True, SOFTCAP=SOFTCAP, EMPTY_ROWS=True,
                                     KV_FP8=KV_FP8)
    return m_i, l_i, acc


@triton.jit
def _fold(acc_m, acc_l, acc_o, m, lsum, o):
    """(acc_m, acc_l, acc_o) merged with a split's (m, lsum, o); exact when either
    is empty (m = -inf)."""
    m_new = tl.maximum(acc_m, m)
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(acc_m - m_sub)
    b = tl.exp2(m - m_sub)
    return m_new, acc_l * a + lsum * b, acc_o * a[:, None] + o * b[:, None]


@triton.jit
def _first_visible(pos, window, HAS_WINDOW: tl.constexpr):
    if HAS_WINDOW:
        return tl.maximum(pos - window + 1, 0)
    return pos * 0


@triton.jit
def _extend_kernel(
    Q, K, V, Out, ReqToToken, ReqPoolIdx, PrefixLens, ExtendLens, ExtendStart, Tiles, SlotMap,
    KScale, VScale, qk_scale, cap_log2, window, split,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_r2t,
    GROUP: tl.constexpr, NH: tl.constexpr, NP: tl.constexpr, ROWS_: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, TRANSLATE: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    t = tl.program_id(0)
    r = tl.load(Tiles + 4 * t)
    g = tl.load(Tiles + 4 * t + 1)
    h0 = tl.load(Tiles + 4 * t + 2)  # first head of the group in the tile
    p0 = tl.load(Tiles + 4 * t + 3)  # first position
    prefix = tl.load(PrefixLens + r)
    seq_len = prefix + tl.load(ExtendLens + r)
    q_start = tl.load(ExtendStart + r)
    row = tl.load(ReqPoolIdx + r).to(tl.int64)

    i = tl.arange(0, ROWS_)
    pos = p0 + i // NH
    hg = h0 + i % NH
    valid = (i < NP * NH) & (pos < seq_len) & (hg < GROUP)
    head = g * GROUP + tl.minimum(hg, GROUP - 1)
    tok = (q_start + pos - prefix).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=valid[:, None], other=0.0)
    lo = _first_visible(pos, window, HAS_WINDOW)

    r2t = ReqToToken + row * stride_r2t
    k_base = K + g * stride_kh + offs_d[None, :]
    v_base = V + g * stride_vh + offs_d[None, :]
    qk_scale = fp8_score_scale(qk_scale, KScale, KV_FP8)
    acc_m = tl.full([ROWS_], float("-inf"), tl.float32)
    acc_l = tl.zeros([ROWS_], tl.float32)
    acc_o = tl.zeros([ROWS_, HEAD_DIM], tl.float32)
    lo_min = tl.min(tl.where(valid, lo, 1 << 30), 0)
    p_max = tl.max(tl.where(valid, pos, -1), 0)
    for s in range(lo_min // split, p_max // split + 1):
        m, lsum, o = _attend_split(q, pos, lo, valid, r2t, k_base, v_base, SlotMap, stride_kn,
                                   stride_vn, s * split, split, qk_scale, cap_log2,
                                   BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, ROWS_=ROWS_,
                                   DOT_PREC=DOT_PREC, SOFTCAP=SOFTCAP, TRANSLATE=TRANSLATE,
                                   KV_FP8=KV_FP8)
        acc_m, acc_l, acc_o = _fold(acc_m, acc_l, acc_o, m, lsum, o)
    out = fp8_value_scale(acc_o / acc_l[:, None], VScale, KV_FP8)
    tl.store(Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _decode_kernel(
    Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, SlotMap, MidO, MidM, MidL, KScale,
    qk_scale, cap_log2, window, split, num_progs,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_r2t,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    GROUP: tl.constexpr, NH: tl.constexpr, HC: tl.constexpr, ROWS_: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, TRANSLATE: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1) // HC
    h0 = (tl.program_id(1) % HC) * NH
    j = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    if seq_len == 0:
        return
    i = tl.arange(0, ROWS_)
    hg = h0 + i
    valid = (i < NH) & (hg < GROUP)
    head = g * GROUP + tl.minimum(hg, GROUP - 1)
    pos = tl.zeros([ROWS_], tl.int64) + (seq_len - 1)
    lo = _first_visible(pos, window, HAS_WINDOW)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=valid[:, None], other=0.0)
    row = tl.load(ReqPoolIdx + b).to(tl.int64)
    r2t = ReqToToken + row * stride_r2t
    k_base = K + g * stride_kh + offs_d[None, :]
    v_base = V + g * stride_vh + offs_d[None, :]
    qk_scale = fp8_score_scale(qk_scale, KScale, KV_FP8)
    first_split = tl.max(lo, 0) // split
    count = (seq_len - 1) // split - first_split + 1
    for si in range(j, count, num_progs):
        m, lsum, o = _attend_split(q, pos, lo, valid, r2t, k_base, v_base, SlotMap, stride_kn,
                                   stride_vn, (first_split + si) * split, split, qk_scale,
                                   cap_log2, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, ROWS_=ROWS_,
                                   DOT_PREC=DOT_PREC, SOFTCAP=SOFTCAP, TRANSLATE=TRANSLATE,
                                   KV_FP8=KV_FP8)
        tl.store(MidO + b * stride_mob + head[:, None] * stride_moh + si * stride_mos
                 + offs_d[None, :], o, mask=valid[:, None])
        tl.store(MidM + b * stride_mlb + head * stride_mlh + si, m, mask=valid)
        tl.store(MidL + b * stride_mlb + head * stride_mlh + si, lsum, mask=valid)


@triton.jit
def _merge_kernel(MidO, MidM, MidL, Out, SeqLens, VScale, window, split,
                  stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
                  stride_ob, stride_oh, HEAD_DIM: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  KV_FP8: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(SeqLens + b)
    pos = seq_len - 1
    count = tl.where(seq_len > 0,
                     pos // split - _first_visible(pos, window, HAS_WINDOW) // split + 1, 0)
    one = tl.arange(0, 1)
    offs_d = tl.arange(0, HEAD_DIM)
    acc_m = tl.full([1], float("-inf"), tl.float32)
    acc_l = tl.zeros([1], tl.float32)
    acc_o = tl.zeros([1, HEAD_DIM], tl.float32)
    for si in range(0, count):
        m = tl.load(MidM + b * stride_mlb + h * stride_mlh + si + one)
        lsum = tl.load(MidL + b * stride_mlb + h * stride_mlh + si + one)
        o = tl.load(MidO + b * stride_mob + h * stride_moh + si * stride_mos
                    + offs_d[None, :])
        acc_m, acc_l, acc_o = _fold(acc_m, acc_l, acc_o, m, lsum, o)
    # seq_len 0 (padding rows): zeros.
    out = fp8_value_scale(tl.where(acc_l[:, None] > 0, acc_o / acc_l[:, None], 0.0), VScale,
                          KV_FP8)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty))


def _tile_heads(group: int) -> tuple[int, int]:
    """(heads per tile, tiles per KV group)."""
    nh = min(group, ROWS)
    return nh, -(-group // nh)


def build_tiles(prefix_lens: list[int], extend_lens: list[int], group: int,
                num_kv_heads: int, device: torch.device | str) -> torch.Tensor:
    """[num_tiles, 4] int32 (request, KV head, first head in the group, first
    position) of an extend batch, heaviest (longest key range) first."""
    nh, hc = _tile_heads(group)
    np_ = ROWS // nh
    tiles: list[tuple[int, int, int, int, int]] = []
    for r, (pre, ext) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        for p0 in range(pre, pre + ext, np_):
            weight = min(p0 + np_, pre + ext)
            for g in range(num_kv_heads):
                for c in range(hc):
                    tiles.append((weight, r, g, c * nh, p0))
    tiles.sort(key=lambda t: -t[0])
    flat = [x for t in tiles for x in t[1:]]
    table = torch.tensor(flat, dtype=torch.int32).view(-1, 4)
    if torch.device(device).type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
    return table


def invariant_extend_fwd(q: torch.Tensor, o: torch.Tensor, k_buffer: torch.Tensor,
                         v_buffer: torch.Tensor, req_to_token: torch.Tensor,
                         req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                         extend_lens: torch.Tensor, extend_start_loc: torch.Tensor,
                         tiles: torch.Tensor, sm_scale: float, split: int, *,
                         window: int | None = None, softcap: float | None = None,
                         slot_map: torch.Tensor | None = None,
                         kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
                         ) -> torch.Tensor:
    """Extend attention with `extend_attention_fwd`'s arguments (q, o: [tokens,
    heads, dim]; the new K/V already in the pool), `tiles` from `build_tiles` and
    the process's `split` (`split_size`); writes and returns `o`."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    assert num_heads % num_kv_heads == 0 and head_dim & (head_dim - 1) == 0
    assert q.stride(-1) == 1 and o.stride(-1) == 1
    group = num_heads // num_kv_heads
    nh, _ = _tile_heads(group)
    cfg = invariant_config(head_dim)
    assert split % cfg["block_n"] == 0
    if tiles.shape[0] == 0:
        return o
    k_scale, v_scale, kv_fp8 = kv_fp8_args(k_buffer, q, kv_scales)
    _extend_kernel[(tiles.shape[0],)](
        q, k_buffer, v_buffer, o, req_to_token, req_pool_indices, prefix_lens, extend_lens,
        extend_start_loc, tiles, slot_map if slot_map is not None else prefix_lens,
        k_scale, v_scale, *score_scales(sm_scale, softcap), window or 0, split,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        GROUP=group, NH=nh, NP=ROWS // nh, ROWS_=ROWS, BLOCK_N=cfg["block_n"],
        HEAD_DIM=head_dim, DOT_PREC=dot_precision(q.dtype), HAS_WINDOW=window is not None,
        SOFTCAP=softcap is not None, TRANSLATE=slot_map is not None, KV_FP8=kv_fp8,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **_launch_options(q))
    return o


def decode_programs(bs: int, num_kv_heads: int, group: int, num_sms: int,
                    programs_per_sm: int = 4) -> int:
    """Programs per (request, KV-head tile): enough to fill the GPU at small batches.
    Which program computes a split never changes how it is computed."""
    _, hc = _tile_heads(group)
    return max(1, min(MAX_SPLITS, -(-programs_per_sm * num_sms // max(1, bs * num_kv_heads * hc))))


def alloc_invariant_scratch(bs: int, num_heads: int, splits: int, head_dim: int,
                            device: torch.device | str
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mid_o [bs, heads, splits, dim], mid_m, mid_l [bs, heads, splits]) fp32."""
    mid_o = torch.empty((bs, num_heads, splits, head_dim), dtype=torch.float32, device=device)
    mid_m = torch.empty((bs, num_heads, splits), dtype=torch.float32, device=device)
    return mid_o, mid_m, torch.empty_like(mid_m)


def invariant_decode_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         o: torch.Tensor, req_to_token: torch.Tensor,
                         req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                         mid_o: torch.Tensor, mid_m: torch.Tensor, mid_l: torch.Tensor,
                         sm_scale: float, split: int, programs: int, *,
                         window: int | None = None, softcap: float | None = None,
                         slot_map: torch.Tensor | None = None,
                         kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
                         ) -> torch.Tensor:
    """Decode attention (q, o: [bs, heads, dim]); scratch from
    `alloc_invariant_scratch` with room for every split of the longest request;
    `programs` from `decode_programs`. No host synchronization."""
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    assert num_heads % num_kv_heads == 0 and head_dim & (head_dim - 1) == 0
    assert q.stride(-1) == 1 and o.stride(-1) == 1
    if bs == 0:
        return o
    group = num_heads // num_kv_heads
    nh, hc = _tile_heads(group)
    cfg = invariant_config(head_dim)
    assert split % cfg["block_n"] == 0
    translate = slot_map is not None
    opts = _launch_options(q)
    k_scale, v_scale, kv_fp8 = kv_fp8_args(k_buffer, q, kv_scales)
    _decode_kernel[(bs, num_kv_heads * hc, programs)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
        slot_map if translate else seq_lens, mid_o, mid_m, mid_l, k_scale,
        *score_scales(sm_scale, softcap), window or 0, split, programs,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_m.stride(0), mid_m.stride(1),
        GROUP=group, NH=nh, HC=hc, ROWS_=ROWS, BLOCK_N=cfg["block_n"], HEAD_DIM=head_dim,
        DOT_PREC=dot_precision(q.dtype), HAS_WINDOW=window is not None,
        SOFTCAP=softcap is not None, TRANSLATE=translate, KV_FP8=kv_fp8,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **opts)
    _merge_kernel[(bs, num_heads)](
        mid_o, mid_m, mid_l, o, seq_lens, v_scale, window or 0, split,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_m.stride(0), mid_m.stride(1),
        o.stride(0), o.stride(1), HEAD_DIM=head_dim, HAS_WINDOW=window is not None,
        KV_FP8=kv_fp8, num_warps=4 if head_dim >= 128 else 2, **opts)
    return o
