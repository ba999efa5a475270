"""Sort the (token, expert) pairs of a top-k routing by expert, each expert's group
padded to the grouped GEMM's BLOCK_M rows, on the device.

A pair is the flat index p = t * top_k + j of `topk_ids[t, j]`. The result is a row
layout the GEMMs walk block by block:

- `sorted_ids[r]`: the pair at row r, or `numel` (= T * top_k, an index past the
  last pair) on a padding row. Expert e's pairs fill rows
  `[start_e, start_e + count_e)` in increasing pair order (stable), padding fills
  `[start_e + count_e, start_e + round_up(count_e, BLOCK_M))`, experts follow each
  other in id order and an expert with no pairs has no rows.
- `expert_ids[b]`: the expert of rows `[b * BLOCK_M, (b + 1) * BLOCK_M)`; -1 for
  blocks past the end.
- `num_post_padded[0]`: rows in use, a multiple of BLOCK_M. A GEMM program whose
  block starts at or past it exits at once: experts with no pairs cost nothing.

Ids outside `[0, num_experts)` (-1: an expert on another rank) belong to no group.

No host synchronisation: the outputs are sized for the worst case from shapes alone
(`max_padded_rows`), so the call can be captured in a CUDA graph. At most
`min(numel, E)` experts have pairs, so the worst case is
`numel + min(numel, E) * (BLOCK_M - 1)` rows: 8 blocks, not 128, at one decode
token with top-8 of 128 experts and BLOCK_M 16.

Kernels: up to SINGLE_TILES tiles of pairs (decode) one program does everything;
beyond that (prefill) `count` (one program per chunk of pairs: a per-expert
histogram), `scan` (one program: expert starts, block map, padding, each chunk's
first row per expert), `scatter` (one program per chunk). A tile of S pairs is
ranked within its experts by a cumulative sum down a [S, E] one-hot matrix, which
keeps the order stable without atomics.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Register tiles of the kernels hold ~4096 int32 (32 per thread at 4 warps): ptxas
# spills past ~16k (sm_90, [256, 64] one-hot tiles).
TILE_ELEMS = 4096
SINGLE_TILES = 4  # up to this many tiles of pairs, one program does all (decode)


class AlignedPairs(NamedTuple):
    sorted_ids: torch.Tensor  # [max_padded] int32
    expert_ids: torch.Tensor  # [max_padded / block_m] int32
    num_post_padded: torch.Tensor  # [1] int32
    block_m: int


def max_padded_rows(numel: int, num_experts: int, block_m: int) -> int:
    """Rows the layout can need for `numel` pairs over `num_experts` experts."""
    rows = numel + min(numel, num_experts) * (block_m - 1)
    return triton.cdiv(rows, block_m) * block_m


def _tile(experts_pow2: int, most: int, least: int = 1) -> int:
    """Rows of a [rows, E] register tile."""
    return max(least, min(most, TILE_ELEMS // experts_pow2))


@triton.jit
def _onehot(ids_ptr, start, hi, num_experts, EP: tl.constexpr, S: tl.constexpr):
    """Pairs [start, start + S) below hi: their indices and [S, EP] expert one-hot."""
    offs = start + tl.arange(0, S)
    e = tl.load(ids_ptr + offs, mask=offs < hi, other=-1)
    cols = tl.arange(0, EP)
    hit = (e[:, None] == cols[None, :]) & (cols < num_experts)[None, :]
    return offs, hit.to(tl.int32)


@triton.jit
def _count_range(ids_ptr, lo, hi, num_experts, EP: tl.constexpr, S: tl.constexpr):
    counts = tl.zeros([EP], dtype=tl.int32)
    for start in range(lo, hi, S):
        _, hit = _onehot(ids_ptr, start, hi, num_experts, EP, S)
        counts += tl.sum(hit, axis=0)
    return counts


@triton.jit
def _scatter_range(ids_ptr, sorted_ptr, lo, hi, base, num_experts, EP: tl.constexpr,
                   S: tl.constexpr):
    """Write pairs [lo, hi) to their rows; base[e] is expert e's next row."""
    for start in range(lo, hi, S):
        offs, hit = _onehot(ids_ptr, start, hi, num_experts, EP, S)
        rank = tl.cumsum(hit, axis=0) - 1  # earlier pairs of the same expert in the tile
        row = tl.sum(hit * (rank + base[None, :]), axis=1)
        tl.store(sorted_ptr + row, offs, mask=tl.sum(hit, axis=1) > 0)
        base += tl.sum(hit, axis=0)


@triton.jit
def _write_layout(counts, sorted_ptr, expert_ids_ptr, npp_ptr, numel, max_blocks,
                  EP: tl.constexpr, BLOCK_M: tl.constexpr, BB: tl.constexpr, QB: tl.constexpr):
    """Block map, padding rows and num_post_padded from per-expert counts [EP];
    returns each expert's first row. BB blocks, QB padding rows per expert per step."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    total = tl.sum(padded, axis=0)
    tl.store(npp_ptr, total)
    for b0 in range(0, max_blocks, BB):
        blk = b0 + tl.arange(0, BB)
        row0 = blk * BLOCK_M
        # Ends are non-decreasing, so the owner is the number of experts ending at
        # or before the block's first row (empty experts end where they start).
        owner = tl.sum((end[None, :] <= row0[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blk, tl.where(row0 < total, owner, -1), mask=blk < max_blocks)
    pads = padded - counts
    for q0 in range(0, BLOCK_M - 1, QB):  # an expert has at most BLOCK_M - 1 padding rows
        q = q0 + tl.arange(0, QB)
        tl.store(sorted_ptr + (start + counts)[:, None] + q[None, :],
                 tl.zeros([EP, QB], dtype=tl.int32) + numel, mask=q[None, :] < pads[:, None])
    return start


@triton.jit
def _align_single_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, npp_ptr, numel, num_experts,
                         max_blocks, EP: tl.constexpr, BLOCK_M: tl.constexpr, S: tl.constexpr,
                         BB: tl.constexpr, QB: tl.constexpr):
    counts = _count_range(ids_ptr, 0, numel, num_experts, EP, S)
    start = _write_layout(counts, sorted_ptr, expert_ids_ptr, npp_ptr, numel, max_blocks,
                          EP, BLOCK_M, BB, QB)
    # Padding and pair rows are disjoint, so no barrier is needed between them.
    _scatter_range(ids_ptr, sorted_ptr, 0, numel, start, num_experts, EP, S)


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, numel, num_experts, chunk, EP: tl.constexpr,
                        S: tl.constexpr):
    c = tl.program_id(0)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, numel)
    counts = _count_range(ids_ptr, lo, hi, num_experts, EP, S)
    tl.store(counts_ptr + c * EP + tl.arange(0, EP), counts)


@triton.jit
def _align_scan_kernel(counts_ptr, sorted_ptr, expert_ids_ptr, npp_ptr, numel, num_chunks,
                       max_blocks, EP: tl.constexpr, CP: tl.constexpr, BLOCK_M: tl.constexpr,
                       BB: tl.constexpr, QB: tl.constexpr):
    rows = tl.arange(0, CP)
    ptrs = counts_ptr + rows[:, None] * EP + tl.arange(0, EP)[None, :]
    live = (rows < num_chunks)[:, None]
    counts = tl.load(ptrs, mask=live, other=0)
    start = _write_layout(tl.sum(counts, axis=0), sorted_ptr, expert_ids_ptr, npp_ptr, numel,
                          max_blocks, EP, BLOCK_M, BB, QB)
    # Chunk c's first row for expert e: e's start plus the pairs of earlier chunks.
    base = start[None, :] + tl.cumsum(counts, axis=0) - counts
    tl.store(ptrs, base, mask=live)


@triton.jit
def _align_scatter_kernel(ids_ptr, bases_ptr, sorted_ptr, numel, num_experts, chunk,
                          EP: tl.constexpr, S: tl.constexpr):
    c = tl.program_id(0)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, numel)
    base = tl.load(bases_ptr + c * EP + tl.arange(0, EP))
    _scatter_range(ids_ptr, sorted_ptr, lo, hi, base, num_experts, EP, S)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int, *,
                         max_chunks: int | None = None) -> AlignedPairs:
    """The expert-sorted, BLOCK_M-padded row layout of `topk_ids` ([T, k] int32,
    contiguous; see the module docstring). `block_m`: a power of two >= 16.
    `max_chunks` bounds the prefill path's programs (default: what the scan's
    [chunks, E] register tile allows; a test lowers it to give each several tiles).
    No host sync; one launch up to SINGLE_TILES tiles of pairs, three beyond."""
    assert topk_ids.dtype == torch.int32 and topk_ids.is_contiguous()
    assert block_m >= 16 and block_m & (block_m - 1) == 0, block_m
    numel = topk_ids.numel()
    dev = topk_ids.device
    rows = max_padded_rows(numel, num_experts, block_m)
    max_blocks = rows // block_m
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    npp = torch.empty(1, dtype=torch.int32, device=dev)
    ep = max(16, triton.next_power_of_2(num_experts))
    s = _tile(ep, 256, least=16)
    layout = dict(BLOCK_M=block_m, BB=_tile(ep, triton.next_power_of_2(max(max_blocks, 1))),
                  QB=_tile(ep, block_m))
    if numel <= SINGLE_TILES * s:
        s = max(16, min(s, triton.next_power_of_2(numel)))  # a decode step: a small tile
        _align_single_kernel[(1,)](topk_ids, sorted_ids, expert_ids, npp, numel, num_experts,
                                   max_blocks, EP=ep, S=s, **layout, num_warps=4)
        return AlignedPairs(sorted_ids, expert_ids, npp, block_m)
    max_chunks = max_chunks or _tile(ep, 64, least=2)
    chunk = max(s, triton.cdiv(triton.cdiv(numel, max_chunks), s) * s)
    num_chunks = triton.cdiv(numel, chunk)
    counts = torch.empty((num_chunks, ep), dtype=torch.int32, device=dev)
    _align_count_kernel[(num_chunks,)](topk_ids, counts, numel, num_experts, chunk, EP=ep, S=s,
                                       num_warps=4)
    _align_scan_kernel[(1,)](counts, sorted_ids, expert_ids, npp, numel, num_chunks, max_blocks,
                             EP=ep, CP=max(2, triton.next_power_of_2(num_chunks)), **layout,
                             num_warps=4)
    _align_scatter_kernel[(num_chunks,)](topk_ids, counts, sorted_ids, numel, num_experts, chunk,
                                         EP=ep, S=s, num_warps=4)
    return AlignedPairs(sorted_ids, expert_ids, npp, block_m)
