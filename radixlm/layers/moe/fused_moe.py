"""The routed experts of one MoE layer, split over the ranks.

Tensor parallelism over the experts: every rank holds a slice of each
expert's intermediate dimension (gate/up rows, down columns), as a dense
MLP's gate_up / down are split. Expert parallelism (`distributed.set_ep_size`):
each expert-parallel group holds a share of the experts, and within it the
ranks split those experts' intermediate dimension. Either way a rank's output
is its partial sum: the consumer (the next norm) all-reduces it over the
tensor-parallel group, which both combines the experts of the groups and
sums the intermediate slices.

The layer owns the partition of its two stacked weights (`partition(name)`);
its `quant_method` (`FusedMoEMethod`, from the model's quantization config)
owns the weights and the products.
"""

from __future__ import annotations

import torch
from torch import nn

from radixlm import distributed as tp
from radixlm.layers.quantization import QuantizationConfig, UnquantizedConfig
from radixlm.layers.sharding import (
    ExpertPartition,
    Piece,
    ShardId,
    WeightSpec,
    register_weight,
    weight_spec,
)

# HF `hidden_act` -> the name the MoE backends take.
MOE_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}


class FusedMoE(nn.Module):
    """Experts [num_experts] of hidden -> intermediate -> hidden gated MLPs.
    forward(x, topk_weights, topk_ids) with global expert ids."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 activation: str = "silu", quant_config: QuantizationConfig | None = None,
                 prefix: str = "", params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if activation not in MOE_ACTIVATIONS:
            raise ValueError(f"activation {activation!r} (hidden_act) is not supported by the "
                             f"experts (supported: {', '.join(MOE_ACTIVATIONS)})")
        par = tp.moe_parallel()
        if num_experts < par.ep_size:
            raise ValueError(f"ep_size={par.ep_size} exceeds the model's {num_experts} experts")
        if intermediate_size % par.tp_size:
            raise ValueError(f"the experts' intermediate size {intermediate_size} does not split "
                             f"over {par.tp_size} ranks (tp_size / ep_size)")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = MOE_ACTIVATIONS[activation]
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.prefix = prefix
        self.expert_start, self.num_local_experts = par.experts(num_experts)
        self.intermediate_per_partition = size = intermediate_size // par.tp_size
        self._partitions = self._make_partitions(par, size)
        # Global expert id -> this rank's index of it, -1 where another rank holds it.
        ids = None
        if self.num_local_experts != num_experts:
            ids = torch.full((num_experts,), -1, dtype=torch.int32)
            ids[self.expert_start:self.expert_start + self.num_local_experts] = torch.arange(
                self.num_local_experts, dtype=torch.int32)
        self.register_buffer("local_ids", ids, persistent=False)
        self.quant_method = (quant_config or UnquantizedConfig()).get_moe_method(self, prefix)
        self.quant_method.create_weights(self, self.params_dtype)

    def _make_partitions(self, par: tp.MoeParallel, size: int) -> dict[str, ExpertPartition]:
        hidden, inter = Piece(self.hidden_size, 0, self.hidden_size), self.intermediate_size
        experts = Piece(self.num_experts, self.expert_start, self.num_local_experts)
        start = par.tp_rank * size
        return {
            "gate_up_proj": ExpertPartition((0, 1), (Piece(inter, start, size, 0),
                                                     Piece(inter, start, size, size)),
                                            hidden, experts, par.group),
            "down_proj": ExpertPartition((None,), (hidden,), Piece(inter, start, size),
                                         experts, par.group),
        }

    def partition(self, name: str) -> ExpertPartition:
        """This rank's part of stacked weight `name` ('gate_up_proj', 'down_proj')."""
        return self._partitions[name]

    def add_weight(self, name: str, data: torch.Tensor, spec: WeightSpec) -> nn.Parameter:
        return register_weight(self, name, data, spec)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        weight_spec(param).load(self, param, loaded, shard_id)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the routed experts' outputs, [T, hidden]."""
        ids = topk_ids if self.local_ids is None else self.local_ids[topk_ids.long()]
        return self.quant_method.apply(self, x, topk_weights, ids)

    def describe(self) -> str:
        return (f"{self.num_local_experts} of {self.num_experts} experts on this rank"
                f" (first {self.expert_start}), {self.intermediate_per_partition} of "
                f"{self.intermediate_size} intermediate features each; "
                f"{self.quant_method.describe(self)}")
