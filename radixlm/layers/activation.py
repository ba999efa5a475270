"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.layers import cpu_ops, fused_ops


class SiluAndMul(nn.Module):
    """[..., 2d] (gate, up) -> [..., d]: silu(gate) * up (the SwiGLU MLP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return fused_ops.silu_and_mul(x)
        if cpu_ops.use_fused(x):
            return cpu_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
