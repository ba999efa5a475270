"""Extend (prefill) attention over the token-level KV pool, flash-attention style.

Each request has `prefix_len` cached tokens and `extend_len` new ones; new token j
sits at position prefix_len + j and attends to positions 0..prefix_len + j.

Where the keys come from: *all* of them, the new tokens' too, are read from the
pool through `req_to_token`, so the caller must store the new K/V at their slots
first (the backend does). One code path for prefix and new keys keeps the kernel
small; the gather costs little because each K/V row is a contiguous
head_dim * itemsize run (256 B at head_dim 128 bf16), which is a whole number of
32-byte sectors.

Work split: the ragged batch is cut into query blocks of BLOCK_M new tokens of
one request; a host-built table lists (request, first new token) per block,
heaviest (longest key range) first so the long causal tails start early and the
short blocks fill the end of the grid. Grid (num_heads, num_blocks): the query
heads vary fastest, so the heads of one GQA group run at about the same time
and share the group's K/V tiles through L2.

Per program, keys run in two loops: blocks entirely before the first query's
position (no mask) and the causal tail (masked). A sliding-window layer adds a
masked loop over the window's leading edge and starts there: keys before the
first query's window are never read. Online softmax in fp32 with
exp2, fp32 accumulation. An FP8 pool is read as in decode
(`flash_block.kv_fp8_args`: tiles widened, k_scale in the score scale,
v_scale on the normalized output).
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


@triton.jit
def _extend_kernel(
    Q, K, V, Out, ReqToToken, ReqPoolIdx, PrefixLens, ExtendLens, ExtendStart, BlockTable,
    SlotMap, KScale, VScale, qk_scale, cap_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_r2t,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PREC: tl.constexpr, HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, TRANSLATE: tl.constexpr, KV_FP8: tl.constexpr,
):
    h = tl.program_id(0)
    blk = tl.program_id(1)
    r = tl.load(BlockTable + 2 * blk)
    m0 = tl.load(BlockTable + 2 * blk + 1).to(tl.int64)
    prefix = tl.load(PrefixLens + r)
    ext = tl.load(ExtendLens + r)
    q_start = tl.load(ExtendStart + r)
    row = tl.load(ReqPoolIdx + r).to(tl.int64)
    g = h // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    mmask = offs_m < ext
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mmask[:, None], other=0.0)
    q_pos = prefix + offs_m

    r2t = ReqToToken + row * stride_r2t
    k_base = K + g * stride_kh + offs_d[None, :]
    v_base = V + g * stride_vh + offs_d[None, :]

    qk_scale = fp8_score_scale(qk_scale, KScale, KV_FP8)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # Keys [0, full_end) precede every query of the block: no causal mask.
    first_q = prefix + m0
    full_end = (first_q // BLOCK_N) * BLOCK_N
    full_start = full_end * 0
    if HAS_WINDOW:
        # Row i sees keys (q_pos_i - window, q_pos_i]. Keys from window_start on
        # may be visible to the first row; from full_start on, to the block's
        # last row too (so to all rows before full_end: no mask there).
        window_start = (tl.maximum(first_q - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_start = tl.cdiv(tl.maximum(first_q + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N
        full_start = tl.minimum(tl.maximum(full_start, window_start), full_end)
        for n0 in range(window_start, full_start, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            slot = load_slots(r2t, offs_n, None, SlotMap, False, TRANSLATE)
            visible = offs_n[None, :] > q_pos[:, None] - window
            m_i, l_i, acc = attend_block(q, k_base, v_base, slot, stride_kn, stride_vn,
                                         visible, m_i, l_i, acc, qk_scale, cap_log2,
                                         DOT_PREC=DOT_PREC, MASKED=True, SOFTCAP=SOFTCAP,
                                         EMPTY_ROWS=True, KV_FP8=KV_FP8)
    for n0 in range(full_start, full_end, BLOCK_N):
        slot = load_slots(r2t, n0 + tl.arange(0, BLOCK_N), None, SlotMap, False,
                          TRANSLATE)
        m_i, l_i, acc = attend_block(q, k_base, v_base, slot, stride_kn, stride_vn, None,
                                     m_i, l_i, acc, qk_scale, cap_log2,
                                     DOT_PREC=DOT_PREC, MASKED=False, SOFTCAP=SOFTCAP,
                                     EMPTY_ROWS=HAS_WINDOW, KV_FP8=KV_FP8)

    # Causal tail: keys [full_end, min(prefix + m0 + BLOCK_M, seq_len)). Key
    # full_end <= every query position, so without a window each row's first
    # tail block has a finite score and m_i never stays -inf (no NaN from fully
    # masked blocks); a window may hide a whole block from a row (EMPTY_ROWS).
    seq_len = prefix + ext
    tail_end = tl.minimum(prefix + m0 + BLOCK_M, seq_len)
    for n0 in range(full_end, tail_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < tail_end
        # Masked-off keys read slot 0 (padding row): gathers stay unmasked.
        slot = load_slots(r2t, offs_n, nmask, SlotMap, True, TRANSLATE)
        visible = (offs_n[None, :] <= q_pos[:, None]) & nmask[None, :]
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = attend_block(q, k_base, v_base, slot, stride_kn, stride_vn, visible,
                                     m_i, l_i, acc, qk_scale, cap_log2,
                                     DOT_PREC=DOT_PREC, MASKED=True, SOFTCAP=SOFTCAP,
                                     EMPTY_ROWS=HAS_WINDOW, KV_FP8=KV_FP8)

    out = fp8_value_scale(acc / l_i[:, None], VScale, KV_FP8)
    tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mmask[:, None])


def extend_config(head_dim: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile shape per (head_dim, dtype); 16-bit values measured on H200 (docs/kernels.md).

    fp32 and head_dim 256 use smaller tiles so K/V stages fit in shared memory.
    """
    if dtype == torch.float32:
        if head_dim >= 256:
            return dict(block_m=32, block_n=32, num_warps=4, num_stages=1)
        return dict(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if head_dim >= 256:
        return dict(block_m=64, block_n=32, num_warps=8, num_stages=2)
    if head_dim >= 128:
        return dict(block_m=64, block_n=64, num_warps=4, num_stages=3)
    return dict(block_m=128, block_n=64, num_warps=4, num_stages=3)


def build_extend_block_table(prefix_lens: list[int], extend_lens: list[int], block_m: int,
                             device: torch.device | str) -> torch.Tensor:
    """[num_blocks, 2] int32 (request index, first new token), heaviest block first.

    Built from the host copies of the lengths, so no device sync.
    """
    blocks: list[tuple[int, int, int]] = []
    for i, (pre, ext) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        for m0 in range(0, ext, block_m):
            # Keys this block scans: the prefix plus new tokens up to its last row.
            blocks.append((pre + min(m0 + block_m, ext), i, m0))
    blocks.sort(key=lambda t: -t[0])
    flat = [x for _, i, m0 in blocks for x in (i, m0)]
    table = torch.tensor(flat, dtype=torch.int32).view(-1, 2)
    if torch.device(device).type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
    return table


def extend_attention_fwd(
    q: torch.Tensor,
    o: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    block_table: torch.Tensor,
    sm_scale: float,
    *,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    window: int | None = None,
    softcap: float | None = None,
    slot_map: torch.Tensor | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Extend attention; writes and returns `o`.

    q, o: [num_new_tokens, num_heads, head_dim] (flat ragged layout, unit last stride).
    k_buffer, v_buffer: pool buffers [pool_size, num_kv_heads, head_dim], already
    holding the new tokens' K/V. prefix_lens, extend_lens, extend_start_loc,
    req_pool_indices: [bs] device tensors. block_table: `build_extend_block_table`
    for the same `block_m`. window / softcap / slot_map / kv_scales: as
    `decode_attention_fwd` (compile-time branches; None costs nothing).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert head_dim & (head_dim - 1) == 0 and head_dim <= 256, "head_dim: power of 2 <= 256"
    assert q.stride(-1) == 1 and o.stride(-1) == 1
    assert k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    num_blocks = block_table.shape[0]
    if num_blocks == 0:
        return o
    k_scale, v_scale, kv_fp8 = kv_fp8_args(k_buffer, q, kv_scales)
    _extend_kernel[(num_heads, num_blocks)](
        q, k_buffer, v_buffer, o, req_to_token, req_pool_indices, prefix_lens, extend_lens,
        extend_start_loc, block_table,
        slot_map if slot_map is not None else prefix_lens, k_scale, v_scale,
        *score_scales(sm_scale, softcap),
        window or 0,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=head_dim, DOT_PREC=dot_precision(q.dtype), HAS_WINDOW=window is not None,
        SOFTCAP=softcap is not None, TRANSLATE=slot_map is not None, KV_FP8=kv_fp8,
        num_warps=num_warps, num_stages=num_stages,
    )
    return o
