"""The sampler's Triton kernels (CUDA), imported only when a CUDA tensor is sampled.

- Gumbel-argmax in one kernel: the noise is made in registers from the same
  32-bit hash as `sampler._mix32_`, so the torch path and this one draw the
  same token except where the kernel's faster `log` rounds a near-tie the
  other way.
- A row's logsumexp whose bits do not depend on the batch: torch's CUDA
  reduction picks its block layout (and so its summation order) from the
  tensor's shape; here every row is cut into the same fixed splits of the
  vocabulary, each reduced by one program in a fixed order, and the splits'
  partial results are combined in split order by one program per row.

Every program works on one row, so a row's result is the same at any batch
size and position."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_SPLIT = 4096  # columns per program: many programs per row keep small batches fast
_BLOCK = 1024


@triton.jit
def _gumbel_argmax_kernel(scores_ptr, keys_ptr, vals_ptr, ids_ptr, vocab, row_stride,
                          SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    # uint32 arithmetic wraps, which is exactly the masked int64 math of _mix32_.
    key = tl.load(keys_ptr + row).to(tl.uint32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_col = tl.zeros([BLOCK], tl.int32)
    for offset in range(0, SPLIT, BLOCK):
        cols = split * SPLIT + offset + tl.arange(0, BLOCK)
        s = tl.load(scores_ptr + row.to(tl.int64) * row_stride + cols, mask=cols < vocab,
                    other=float("-inf"))
        h = key ^ (cols.to(tl.uint32) * 0x9E3779B1)
        h ^= h >> 16
        h *= 0x21F0AAAD
        h ^= h >> 15
        h *= 0x735A2D97
        h ^= h >> 15
        u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
        v = s - tl.log(-tl.log(u))
        better = v > best  # strict: each lane keeps its lowest column on ties
        best = tl.where(better, v, best)
        best_col = tl.where(better, cols, best_col)
    top = tl.max(best, axis=0)
    col = tl.min(tl.where(best == top, best_col, 2147483647), axis=0)
    tl.store(vals_ptr + row * tl.num_programs(1) + split, top)
    tl.store(ids_ptr + row * tl.num_programs(1) + split, col)


def gumbel_argmax(scores: Tensor, keys: Tensor) -> Tensor:
    n, vocab = scores.shape
    scores = scores.contiguous()
    splits = triton.cdiv(vocab, _SPLIT)
    vals = torch.empty((n, splits), dtype=torch.float32, device=scores.device)
    ids = torch.empty((n, splits), dtype=torch.int32, device=scores.device)
    _gumbel_argmax_kernel[(n, splits)](scores, keys, vals, ids, vocab, scores.stride(0),
                                      SPLIT=_SPLIT, BLOCK=_BLOCK)
    # argmax takes the first split holding the maximum: ties go to the lowest id.
    return ids.gather(1, vals.argmax(dim=1, keepdim=True)).squeeze(1).long()


@triton.jit
def _lse_partial_kernel(x_ptr, m_ptr, l_ptr, vocab, row_stride, SPLIT: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    base = x_ptr + row.to(tl.int64) * row_stride
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    for offset in range(0, SPLIT, BLOCK):
        cols = split * SPLIT + offset + tl.arange(0, BLOCK)
        mx = tl.maximum(mx, tl.load(base + cols, mask=cols < vocab, other=float("-inf")))
    m = tl.max(mx, axis=0)
    acc = tl.zeros([BLOCK], tl.float32)
    for offset in range(0, SPLIT, BLOCK):
        cols = split * SPLIT + offset + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf"))
        # -inf logits (banned tokens, padding) add exactly 0, also when m is -inf.
        acc += tl.where(x == float("-inf"), 0.0, tl.exp(x - m))
    tl.store(m_ptr + row * tl.num_programs(1) + split, m)
    tl.store(l_ptr + row * tl.num_programs(1) + split, tl.sum(acc, axis=0))


@triton.jit
def _lse_combine_kernel(m_ptr, l_ptr, out_ptr, splits, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    m = tl.load(m_ptr + row * splits + s, mask=s < splits, other=float("-inf"))
    lsum = tl.load(l_ptr + row * splits + s, mask=s < splits, other=0.0)
    top = tl.max(m, axis=0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, lsum * tl.exp(m - top)), axis=0)
    tl.store(out_ptr + row, tl.where(top == float("-inf"), top, top + tl.log(total)))


def row_logsumexp(x: Tensor) -> Tensor:
    """logsumexp over the last dim of x [n, V] float32 -> [n]; a row's bits do not
    depend on n or the other rows."""
    n, vocab = x.shape
    x = x.contiguous()
    splits = triton.cdiv(vocab, _SPLIT)
    m = torch.empty((n, splits), dtype=torch.float32, device=x.device)
    lsum = torch.empty((n, splits), dtype=torch.float32, device=x.device)
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    if n == 0:
        return out
    _lse_partial_kernel[(n, splits)](x, m, lsum, vocab, x.stride(0), SPLIT=_SPLIT, BLOCK=_BLOCK)
    _lse_combine_kernel[(n,)](m, lsum, out, splits,
                              BLOCK_S=max(16, triton.next_power_of_2(splits)))
    return out
