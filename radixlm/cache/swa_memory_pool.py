"""A KV pool that frees the sliding-window layers' KV once it left every window.

A model with window layers (Gemma 2/3, Mistral) needs all of a token's KV in
its full-attention layers for as long as the token is in context, but in a
window layer only while the token is among the last W of some request that
reads it. One slot per token for every layer would keep the window layers' KV
of a 100k-token context although they read 1k of it.

So two slot spaces (the hybrid allocator SGLang's SWA pool introduced):
- full slots, 1..size: what `alloc` hands out, what the request table and
  the prefix cache hold; the full layers' K/V rows;
- window slots, 1..window_size (smaller): the window layers' K/V rows. Each
  allocated full slot has one (`alloc` takes both) until `free_window` gives it
  up; `slot_map[full slot]` is its window slot, 0 (the padding row) after.

Everything else sees full slots only; a backend reads a window layer's rows
through `layer_slot_map(layer)`. Who calls `free_window` and when (the KV
manager for a request's own tokens, the radix cache for the tokens it holds)
is their business; this pool keeps the books: `check_invariants` asserts that
every window slot is free xor held by exactly one allocated full slot, and
that the device map equals the host one.
"""

from __future__ import annotations

import torch

from radixlm.cache.kv_spec import MHA, KVSpec
from radixlm.cache.memory_pool import FLOAT_KV_DTYPES, KVPool, MHATokenToKVPool, PoolOptions
from radixlm.utils import to_device


class SWAKVPool(MHATokenToKVPool):
    """`layer_windows`: {layer id: sliding window} of the window layers; the
    other layers attend to the full context. `window_size`: window slots (a
    request holds about its window plus its prefill chunk of them at a time)."""

    def __init__(self, size: int, window_size: int, dtype: torch.dtype, num_kv_heads: int,
                 head_dim: int, num_layers: int, layer_windows: dict[int, int],
                 device: torch.device | str, v_head_dim: int | None = None) -> None:
        if not layer_windows:
            raise ValueError("SWAKVPool needs at least one sliding-window layer")
        if not all(0 <= i < num_layers for i in layer_windows):
            raise ValueError(f"window layers {sorted(layer_windows)} outside 0..{num_layers - 1}")
        if window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {window_size}")
        self.window_size = window_size
        self.layer_windows = dict(layer_windows)
        self.window = max(layer_windows.values())
        self.device = torch.device(device)
        self.slot_map = torch.zeros(size + 1, dtype=torch.int64, device=self.device)
        super().__init__(size, dtype, num_kv_heads, head_dim, num_layers, device, v_head_dim)

    @classmethod
    def accepts(cls, spec: KVSpec, dtype: torch.dtype) -> bool:
        return spec.kind == MHA and bool(spec.window_layers) and dtype in FLOAT_KV_DTYPES

    @classmethod
    def bytes_per_slot(cls, spec: KVSpec, dtype: torch.dtype, options: PoolOptions) -> float:
        """Bytes per full slot when each brings `swa_full_tokens_ratio` window slots."""
        windowed = len(spec.window_layers)
        full = spec.num_layers - windowed
        return spec.layer_bytes(dtype) * (full + options.swa_full_tokens_ratio * windowed)

    @classmethod
    def create(cls, spec: KVSpec, dtype: torch.dtype, size: int, device: torch.device,
               options: PoolOptions) -> KVPool:
        ratio = options.swa_full_tokens_ratio
        window_size = max(1, int(size * ratio))
        window = max(spec.window_layers.values())
        if window_size < 2 * window:
            # A running request holds up to two windows of window slots (the last
            # W - 1 of its cached prefix, and its own last W tokens).
            raise ValueError(
                f"swa_full_tokens_ratio={ratio} gives {window_size} window-layer KV slots for "
                f"{size} tokens, fewer than the {2 * window} one request needs with window "
                f"{window}: raise it (or the KV memory), or pass --disable-hybrid-swa-memory")
        return cls(size, window_size, dtype, spec.num_kv_heads, spec.k_head_dim,
                   spec.num_layers, spec.window_layers, device, v_head_dim=spec.v_head_dim)

    def _rows(self, layer_id: int) -> int:
        return (self.window_size if layer_id in self.layer_windows else self.size) + 1

    def _allocate_buffers(self) -> None:
        self.k_buffer = [self._buffer(self._rows(i), self.head_dim)
                         for i in range(self.num_layers)]
        self.v_buffer = [self._buffer(self._rows(i), self.v_head_dim)
                         for i in range(self.num_layers)]

    def clear(self) -> None:
        super().clear()
        self.free_window_slots = torch.arange(1, self.window_size + 1, dtype=torch.int64)
        self._window_of = torch.zeros(self.size + 1, dtype=torch.int64)  # host mirror
        self.slot_map.zero_()

    # ---- slots -------------------------------------------------------------
    def full_available_size(self) -> int:
        return len(self.free_slots)

    def window_available_size(self) -> int:
        return len(self.free_window_slots)

    def available_size(self) -> int:
        return min(len(self.free_slots), len(self.free_window_slots))

    def alloc(self, n: int) -> torch.Tensor | None:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self.available_size():
            return None
        full = super().alloc(n)
        assert full is not None
        win, self.free_window_slots = self.free_window_slots[:n], self.free_window_slots[n:]
        self._set_map(full, win)
        return full

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel():
            self.free_window(indices)
            super().free(indices)

    def free_window(self, indices: torch.Tensor) -> int:
        """Give up the window KV of full slots `indices` (those that still have
        it); they stay allocated. Returns how many window slots were freed."""
        idx = indices.to("cpu", torch.int64)
        win = self._window_of[idx]
        held = win > 0
        if not bool(held.any()):
            return 0
        idx = idx[held]
        self.free_window_slots = torch.cat([self.free_window_slots, win[held]])
        self._set_map(idx, torch.zeros_like(idx))
        return len(idx)

    def adopt_window(self, dst: torch.Tensor, src: torch.Tensor) -> int:
        """Where full slot dst[i] has no window KV and src[i] has (the same token's
        KV, computed again by another request), move src[i]'s window slot to
        dst[i]: no copy, only the map changes. Returns how many moved."""
        dst, src = dst.to("cpu", torch.int64), src.to("cpu", torch.int64)
        move = (self._window_of[dst] == 0) & (self._window_of[src] > 0)
        if not bool(move.any()):
            return 0
        dst, src = dst[move], src[move]
        win = self._window_of[src]
        self._set_map(torch.cat([dst, src]), torch.cat([win, torch.zeros_like(win)]))
        return len(dst)

    def has_window(self, indices: torch.Tensor) -> torch.Tensor:
        """Bool per full slot: does it still hold window KV? (host, no device sync)"""
        return self._window_of[indices.to("cpu", torch.int64)] > 0

    def _set_map(self, full: torch.Tensor, win: torch.Tensor) -> None:
        self._window_of[full] = win
        if len(full):
            self.slot_map[to_device(full, self.device)] = to_device(win, self.device)

    # ---- layers ------------------------------------------------------------
    def layer_slot_map(self, layer_id: int) -> torch.Tensor | None:
        return self.slot_map if layer_id in self.layer_windows else None

    def check_invariants(self) -> None:
        held = self._window_of[self._window_of > 0]
        free = self.free_window_slots
        every = torch.cat([held, free])
        assert len(every) == self.window_size and len(torch.unique(every)) == len(every), (
            f"window slots broken: {len(held)} held + {len(free)} free != {self.window_size} "
            f"distinct")
        assert self._window_of[0] == 0, "the padding slot has a window slot"
        assert not bool((self._window_of[self.free_slots] > 0).any()), \
            "a free full slot still holds a window slot"
        assert torch.equal(self.slot_map.cpu(), self._window_of), "device slot map out of date"
