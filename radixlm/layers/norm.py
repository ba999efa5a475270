"""RMSNorm, optionally fused with the residual add that precedes it; and
Gemma's variant, which scales by (1 + weight)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from radixlm import distributed as tp
from radixlm.layers import cpu_ops
from radixlm.layers.fp8_rows import Fp8Rows, to_fp8_rows
from radixlm.layers.linear import default_weight_loader
from radixlm.utils import lazy_import

fused_ops = lazy_import("radixlm.layers.fused_ops")  # Triton: CUDA tensors only


class RMSNorm(nn.Module):
    identity_weight = 1.0  # the weight that leaves normalized rows as they are

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
                residual: torch.Tensor | None = None, *, reduce: bool = False,
                pre_norm: RMSNorm | None = None, fp8_out: bool = False) -> Any:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual),
        the second being the next layer's residual stream. `reduce`: x is this
        tensor-parallel rank's partial sum (a row-parallel layer built with
        reduce_results=False); it is all-reduced first, in the same kernel as the
        add and the norm where `distributed.all_reduce_add_rms_norm` can.
        `pre_norm` (with `residual`): x is first normalized by that norm (a
        sandwich layer's post-norm), on CUDA in the same kernel. `fp8_out`:
        norm(...) quantized per row to FP8 for the next projection (`Fp8Rows`,
        `LinearBase.takes_fp8_rows`), on CUDA in the same kernel."""
        if fp8_out and x.is_cuda and not (reduce and tp.get_tp_size() > 1):
            assert pre_norm is None or (residual is not None and pre_norm.eps == self.eps)
            out = fused_ops.rms_norm(x, self.scale, self.eps, residual, fp8_out=True,
                                     pre_weight=None if pre_norm is None else pre_norm.scale)
            if residual is None:
                return Fp8Rows(*out, x.dtype)
            return Fp8Rows(*out[0], x.dtype), out[1]
        out = self._forward(x, residual, reduce=reduce, pre_norm=pre_norm)
        if not fp8_out:
            return out
        return to_fp8_rows(out) if residual is None else (to_fp8_rows(out[0]), out[1])

    def _forward(self, x: torch.Tensor, residual: torch.Tensor | None, *, reduce: bool,
                 pre_norm: RMSNorm | None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if reduce and tp.get_tp_size() > 1:
            fused = None
            if residual is not None and pre_norm is None:
                fused = tp.all_reduce_add_rms_norm(x, residual, self.scale, self.eps)
            if fused is not None:
                return fused
            x = tp.tensor_model_parallel_all_reduce(x)
        if pre_norm is not None:
            assert residual is not None and pre_norm.eps == self.eps
            if x.is_cuda:  # norm -> add -> norm in one pass
                return fused_ops.rms_norm(x, self.scale, self.eps, residual,
                                          pre_weight=pre_norm.scale)
            x = pre_norm(x)
        if x.is_cuda:  # one fused Triton pass instead of ~6 elementwise kernels
            return fused_ops.rms_norm(x, self.scale, self.eps, residual)
        if cpu_ops.use_fused(x, self.scale):  # the same on the CPU
            return cpu_ops.rms_norm(x, self.scale, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    @property
    def scale(self) -> torch.Tensor:
        """What the normalized rows are multiplied by (the fused kernels take it)."""
        return self.weight


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + weight), all in float32
    and rounded once, as HF computes it. The checkpoint holds `weight` (zero
    means identity); 1 + weight is kept beside it in float32 (exact for a half
    precision weight), re-derived whenever the weight is loaded and in
    `process_weights_after_loading` (after any other write: a rollback), so
    the fused kernels take it as the scale with no extra op per call."""

    identity_weight = 0.0

    def __init__(self, hidden_size: int, eps: float = 1e-6,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden_size, eps, params_dtype)
        with torch.no_grad():
            self.weight.zero_()
        self.weight.weight_loader = self._load_weight
        self.register_buffer("offset_weight", torch.ones(hidden_size, dtype=torch.float32),
                             persistent=False)

    def _load_weight(self, param: torch.Tensor, loaded: torch.Tensor,
                     shard_id: object = None) -> None:
        default_weight_loader(param, loaded, shard_id)
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        with torch.no_grad():
            self.offset_weight.copy_(1.0 + self.weight.float())

    @property
    def scale(self) -> torch.Tensor:
        return self.offset_weight

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.offset_weight).to(x.dtype)
