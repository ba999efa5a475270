"""Where float experts are computed: a registry of backends, chosen by device.

Every backend computes `fused_experts` with the signature and meaning of
`torch_ref.fused_experts`, FP8 weights with their scales included
(`w13_scale`, `w2_scale`, `block_shape`: the Triton kernels' contract).
`--moe-runner-backend auto` takes, for the model's device, the first of its
preferences that is available here.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixlm.utils import triton_installed

logger = logging.getLogger(__name__)

FusedExperts = Callable[..., torch.Tensor]
TRITON_MODULE = "radixlm.layers.moe.triton_ops.fused_moe"


@dataclass(frozen=True)
class MoeBackend:
    name: str
    module: str  # imported when the backend is chosen (Triton only on a GPU)
    devices: tuple[str, ...]  # device types it runs on
    graph_capturable: bool  # no host sync: decode can be captured in CUDA graphs
    requires: Callable[[], str | None] = lambda: None  # why it is unavailable, or None

    def load(self) -> FusedExperts:
        return importlib.import_module(self.module).fused_experts

    def runs_on(self, device: torch.device) -> bool:
        """Whether the backend computes on `device`: its devices, and for the
        Triton backend CPU tensors under the interpreter (`TRITON_INTERPRET=1`,
        the tests' way of running the kernels without a GPU)."""
        if device.type in self.devices:
            return True
        return (self.name == "triton" and device.type == "cpu"
                and os.environ.get("TRITON_INTERPRET") == "1")


def _triton_missing() -> str | None:
    if not triton_installed():
        return "Triton is not installed"
    if importlib.util.find_spec(TRITON_MODULE) is None:
        return f"{TRITON_MODULE} is not in this build"
    return None


MOE_BACKENDS: dict[str, MoeBackend] = {
    "triton": MoeBackend("triton", TRITON_MODULE, ("cuda",), True, _triton_missing),
    "cpu": MoeBackend("cpu", "radixlm.layers.moe.cpu", ("cpu",), True),
    # The reference: float32 products, a host sync per call (which experts have tokens).
    "torch": MoeBackend("torch", "radixlm.layers.moe.torch_ref", ("cpu", "cuda"), False),
}
# Device type -> the backends `auto` tries, in order.
AUTO_PREFERENCE: dict[str, tuple[str, ...]] = {"cuda": ("triton", "torch"), "cpu": ("cpu",)}


def select_backend(name: str, device: torch.device) -> MoeBackend:
    """The backend `name` ('auto' or a key of MOE_BACKENDS) for experts on
    `device`; ValueError naming the reason when it cannot run there."""
    if name == "auto":
        tried = []
        for candidate in AUTO_PREFERENCE.get(device.type, ("torch",)):
            why = MOE_BACKENDS[candidate].requires()
            if why is None:
                if tried:
                    logger.warning("MoE backend auto -> %s on %s (%s)", candidate, device.type,
                                   "; ".join(tried))
                return MOE_BACKENDS[candidate]
            tried.append(f"{candidate}: {why}")
        raise ValueError(f"no MoE backend runs on {device.type} here ({'; '.join(tried)})")
    if name not in MOE_BACKENDS:
        raise ValueError(f"moe_runner_backend={name!r}: expected auto or one of "
                         f"{', '.join(MOE_BACKENDS)}")
    backend = MOE_BACKENDS[name]
    if not backend.runs_on(device):
        raise ValueError(f"moe_runner_backend={name!r} runs on {', '.join(backend.devices)}, "
                         f"not {device.type}")
    why = backend.requires()
    if why is not None:
        raise ValueError(f"moe_runner_backend={name!r} is unavailable: {why}")
    return backend
