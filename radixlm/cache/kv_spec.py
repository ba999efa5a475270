"""What a model keeps per token in its KV cache, as the model declares it.

The model says what its attention layers store (`DecoderForCausalLM.kv_spec()`);
the pool registry (`cache/pool_registry.py`) picks the pool that holds it and
the memory plan (`runtime/memory_plan.py`) sizes it. Nothing else infers a
layout from a config's head counts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

# Per-head keys and values, [slots, kv_heads, head_dim] per layer (Llama, Qwen, Gemma...).
MHA = "mha"


@dataclass(frozen=True)
class KVSpec:
    """One tensor-parallel rank's KV layout.

    `kind` names what a token stores: MHA (per-head K and V); a latent kind (one
    compressed vector per token, MLA) registers its own pool. `windows[i]` is
    layer i's sliding window (None: it attends to the whole context); a pool
    may drop the KV of window layers that left every window.
    """

    kind: str
    num_layers: int
    num_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    windows: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        if self.windows and len(self.windows) != self.num_layers:
            raise ValueError(f"KVSpec.windows: {len(self.windows)} entries for "
                             f"{self.num_layers} layers")
        if min(self.num_layers, self.num_kv_heads, self.k_head_dim, self.v_head_dim) < 1:
            raise ValueError(f"KVSpec sizes must be >= 1: {self}")

    @property
    def window_layers(self) -> dict[int, int]:
        """{layer: window} of the sliding-window layers."""
        return {i: w for i, w in enumerate(self.windows) if w is not None}

    def without_windows(self) -> KVSpec:
        """The same layout with every layer's KV kept for every token (a plain pool)."""
        return replace(self, windows=())

    def layer_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one token's K and V in one layer."""
        return self.num_kv_heads * (self.k_head_dim + self.v_head_dim) * dtype.itemsize
