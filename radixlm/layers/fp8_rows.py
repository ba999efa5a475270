"""Activations quantized per token to FP8 by the op that made them.

A projection whose method runs the W8A8 GEMM (`--quantization fp8`, per-channel
weights, dynamic activation scales) quantizes its input rows to FP8 first: a
launch of its own that reads the bf16 rows the op before it (the norm before
qkv and gate_up, SiLU-and-mul before down) has just written. Where the method
says it will (`LinearMethod.takes_fp8_rows`), that op writes the FP8 codes and
their scales itself, in the same pass (`fused_ops.rms_norm` / `silu_and_mul`
with `fp8_out`), and hands them over as `Fp8Rows`: one launch and a round trip
of the rows fewer per projection. The codes are those `quantize_activations`
makes of the op's rounded output, bit for bit, so the products do not change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Fp8Rows:
    """q [M, K] FP8 codes and scales [M, 1] fp32 (row i is q[i] * scales[i]) of
    activations in `dtype`, the dtype the product returns."""

    q: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def is_cuda(self) -> bool:
        return self.q.is_cuda

    def dequantize(self) -> torch.Tensor:
        """The rows in `dtype` (for a consumer that takes no FP8 rows)."""
        return (self.q.float() * self.scales).to(self.dtype)


def quantize_rows_torch(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales [M, 1]) of y [M, K] per row, as the kernels make them: scale =
    max(max |row|, 1e-12) / 448, codes = y / scale rounded to nearest even, a
    code of zero always +0 (as `round_e4m3` gives it)."""
    yf = y.float()
    s = yf.abs().amax(-1, keepdim=True).clamp(min=1e-12)
    # A tensor divisor: on CUDA a division by a Python scalar multiplies by its
    # reciprocal, which is not the kernels' correctly rounded division.
    s = s / torch.full_like(s, 448.0)
    q = (yf / s).clamp(-448.0, 448.0).to(FP8)
    bits = q.view(torch.uint8)
    return torch.where(bits == 0x80, 0, bits).view(FP8), s  # -0 -> +0


def to_fp8_rows(y: torch.Tensor) -> Fp8Rows:
    """y [..., K] quantized per row (on CUDA by our kernel, else `quantize_rows_torch`):
    for an output made where the quantization could not be fused."""
    y2 = y.reshape(-1, y.shape[-1])
    if y.is_cuda:
        from radixlm.layers.quantization.triton_ops.fp8 import quantize_activations
        q, s = quantize_activations(y2.contiguous())
    else:
        q, s = quantize_rows_torch(y2)
    return Fp8Rows(q, s, y.dtype)
