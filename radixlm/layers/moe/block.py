"""A MoE MLP block: router, routed experts, and an optional shared expert."""

from __future__ import annotations

import torch
from torch import nn

from radixlm.layers.moe.fused_moe import FusedMoE
from radixlm.layers.moe.router import SharedExpertGate, TopKRouter


class SparseMoeBlock(nn.Module):
    """out = sum of the top-k experts' outputs, weighted by the router, plus
    (Qwen2-MoE) a shared expert every token takes, scaled by its sigmoid gate.
    Module names are HF's (`gate`, `experts`, `shared_expert`,
    `shared_expert_gate`). Under tensor parallelism the output is this rank's
    partial sum, like a dense MLP's: the experts' and the shared expert's
    partials are added in place into one buffer for the next norm to reduce."""

    def __init__(self, gate: TopKRouter, experts: FusedMoE,
                 shared_expert: nn.Module | None = None,
                 shared_expert_gate: SharedExpertGate | None = None) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate

    def forward_after_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(h), x + residual) with h, x + residual = norm(x, residual,
        reduce=True): the decoder layer's post-attention norm and this block. Where the
        router can (`TopKRouter.route_after_norm`), the norm runs in its logits
        kernel: one launch fewer on a decode step's chain."""
        fused = self.gate.route_after_norm(x, residual, norm)
        if fused is None:
            h, residual = norm(x, residual, reduce=True)
            return self.forward(h), residual
        h, residual, weights, ids = fused
        return self._experts(h, weights, ids), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self._experts(x, weights, ids)

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                 ) -> torch.Tensor:
        routed = self.experts(x, weights, ids)
        if self.shared_expert is None:
            return routed
        # The shared expert's partial may live in the fused all-reduce's buffer:
        # add into it in place so the norm finds it there.
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared.mul_(self.shared_expert_gate(x))
        return shared.add_(routed)
