"""The router of a MoE layer: which experts each token goes to, with what weight."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from radixlm import distributed as tp
from radixlm.layers.linear import default_weight_loader
from radixlm.layers.norm import RMSNorm


class TopKRouter(nn.Module):
    """HF's softmax top-k gate: logits x W^T, softmax in float32, the k largest,
    optionally renormalized to sum to one. The logits are float32 products of
    a float32 weight (HF takes them in the model's dtype): near-tied experts
    are ranked more exactly, and on the CPU a bf16 product re-lays-out the
    weight for oneDNN on every call (one decode row of OLMoE's 64 x 2048
    router: 191 us in bf16, 66 us in fp32, measured beside our quantized
    products).

    `round_weights`: the routing weights are rounded to the model's dtype
    (and back), as Qwen's and OLMoE's HF models do before weighting the
    experts; Mixtral's keep float32. Either way the weights handed on are
    float32. The weight [num_experts, hidden] is replicated on every rank,
    so every rank routes every token the same way.

    `fused_kernel`: the whole router in Triton's `fused_topk` (two launches, a
    token's result independent of its batch; `triton_ops/topk.py`) on CUDA
    tensors, or on CPU ones under TRITON_INTERPRET=1 (the tests). The model sets
    it where the layer's experts run on the Triton MoE backend; elsewhere the
    torch code below runs."""

    def __init__(self, num_experts: int, hidden_size: int, top_k: int, renormalize: bool,
                 round_weights: bool = False, fused_kernel: bool = False) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k}: expected 1..{num_experts} "
                             f"(the number of experts)")
        self.top_k = top_k
        self.renormalize = renormalize
        self.round_weights = round_weights
        self.fused_kernel = fused_kernel
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def route_after_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(norm(x + residual), x + residual, weights, ids) from one kernel for the
        norm and the logits (`triton_ops.topk.fused_norm_topk`) where it applies: the
        fused router, a plain `RMSNorm` on one rank (no all-reduce to fold in), a
        decode batch. None elsewhere: the caller norms, then calls forward."""
        if not self.fused_kernel or type(norm) is not RMSNorm or tp.get_tp_size() > 1:
            return None
        from radixlm.layers.moe.triton_ops import topk

        if not topk.norm_fusable(x, residual, norm.scale, self.weight):
            return None
        return topk.fused_norm_topk(x, residual, norm.scale, norm.eps, self.weight, self.top_k,
                                    self.renormalize, x.dtype if self.round_weights else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k] int32) for x [T, hidden]."""
        if self.fused_kernel and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
            from radixlm.layers.moe.triton_ops.topk import fused_topk

            return fused_topk(x, self.weight, self.top_k, self.renormalize,
                              x.dtype if self.round_weights else None)
        dtype, x = x.dtype, x.float()
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_weights and dtype != torch.float32:
            weights = weights.to(dtype).float()
        return weights, ids.to(torch.int32)


class SharedExpertGate(nn.Module):
    """Qwen2-MoE's scalar gate of its shared expert: sigmoid(x w^T), w [1, hidden]
    replicated on every rank (it scales each rank's partial sum alike)."""

    def __init__(self, hidden_size: int, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size, dtype=params_dtype),
                                   requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.weight))
