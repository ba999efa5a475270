"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.layers import cpu_ops
from radixlm.layers.fp8_rows import Fp8Rows, to_fp8_rows
from radixlm.utils import lazy_import

fused_ops = lazy_import("radixlm.layers.fused_ops")  # Triton: CUDA tensors only


class SiluAndMul(nn.Module):
    """[..., 2d] (gate, up) -> [..., d]: silu(gate) * up (the SwiGLU MLP)."""

    def forward(self, x: torch.Tensor, fp8_out: bool = False) -> torch.Tensor | Fp8Rows:
        """`fp8_out`: quantized per row to FP8 for the next projection (`Fp8Rows`),
        on CUDA in the same kernel."""
        if x.is_cuda:
            if fp8_out:
                return Fp8Rows(*fused_ops.silu_and_mul(x, fp8_out=True), x.dtype)
            return fused_ops.silu_and_mul(x)
        if cpu_ops.use_fused(x):
            y = cpu_ops.silu_and_mul(x)
        else:
            gate, up = x.chunk(2, dim=-1)
            y = F.silu(gate) * up
        return to_fp8_rows(y) if fp8_out else y


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
