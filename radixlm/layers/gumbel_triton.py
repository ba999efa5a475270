"""The sampler's Gumbel-argmax as one Triton kernel (CUDA): the noise is made in
registers from the same 32-bit hash as `sampler._mix32_`, so the torch path and
this one draw the same token except where the kernel's faster `log` rounds a
near-tie the other way. Imported only when a CUDA tensor is sampled."""

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
