"""The sum over top-k of the down GEMM's weighted rows: out[t] = sum_j rows[t * k + j].

Pairs whose expert id is outside [0, E) were never computed (another rank's expert,
or the id -1), so their rows hold whatever the buffer held: the kernel skips them
by id instead of reading them. The sum is in fp32 with one rounding to out's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _moe_sum_kernel(rows_ptr, ids_ptr, out_ptr, H, num_experts, stride_out,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        # Broadcast to a vector: the interpreter cannot AND a scalar bool into a mask.
        e = tl.load(ids_ptr + t * TOP_K + j) + tl.zeros([BLOCK_H], dtype=tl.int32)
        keep = (e >= 0) & (e < num_experts)
        x = tl.load(rows_ptr + (t * TOP_K + j) * H + offs, mask=in_row & keep, other=0.0)
        acc += x.to(tl.float32)
    tl.store(out_ptr + t * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=in_row)


def moe_sum(rows: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
            out: torch.Tensor) -> torch.Tensor:
    """rows [T * k, H] contiguous, topk_ids [T, k] int32, out [T, H] (rows of stride
    out.stride(0), last dim contiguous). Writes and returns out."""
    t, k = topk_ids.shape
    h = out.shape[1]
    block_h = min(1024, triton.next_power_of_2(h))
    _moe_sum_kernel[(t, triton.cdiv(h, block_h))](
        rows, topk_ids, out, h, num_experts, out.stride(0), TOP_K=k, BLOCK_H=block_h,
        num_warps=4)
    return out
