"""Store the new tokens' K and V rows into the pool in one launch.

`k_buf[loc] = k; v_buf[loc] = v` is two index_put launches; this kernel writes
both with one program per token (one row = num_kv_heads * head_dim contiguous
elements in the input and in the pool). Measured by
`python -m radixlm.bench.kernels` on H200 (docs/kernels.md): 1.6 vs 6.4 us for
32 tokens inside a CUDA graph (one launch instead of two), 36 vs 155 us for 16k
tokens (index_put moves ~0.8 TB/s here, this kernel ~3.5 TB/s), so the backend
uses it by default.

FP8 pools (`FP8TokenToKVPool`): with `kv_scales` the kernel writes
K / k_scale and V / v_scale, clamped to the FP8 dtype's finite range and
rounded to nearest even, the very codes of the pool's own `set_kv_buffer`
(fp32 division correctly rounded, as torch's, then the same clamp and cast).
The scales are read from device memory, so CUDA graphs replay new ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@triton.jit
def _quantize(x, scale, FP8_MAX: tl.constexpr, dtype: tl.constexpr):
    """x / scale (IEEE division, like torch's) clamped to +-FP8_MAX, then cast (RTNE)."""
    y = tl.div_rn(x.to(tl.float32), scale)
    y = tl.clamp(y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return y.to(dtype)


@triton.jit
def _store_kv_kernel(K, V, KBuf, VBuf, Loc, KScale, VScale, stride_k, stride_v, stride_kb,
                     stride_vb, ROW: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr,
                     FP8_MAX: tl.constexpr):
    t = tl.program_id(0)
    loc = tl.load(Loc + t).to(tl.int64)  # int64: loc * row stride can pass 2**31
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(K + t * stride_k + offs, mask=mask)
    v = tl.load(V + t * stride_v + offs, mask=mask)
    if QUANT:
        k = _quantize(k, tl.load(KScale), FP8_MAX, KBuf.dtype.element_ty)
        v = _quantize(v, tl.load(VScale), FP8_MAX, VBuf.dtype.element_ty)
    tl.store(KBuf + loc * stride_kb + offs, k, mask=mask)
    tl.store(VBuf + loc * stride_vb + offs, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
             loc: torch.Tensor,
             kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """k, v: [n, num_kv_heads * head_dim] (or [n, kvh, d]); buffers [size, kvh, d]; loc [n].

    FP8 buffers need `kv_scales` = (k_scale, v_scale), one-element fp32 device
    tensors (the layer's entries of `FP8TokenToKVPool.k_scales` / `.v_scales`)."""
    n = loc.shape[0]
    if n == 0:
        return
    row = k_buffer.shape[1] * k_buffer.shape[2]
    k = k.reshape(n, row)
    v = v.reshape(n, row)
    assert k.stride(1) == 1 and v.stride(1) == 1 and k_buffer.is_contiguous()
    assert v_buffer.is_contiguous() and v_buffer.dtype == k_buffer.dtype
    quant = k_buffer.dtype in FP8_DTYPES and k.dtype != k_buffer.dtype
    if quant:
        assert kv_scales is not None, "an FP8 pool needs kv_scales"
        ks, vs = kv_scales
        fp8_max = torch.finfo(k_buffer.dtype).max
    else:
        assert k.dtype == k_buffer.dtype
        ks, vs, fp8_max = loc, loc, 0.0  # unused pointers
    block = triton.next_power_of_2(row)
    _store_kv_kernel[(n,)](
        k, v, k_buffer, v_buffer, loc, ks, vs, k.stride(0), v.stride(0), row, row,
        ROW=row, BLOCK=block, QUANT=quant, FP8_MAX=fp8_max,
        num_warps=max(1, min(8, block // 256)),
    )
