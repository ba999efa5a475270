"""The attention layer the models use: shapes plus a call into the backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixlm.layers.quantization.specs import OPTIONAL_SCALAR
from radixlm.layers.sharding import register_weight, weight_spec

if TYPE_CHECKING:
    from radixlm.forward_batch import ForwardBatch
    from radixlm.layers.rotary import QKNormRotary, RotaryEmbedding
    from radixlm.layers.split_sums import SplitSums

    # (the layer's rotary embedding, or its QK norm + rotary, and the positions)
    Rope = tuple[RotaryEmbedding | QKNormRotary, torch.Tensor]


class RadixAttention(nn.Module):
    """One layer's attention shape and variant. `sliding_window` W (None: full
    context): a query attends only to the last W positions up to its own (HF's
    convention; backends/base.py pins it). `logit_softcap` c (None: off): scores
    become c * tanh(scores / c) before the softmax (Gemma 2).

    `k_scale` / `v_scale` (fp32 [1] parameters, 1.0 unless the checkpoint has
    them: FP8 checkpoints calibrated for an FP8 KV cache carry them): what an
    FP8 KV pool scales this layer's keys and values by. Nothing reads them
    while the cache is in the model's dtype."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scaling: float, sliding_window: int | None = None,
                 logit_softcap: float | None = None) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 (or None), got {sliding_window}")
        if logit_softcap is not None and logit_softcap <= 0:
            raise ValueError(f"logit_softcap must be > 0 (or None), got {logit_softcap}")
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        for name in ("k_scale", "v_scale"):
            register_weight(self, name, torch.ones(1, dtype=torch.float32), OPTIONAL_SCALAR)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        weight_spec(param).load(self, param, loaded, shard_id)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                fb: ForwardBatch, rope: Rope | None = None,
                sums: SplitSums | None = None) -> torch.Tensor:
        """`rope`: (rotary embedding, positions) to apply to q and k first, left to
        the backend so it can fuse it with the K/V store. `sums`: q, k and v are
        views of `sums.out`, whose split-K sum is left to the backend too."""
        return fb.attn_backend.forward(q, k, v, self, fb, rope, sums)
