"""Prefix-sharing (cascade) decode attention.

Requests of a decode batch that hold the same radix-tree prefix have the very
same pool slots for it (`PrefixGroups` in forward_batch.py finds them).
Plain decode reads that prefix's K/V once per request; here it is read once per
group:

- Pass 1 (this module), grid (max_items, num_kv_heads): a group is cut into
  chunks of at most `members` requests, and a chunk's prefix into splits of
  whole key blocks; an item is one (chunk, split). Program (i, g) stacks the
  query heads of KV group g of *all* the chunk's requests as the M side of a
  `tl.dot` (members x GQA heads rows, e.g. 16 x 4 = 64), reads each K/V row of
  its split once, and writes one normalized partial output and log2-domain
  log-sum-exp per (request, head) into `mid_po` / `mid_plse`, at that request's
  partial index `split`.
- Pass 2: the plain split-KV decode kernel over each request's own tokens
  prefix_len..seq_len (stage 1 with `prefix_lens`), then its stage 2 merges the
  suffix splits and the prefix partials with their log-sum-exps.

Requests in no group have prefix_len 0 and no partials: plain decode. The
tables (items, members, prefix_lens, num_prefix) are built on the host from the
groups, once per change of the running set, and packed into one int32 buffer,
so one host-to-device copy moves them. For CUDA graphs the buffer is sized for
(max_bs, max_items): items past the plan's end have start == end and exit at
once, so a graph captured with the cascade path replays any plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixlm.layers.attention.triton_ops.decode_attention import (
    DecodePrefix,
    decode_attention_fwd,
    dot_precision,
)
from radixlm.layers.attention.triton_ops.flash_block import (
    attend_block,
    fp8_score_scale,
    fp8_value_scale,
    kv_fp8_args,
    score_scales,
)

# Pass-1 tiles (H200 sweep, docs/kernels.md). CASCADE_ROWS query rows per program
# (members x GQA heads): one K/V block read feeds 64 dot rows instead of 16.
CASCADE_ROWS = 64
CASCADE_BLOCK_N = 32
CASCADE_NUM_WARPS = 4
CASCADE_NUM_STAGES = 2
# Prefix splits start at multiples of this (a multiple of every pass-1 tile).
SPLIT_ALIGN = 64
# Partials per request from pass 1 (stage 2 merges them in one vector).
MAX_PREFIX_SPLITS = 16
# A split shorter than this costs more in launch and merge than it spreads.
MIN_SPLIT_TOKENS = 128
# Items: (chunk, first token, end token, partial index).
ITEM_FIELDS = 4


def cascade_block_n(head_dim: int, dtype: torch.dtype) -> int:
    # One K (or V) tile at <= 16 KB: two stages of K and V plus q fit shared memory.
    return max(16, min(CASCADE_BLOCK_N, 16384 // (head_dim * dtype.itemsize)))


def cascade_members(group: int, head_dim: int) -> int:
    """Requests per pass-1 program: CASCADE_ROWS query rows (halved for d256,
    whose fp32 accumulator would not fit the registers)."""
    rows = CASCADE_ROWS if head_dim <= 128 else CASCADE_ROWS // 2
    return max(1, rows // group)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class CascadePlan:
    """Host-side tables for one grouping of one batch (see the module docstring)."""

    batch_size: int
    members_per_chunk: int
    prefix_lens: list[int]  # [bs]
    num_prefix: list[int]  # [bs]
    items: list[tuple[int, int, int, int]]  # (chunk, start, end, partial index)
    chunks: list[list[int]]  # batch indices, the first one's table row is read

    @property
    def num_items(self) -> int:
        return len(self.items)

    def pack(self, bs_cap: int, items_cap: int) -> torch.Tensor:
        """The tables as one int32 CPU tensor, laid out as `table_views` reads it."""
        assert self.batch_size <= bs_cap and self.num_items <= items_cap
        m = self.members_per_chunk
        buf = torch.zeros(table_size(bs_cap, items_cap, m), dtype=torch.int32)
        t = table_views(buf, bs_cap, items_cap, m)
        t.prefix_lens[:self.batch_size] = torch.tensor(self.prefix_lens, dtype=torch.int32)
        t.num_prefix[:self.batch_size] = torch.tensor(self.num_prefix, dtype=torch.int32)
        if self.items:
            t.items[:self.num_items] = torch.tensor(self.items, dtype=torch.int32)
        t.members.fill_(-1)
        for c, members in enumerate(self.chunks):
            t.members[c, :len(members)] = torch.tensor(members, dtype=torch.int32)
        return buf


@dataclass
class CascadeTables:
    """Views into one packed int32 buffer (device or host)."""

    prefix_lens: torch.Tensor  # [bs_cap]
    num_prefix: torch.Tensor  # [bs_cap]
    items: torch.Tensor  # [items_cap, ITEM_FIELDS]
    members: torch.Tensor  # [items_cap, members_per_chunk], -1 padded


def table_size(bs_cap: int, items_cap: int, members: int) -> int:
    return 2 * bs_cap + items_cap * (ITEM_FIELDS + members)


def table_views(buf: torch.Tensor, bs_cap: int, items_cap: int, members: int) -> CascadeTables:
    i = 2 * bs_cap
    j = i + items_cap * ITEM_FIELDS
    return CascadeTables(buf[:bs_cap], buf[bs_cap:i], buf[i:j].view(items_cap, ITEM_FIELDS),
                         buf[j:j + items_cap * members].view(items_cap, members))


def build_cascade_plan(groups: Sequence[tuple[int, Sequence[int]]], batch_size: int,
                       members_per_chunk: int, num_kv_heads: int, target_programs: int,
                       max_items: int, block_n: int,
                       max_splits: int = MAX_PREFIX_SPLITS) -> CascadePlan | None:
    """Chunks and splits for `groups` ((prefix_len, batch indices) each); None if no
    chunk of >= 2 requests remains.

    Each group is cut into near-equal chunks of at most `members_per_chunk`
    requests. Splits: about `target_programs / num_kv_heads` items over all
    chunks, each split a whole number of key blocks and at least MIN_SPLIT_TOKENS
    long, at most `max_splits` per chunk and `max_items` in all (then the chunks
    that save the fewest reads are left to plain decode).
    """
    chunks: list[tuple[int, list[int]]] = []
    for prefix_len, members in groups:
        members = list(members)
        n = _cdiv(len(members), members_per_chunk)
        for c in range(n):
            piece = members[c * len(members) // n:(c + 1) * len(members) // n]
            if len(piece) >= 2 and prefix_len > 0:
                chunks.append((prefix_len, piece))
    if not chunks:
        return None
    if len(chunks) > max_items:
        chunks.sort(key=lambda c: (len(c[1]) - 1) * c[0], reverse=True)
        chunks = chunks[:max_items]
    total = sum(lp for lp, _ in chunks)
    target_items = max(1, _cdiv(target_programs, num_kv_heads))
    split_len = _cdiv(max(MIN_SPLIT_TOKENS, _cdiv(total, target_items)), block_n) * block_n
    while sum(min(max_splits, _cdiv(lp, split_len)) for lp, _ in chunks) > max_items:
        split_len *= 2
    prefix_lens, num_prefix = [0] * batch_size, [0] * batch_size
    items: list[tuple[int, int, int, int]] = []
    for c, (lp, members) in enumerate(chunks):
        splits = min(max_splits, _cdiv(lp, split_len))
        per = _cdiv(_cdiv(lp, splits), block_n) * block_n
        n_s = _cdiv(lp, per)
        items += [(c, s * per, min((s + 1) * per, lp), s) for s in range(n_s)]
        for b in members:
            prefix_lens[b], num_prefix[b] = lp, n_s
    return CascadePlan(batch_size, members_per_chunk, prefix_lens, num_prefix, items,
                       [m for _, m in chunks])


@triton.jit
def _cascade_prefix_kernel(
    Q, K, V, ReqToToken, ReqPoolIdx, Items, Members, MidPO, MidPLse,
    KScale, VScale, qk_scale, cap_log2,
    stride_qb, stride_qh,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_r2t,
    stride_pob, stride_poh, stride_pos,
    stride_plb, stride_plh,
    GROUP: tl.constexpr, MEMBERS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PREC: tl.constexpr,
    SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr,
):
    it = tl.program_id(0)
    g = tl.program_id(1)
    item = Items + it * 4
    start = tl.load(item + 1)
    end = tl.load(item + 2)
    if start >= end:  # past the plan's end (CUDA-graph padding)
        return
    chunk = tl.load(item).to(tl.int64)
    split = tl.load(item + 3)

    # Row r: member r // GROUP of the chunk, query head g * GROUP + r % GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    member = offs_m // GROUP
    b = tl.load(Members + chunk * MEMBERS + member, mask=member < MEMBERS, other=-1)
    valid = b >= 0
    b = tl.where(valid, b, 0).to(tl.int64)
    heads = g * GROUP + offs_m % GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    # Padding rows hold q = 0: finite scores, results not stored.
    q = tl.load(Q + b[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=valid[:, None], other=0.0)

    # The prefix's slots are the same in every member's row: read the first one's.
    lead = tl.load(Members + chunk * MEMBERS)
    r2t = ReqToToken + tl.load(ReqPoolIdx + lead).to(tl.int64) * stride_r2t
    k_base = K + g * stride_kh + offs_d[None, :]
    v_base = V + g * stride_vh + offs_d[None, :]

    qk_scale = fp8_score_scale(qk_scale, KScale, KV_FP8)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        # Masked tokens read slot 0 (the padding row); int64 offsets as in decode.
        slot = tl.load(r2t + offs_n, mask=nmask, other=0).to(tl.int64)
        m_i, l_i, acc = attend_block(q, k_base, v_base, slot, stride_kn, stride_vn,
                                     nmask[None, :], m_i, l_i, acc, qk_scale, cap_log2,
                                     DOT_PREC=DOT_PREC, MASKED=True, SOFTCAP=SOFTCAP,
                                     EMPTY_ROWS=False, KV_FP8=KV_FP8)

    po = MidPO + b[:, None] * stride_pob + heads[:, None] * stride_poh + split * stride_pos
    tl.store(po + offs_d[None, :], fp8_value_scale(acc / l_i[:, None], VScale, KV_FP8),
             mask=valid[:, None])
    tl.store(MidPLse + b * stride_plb + heads * stride_plh + split, m_i + tl.log2(l_i),
             mask=valid)


def cascade_prefix_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                       req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                       tables: CascadeTables, mid_po: torch.Tensor, mid_plse: torch.Tensor,
                       sm_scale: float, *, block_n: int | None = None,
                       num_warps: int | None = None, num_stages: int | None = None,
                       softcap: float | None = None,
                       kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Pass 1 over every item of `tables` (grid: all of its rows; empty ones exit);
    `kv_scales` as `decode_attention_fwd`'s."""
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    members = tables.members.shape[1]
    n_items = tables.items.shape[0]
    if n_items == 0:
        return
    block_m = max(16, triton.next_power_of_2(members * group))
    k_scale, v_scale, kv_fp8 = kv_fp8_args(k_buffer, q, kv_scales)
    _cascade_prefix_kernel[(n_items, num_kv_heads)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, tables.items, tables.members,
        mid_po, mid_plse, k_scale, v_scale, *score_scales(sm_scale, softcap),
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        mid_po.stride(0), mid_po.stride(1), mid_po.stride(2),
        mid_plse.stride(0), mid_plse.stride(1),
        GROUP=group, MEMBERS=members, BLOCK_M=block_m,
        BLOCK_N=block_n or cascade_block_n(head_dim, q.dtype), HEAD_DIM=head_dim,
        DOT_PREC=dot_precision(q.dtype), SOFTCAP=softcap is not None, KV_FP8=kv_fp8,
        num_warps=num_warps or CASCADE_NUM_WARPS, num_stages=num_stages or CASCADE_NUM_STAGES,
    )


def cascade_decode_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                       o: torch.Tensor, req_to_token: torch.Tensor,
                       req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                       mid_o: torch.Tensor, mid_lse: torch.Tensor, num_splits: int,
                       sm_scale: float, tables: CascadeTables, mid_po: torch.Tensor,
                       mid_plse: torch.Tensor, softcap: float | None = None,
                       kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> torch.Tensor:
    """Decode attention with shared prefixes; writes and returns `o`.

    Arguments as `decode_attention_fwd`, plus the plan's device `tables` (rows
    past the batch must have prefix_len 0 and no partials) and pass 1's scratch:
    mid_po [>= bs, num_heads, >= max partials, head_dim], mid_plse [>= bs,
    num_heads, >= max partials] fp32. No host synchronization. Softcapped layers
    are fine; sliding-window layers take plain decode (`decode_attention_fwd`
    with `window`): the shared prefix is mostly outside their window, and what
    is inside differs per request. `kv_scales`: an FP8 pool's, as in
    `decode_attention_fwd` (both passes apply them).
    """
    bs = q.shape[0]
    cascade_prefix_fwd(q, k_buffer, v_buffer, req_to_token, req_pool_indices, tables,
                       mid_po, mid_plse, sm_scale, softcap=softcap, kv_scales=kv_scales)
    prefix = DecodePrefix(tables.prefix_lens[:bs], tables.num_prefix[:bs], mid_po, mid_plse)
    return decode_attention_fwd(q, k_buffer, v_buffer, o, req_to_token, req_pool_indices,
                                seq_lens, mid_o, mid_lse, num_splits, sm_scale, prefix=prefix,
                                softcap=softcap, kv_scales=kv_scales)
