"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.layers import cpu_ops
from radixlm.utils import lazy_import

fused_ops = lazy_import("radixlm.layers.fused_ops")  # Triton: CUDA tensors only


class SiluAndMul(nn.Module):
    """[..., 2d] (gate, up) -> [..., d]: silu(gate) * up (the SwiGLU MLP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return fused_ops.silu_and_mul(x)
        if cpu_ops.use_fused(x):
            return cpu_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """[..., 2d] (gate, up) -> [..., d]: gelu(gate) * up (GeGLU, Gemma's MLP);
    `approximate` "tanh" is HF's gelu_pytorch_tanh, "none" the exact erf form."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.approximate == "tanh":  # one kernel instead of three
            return fused_ops.gelu_tanh_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


# HF `hidden_act` / `hidden_activation` name -> the gated activation computing it.
GATED_ACTIVATIONS = {
    "silu": SiluAndMul,
    "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"),
    "gelu": lambda: GeluAndMul("none"),
}
