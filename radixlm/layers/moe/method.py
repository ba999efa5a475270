"""Float experts: the checkpoint's tensors stacked per layer, computed by a backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixlm.layers.moe.backends import MoeBackend, select_backend
from radixlm.layers.quantization.base import FusedMoEMethod
from radixlm.layers.sharding import AxisSpec, ExpertSpec

if TYPE_CHECKING:
    from radixlm.layers.moe.fused_moe import FusedMoE


def check_graph_capture(backend: MoeBackend, x: torch.Tensor) -> None:
    """RuntimeError, naming the way out, when a backend that synchronizes with the
    host is about to run inside a CUDA graph capture."""
    if not backend.graph_capturable and x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"the {backend.name!r} MoE backend synchronizes with the host and "
                           "cannot run in a CUDA graph: pass --disable-cuda-graph or "
                           "--moe-runner-backend triton")


class UnquantizedFusedMoEMethod(FusedMoEMethod):
    """`gate_up_proj` [local experts, 2I, H] and `down_proj` [local experts, H, I]
    in the model's dtype, each expert's slice loaded as a dense weight would be
    (`AxisSpec` under the layer's per-expert pieces); products by the backend
    `backend` names (`layers/moe/backends.py`), picked from the device the
    weights are created on."""

    def __init__(self, backend: str = "auto") -> None:
        self.backend_name = backend

    def create_weights(self, layer: FusedMoE, params_dtype: torch.dtype) -> None:
        e, h, i = layer.num_local_experts, layer.hidden_size, layer.intermediate_per_partition
        for name, shape in (("gate_up_proj", (e, 2 * i, h)), ("down_proj", (e, h, i))):
            spec = ExpertSpec(AxisSpec(output_dim=0, input_dim=1), layer.partition(name))
            layer.add_weight(name, torch.empty(shape, dtype=params_dtype), spec)
        self.backend = select_backend(self.backend_name, torch.get_default_device())
        self.fused_experts = self.backend.load()

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        check_graph_capture(self.backend, x)
        return self.fused_experts(x, layer.gate_up_proj, layer.down_proj, topk_weights,
                                  topk_ids, activation=layer.activation)

    def describe(self, layer: FusedMoE) -> str:
        return (f"{str(layer.params_dtype).removeprefix('torch.')} experts on the "
                f"{self.backend.name} backend")
