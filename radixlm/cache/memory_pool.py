"""Token-level KV memory (seed 001: "KV Cache memory pool, every token one page").

Two pools:
- `ReqToTokenPool` maps (request slot, position) -> KV slot index. Each running
  request owns one row while it lives.
- `KVPool` owns the per-layer K and V buffers and a free-slot allocator over
  them (page size 1): `MHATokenToKVPool` for per-head K/V, `SWAKVPool`
  (swa_memory_pool.py) when window layers drop what left their window. Which
  pool holds a model's `KVSpec` is the registry's choice (pool_registry.py).

Slot 0 of the KV buffers is never handed out: padded entries (CUDA-graph
padding, dummy decode rows) write there harmlessly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from radixlm.cache.kv_spec import MHA, KVSpec

# Dtypes a pool stores K/V in as they are computed (FP8 pools scale them: fp8_pool.py).
FLOAT_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class PoolOptions:
    """Sizing knobs of the pools that have any (ServerArgs' memory group)."""

    swa_full_tokens_ratio: float = 0.8  # window pools: window slots per full slot


class ReqToTokenPool:
    """`req_to_token[slot, pos]` is the KV slot of token `pos` of the request in `slot`.

    `path_rows`: that many more rows after the `size` request rows, never handed
    out: where the CUDA graph runner writes a tree verify's per-row slot tables
    (`path_table`). Captured kernels keep this tensor's address, so a table the
    graphs can read must be rows of it; decode and chains never touch them."""

    def __init__(self, size: int, max_context_len: int, device: torch.device | str,
                 path_rows: int = 0) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.num_path_rows = path_rows
        self.req_to_token = torch.zeros((size + path_rows, max_context_len), dtype=torch.int32,
                                        device=device)
        self.free_slots = list(range(size))

    def alloc(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def free(self, slot: int) -> None:
        assert 0 <= slot < self.size and slot not in self.free_slots, f"double free of slot {slot}"
        self.free_slots.append(slot)

    def available_size(self) -> int:
        return len(self.free_slots)

    def clear(self) -> None:
        self.free_slots = list(range(self.size))

    def path_table(self, n: int, width: int) -> torch.Tensor:
        """The first `n` path rows, columns [0, width): a view to copy a table into."""
        assert n <= self.num_path_rows, f"{n} path rows wanted, {self.num_path_rows} reserved"
        return self.req_to_token[self.size:self.size + n, :width]

    def path_row_indices(self, n: int, device: torch.device | str) -> torch.Tensor:
        """Row indices of the first `n` path rows (int64 on `device`)."""
        assert n <= self.num_path_rows, f"{n} path rows wanted, {self.num_path_rows} reserved"
        return torch.arange(self.size, self.size + n, dtype=torch.int64, device=device)


class KVPool(ABC):
    """Contract: `alloc(n)` returns n distinct int64 slot indices in [1, size] or
    None when fewer than n are free (nothing is taken then); `free(idx)` returns
    them. The caller that allocated a slot is the one that frees it, or hands
    it to the prefix cache, which then owns it. `size` counts usable slots.

    Window pools (`window` set, `SWAKVPool`): sliding-window layers keep their
    K/V in a second, smaller slot space; `free_window(idx)` gives up only that
    part of slots whose tokens left every window that reads them (the slots stay
    allocated for the full-attention layers), and `layer_slot_map(layer)` is how
    a backend finds a window layer's rows.

    Registry contract (pool_registry.py): `accepts(spec, dtype)` says whether this
    class holds that layout in that dtype (exactly one registered class may);
    `bytes_per_slot` is what one slot costs, so the memory plan can size
    the pool before it exists; `create` builds it with `size` usable slots."""

    size: int
    dtype: torch.dtype
    # The largest sliding window of the layers whose out-of-window KV this pool
    # frees; None: a plain pool (every slot holds every layer's KV).
    window: int | None = None

    @classmethod
    def accepts(cls, spec: KVSpec, dtype: torch.dtype) -> bool:
        return False

    @classmethod
    def bytes_per_slot(cls, spec: KVSpec, dtype: torch.dtype,
                             options: PoolOptions) -> float:
        raise NotImplementedError

    @classmethod
    def create(cls, spec: KVSpec, dtype: torch.dtype, size: int, device: torch.device,
               options: PoolOptions) -> KVPool:
        raise NotImplementedError

    @abstractmethod
    def alloc(self, n: int) -> torch.Tensor | None: ...

    @abstractmethod
    def free(self, indices: torch.Tensor) -> None: ...

    @abstractmethod
    def available_size(self) -> int: ...

    @abstractmethod
    def clear(self) -> None: ...

    @abstractmethod
    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> None: ...

    def full_available_size(self) -> int:
        """Free slots as `size` counts them (a window pool's `available_size` is the
        smaller of its two spaces')."""
        return self.available_size()

    def layer_scales(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(key scale, value scale), one-element fp32 device tensors, a reader
        multiplies this layer's stored K and V by (a quantized cache); None: they
        are stored as computed."""
        return None

    def layer_slot_map(self, layer_id: int) -> torch.Tensor | None:
        """None where `get_kv_buffer(layer_id)`'s rows are the slots `alloc` hands
        out; for a window pool's window layer, the device int64 map from those
        slots to the layer's rows (0, the padding row, once freed)."""
        return None


def row_kv_buffers(pool: KVPool, layer_id: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Layer `layer_id`'s (k, v) buffers when a kernel may copy new K/V rows of
    `dtype` straight into them: the plain MHA layout in that dtype. None for pools
    that override `set_kv_buffer` (other layouts, quantized caches): use it."""
    if type(pool).set_kv_buffer is not MHATokenToKVPool.set_kv_buffer:
        return None
    if pool.layer_slot_map(layer_id) is not None:
        return None
    k_buf, v_buf = pool.get_kv_buffer(layer_id)
    return (k_buf, v_buf) if k_buf.dtype == dtype else None


class MHATokenToKVPool(KVPool):
    """Per-head K [slots, kv_heads, head_dim] and V [slots, kv_heads, v_head_dim]
    per layer (`v_head_dim` defaults to `head_dim`)."""

    def __init__(self, size: int, dtype: torch.dtype, num_kv_heads: int, head_dim: int,
                 num_layers: int, device: torch.device | str,
                 v_head_dim: int | None = None) -> None:
        self.size = size
        self.dtype = dtype
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.num_layers = num_layers
        self.device = torch.device(device)
        self._allocate_buffers()
        self.clear()

    @classmethod
    def accepts(cls, spec: KVSpec, dtype: torch.dtype) -> bool:
        return spec.kind == MHA and not spec.windows and dtype in FLOAT_KV_DTYPES

    @classmethod
    def bytes_per_slot(cls, spec: KVSpec, dtype: torch.dtype,
                             options: PoolOptions) -> float:
        return spec.num_layers * spec.layer_bytes(dtype)

    @classmethod
    def create(cls, spec: KVSpec, dtype: torch.dtype, size: int, device: torch.device,
               options: PoolOptions) -> KVPool:
        return cls(size, dtype, spec.num_kv_heads, spec.k_head_dim, spec.num_layers, device,
                   v_head_dim=spec.v_head_dim)

    def _buffer(self, rows: int, head_dim: int) -> torch.Tensor:
        return torch.zeros((rows, self.num_kv_heads, head_dim), dtype=self.dtype,
                           device=self.device)

    def _allocate_buffers(self) -> None:
        self.k_buffer = [self._buffer(self.size + 1, self.head_dim)
                         for _ in range(self.num_layers)]
        self.v_buffer = [self._buffer(self.size + 1, self.v_head_dim)
                         for _ in range(self.num_layers)]

    def release_buffers(self) -> None:
        """Drop the K/V memory (release_memory_occupation); `restore_buffers` brings it back."""
        self.k_buffer, self.v_buffer = [], []

    def restore_buffers(self) -> None:
        self._allocate_buffers()

    def clear(self) -> None:
        # Kept on the CPU: allocation is bookkeeping, the indices travel with the batch.
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64)

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int) -> torch.Tensor | None:
        if n < 0:  # a negative slice bound would hand out all but |n| free slots
            raise ValueError(f"n must be >= 0, got {n}")
        if n > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return out

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel():
            self.free_slots = torch.cat([self.free_slots, indices.to("cpu", torch.int64)])

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> None:
        slot_map = self.layer_slot_map(layer_id)
        if slot_map is not None:  # a window pool's window layer: rows at its window slots
            loc = slot_map[loc]
        # .to(): a no-op unless --kv-cache-dtype differs from the model's dtype.
        self.k_buffer[layer_id][loc] = k.view(-1, self.num_kv_heads, self.head_dim).to(self.dtype)
        self.v_buffer[layer_id][loc] = v.view(-1, self.num_kv_heads,
                                              self.v_head_dim).to(self.dtype)
