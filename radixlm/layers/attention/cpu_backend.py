"""CPU attention: our C++ kernels over the token-level pool, torch SDPA elsewhere.

Decode on the CPU is bound by reading each request's K/V. The torch path
gathers them through a padded index into a copy (and converts half-precision
copies to fp32, since SDPA's bf16 single-query path is slow), then attends to
the copy; the kernel in `cpu_ops` reads each K/V row from the pool once.
Extend (prefill) of fresh bf16 prompts runs on `cpu_ops.extend_attention`
where the CPU has AVX512-BF16 (3-4x torch's CPU flash attention); prompts
after a cached prefix, and other dtypes, keep the torch path. Both kernels
compute sliding windows and logit softcaps themselves, as the torch path does.
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

# A request is cut into several chunks for different threads only when it has
# at least this many tokens per chunk: below that the merge costs more.
MIN_SPLIT_TOKENS = 256


class CpuAttentionBackend(TorchNativeBackend):
    """`TorchNativeBackend` with decode through `cpu_ops.decode_attention`.

    Usable when `cpu_ops.load()` succeeds (a C++ compiler is present) and the
    head dim is a multiple of 16; `supports(head_dim)` says which.
    """

    def __init__(self) -> None:
        self.decode_batch_size, self.longest = 1, 1
        # Extend: rows (start, length) of the prompts without a cached prefix, for the
        # fresh-prompt kernel, and (request, start, prefix, length) of the others.
        self.fresh_starts = self.fresh_lens = torch.empty(0, dtype=torch.int64)
        self.cached: list[tuple[int, int, int, int]] = []
        self.cast_kv = False  # the pool's dtype is not the model's: decode on the torch path

    @staticmethod
    def supports(head_dim: int) -> bool:
        return head_dim % 16 == 0 and cpu_ops.load()

    @classmethod
    def unusable(cls, device: torch.device, head_dim: int) -> str | None:
        if device.type != "cpu":
            return "it runs on the CPU device only"
        if not cls.supports(head_dim):
            return ("it needs a C++ compiler (see the log) and a head dim that is a multiple "
                    f"of 16 (got {head_dim})")
        return None

    def check_kv_dtype(self, model_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        # The decode kernel reads K/V in the queries' dtype only.
        self.cast_kv = kv_dtype != model_dtype

    def _store(self, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
               fb: ForwardBatch) -> None:
        # One memcpy per row instead of the pool's two index_put ops.
        bufs = row_kv_buffers(fb.token_to_kv_pool, layer.layer_id, k.dtype)
        if bufs is not None and fb.out_cache_loc.dtype == torch.int64:
            cpu_ops.store_kv(k, v, *bufs, fb.out_cache_loc)
        else:
            super()._store(k, v, layer, fb)

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if not fb.mode.is_decode():
            fresh, self.cached, start = [], [], 0
            for i, (pre, ext) in enumerate(zip(fb.extend_prefix_lens_cpu,
                                               fb.extend_seq_lens_cpu)):
                if pre == 0:
                    fresh.append((start, ext))
                else:
                    self.cached.append((i, start, pre, ext))
                start += ext
            rows = torch.tensor(fresh, dtype=torch.int64).view(-1, 2)
            self.fresh_starts, self.fresh_lens = rows[:, 0].contiguous(), rows[:, 1].contiguous()
            return
        self.decode_batch_size, self.longest = fb.batch_size, max(fb.seq_lens_cpu)
        if self.cast_kv:
            super().init_forward_metadata(fb)

    def _num_splits(self, window: int | None) -> int:
        """Few requests leave threads idle: split each over the threads instead."""
        threads = torch.get_num_threads()
        longest = self.longest if window is None else min(self.longest, window)
        return max(1, min(-(-threads // self.decode_batch_size), longest // MIN_SPLIT_TOKENS))

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor:
        h, kvh, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        if not (q.dtype == torch.bfloat16 and d in (64, 128) and len(self.fresh_lens)
                and cpu_ops.has_extend_attention()):
            return super().forward_extend(q, k, v, layer, fb)
        self._store(k, v, layer, fb)
        q3, k3, v3 = q.view(-1, h, d), k.view(-1, kvh, d), v.view(-1, kvh, d)
        if k3.stride() != v3.stride():
            k3, v3 = k3.contiguous(), v3.contiguous()
        out = torch.empty_like(q3)
        cpu_ops.extend_attention(q3, k3, v3, out, self.fresh_starts, self.fresh_lens,
                                 layer.scaling, layer.sliding_window, layer.logit_softcap)
        for i, start, pre, ext in self.cached:  # these read a cached prefix from the pool
            rows = slice(start, start + ext)
            out[rows] = self._extend_one(q3[rows], i, pre, ext, layer, fb)
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
                                 self._num_splits(layer.sliding_window), layer.sliding_window,
                                 layer.logit_softcap)
        return out.view(bs, layer.num_heads * layer.head_dim)
