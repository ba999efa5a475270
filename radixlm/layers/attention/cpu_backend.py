"""CPU attention: our C++ kernels over the token-level pool.

Decode on the CPU is bound by reading each request's K/V. The torch path
gathers them through a padded index into a copy (and converts half-precision
copies to fp32, since SDPA's bf16 single-query path is slow), then attends to
the copy; `cpu_ops.decode_attention` reads each K/V row from the pool once.
Extend (prefill, with or without a cached prefix, any chunk) runs on
`cpu_ops.extend_attention`, which reads the prefix and the new tokens' K/V
from the pool too (in bf16 on AVX512-BF16 CPUs, 3-4x torch's CPU flash
attention). Both kernels compute sliding windows and logit softcaps.

Batch invariance: the two kernels reduce every query row over its context in
one order fixed by absolute positions (`cpu_ops/attention.h`), so a row's
bits do not depend on the batch, on how its prompt was chunked, on how much
of it came from the prefix cache, or on whether it was computed in a decode
step or recomputed by a prefill after a retraction.

A pool in another dtype than the model's (`--kv-cache-dtype`, FP8 say) is
read by the torch path, which converts what it gathers: the kernels read K/V
in the queries' dtype only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixlm.cache.memory_pool import row_kv_buffers
from radixlm.layers import cpu_ops
from radixlm.layers.attention.torch_native import TorchNativeBackend

if TYPE_CHECKING:
    from radixlm.forward_batch import ForwardBatch
    from radixlm.layers.attention.radix_attention import RadixAttention

MAX_HEAD_DIM = 256


class CpuAttentionBackend(TorchNativeBackend):
    """`TorchNativeBackend` with extend and decode through `cpu_ops`' kernels.

    Usable when `cpu_ops.load()` succeeds (a C++ compiler is present) and the
    head dim is a multiple of 16 up to 256; `supports(head_dim)` says which.
    """

    batch_invariant = True  # a row's bits never depend on the batch (module docstring)

    def __init__(self) -> None:
        self.cast_kv = False  # the pool's dtype is not the model's: the torch path

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if self.cast_kv:
            super().init_forward_metadata(fb)
        # else nothing: the kernels read the batch's tensors directly

    @staticmethod
    def supports(head_dim: int) -> bool:
        return head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM and cpu_ops.load()

    @classmethod
    def unusable(cls, device: torch.device, head_dim: int) -> str | None:
        if device.type != "cpu":
            return "it runs on the CPU device only"
        if not cls.supports(head_dim):
            return ("it needs a C++ compiler (see the log) and a head dim that is a multiple "
                    f"of 16 up to {MAX_HEAD_DIM} (got {head_dim})")
        return None

    def check_kv_dtype(self, model_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        self.cast_kv = kv_dtype != model_dtype
        # The torch path's rows depend on the batch's padding: no longer invariant.
        self.batch_invariant = not self.cast_kv

    def _store(self, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
               fb: ForwardBatch) -> None:
        # One memcpy per row instead of the pool's two index_put ops.
        bufs = row_kv_buffers(fb.token_to_kv_pool, layer.layer_id, k.dtype)
        if bufs is not None and fb.out_cache_loc.dtype == torch.int64:
            cpu_ops.store_kv(k, v, *bufs, fb.out_cache_loc)
        else:
            super()._store(k, v, layer, fb)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor:
        if self.cast_kv:
            return super().forward_extend(q, k, v, layer, fb)
        self._store(k, v, layer, fb)
        k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        h, d = layer.num_heads, layer.head_dim
        q3 = q.view(-1, h, d)
        out = torch.empty_like(q3)
        cpu_ops.extend_attention(q3, k_buf, v_buf, out, fb.req_to_token_pool.req_to_token,
                                 fb.req_pool_indices, fb.extend_prefix_lens,
                                 fb.extend_seq_lens, layer.scaling, layer.sliding_window,
                                 layer.logit_softcap)
        return out.view(-1, h * d)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor:
        if self.cast_kv:
            return super().forward_decode(q, k, v, layer, fb)
        self._store(k, v, layer, fb)
        k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        bs = fb.batch_size
        q = q.reshape(bs, layer.num_heads, layer.head_dim)
        out = torch.empty_like(q)
        cpu_ops.decode_attention(q, k_buf, v_buf, out, fb.req_to_token_pool.req_to_token,
                                 fb.req_pool_indices, fb.seq_lens, layer.scaling,
                                 layer.sliding_window, layer.logit_softcap)
        return out.view(bs, layer.num_heads * layer.head_dim)
