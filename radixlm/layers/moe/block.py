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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        routed = self.experts(x, weights, ids)
        if self.shared_expert is None:
            return routed
        # The shared expert's partial may live in the fused all-reduce's buffer:
        # add into it in place so the norm finds it there.
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared.mul_(self.shared_expert_gate(x))
        return shared.add_(routed)
