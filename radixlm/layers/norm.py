"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from radixlm import distributed as tp
from radixlm.layers import cpu_ops, fused_ops
from radixlm.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype),
                                   requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # The variance is taken in float32 even for half-precision activations:
        # squares of bf16 values lose too much.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None, *, reduce: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual),
        the second being the next layer's residual stream. `reduce`: x is this
        tensor-parallel rank's partial sum (a row-parallel layer built with
        reduce_results=False); it is all-reduced first, in the same kernel as the
        add and the norm where `distributed.all_reduce_add_rms_norm` can."""
        if reduce and tp.get_tp_size() > 1:
            fused = None
            if residual is not None:
                fused = tp.all_reduce_add_rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
            x = tp.tensor_model_parallel_all_reduce(x)
        if x.is_cuda:  # one fused Triton pass instead of ~6 elementwise kernels
            return fused_ops.rms_norm(x, self.weight, self.eps, residual)
        if cpu_ops.use_fused(x):  # the same fusion for half precision on the CPU
            return cpu_ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
