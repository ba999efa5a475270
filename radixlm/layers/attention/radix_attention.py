"""The attention layer the models use: shapes plus a call into the backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from radixlm.forward_batch import ForwardBatch
    from radixlm.layers.rotary import RotaryEmbedding

    Rope = tuple[RotaryEmbedding, torch.Tensor]  # (the layer's rotary embedding, positions)


class RadixAttention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scaling: float) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                fb: ForwardBatch, rope: Rope | None = None) -> torch.Tensor:
        """`rope`: (rotary embedding, positions) to apply to q and k first, left to
        the backend so it can fuse it with the K/V store."""
        return fb.attn_backend.forward(q, k, v, self, fb, rope)
