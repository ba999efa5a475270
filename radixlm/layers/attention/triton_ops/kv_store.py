"""Store the new tokens' K and V rows into the pool in one launch.

`k_buf[loc] = k; v_buf[loc] = v` is two index_put launches; this kernel writes
both with one program per token (one row = num_kv_heads * head_dim contiguous
elements in the input and in the pool). Measured by
`python -m radixlm.bench.kernels` on H200 (docs/kernels.md): 1.6 vs 6.4 us for
32 tokens inside a CUDA graph (one launch instead of two), 36 vs 155 us for 16k
tokens (index_put moves ~0.8 TB/s here, this kernel ~3.5 TB/s), so the backend
uses it by default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(K, V, KBuf, VBuf, Loc, stride_k, stride_v, stride_kb, stride_vb,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    loc = tl.load(Loc + t).to(tl.int64)  # int64: loc * row stride can pass 2**31
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(K + t * stride_k + offs, mask=mask)
    v = tl.load(V + t * stride_v + offs, mask=mask)
    tl.store(KBuf + loc * stride_kb + offs, k, mask=mask)
    tl.store(VBuf + loc * stride_vb + offs, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
             loc: torch.Tensor) -> None:
    """k, v: [n, num_kv_heads * head_dim] (or [n, kvh, d]); buffers [size, kvh, d]; loc [n]."""
    n = loc.shape[0]
    if n == 0:
        return
    row = k_buffer.shape[1] * k_buffer.shape[2]
    k = k.reshape(n, row)
    v = v.reshape(n, row)
    assert k.stride(1) == 1 and v.stride(1) == 1 and k_buffer.is_contiguous()
    assert v_buffer.is_contiguous() and k.dtype == k_buffer.dtype
    block = triton.next_power_of_2(row)
    _store_kv_kernel[(n,)](
        k, v, k_buffer, v_buffer, loc, k.stride(0), v.stride(0), row, row,
        ROW=row, BLOCK=block, num_warps=max(1, min(8, block // 256)),
    )
